"""genai-perf against the real tritonserver, the way its users run it: the gRPC streaming
form of Triton's vLLM backend interface, a local tokenizer, synthetic prompts, values sent
as strings (`"max_tokens": "16"`). The profile must complete with no error, every request
answered, and the engine idle afterwards.

genai-perf 0.0.16 lives in its own venv (`make genai-perf-setup`, run here; a no-op once
done), whose `perf_analyzer` is the project's wrapper of the tritonclient 2.51 binary. The
command is `make genai-perf`'s (client/bench/loadtest.py), with its five `return_*` inputs and,
as genai-perf users type it, without them; `make perf`'s perf_analyzer recipe is tested
here too, and so is the comparison run (the same recipe against an OpenAI-compatible
server, here the project's own frontend standing in for vLLM's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from backend.protocol import RETURN_FLAGS
from client.bench.loadtest import genai_perf_command
from tests.e2e.e2e_util import scrape, wait_idle

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


def finished_since(before, metrics_port: int, model: str) -> dict[str, float]:
    """Requests the model finished since the `before` scrape, by finish reason, once idle."""
    after = wait_idle(metrics_port, model)
    return {reason: after.get("inflight_requests_finished_total", model=model, finish_reason=reason)
            - before.get("inflight_requests_finished_total", model=model, finish_reason=reason)
            for reason in ("stop", "length", "abort", "error")}


def run_profile(triton_server, genai_perf, tmp_path, return_inputs: bool) -> tuple[dict, list[dict]]:
    """`make genai-perf`'s command at a small size (`return_inputs` False: without the five
    `return_*` inputs); its summary, checked complete, and perf_analyzer's request records."""
    artifacts = tmp_path / "artifacts"
    command = genai_perf_command(
        genai_perf, model=triton_server.model, url=triton_server.grpc_url, tokenizer=DEFAULT_CHECKPOINT,
        concurrency=CONCURRENCY, num_requests=REQUESTS, input_tokens=INPUT_TOKENS, output_tokens=OUTPUT_TOKENS,
        artifact_dir=artifacts, seed=7, return_inputs=return_inputs,
    )
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
    assert summary["time_to_first_token"]["avg"] > 0 and summary["inter_token_latency"]["avg"] > 0
    assert summary["output_token_throughput"]["avg"] > 0

    # What perf_analyzer saw, request by request.
    [raw_path] = artifacts.rglob("profile_export.json")
    requests = json.loads(raw_path.read_text())["experiments"][0]["requests"]
    assert len(requests) == REQUESTS
    return summary, requests


def assert_every_output_real(responses: list[dict]) -> None:
    """perf_analyzer 2.51 records all seven declared outputs of every response; one a response
    lacks reads as stray memory (client/bench/loadtest.py). Every one must be the real value."""
    assert all(r["num_input_tokens"] == INPUT_TOKENS for r in responses), responses
    assert sum(r["num_output_tokens"] for r in responses) == OUTPUT_TOKENS
    assert [r["finish_reason"] for r in responses[:-1]] == ["None"] * (len(responses) - 1)
    assert responses[-1]["finish_reason"] == "length"
    logprobs = [r["cumulative_logprob"] for r in responses]
    assert all(b <= a <= 0 for a, b in zip(logprobs, logprobs[1:])), logprobs  # a running sum of log p


