"""genai-perf against the real tritonserver, the way its users run it: the gRPC streaming
form of Triton's vLLM backend interface, a local tokenizer, synthetic prompts, values sent
as strings (`"max_tokens": "16"`). The profile must complete with no error, every request
answered, and the engine idle afterwards.

genai-perf 0.0.16 lives in its own venv (`make genai-perf-setup`, run here; a no-op once
done), with a `perf_analyzer` wrapper around the project venv's tritonclient 2.51 binary
(tests/genai_perf_setup.py). perf_analyzer 2.51 hangs when --warmup-request-count is below
the concurrency, so there is no warm-up (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import DEFAULT_CHECKPOINT
from tests.e2e_util import REPO_ROOT, scrape, wait_idle

pytestmark = pytest.mark.e2e

GENAI_VENV = REPO_ROOT / ".venv-genai"
CONCURRENCY, REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS = 4, 8, 32, 16


@pytest.fixture(scope="module")
def genai_perf() -> Path:
    setup = subprocess.run(["make", "-s", "genai-perf-setup"], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=900)
    assert setup.returncode == 0, f"make genai-perf-setup failed:\n{setup.stdout}\n{setup.stderr}"
    binary = GENAI_VENV / "bin" / "genai-perf"
    assert binary.exists() and (GENAI_VENV / "bin" / "perf_analyzer").exists()
    return binary


def test_genai_perf_profile_completes_without_errors(triton_server, genai_perf, tmp_path):
    model = triton_server.model
    before = wait_idle(triton_server.metrics_port, model)
    artifacts = tmp_path / "artifacts"
    command = [
        str(genai_perf), "profile", "-m", model, "--endpoint-type", "kserve", "--backend", "vllm", "--streaming",
        "-u", triton_server.grpc_url, "--tokenizer", str(DEFAULT_CHECKPOINT),
        "--concurrency", str(CONCURRENCY), "--num-prompts", str(REQUESTS), "--request-count", str(REQUESTS),
        "--warmup-request-count", "0", "--random-seed", "7",
        "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
        "--artifact-dir", str(artifacts),
    ]
    env = {
        **os.environ,
        "PATH": f"{GENAI_VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",  # the tokenizer is a local folder; never reach for a hub
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = f"$ {' '.join(command)}\n--- stdout ---\n{run.stdout[-6000:]}\n--- stderr ---\n{run.stderr[-6000:]}"
    assert run.returncode == 0, log
    assert "Thread [" not in run.stdout + run.stderr, log  # perf_analyzer's "Thread [0] had error: ..."

    [summary_path] = artifacts.rglob("profile_export_genai_perf.json")
    summary = json.loads(summary_path.read_text())
    assert summary["request_count"]["avg"] == REQUESTS, summary["request_count"]
    assert summary["input_sequence_length"]["avg"] == INPUT_TOKENS
    assert 1 <= summary["output_sequence_length"]["min"] <= summary["output_sequence_length"]["max"] <= OUTPUT_TOKENS
    assert summary["time_to_first_token"]["avg"] > 0 and summary["inter_token_latency"]["avg"] > 0
    assert summary["output_token_throughput"]["avg"] > 0

    # What perf_analyzer saw, request by request: the interface genai-perf speaks, and answers.
    [raw_path] = artifacts.rglob("profile_export.json")
    requests = json.loads(raw_path.read_text())["experiments"][0]["requests"]
    assert len(requests) == REQUESTS
    for record in requests:
        inputs = record["request_inputs"]
        assert inputs["stream"] is True and inputs["exclude_input_in_output"] is True
        assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": str(OUTPUT_TOKENS)}
        texts = [r.get("text_output", "") for r in record["response_outputs"]]
        assert len(texts) >= 2 and "".join(texts).strip(), record  # streamed, with text

    # The server's side: every request ended normally and nothing is left behind.
    after = wait_idle(triton_server.metrics_port, model)
    ended = {reason: after.get("inflight_requests_finished_total", model=model, finish_reason=reason)
             - before.get("inflight_requests_finished_total", model=model, finish_reason=reason)
             for reason in ("stop", "length", "abort", "error")}
    assert ended["abort"] == 0 and ended["error"] == 0, ended
    assert ended["stop"] + ended["length"] == REQUESTS, ended
    assert scrape(triton_server.metrics_port).get(
        "nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="used") == 0
