"""The benchmark's peer systems (client/bench/peers.py) without vLLM or OpenVINO installed.

hf-continuous runs for real on a tiny random checkpoint: exact token counts, one time per
token, and greedy output equal to transformers' own `generate()`. vllm-offline is checked
up to the process boundary: the request/result JSON both sides agree on, the command
client.bench.peers runs (with a stand-in for the .venv-peers child), and the error when
.venv-peers is missing. The real vLLM run is `make peers` plus client/bench/vllm_offline.py's
usage line, which need minutes and .venv-peers. openvino-offline likewise: its settings
(client/bench/openvino_offline.py), the export command and its reuse, and the plumbing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from backend.config import EngineConfig
from backend.paths import MODELS_DIR, REPO_ROOT
from client.bench import (
    gguf_serving,
    kv_serving,
    llama_cpp,
    openvino_offline,
    peers,
    servers,
    speculative_serving,
    vllm_peer,
)
from client.bench.records import RequestRecord, SystemRun
from client.bench.stats import summarize
from client.bench.workloads import BenchRequest, Workload
from tests.checkpoints import hf_greedy
from tools.launch import free_ports, stop


def small_workload(temperature: float = 0.0, max_tokens=(3, 5, 8)) -> Workload:
    prompts = [[300 + i for i in range(10)], [5000 + 7 * i for i in range(7)], [900, 901, 902]]
    requests = [BenchRequest(p, n, temperature=temperature) for p, n in zip(prompts, max_tokens)]
    return Workload("T", "three requests of different lengths", requests, {"max_num_seqs": 2})


def check_run(run: SystemRun, workload: Workload, system: str) -> dict:
    assert run.system == system
    assert run.duration_s > 0
    assert len(run.records) == len(workload.requests)
    for record, spec in zip(run.records, workload.requests):
        assert record.num_output_tokens == record.expected_output_tokens == spec.max_tokens
        assert len(record.token_times) == spec.max_tokens
        assert record.token_times == sorted(record.token_times)
        assert record.arrival <= record.token_times[0]
        assert record.finish_reason == "length"
    summary = summarize(run, workload)
    assert summary["num_completed"] == len(workload.requests)
    assert summary["all_token_counts_right"]
    assert summary["output_tokens"] == sum(r.max_tokens for r in workload.requests)
    return summary


# ---- vllm-offline -----------------------------------------------------------------------


def test_vllm_requests_round_trip(tmp_path):
    workload = small_workload(temperature=0.6)
    requests = peers.vllm_requests(workload)
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(requests))
    loaded = vllm_peer.load_requests(str(path))
    assert loaded == [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens, "temperature": 0.6}
                      for r in workload.requests]


@pytest.mark.parametrize("bad", [
    [],
    [{"prompt_token_ids": [1, 2], "max_tokens": 4}],
    [{"prompt_token_ids": [], "max_tokens": 4, "temperature": 0.0}],
    [{"prompt_token_ids": [1, -2], "max_tokens": 4, "temperature": 0.0}],
    [{"prompt_token_ids": [1, 2], "max_tokens": 0, "temperature": 0.0}],
    [{"prompt_token_ids": [1, 2], "max_tokens": 4, "temperature": -1.0}],
])
def test_vllm_requests_rejected(bad):
    with pytest.raises(ValueError):
        vllm_peer.check_requests(bad)


def test_vllm_records_from_result():
    workload = small_workload()
    result = {"duration_s": 1.5, "num_output_tokens": [3, 5, 8], "vllm_version": "0.32.0"}
    records = peers.vllm_records(workload, result, start=10.0, end=11.5)
    assert [r.token_times for r in records] == [[11.5] * 3, [11.5] * 5, [11.5] * 8]
    assert all(r.arrival == 10.0 for r in records)
    summary = check_run(SystemRun("vllm-offline", records, 1.5), workload, "vllm-offline")
    assert summary["ttft_ms"]["mean"] == pytest.approx(1500.0)
    with pytest.raises(ValueError):
        peers.vllm_records(workload, {**result, "num_output_tokens": [3, 5]}, 10.0, 11.5)


def test_vllm_cpu_environment():
    env = vllm_peer.cpu_environment({})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"]  # every CPU this process may use, e.g. "0,1"
    assert vllm_peer.cpu_environment({"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_OMP_THREADS_BIND": "auto"}) == {}


def test_vllm_preload_environment(monkeypatch, tmp_path):
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(vllm_peer.sys, "prefix", str(tmp_path))
    assert vllm_peer.preload_environment({}) == {}  # no Intel OpenMP in this venv
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    assert vllm_peer.preload_environment({}) == {"LD_PRELOAD": str(tmp_path / "lib" / "libiomp5.so")}
    assert vllm_peer.preload_environment({"LD_PRELOAD": ""}) == {}  # the caller's choice stands


def test_run_vllm_offline_needs_peers_venv(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "PEERS_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(FileNotFoundError, match="make peers"):
        peers.run_vllm_offline(small_workload(), "unused", 32, "float32")


def test_run_vllm_offline_plumbing(monkeypatch, tmp_path):
    """client.bench.peers' side of the subprocess, with a stand-in child that answers as vLLM would."""
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    monkeypatch.setattr(peers, "PEERS_PYTHON", str(fake_python))
    seen = {}

    def fake_run(command, cwd, env, **kwargs):
        seen.update(command=command, cwd=cwd, env=env)
        args = dict(zip(command[3::2], command[4::2]))
        requests = vllm_peer.load_requests(args["--requests"])
        with open(args["--out"], "w") as f:
            json.dump({"duration_s": 0.25, "num_output_tokens": [r["max_tokens"] for r in requests],
                       "vllm_version": "0.32.0", "dtype": args["--dtype"],
                       "max_num_seqs": int(args["--max-num-seqs"])}, f)
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    workload = small_workload()
    run = peers.run_vllm_offline(workload, "some/model", 16, "bfloat16", progress=False, seed=3)
    assert seen["command"][:3] == [str(fake_python), "-m", "client.bench.vllm_offline"]
    args = dict(zip(seen["command"][3::2], seen["command"][4::2]))
    assert args["--model"].endswith("some/model") and args["--model"].startswith("/")
    assert (args["--dtype"], args["--max-num-seqs"], args["--seed"]) == ("bfloat16", "16", "3")
    assert seen["cwd"] == peers.REPO_ROOT
    assert "PYTHONPATH" not in seen["env"]
    check_run(run, workload, "vllm-offline")
    assert run.duration_s == 0.25
    assert run.engine_kpis["vllm_version"] == "0.32.0" and run.engine_kpis["max_num_seqs"] == 16


