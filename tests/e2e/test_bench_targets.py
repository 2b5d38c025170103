"""The benchmark's server targets (client/bench/targets.py) against the session's real
tritonserver over gRPC, HTTP and our OpenAI frontend: tiny workloads whose every request's
token count and timing are checked (the harness's in-process tests are
tests/unit/test_bench_harness.py).
"""

from __future__ import annotations

import pytest

from backend.paths import DEFAULT_CHECKPOINT
from client.bench import workloads
from client.bench.stats import summarize
from client.bench.targets import parse_target, run_target


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


@pytest.mark.e2e
def test_server_targets_complete_every_request_with_its_token_count(triton_server, tokenizer):
    from tests.e2e.openai_frontend import run_frontend

    w = workloads.attach_text(workloads.w3_online(num_requests=4, input_len=16, output_len=8, rate_per_s=8.0),
                              tokenizer)
    with run_frontend(triton_server.grpc_url) as frontend:
        runs = [
            run_target(parse_target(f"grpc://{triton_server.grpc_url}"), w, progress=False),
            run_target(parse_target(triton_server.http_url), w, progress=False),
            run_target(parse_target(f"openai://127.0.0.1:{frontend.port}"), w, progress=False),
            run_target(parse_target(f"grpc://{triton_server.grpc_url}"), w, concurrency=2, progress=False),
        ]
    for run in runs:
        assert len(run.records) == 4, run.system
        for r in run.records:
            assert r.error is None and r.finish_reason == "length", (run.system, r)
            assert r.num_output_tokens == 8, (run.system, r)
            assert r.token_times and r.arrival < r.token_times[0] <= r.token_times[-1] <= r.end_time
            assert r.text.strip(), (run.system, r)  # every client keeps the output text
        result = summarize(run, w)
        assert result["num_completed"] == 4 and result["all_token_counts_right"], result
        assert result["ttft_ms"]["p99"] <= result["e2el_ms"]["p99"]
        assert result["output_tokens"] == 32
    assert [run.system for run in runs] == ["triton-grpc", "triton-http", "openai", "triton-grpc"]
    assert runs[3].concurrency == 2
