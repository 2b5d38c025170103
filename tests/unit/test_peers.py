"""The benchmark's peer systems (client/bench/peers.py) without vLLM installed.

hf-continuous runs for real on a tiny random checkpoint: exact token counts, one time per
token, and greedy output equal to transformers' own `generate()`. vllm-offline is checked
up to the process boundary: the request/result JSON both sides agree on, the command
client.bench.peers runs (with a stand-in for the .venv-peers child), and the error when
.venv-peers is missing. The real vLLM run is `make peers` plus client/bench/vllm_offline.py's
usage line, which need minutes and .venv-peers.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from client.bench import peers, vllm_peer
from client.bench.records import SystemRun
from client.bench.stats import summarize
from client.bench.workloads import BenchRequest, Workload
from tests.checkpoints import hf_greedy


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