# ---- hf-continuous ----------------------------------------------------------------------


def test_hf_continuous_run(tiny_checkpoint):
    workload = small_workload()
    run = peers.run_hf_continuous(workload, tiny_checkpoint, max_num_seqs=2, dtype="float32", progress=False)
    check_run(run, workload, "hf-continuous")
    # Per-token times, not one time for the batch: the 8-token request decodes over several steps.
    assert run.records[2].token_times[-1] > run.records[2].token_times[0]
    assert all(r.queue_time is not None and r.queue_time >= 0 for r in run.records)
    assert run.engine_kpis["max_num_seqs"] == 2 and run.engine_kpis["num_blocks"] >= 2


def test_hf_continuous_greedy_matches_generate(tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    workload = small_workload()
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    outputs, *_ = peers.hf_continuous_generate(model, workload, max_num_seqs=2, progress=False)
    expected = [hf_greedy(tiny_checkpoint, [r.prompt_token_ids], r.max_tokens)[0] for r in workload.requests]
    assert [out.generated_tokens for out in outputs] == expected


def test_hf_continuous_sampling(tiny_checkpoint):
    workload = small_workload(temperature=0.6)
    run = peers.run_hf_continuous(workload, tiny_checkpoint, max_num_seqs=3, dtype="float32", progress=False, seed=1)
    check_run(run, workload, "hf-continuous")


def test_hf_continuous_one_temperature_only(tiny_checkpoint):
    workload = small_workload()
    workload.requests[0].temperature = 0.6
    with pytest.raises(ValueError, match="one temperature"):
        peers.run_hf_continuous(workload, tiny_checkpoint, max_num_seqs=2, dtype="float32", progress=False)


def test_vllm_server_execs_vllms_openai_server_with_the_cpu_settings(monkeypatch):
    from client.bench import vllm_server

    calls = []
    monkeypatch.setattr(vllm_server.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")  # the caller's own preload is kept
    monkeypatch.setattr(vllm_server.sys, "argv", ["vllm_server", "--model", "m", "--port", "9100"])
    vllm_server.main()
    [(path, argv, env)] = calls
    assert argv[1:] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "9100"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_peer.DEFAULT_KVCACHE_SPACE_GIB)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] and env["LD_PRELOAD"] == ""


# ---- openvino-offline -----------------------------------------------------------------------


def test_openvino_settings_are_the_dtype_under_test_and_the_engines_batch():
    assert openvino_offline.plugin_properties("bfloat16", 2, bf16_arithmetic=True) == {
        "INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16", "INFERENCE_NUM_THREADS": 2}
    # Without bf16 arithmetic (AVX2) the plugin computes in f32 and takes only an f32 KV cache.
    assert openvino_offline.plugin_properties("bfloat16", 2, bf16_arithmetic=False)["KV_CACHE_PRECISION"] == "f32"
    for bf16 in (True, False):
        properties = openvino_offline.plugin_properties("float32", 16, bf16)
        assert (properties["INFERENCE_PRECISION_HINT"], properties["KV_CACHE_PRECISION"]) == ("f32", "f32")
    with pytest.raises(ValueError, match="dtype 'float16'"):
        openvino_offline.plugin_properties("float16", 2, True)
    with pytest.raises(ValueError, match="threads"):
        openvino_offline.plugin_properties("float32", 0, True)
    assert openvino_offline.scheduler_settings(32) == {
        "max_num_seqs": 32, "max_num_batched_tokens": 2048, "cache_size": 2, "enable_prefix_caching": False,
        "dynamic_split_fuse": True}
    assert openvino_offline.scheduler_settings(4096)["max_num_batched_tokens"] == 4096
    with pytest.raises(ValueError, match="max_num_seqs"):
        openvino_offline.scheduler_settings(0)


def test_openvino_generation_settings_give_exactly_max_tokens():
    greedy = openvino_offline.generation_settings({"prompt_token_ids": [1], "max_tokens": 7, "temperature": 0.0}, 5)
    assert greedy == {"max_new_tokens": 7, "min_new_tokens": 7, "ignore_eos": True, "do_sample": False}
    sampled = openvino_offline.generation_settings({"prompt_token_ids": [1], "max_tokens": 3, "temperature": 0.8}, 5)
    assert sampled == {"max_new_tokens": 3, "min_new_tokens": 3, "ignore_eos": True, "do_sample": True,
                       "temperature": 0.8, "rng_seed": 5}


