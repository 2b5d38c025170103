"""Disaggregated serving through a real tritonserver: model_repository_disaggregated/'s
`llm` (a BLS model) sends each request to llm_prefill and its KV transfer to llm_decode, in
one server. A tritonclient gRPC stream must see the aggregated engine's tokens in one
ordinary stream with exactly one final response, and both engines end holding no block.
"""

from __future__ import annotations

import pytest

from backend.disagg import SHM_PREFIX
from backend.paths import REPO_ROOT
from tests.e2e.e2e_util import generate, greedy_tokens_and_texts, inputs_for, output, tensor, wait_idle
from tests.e2e.server import E2E_PARAMETERS

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers and explain why each is prime, step by step, in detail."]
MAX_TOKENS = 12

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def disaggregated_server(tritonserver):
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8")  # several prefill chunks a prompt
    server = tritonserver({"llm": {}, "llm_prefill": engine, "llm_decode": engine},
                          source_repository=REPO_ROOT / "model_repository_disaggregated",
                          sources={name: name for name in ("llm", "llm_prefill", "llm_decode")})
    try:
        yield server
    finally:
        server.stop()


def test_disaggregated_greedy_tokens_are_the_aggregated_servers(disaggregated_server, triton_server):
    aggregated = greedy_tokens_and_texts(triton_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    disaggregated = greedy_tokens_and_texts(disaggregated_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    assert disaggregated == aggregated
    for model in ("llm_prefill", "llm_decode"):
        wait_idle(disaggregated_server.metrics_port, model)


def test_a_stream_is_one_ordinary_stream_with_one_final_response(disaggregated_server, triton_server):
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    inputs = lambda: inputs_for(PROMPTS[1], sampling, stream=True)
    aggregated = generate(triton_server.grpc_url, "llm", inputs())
    outcome = generate(disaggregated_server.grpc_url, "llm", inputs())
    assert outcome.error is None, outcome.message
    assert outcome.finals == 1 and outcome.after_final == 0
    assert outcome.text == aggregated.text and len(outcome.responses) > 1
    assert outcome.total("num_output_tokens") == MAX_TOKENS
    assert output(outcome.last, "finish_reason") == "length"
    wait_idle(disaggregated_server.metrics_port, "llm_decode")
    metrics = wait_idle(disaggregated_server.metrics_port, "llm_prefill")
    # Every request handed over was taken: the same transfers and bytes on both sides.
    exported, imported = ({name: metrics.get(name, model=model) for name in (
        "inflight_kv_transfers_total", "inflight_kv_transfer_bytes_total", "inflight_kv_transfer_seconds_count")}
        for model in ("llm_prefill", "llm_decode"))
    assert exported == imported and exported["inflight_kv_transfer_bytes_total"] > 0
    assert exported["inflight_kv_transfers_total"] == exported["inflight_kv_transfer_seconds_count"] >= 4
    # The prefill model ends its part of each request with "transferred"; the decode model
    # finishes the request.
    assert metrics.get("inflight_requests_finished_total", model="llm_decode", finish_reason="length") >= 1


def test_a_first_token_that_ends_the_request_is_answered_by_the_prefill_model(disaggregated_server):
    outcome = generate(disaggregated_server.grpc_url, "llm",
                       inputs_for(PROMPTS[0], {"temperature": 0, "max_tokens": 1, "ignore_eos": True}, stream=True))
    assert outcome.error is None, outcome.message
    assert outcome.finals == 1 and outcome.after_final == 0 and outcome.text
    assert output(outcome.last, "finish_reason") == "length"


def test_a_handle_that_names_no_transfer_ends_with_one_clear_error(disaggregated_server):
    missing = SHM_PREFIX + "0" * 24
    inputs = inputs_for(PROMPTS[0], {"max_tokens": 4}) + [tensor("transfer", missing, "BYTES")]
    outcome = generate(disaggregated_server.grpc_url, "llm_decode", inputs)
    assert outcome.finals == 1 and outcome.after_final == 0 and not outcome.responses
    assert f"no KV transfer named '{missing}'" in outcome.message
    assert "transfer:" in outcome.message


def test_an_invalid_request_is_refused_by_name_through_the_bls_model(disaggregated_server):
    outcome = generate(disaggregated_server.grpc_url, "llm", inputs_for(PROMPTS[0], {"temperature": -1}))
    assert outcome.finals == 1 and outcome.error is not None
    assert outcome.message.startswith("temperature")


def test_a_full_decode_model_refuses_with_unavailable_and_nothing_leaks(disaggregated_server):
    """12 requests at once against a decode model of max_num_seqs 8: the prefill model hands
    over the first 8 together, and the 4 after them reach a decode batch still busy with those
    8 for dozens of steps. Each request ends with exactly one final response: all its tokens,
    or UNAVAILABLE naming what is full; then neither engine holds a block or a transfer."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}

    def ask(i: int):  # a stream each: an error response carries no request id
        return generate(disaggregated_server.grpc_url, "llm", inputs_for(f"{PROMPTS[2]} ({i})", sampling, stream=True),
                        timeout=300)

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(ask, range(12)))
    refused = [o for o in outcomes if o.error is not None]
    assert all(o.finals == 1 and o.after_final == 0 for o in outcomes)
    assert refused and len(refused) <= 4
    for outcome in refused:
        assert "decode instance is full" in outcome.message and "max_num_seqs=8" in outcome.message
        assert "retry later" in outcome.message  # how a gRPC stream tells UNAVAILABLE from a bad request
    for outcome in outcomes:
        if outcome.error is None:
            assert outcome.total("num_output_tokens") == 48
    for model in ("llm_prefill", "llm_decode"):
        wait_idle(disaggregated_server.metrics_port, model)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)]
