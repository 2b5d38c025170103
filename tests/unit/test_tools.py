"""The launchers' command lines, environment and ports (tools/launch.py), `make serve`'s settings,
and the shipped model repository's config."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF, REPO_ROOT
from tools import launch, serve


def test_command_binds_host_and_ports():
    cmd = launch.tritonserver_command("model_repository", "0.0.0.0", 9000, 9001, 9002, log_verbose=1, extra_args=["--foo=1"])
    assert cmd[0].endswith("bin/tritonserver")
    args = set(cmd[1:])
    assert f"--model-repository={Path('model_repository').resolve()}" in args
    assert f"--backend-directory={launch.TRITON_DIR.resolve() / 'backends'}" in args
    for expected in ("--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--http-port=9000", "--grpc-port=9001",
                     "--metrics-port=9002", "--allow-metrics=true", "--model-control-mode=none", "--log-verbose=1"):
        assert expected in args
    assert cmd[-1] == "--foo=1"


def test_frontend_command_serves_the_triton_url_on_host_and_port():
    cmd = launch.frontend_command("10.0.0.2:8001", "10.0.0.2", 9003, model_repository="/models", extra_args=["-v"])
    assert cmd == [sys.executable, "-m", "client.openai", "--triton-url", "10.0.0.2:8001", "--host", "10.0.0.2",
                   "--port", "9003", "--model-repository", "/models", "-v"]
    assert "--model-repository" not in launch.frontend_command("127.0.0.1:8001")


@pytest.mark.parametrize("consecutive", [False, True])
def test_free_ports_can_all_be_bound_at_once(consecutive):
    ports = launch.free_ports(6, consecutive=consecutive)
    assert len(set(ports)) == 6
    if consecutive:
        assert ports == list(range(ports[0], ports[0] + 6))
    socks = [socket.socket() for _ in ports]
    try:
        for s, port in zip(socks, ports):
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_environment_puts_venv_and_libpython_first():
    env = launch.tritonserver_env({"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/x", "PYTHONHOME": "/nope"})
    assert env["PATH"].split(":")[0] == str(launch.venv_dir() / "bin")
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert libs[0] == sysconfig.get_config_var("LIBDIR")
    assert any(p.endswith("nvidia_pytriton.libs") for p in libs[1:])
    assert libs[-1] == "/opt/x"
    assert "PYTHONHOME" not in env


def test_shipped_config_parameters_are_engine_parameters():
    from backend.config import EngineConfig

    config = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    assert re.search(r'^backend:\s*"inflight"', config, re.M)
    assert re.search(r"decoupled:\s*true", config)
    params = dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config))
    version_dir = REPO_ROOT / "model_repository" / "llm" / "1"
    engine_config = EngineConfig.from_parameters(params, str(version_dir))
    assert Path(engine_config.model_path) == DEFAULT_CHECKPOINT


def test_serve_set_serves_a_copy_with_the_parameters_set(tmp_path, monkeypatch):
    from backend.config import EngineConfig, ServingOptions

    monkeypatch.chdir(tmp_path)
    parameters = serve.parse_settings(["model_path=ckpt", "max_num_seqs=8", "merge_queued_responses=false"])
    assert parameters["model_path"] == str(tmp_path / "ckpt")  # from the working directory
    copy = launch.repository_with_parameters(REPO_ROOT / "model_repository", tmp_path / "repo", parameters)
    config = (copy / "llm" / "config.pbtxt").read_text()
    found = re.findall(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config)
    assert [key for key, _ in found].count("max_num_seqs") == 1  # replaced, not added twice
    params = dict(found)
    assert EngineConfig.from_parameters(params, str(copy / "llm" / "1")).max_num_seqs == 8
    assert Path(EngineConfig.from_parameters(params, "/").model_path) == tmp_path / "ckpt"
    assert ServingOptions.from_parameters(params).merge_queued_responses is False
    # Untouched: the repository itself, and a relative model_path the copy would break.
    assert "merge_queued_responses" not in (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    kept = launch.repository_with_parameters(REPO_ROOT / "model_repository", tmp_path / "kept", {"max_num_seqs": "4"})
    kept_params = dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"',
                                  (kept / "llm" / "config.pbtxt").read_text()))
    assert Path(EngineConfig.from_parameters(kept_params, str(kept / "llm" / "1")).model_path) == DEFAULT_CHECKPOINT
    q4_params = dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"',
                                (kept / "llm_q4" / "config.pbtxt").read_text()))
    q4 = EngineConfig.from_parameters(q4_params, str(kept / "llm_q4" / "1"))
    assert (Path(q4.model_path), Path(q4.tokenizer)) == (DEFAULT_GGUF, DEFAULT_CHECKPOINT)
    for bad in ("max_num_seqs", "=8"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            serve.parse_settings([bad])


def test_vllm_backend_peer_lays_out_the_backend_and_its_model(tmp_path):
    from client.bench import vllm_backend_peer

    source = tmp_path / "vllm_backend"
    (source / "src" / "utils").mkdir(parents=True)
    (source / "src" / "model.py").write_text("# Triton's vLLM backend\n")
    (source / "src" / "utils" / "metrics.py").write_text("")
    triton = tmp_path / "triton"
    for name in ("bin", "caches", "backends/python"):
        (triton / name).mkdir(parents=True)
    arguments = vllm_backend_peer.engine_arguments(str(DEFAULT_CHECKPOINT), "bfloat16", 32)
    work = vllm_backend_peer.lay_out(tmp_path / "work", source, "llm", arguments, triton_dir=triton)

    assert (work / "backends" / "vllm" / "vllm_backend_model.py").read_text() == "# Triton's vLLM backend\n"
    assert "from vllm_backend_model import TritonPythonModel" in (work / "backends" / "vllm" / "model.py").read_text()
    assert (work / "backends" / "vllm" / "utils" / "metrics.py").is_file()
    assert (work / "backends" / "python").resolve() == (triton / "backends" / "python").resolve()
    assert (work / "bin").resolve() == (triton / "bin").resolve()
    config = (work / "model_repository" / "llm" / "config.pbtxt").read_text()
    assert re.search(r'^backend:\s*"vllm"', config, re.M) and re.search(r"decoupled:\s*true", config)
    model_json = json.loads((work / "model_repository" / "llm" / "1" / "model.json").read_text())
    assert model_json == {"model": str(DEFAULT_CHECKPOINT.resolve()), "dtype": "bfloat16", "max_num_seqs": 32,
                          "enforce_eager": True, "disable_log_stats": False}
    command = launch.tritonserver_command(work / "model_repository", triton_dir=work)
    assert f"--backend-directory={work / 'backends'}" in command
    # Laid out again (a rerun), the tree is rebuilt rather than refused.
    vllm_backend_peer.lay_out(tmp_path / "work", source, "llm", arguments, triton_dir=triton)

    with pytest.raises(FileNotFoundError, match=r"--vllm-backend-src: .*src/model.py is missing"):
        vllm_backend_peer.lay_out(tmp_path / "other", tmp_path, "llm", arguments, triton_dir=triton)


def _genai_result(system: str, tokens_per_s: float, ttft: float, run: int | None = None, concurrency: int = 32) -> dict:
    stats = {"avg": ttft, "p99": 2 * ttft}
    return {"system": system, "concurrency": concurrency, **({"run": run} if run else {}),
            "output_token_throughput": {"avg": tokens_per_s}, "time_to_first_token": stats, "inter_token_latency": stats}


def test_genai_perf_ratios_of_repeated_runs_are_the_medians_of_each_runs_ratios():
    from client.bench.loadtest import comparison_ratios

    runs = [(1, 400.0, 300.0, 1.0, 2.0), (2, 480.0, 320.0, 1.0, 1.0), (3, 420.0, 400.0, 1.0, 4.0)]
    results = [r for run, ours, peer, ttft, peer_ttft in runs
               for r in (_genai_result("triton-grpc", ours, ttft, run), _genai_result("vllm", peer, peer_ttft, run))]
    ratio = comparison_ratios(results)["triton-grpc/vllm @ c=32"]
    # Per run 1.333, 1.5, 1.05: the median run's, not the ratio of the medians (440 / 320 = 1.375).
    assert ratio["output_tokens_per_s"] == pytest.approx(400 / 300)
    assert ratio["runs"] == pytest.approx([400 / 300, 480 / 320, 420 / 400])
    assert ratio["ttft_mean"] == pytest.approx(0.5)  # 0.5, 1, 0.25

    single = comparison_ratios([_genai_result("triton-grpc", 400.0, 1.0), _genai_result("vllm", 300.0, 2.0),
                                _genai_result("triton-grpc", 100.0, 1.0, concurrency=1),
                                _genai_result("vllm", 50.0, 1.0, concurrency=1)])
    assert set(single) == {"triton-grpc/vllm @ c=32", "triton-grpc/vllm @ c=1"}
    assert "runs" not in single["triton-grpc/vllm @ c=32"]
    assert single["triton-grpc/vllm @ c=1"]["output_tokens_per_s"] == 2.0


def test_loadtest_refuses_genai_perf_options_for_perf_analyzer():
    from client.bench.loadtest import main

    with pytest.raises(SystemExit):
        main(["perf-analyzer", "--repeat", "3"])
    with pytest.raises(SystemExit):
        main(["genai-perf", "--repeat", "0"])


def test_stop_leaves_no_process_of_the_group_and_no_shared_memory_region(tmp_path):
    """A server killed mid-run leaves stubs (here a grandchild) and /dev/shm regions behind;
    stop() removes both before it returns, so a relaunch on the same ports starts clean."""
    prefix = f"inflight_test_{tmp_path.name}_"
    region = Path("/dev/shm") / f"{prefix}stub-region"
    region.write_bytes(b"\0" * 4096)
    unrelated = Path("/dev/shm") / f"inflight_other_{tmp_path.name}"
    unrelated.write_bytes(b"\0")
    # The "server" starts a child that ignores SIGTERM, as a busy stub would, then is killed alone.
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
             "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); time.sleep(600)"
    args = [sys.executable, "-c", script, f"{launch.SHM_PREFIX_FLAG}{prefix}"]
    proc = launch._popen(args, dict(os.environ), None, None)
    try:
        time.sleep(1.0)
        proc.kill()
        proc.wait()
        os.killpg(proc.pid, 0)  # the child is still alive in the group
        launch.stop(proc, timeout=1)
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
        assert not region.exists()
        assert unrelated.exists()
    finally:
        unrelated.unlink(missing_ok=True)
        region.unlink(missing_ok=True)