def test_openvino_export_is_the_unquantized_checkpoint_and_is_reused(tmp_path, monkeypatch):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    command = openvino_offline.export_command("optimum-cli", str(model), str(tmp_path / "ir"))
    assert command[:3] == ["optimum-cli", "export", "openvino"]
    assert command[command.index("--weight-format") + 1] == "fp32"  # no int8/int4 compression
    assert command[command.index("--task") + 1] == "text-generation-with-past"
    exports = []

    def fake_run(cmd, check):
        exports.append(cmd)
        os.makedirs(cmd[-1], exist_ok=True)

    monkeypatch.setattr(openvino_offline.subprocess, "run", fake_run)
    ir = str(tmp_path / "ir")
    openvino_offline.export(str(model), ir)
    assert openvino_offline.export(str(model), ir) == 0.0 and len(exports) == 1  # reused
    os.utime(model / "model.safetensors", (1, 1))  # the checkpoint changed: exported again
    openvino_offline.export(str(model), ir)
    assert len(exports) == 2


def test_run_openvino_offline_plumbing(monkeypatch, tmp_path):
    """client.bench.peers' side of the subprocess, with a stand-in child that answers as
    client/bench/openvino_offline.py does."""
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    monkeypatch.setattr(peers, "OPENVINO_PYTHON", str(fake_python))
    seen = {}

    def fake_run(command, cwd, env, **kwargs):
        seen.update(command=command, env=env)
        args = dict(zip(command[3::2], command[4::2]))
        requests = vllm_peer.load_requests(args["--requests"])
        with open(args["--out"], "w") as f:
            json.dump({"duration_s": 0.5, "num_output_tokens": [r["max_tokens"] for r in requests],
                       "openvino_genai_version": "2026.4.1.0", "dtype": args["--dtype"],
                       "properties": openvino_offline.plugin_properties(args["--dtype"], 2, True)}, f)
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    workload = small_workload()
    run = peers.run_openvino_offline(workload, "some/model", 16, "bfloat16", progress=False)
    assert seen["command"][:3] == [str(fake_python), "-m", "client.bench.openvino_offline"]
    args = dict(zip(seen["command"][3::2], seen["command"][4::2]))
    assert args["--model"].startswith("/") and args["--ir"] == peers.openvino_ir_dir("some/model")
    assert (args["--dtype"], args["--max-num-seqs"]) == ("bfloat16", "16")
    assert "PYTHONPATH" not in seen["env"]
    check_run(run, workload, "openvino-offline")
    assert run.engine_kpis["properties"]["INFERENCE_PRECISION_HINT"] == "bf16"