def test_genai_perf_profile_completes_without_errors(triton_server, genai_perf, tmp_path):
    model = triton_server.model
    before = wait_idle(triton_server.metrics_port, model)
    summary, requests = run_profile(triton_server, genai_perf, tmp_path, return_inputs=True)

    # The interface genai-perf speaks, and its answers.
    # genai-perf's output length is the joined text re-encoded, not the count generated: the
    # model may emit a non-canonical split ("Par"+"is") that re-encodes to fewer tokens, or
    # the reverse, so it can pass max_tokens. The exact count is each response's
    # num_output_tokens, checked below; here the summary must match genai-perf's definition.
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    reencoded = [len(tokenizer.encode("".join(r.get("text_output", "") for r in record["response_outputs"]),
                                      add_special_tokens=False)) for record in requests]
    assert (summary["output_sequence_length"]["min"], summary["output_sequence_length"]["max"]) \
        == (min(reencoded), max(reencoded)) and min(reencoded) >= 1, (summary["output_sequence_length"], reencoded)
    for record in requests:
        inputs = record["request_inputs"]
        assert inputs["stream"] is True and inputs["exclude_input_in_output"] is True
        # Exactly OUTPUT_TOKENS each (min_tokens = max_tokens), so every server does the same work.
        assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": str(OUTPUT_TOKENS),
                                                             "min_tokens": str(OUTPUT_TOKENS)}
        assert all(inputs[flag] is True for flag in RETURN_FLAGS)
        responses = record["response_outputs"]
        texts = [r.get("text_output", "") for r in responses]
        assert len(texts) >= 2 and "".join(texts).strip(), record  # streamed, with text
        assert_every_output_real(responses)

    # The server's side: every request ended normally and nothing is left behind.
    ended = finished_since(before, triton_server.metrics_port, model)
    assert ended == {"stop": 0, "length": REQUESTS, "abort": 0, "error": 0}, ended
    assert scrape(triton_server.metrics_port).get(
        "nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="used") == 0


def test_plain_genai_perf_command_gets_a_complete_export(triton_server, genai_perf, tmp_path):
    """The command without the `return_*` inputs, as genai-perf users type it: perf_analyzer
    still asks for all seven outputs, and every response carries them (before, a response
    carried only text_output, and a stray float that read as NaN left a zero-length export)."""
    model = triton_server.model
    before = wait_idle(triton_server.metrics_port, model)
    summary, requests = run_profile(triton_server, genai_perf, tmp_path, return_inputs=False)
    assert summary["request_throughput"]["avg"] > 0

    for record in requests:
        inputs = record["request_inputs"]
        assert not any(flag in inputs for flag in RETURN_FLAGS), inputs
        responses = record["response_outputs"]
        assert len(responses) >= 2 and "".join(r["text_output"] for r in responses).strip(), record
        assert all(r["logprobs"] == "null" for r in responses), responses  # no "logprobs" sampling value asked
        assert all(r["trace"] == "null" for r in responses), responses  # no return_trace asked
        assert_every_output_real(responses)

    ended = finished_since(before, triton_server.metrics_port, model)
    assert ended == {"stop": 0, "length": REQUESTS, "abort": 0, "error": 0}, ended


def test_perf_analyzer_recipe_measures_every_request(triton_server, tmp_path):
    """`make perf`'s recipe at a small size: perf_analyzer 2.51 over gRPC streaming with the
    project's wrapper, EOS ignored so every request streams exactly its max_tokens."""
    model, requests, output_tokens = triton_server.model, 6, 8
    before = wait_idle(triton_server.metrics_port, model)
    out = tmp_path / "perf_analyzer"
    command = [sys.executable, "-m", "client.bench.loadtest", "perf-analyzer", "--url", triton_server.grpc_url,
               "--model", model, "--concurrency", "3", "--num-requests", str(requests),
               "--input-tokens", "24", "--output-tokens", str(output_tokens), "--out", str(out)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    log = f"$ {' '.join(command)}\n--- stdout ---\n{run.stdout[-6000:]}\n--- stderr ---\n{run.stderr[-6000:]}"
    assert run.returncode == 0, log
    assert "Thread [" not in run.stdout + run.stderr, log

    csv_header, csv_row = (out / "concurrency3.csv").read_text().splitlines()[:2]
    assert csv_header.startswith("Concurrency,Inferences/Second") and csv_row.startswith("3,"), log
    records = json.loads((out / "concurrency3_profile_export.json").read_text())["experiments"][0]["requests"]
    assert len(records) >= requests
    for record in records:
        responses = record["response_outputs"]
        assert sum(r["num_output_tokens"] for r in responses) == output_tokens, responses
        assert all(r["num_input_tokens"] == 24 for r in responses), responses
        assert responses[-1]["finish_reason"] == "length"

    assert finished_since(before, triton_server.metrics_port, model)["length"] == len(records)


def test_genai_perf_compares_this_backend_with_an_openai_server(triton_server, genai_perf, tmp_path):
    """`python -m client.bench.loadtest genai-perf --openai-url NAME=HOST:PORT --repeat 2 --json ...`:
    the same recipe against Triton (kserve) and an OpenAI-compatible server (completions),
    twice, interleaved, each run with prompts of its own; one export folder per profile; a
    report with every profile and the median ratios. The OpenAI server here is the
    project's frontend over the same tritonserver (vLLM's is not installed in CI)."""
    from tests.e2e.openai_frontend import run_frontend

    model, requests, output_tokens = triton_server.model, 4, 8
    before = wait_idle(triton_server.metrics_port, model)
    out, report_path = tmp_path / "genai_perf", tmp_path / "results" / "compare.json"
    with run_frontend(triton_server.grpc_url) as frontend:
        command = [sys.executable, "-m", "client.bench.loadtest", "genai-perf", "--url", triton_server.grpc_url,
                   "--openai-url", f"frontend=127.0.0.1:{frontend.port}", "--model", model, "--concurrency", "2",
                   "--num-requests", str(requests), "--input-tokens", "16", "--output-tokens", str(output_tokens),
                   "--out", str(out), "--json", str(report_path), "--repeat", "2"]
        run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    log = f"$ {' '.join(command)}\n--- stdout ---\n{run.stdout[-6000:]}\n--- stderr ---\n{run.stderr[-6000:]}"
    assert run.returncode == 0, log

    report = json.loads(report_path.read_text())
    assert [(r["system"], r["concurrency"], r["run"], r["seed"]) for r in report["results"]] == [
        ("triton-grpc", 2, 1, 0), ("frontend", 2, 1, 0), ("triton-grpc", 2, 2, 1), ("frontend", 2, 2, 1)]
    for r in report["results"]:
        assert r["request_count"]["avg"] == requests and r["input_sequence_length"]["avg"] == 16, r
        assert r["output_token_throughput"]["avg"] > 0 and r["time_to_first_token"]["avg"] > 0, r
    ratios = report["ratios"]["triton-grpc/frontend @ c=2"]
    per_run = [ours["output_token_throughput"]["avg"] / peer["output_token_throughput"]["avg"]
               for ours, peer in (report["results"][:2], report["results"][2:])]
    assert ratios["runs"] == pytest.approx(per_run)
    assert ratios["output_tokens_per_s"] == pytest.approx(sum(per_run) / 2)  # the median of two
    assert set(ratios) == {"output_tokens_per_s", "ttft_mean", "ttft_p99", "itl_mean", "itl_p99", "runs"}
    assert report["recipe"]["output_tokens"] == output_tokens and report["git_commit"]

    # The OpenAI profile asked for exactly output_tokens, streamed, and each profile kept its own
    # export; the second run's prompts are not the first's (a prefix cache would serve them).
    prompts = []
    for run in (1, 2):
        [raw] = (out / "frontend" / "concurrency2" / f"run{run}").rglob("profile_export.json")
        payloads = [json.loads(record["request_inputs"]["payload"])
                    for record in json.loads(raw.read_text())["experiments"][0]["requests"]]
        for payload in payloads:
            assert payload["stream"] is True and payload["max_tokens"] == payload["min_tokens"] == output_tokens
        prompts.append({payload["prompt"] if isinstance(payload["prompt"], str) else json.dumps(payload["prompt"])
                        for payload in payloads})
        assert len(list((out / "triton-grpc" / "concurrency2" / f"run{run}").rglob(
            "profile_export_genai_perf.json"))) == 1
    assert prompts[0].isdisjoint(prompts[1])

    # docs/results.md's generator (client.bench.table) lists the report in its genai-perf table, ratios named by file.
    from client.bench import table

    rendered = table.table([str(report_path)])
    peer = report["results"][1]
    assert f"| frontend @ run 1 | 2 | {peer['output_token_throughput']['avg']:.1f} |" in rendered
    assert f", compare) triton-grpc/frontend @ c=2: output tokens per s {ratios['output_tokens_per_s']:.2f}x" in rendered

    # Every profile went through the one engine: 4 x requests, every one to its length.
    finished = finished_since(before, triton_server.metrics_port, model)
    assert finished == {"stop": 0, "length": 4 * requests, "abort": 0, "error": 0}, finished