def test_run_openvino_offline_needs_its_venv(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "OPENVINO_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(FileNotFoundError, match="make peers-openvino"):
        peers.run_openvino_offline(small_workload(), "unused", 32, "float32")


# ---- llama-server (a --target) -----------------------------------------------------------


@pytest.mark.parametrize("dtype,gguf_type", [("float32", "f32"), ("bfloat16", "bf16")])
def test_llama_server_runs_the_engines_settings_in_the_dtype_under_test(dtype, gguf_type):
    gguf = llama_cpp.gguf_path("/x/SmolLM2-135M-Instruct", dtype)
    assert gguf.endswith(f"gguf/SmolLM2-135M-Instruct-{gguf_type}.gguf")
    convert = llama_cpp.convert_command("/x/SmolLM2-135M-Instruct", dtype, gguf)
    assert convert[1].endswith("convert_hf_to_gguf.py") and convert[convert.index("--outtype") + 1] == gguf_type
    command = llama_cpp.server_command(gguf, dtype, 8090, slots=32, slot_context=1024, threads=2)
    flags = dict(zip(command[1::2], command[2::2]))
    assert command[0] == str(llama_cpp.LLAMA_SERVER)
    assert (flags["--parallel"], flags["--ctx-size"], flags["--threads"], flags["--threads-batch"]) == (
        "32", str(32 * 1024), "2", "2")
    assert flags["--cache-type-k"] == flags["--cache-type-v"] == gguf_type  # KV in the weights' dtype
    assert flags["--cache-reuse"] == "0" and command[-2:] == ["--cont-batching", "--no-webui"]
    with pytest.raises(ValueError, match="slots"):
        llama_cpp.server_command(gguf, dtype, 8090, slots=0)
    with pytest.raises(ValueError, match="dtype 'float16'"):
        llama_cpp.convert("/x", "float16")


def test_quantized_gguf_files_go_to_models_gguf_named_after_checkpoint_and_type():
    path = llama_cpp.quantized_gguf_path("/x/SmolLM2-135M-Instruct/", "Q4_K_M")
    assert path == str(MODELS_DIR / "gguf" / "SmolLM2-135M-Instruct-Q4_K_M.gguf")
    assert llama_cpp.QUANTIZED_TYPES == ("Q8_0", "Q4_0", "Q4_K_M")


def test_llama_server_launch_confines_it_to_the_cpus_in_a_group_of_its_own(tmp_path):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    script = "import os; print(sorted(os.sched_getaffinity(0)), os.getpgid(0) == os.getpid())"
    with open(tmp_path / "log", "w") as log:
        proc = llama_cpp.launch([sys.executable, "-c", script], [cpu], log)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().split() == [f"[{cpu}]", "True"]


def test_llama_server_wait_ready_fails_when_it_exits_or_nothing_answers(tmp_path):
    (port,) = free_ports(1)
    with open(tmp_path / "log", "w") as log:
        exited = llama_cpp.launch([sys.executable, "-c", "raise SystemExit(3)"], sorted(os.sched_getaffinity(0)), log)
    exited.wait(timeout=60)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        llama_cpp.wait_ready(port, exited)
    with open(tmp_path / "log", "w") as log:
        silent = llama_cpp.launch([sys.executable, "-c", "import time; time.sleep(60)"],
                                  sorted(os.sched_getaffinity(0)), log)
    try:
        with pytest.raises(TimeoutError, match=f"port {port} not ready"):
            llama_cpp.wait_ready(port, silent, timeout=0.5)
    finally:
        stop(silent)


# ---- Q3: GGUF files through tritonserver and llama-server (client/bench/gguf_serving.py) --


def test_q3_types_and_concurrencies_parse_or_name_what_is_wrong():
    assert gguf_serving.parse_types("Q4_1,Q8_0,Q4_K_M") == ["Q4_1", "Q8_0", "Q4_K_M"]
    for bad in ("Q5_K", "Q4_1,f32", ""):
        with pytest.raises(ValueError, match="Q4_1, Q8_0, Q4_0, Q4_K_M"):
            gguf_serving.parse_types(bad)
    assert servers.parse_concurrencies("1,32") == [1, 32]
    for bad in ("0,32", "one", ""):
        with pytest.raises(ValueError, match="integers >= 1"):
            servers.parse_concurrencies(bad)
    # Three waves of the concurrency, at least 12, unless given.
    assert [gguf_serving.requests_for(c, None) for c in (1, 4, 32)] == [12, 12, 96]
    assert gguf_serving.requests_for(32, 4) == 4


@pytest.mark.parametrize("argv,message", [
    (["--types", "Q5_K"], "--types 'Q5_K'"),
    (["--concurrency", "1,0"], "--concurrency '1,0'"),
    (["--num-requests", "0"], "--num-requests must be at least 1"),
    (["--slots", "0"], "--slots must be at least 1"),
    (["--cores", "4096"], "--cores 4096: this process may use"),
])
def test_q3_refuses_bad_arguments_before_it_starts_anything(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gguf_serving.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_q3_needs_llama_quantize_only_for_the_types_it_makes(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llama_cpp, "LLAMA_SERVER", tmp_path / "llama-server")
    monkeypatch.setattr(llama_cpp, "LLAMA_QUANTIZE", tmp_path / "missing" / "llama-quantize")
    (tmp_path / "llama-server").write_text("")
    with pytest.raises(SystemExit):
        gguf_serving.main(["--types", "Q4_1,Q4_0"])
    assert "llama-quantize is missing: run `make peers-llama-cpp`" in capsys.readouterr().err


PARAMETER = re.compile(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def test_q3_repository_serves_the_gguf_file_as_llm_with_llm_q4s_settings(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf"
    repository = servers.write_repository(tmp_path / "repo", gguf_serving.BASE_MODEL,
                                          {"model_path": str(gguf), "tokenizer": "some/tokenizer"}, [1, 3], 8)
    assert sorted(p.name for p in repository.iterdir()) == ["llm"]
    assert (repository / "llm" / "1").is_dir()
    config = (repository / "llm" / "config.pbtxt").read_text()
    shipped = (REPO_ROOT / "model_repository" / "llm_q4" / "config.pbtxt").read_text()
    assert re.findall(r'^name:\s*"([^"]*)"', config, flags=re.M) == ["llm"]
    assert 'backend: "inflight"' in config and "decoupled: true" in config
    params, shipped_params = dict(PARAMETER.findall(config)), dict(PARAMETER.findall(shipped))
    assert params["model_path"] == str(gguf) and params["tokenizer"] == os.path.abspath("some/tokenizer")
    assert (params["omp_threads_bind"], params["max_num_seqs"]) == ("1,3", "8")
    changed = {"model_path", "tokenizer", "omp_threads_bind", "max_num_seqs"}
    assert {k: v for k, v in params.items() if k not in changed} == \
        {k: v for k, v in shipped_params.items() if k not in changed}
    # What the backend makes of it: the engine's settings, model_path the file.
    engine = EngineConfig.from_parameters(params, str(repository / "llm" / "1"))
    assert (engine.model_path, engine.max_num_seqs, engine.omp_threads_bind) == (str(gguf), 8, "1,3")


def test_started_gives_each_server_a_fresh_folder_records_its_version_and_stops_it(tmp_path, capsys):
    from contextlib import contextmanager

    events = []

    @contextmanager
    def fake_server(workdir):
        events.append(("start", workdir))
        yield "127.0.0.1:1234", "v9"
        events.append(("stop", workdir))

    versions = {}
    with servers.started("llama-server q8_0", "llama-server", fake_server, str(tmp_path), versions) as address:
        assert address == "127.0.0.1:1234" and versions == {"llama-server": "v9"}
        assert events == [("start", tmp_path / "llama-server-q8_0")] and events[0][1].is_dir()
    assert events[-1] == ("stop", tmp_path / "llama-server-q8_0")
    assert "llama-server q8_0: ready in" in capsys.readouterr().out
    with pytest.raises(FileExistsError):  # a label run twice would mix two servers' logs
        with servers.started("llama-server q8_0", "llama-server", fake_server, str(tmp_path), versions):
            pass


def recorded(system: str, gguf_type: str, concurrency: int, duration_s: float, ttft_s: float) -> dict:
    """A summarized run of two requests of 4 tokens, each first token `ttft_s` after it was sent."""
    workload = Workload("W3", "two requests", [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5, 6], 4)])
    records = [RequestRecord(0.0, [ttft_s + 0.01 * i for i in range(4)], 4, 4, finish_reason="length")
               for _ in workload.requests]
    return {"gguf_type": gguf_type, **summarize(SystemRun(system, records, duration_s, concurrency=concurrency),
                                                workload)}


def test_q3_compares_tritonserver_to_llama_server_per_type_and_concurrency_against_the_targets():
    results = [
        recorded("tritonserver", "Q4_1", 1, 2.0, 0.05), recorded("tritonserver", "Q4_1", 32, 1.0, 0.20),
        recorded("llama-server", "Q4_1", 1, 1.8, 0.10), recorded("llama-server", "Q4_1", 32, 1.5, 0.10),
        recorded("tritonserver", "Q8_0", 4, 1.0, 0.05), recorded("llama-server", "Q8_0", 4, 3.0, 0.10),
        recorded("tritonserver", "Q8_0", 32, 1.0, 0.05),  # llama-server's run missing: no ratio
    ]
    compared = gguf_serving.compare(results)
    assert list(compared) == ["Q4_1", "Q8_0"] and list(compared["Q4_1"]) == ["c=1", "c=32"]
    c1, c32 = compared["Q4_1"]["c=1"], compared["Q4_1"]["c=32"]
    assert c1["output_tokens_per_s"] == pytest.approx(1.8 / 2.0) and c1["ttft_mean"] == pytest.approx(0.5)
    assert c1["target"] == {"output_tokens_per_s": 1.0, "lower_ttft": True, "met": False}  # 0.9x < 1.0x
    assert c32["output_tokens_per_s"] == pytest.approx(1.5) and c32["ttft_mean"] == pytest.approx(2.0)
    assert c32["target"]["output_tokens_per_s"] == 1.3 and not c32["target"]["met"]  # fast, but a higher TTFT
    # A concurrency without a target (the smoke run's) gets the ratios alone.
    assert list(compared["Q8_0"]) == ["c=4"] and "target" not in compared["Q8_0"]["c=4"]
    assert compared["Q8_0"]["c=4"]["output_tokens_per_s"] == pytest.approx(3.0)
    met = gguf_serving.compare([recorded("tritonserver", "Q4_0", 32, 1.0, 0.05),
                                recorded("llama-server", "Q4_0", 32, 1.4, 0.10)])
    assert met["Q4_0"]["c=32"]["target"]["met"]


# ---- W9 against llama-server (client/bench/speculative_serving.py) --------------------


def test_w9_llama_methods_parse_with_off_or_name_what_is_wrong():
    parse = speculative_serving.parse_methods
    assert parse("off,suffix,ngram,suffix", speculative_serving.METHODS, "--methods") == ["off", "suffix", "ngram"]
    for bad in ("ngram", "off,eagle", ""):  # no `off` to compare with, an unknown name, nothing
        with pytest.raises(ValueError, match="--llama-methods .*`off` and any of ngram-simple, ngram-mod, draft-q8"):
            parse(bad, speculative_serving.LLAMA_METHODS, "--llama-methods")


@pytest.mark.parametrize("benchmark,argv,message", [
    (speculative_serving, ["--methods", "ngram"], "--methods 'ngram'"),
    (speculative_serving, ["--llama-methods", "off,lookahead"], "--llama-methods 'off,lookahead'"),
    (speculative_serving, ["--methods", "off,draft_int8"], "--methods draft_int8: through the server a draft_model"),
    (speculative_serving, ["--concurrency", "1,4", "--slots", "2"], "--slots 2: fewer than the highest concurrency, 4"),
    (speculative_serving, ["--requests", "0"], "--requests, --max-tokens and --rounds must be at least 1"),
    (speculative_serving, ["--rounds", "0"], "--requests, --max-tokens and --rounds must be at least 1"),
    (speculative_serving, ["--cores", "4096"], "--cores 4096: this process may use"),
    (kv_serving, ["--kv-dtypes", "int8"], "--kv-dtypes 'int8': comma-separated, auto and any of int8, fp8_e4m3, fp8_e5m2"),
    (kv_serving, ["--llama-cache-types", "model,q5_1"], "--llama-cache-types 'model,q5_1'"),
    (kv_serving, ["--requests", "0"], "--concurrency, --requests, --input-len and --max-tokens must be at least 1"),
    (kv_serving, ["--cores", "4096"], "--cores 4096: this process may use"),
], ids=lambda v: v.__name__.rsplit(".", 1)[-1] if hasattr(v, "__name__") else None)
def test_serving_benchmarks_refuse_bad_arguments_before_they_start_anything(benchmark, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("benchmark", [gguf_serving, speculative_serving, kv_serving],
                         ids=lambda v: v.__name__.rsplit(".", 1)[-1])
def test_every_benchmark_that_starts_llama_server_takes_flags_for_it(benchmark, capsys):
    """`--llama-server-args` (such as --no-repack, where llama-server's repacked AMX kernels die)
    parses wherever llama-server starts: the run then stops at the bad --cores, not at the flags."""
    with pytest.raises(SystemExit) as exc:
        benchmark.main(["--llama-server-args=--no-repack --threads-http 1", "--cores", "4096"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--cores 4096: this process may use" in err and "unrecognized" not in err


def test_w9_llama_engine_repository_carries_each_methods_speculative_config(tmp_path):
    for method in ("off", "ngram", "suffix"):
        parameters = speculative_serving.engine_parameters(method, "some/checkpoint")
        repository = servers.write_repository(tmp_path / method, speculative_serving.BASE_MODEL, parameters, [0], 4)
        params = {k: v.replace('\\"', '"') for k, v in re.findall(
            r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"',
            (repository / "llm" / "config.pbtxt").read_text())}
        engine = EngineConfig.from_parameters(params, str(repository / "llm" / "1"))
        assert (engine.model_path, engine.dtype, engine.max_num_seqs) == (os.path.abspath("some/checkpoint"),
                                                                          "float32", 4)
        # What the backend loads: speculative.METHODS' settings, none when off.
        expected = speculative_serving.METHODS[method]
        assert engine.speculative_config == expected


def llama_flags_of(command: list[str]) -> dict[str, str | None]:
    """A command line's flags: each flag's value, None for a flag without one."""
    flags, args = {}, command[1:]
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            flags[arg] = value
    return flags


def test_w9_llama_server_commands_add_each_speculation_to_the_shared_settings():
    plain = servers.llama_server_command("/m/f32.gguf", 8090, [2, 3], 4)
    assert plain == llama_cpp.server_command("/m/f32.gguf", "float32", 8090, slots=4, threads=2)
    for method in speculative_serving.LLAMA_METHODS:
        command = servers.llama_server_command("/m/f32.gguf", 8090, [2, 3], 4,
                                               speculative_serving.llama_flags(method, "/m/Q8_0.gguf"))
        assert command[:len(plain)] == plain
        flags = llama_flags_of(command)
        assert (flags["--parallel"], flags["--threads"], flags["--cache-type-k"], flags["--cache-type-v"]) == (
            "4", "2", "f32", "f32")
        spec = {k: v for k, v in flags.items() if k.startswith("--spec-")}
        if method == "off":
            assert spec == {}
        elif method == "draft-q8":
            assert spec == {"--spec-type": "draft-simple", "--spec-draft-model": "/m/Q8_0.gguf",
                            "--spec-draft-n-max": "3"}
        else:  # its n-gram speculation: a lookup of 4 (the engine's ngram's) or 8, then drafts of up to 16
            assert spec == {"ngram-simple": {"--spec-type": "ngram-simple", "--spec-ngram-simple-size-n": "4",
                                             "--spec-ngram-simple-size-m": "16"},
                            "ngram-mod": {"--spec-type": "ngram-mod", "--spec-ngram-mod-n-match": "8",
                                          "--spec-ngram-mod-n-min": "2", "--spec-ngram-mod-n-max": "16"}}[method]


def w9_recorded(system: str, method: str, workload: str, concurrency: int, duration_s: float,
                tpot_s: float = 0.01) -> dict:
    """Two requests of 4 tokens, each `tpot_s` apart, the run taking `duration_s`."""
    w = Workload(workload, "two requests", [BenchRequest([1, 2, 3], 4), BenchRequest([4, 5, 6], 4)])
    records = [RequestRecord(0.0, [0.05 + tpot_s * i for i in range(4)], 4, 4, finish_reason="length")
               for _ in w.requests]
    return {"method": method, "workload": workload,
            **summarize(SystemRun(system, records, duration_s, concurrency=concurrency), w)}


def test_w9_llama_ratios_take_llama_servers_fastest_speculation_and_each_systems_off():
    results = [
        w9_recorded("tritonserver", "off", "W9a", 1, 4.0), w9_recorded("tritonserver", "ngram", "W9a", 1, 2.0, 0.005),
        w9_recorded("tritonserver", "suffix", "W9a", 1, 1.0, 0.0025),
        w9_recorded("llama-server", "off", "W9a", 1, 3.0), w9_recorded("llama-server", "ngram-simple", "W9a", 1, 2.5),
        w9_recorded("llama-server", "draft-q8", "W9a", 1, 1.5, 0.02),
        w9_recorded("tritonserver", "off", "W9a", 2, 1.0), w9_recorded("tritonserver", "suffix", "W9a", 2, 1.0),
        w9_recorded("llama-server", "off", "W9a", 2, 1.0),  # no speculation of llama-server's: no comparison
    ]
    compared = speculative_serving.compare(results)
    assert list(compared) == ["W9a c=1", "W9a c=2"]
    c1 = compared["W9a c=1"]
    assert c1["llama_server_best"] == "draft-q8"  # the fastest in output tokens/s, whatever its TPOT
    assert c1["vs_llama_server"]["suffix"]["output_tokens_per_s"] == pytest.approx(1.5)
    assert c1["vs_llama_server"]["suffix"]["tpot_p50"] == pytest.approx(0.125)
    assert c1["vs_llama_server"]["suffix"]["target"] == {"output_tokens_per_s": 1.3, "met": True}
    assert c1["vs_llama_server"]["ngram"]["output_tokens_per_s"] == pytest.approx(0.75)
    assert not c1["vs_llama_server"]["ngram"]["target"]["met"]
    assert c1["over_off"]["tritonserver"]["ngram"] == pytest.approx({"output_tokens_per_s": 2.0, "tpot_p50": 0.5})
    theirs = c1["over_off"]["llama-server"]
    assert list(theirs) == ["ngram-simple", "draft-q8"]
    assert theirs["ngram-simple"] == pytest.approx({"output_tokens_per_s": 1.2, "tpot_p50": 1.0})
    assert theirs["draft-q8"] == pytest.approx({"output_tokens_per_s": 2.0, "tpot_p50": 2.0})
    assert "off" not in c1["vs_llama_server"] and "off" not in c1["over_off"]["tritonserver"]
    # Concurrency 2 has no target (the smoke run's), and llama-server ran no speculation there.
    c2 = compared["W9a c=2"]
    assert "vs_llama_server" not in c2 and "llama_server_best" not in c2
    assert c2["over_off"] == {"tritonserver": {"suffix": {"output_tokens_per_s": 1.0, "tpot_p50": 1.0}}}


def test_w9_llama_ratios_of_several_rounds_are_the_medians_of_each_rounds_own():
    def one_round(k: int, suffix_s: float, simple_s: float, mod_s: float) -> list[dict]:
        runs = [w9_recorded("tritonserver", "off", "W9a", 1, 4.0), w9_recorded("tritonserver", "suffix", "W9a", 1, suffix_s),
                w9_recorded("llama-server", "off", "W9a", 1, 4.0),
                w9_recorded("llama-server", "ngram-simple", "W9a", 1, simple_s),
                w9_recorded("llama-server", "ngram-mod", "W9a", 1, mod_s)]
        return [{**r, "round": k} for r in runs]

    # Per round, suffix over llama-server's fastest that round: 2.0 / 1.0 = 2.0, 1.6 / 1.2 = 1.333...,
    # then 1.0 / 1.0 = 1.0 (ngram-mod the fastest in that round only).
    results = one_round(0, 1.0, 2.0, 3.0) + one_round(1, 1.2, 1.6, 3.0) + one_round(2, 1.0, 3.0, 1.0)
    c1 = speculative_serving.compare(results)["W9a c=1"]
    assert c1["rounds"] == 3
    assert c1["llama_server_best"] == "ngram-simple"  # the fastest in two rounds of three
    assert c1["vs_llama_server"]["suffix"]["output_tokens_per_s"] == pytest.approx(1.6 / 1.2)
    assert c1["vs_llama_server"]["suffix"]["target"] == {"output_tokens_per_s": 1.3, "met": True}
    # Over its own off: 4.0, 3.333..., 4.0 for suffix; ngram-simple's 2.0, 2.5, 1.333...
    assert c1["over_off"]["tritonserver"]["suffix"]["output_tokens_per_s"] == pytest.approx(4.0)
    assert c1["over_off"]["llama-server"]["ngram-simple"]["output_tokens_per_s"] == pytest.approx(2.0)
    # A round under way (the report is written after each server) counts for what it has.
    partial = [r for r in one_round(3, 0.5, 1.0, 3.0) if r["system"] == "tritonserver"]
    under_way = speculative_serving.compare(results + partial)["W9a c=1"]
    assert under_way["rounds"] == 4 and under_way["vs_llama_server"] == c1["vs_llama_server"]
    assert under_way["over_off"]["tritonserver"]["suffix"]["output_tokens_per_s"] == pytest.approx(4.0)
    ngram_once = speculative_serving.compare(results + [{**w9_recorded("tritonserver", "ngram", "W9a", 1, 2.0), "round": 0}])
    assert ngram_once["W9a c=1"]["vs_llama_server"]["ngram"]["output_tokens_per_s"] == pytest.approx(1.0)
    engine_only = speculative_serving.compare(one_round(0, 1.0, 2.0, 3.0)[:2] + [
        {**r, "round": 1} for r in one_round(0, 1.0, 2.0, 3.0)])["W9a c=1"]
    assert engine_only["vs_llama_server"]["suffix"]["output_tokens_per_s"] == pytest.approx(2.0)
    # One round alone: that round's ratios, unchanged.
    assert speculative_serving.compare(one_round(1, 1.2, 1.6, 3.0)) == speculative_serving.compare_round(
        one_round(1, 1.2, 1.6, 3.0))


def test_w9_llama_rounds_whose_greedy_texts_are_not_the_first_rounds_are_named():
    first = {("tritonserver", "off", "W9a", 1): ["a"], ("llama-server", "off", "W9a", 1): ["b"]}
    assert speculative_serving.unrepeated([first, dict(first)]) == []
    changed = {**first, ("llama-server", "off", "W9a", 1): ["c"]}
    assert speculative_serving.unrepeated([first, dict(first), changed]) == [(2, "llama-server", "off", "W9a", 1)]


def test_w9_llama_greedy_texts_compare_each_method_with_its_systems_off():
    texts = {
        ("tritonserver", "off", "W9a", 1): ["the cat sat", "a dog"],
        ("tritonserver", "suffix", "W9a", 1): ["the cat sat", "a dog"],
        ("llama-server", "off", "W9a", 1): ["the cat sat", "a dig"],
        ("llama-server", "ngram-mod", "W9a", 1): ["the hat sat", "a dog"],
        ("tritonserver", "off", "W9b", 1): ["hi"],
        ("tritonserver", "ngram", "W9b", 1): ["ho"],
    }
    greedy = speculative_serving.compare_texts(texts)
    assert greedy["W9a c=1"] == {
        "tritonserver": {"suffix": {"requests_differing": 0}},
        "llama-server": {"ngram-mod": {"requests_differing": 2, "first": {"request": 0, "offset": 4}}},
        "llama-server off vs tritonserver off": {"requests_differing": 1, "first": {"request": 1, "offset": 3}},
    }
    assert speculative_serving.text_difference(["abc"], ["ab"]) == {"requests_differing": 1,
                                                                    "first": {"request": 0, "offset": 2}}
    assert greedy["W9b c=1"] == {"tritonserver": {"ngram": {"requests_differing": 1,
                                                            "first": {"request": 0, "offset": 1}}}}
    # The engine's methods must give its off's text; llama-server's may differ.
    assert not speculative_serving.engine_texts_agree(greedy)
    del texts[("tritonserver", "ngram", "W9b", 1)]
    assert speculative_serving.engine_texts_agree(speculative_serving.compare_texts(texts))


# ---- quantized KV against llama-server (client/bench/kv_serving.py) ---------------------


def test_kv_long_prompts_are_stretches_of_the_fixed_text_that_share_no_prefix():
    from transformers import AutoTokenizer

    from backend.paths import DEFAULT_CHECKPOINT

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    workload = kv_serving.long_prompts(tokenizer, 6, 500, 32, seed=3)
    assert [r.max_tokens for r in workload.requests] == [32] * 6
    for r in workload.requests:
        assert r.prompt_token_ids == tokenizer.encode(r.prompt_text)  # what a server tokenizes
        assert abs(len(r.prompt_token_ids) - 500) <= 5
    firsts = {tuple(r.prompt_token_ids[:8]) for r in workload.requests}
    assert len(firsts) == 6  # no server can reuse one request's KV for another
    assert [r.prompt_text for r in kv_serving.long_prompts(tokenizer, 6, 500, 32, seed=3).requests] == \
        [r.prompt_text for r in workload.requests]
    with pytest.raises(ValueError, match="--input-len 10000000: the fixed text has"):
        kv_serving.long_prompts(tokenizer, 1, 10_000_000, 8)


def test_kv_llama_servers_quantized_caches_override_the_model_dtypes_and_the_engine_gets_its_kv_dtype(tmp_path):
    plain = servers.llama_server_command("/m/bf16.gguf", 8090, [0, 1], 8, dtype="bfloat16", slot_context=4200)
    flags = llama_flags_of(plain)
    assert (flags["--cache-type-k"], flags["--cache-type-v"], flags["--ctx-size"]) == ("bf16", "bf16", str(8 * 4200))
    assert kv_serving.llama_flags("model") == []
    command = servers.llama_server_command("/m/bf16.gguf", 8090, [0, 1], 8, kv_serving.llama_flags("q8_0"),
                                           dtype="bfloat16", slot_context=4200)
    # llama.cpp's parser takes flags in order: the later cache type is the one it runs.
    assert command[:len(plain)] == plain and command[len(plain):] == ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    parameters = kv_serving.engine_parameters("int8", "some/checkpoint", "bfloat16", 1024, 4200)
    repository = servers.write_repository(tmp_path / "repo", kv_serving.BASE_MODEL, parameters, [0], 8)
    params = dict(re.findall(r'key:\s*"([^"]+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"',
                             (repository / "llm" / "config.pbtxt").read_text()))
    engine = EngineConfig.from_parameters(params, str(repository / "llm" / "1"))
    assert (engine.kv_cache_dtype, engine.dtype, engine.kv_cache_memory_mb, engine.max_model_len,
            engine.enable_prefix_caching, engine.max_num_seqs) == ("int8", "bfloat16", 1024, 4200, False, 8)


def test_kv_llama_ratios_put_each_engine_cache_against_llama_servers_q8_0_and_each_systems_own():
    def recorded(system, setting, duration_s, tpot_s=0.01):
        return {"setting": setting, **w9_recorded(system, setting, "long-context", 8, duration_s, tpot_s)}

    compared = kv_serving.compare([recorded("tritonserver", "auto", 4.0), recorded("tritonserver", "int8", 2.0, 0.005),
                                   recorded("llama-server", "model", 3.0), recorded("llama-server", "q8_0", 2.5)])
    ours = compared["tritonserver_over_llama_server_q8_0"]
    assert ours["int8"]["output_tokens_per_s"] == pytest.approx(1.25) and ours["int8"]["target"]["met"]
    assert ours["auto"]["output_tokens_per_s"] == pytest.approx(0.625) and not ours["auto"]["target"]["met"]
    assert compared["tritonserver_over_its_auto"]["int8"]["output_tokens_per_s"] == pytest.approx(2.0)
    assert compared["tritonserver_over_its_auto"]["int8"]["tpot_p50"] == pytest.approx(0.5)
    assert compared["llama_server_over_its_model_dtype"]["q8_0"]["output_tokens_per_s"] == pytest.approx(1.2)
    # Without llama-server's q8_0 run there is nothing to hold the target against.
    assert "tritonserver_over_llama_server_q8_0" not in kv_serving.compare([recorded("tritonserver", "auto", 1.0)])
