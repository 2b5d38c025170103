"""Disaggregated serving through a real tritonserver with the KV transfer over TCP:
llm_prefill has `kv_transfer: tcp`, so each request's KV crosses a socket (here over the
loopback) instead of /dev/shm, and llm_decode pulls it off its step loop. The client sees the
aggregated server's tokens in one ordinary stream; afterwards neither engine holds a block, a
transfer or a pull, and both counted the same transfers and bytes. A stream cancelled
mid-decode leaves no transfer held either.
"""

from __future__ import annotations

import os

import pytest

from backend.disagg import SHM_PREFIX
from tests.e2e.e2e_util import generate, greedy_tokens_and_texts, inputs_for, scrape, wait_idle
from tests.e2e.server import E2E_PARAMETERS
from tests.e2e.test_e2e_disaggregated import (
    MAX_TOKENS,
    PROMPTS,
    cancel_mid_decode,
    serve_disaggregated,
)

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

MODELS = ("llm_prefill", "llm_decode")


@pytest.fixture(scope="module")
def tcp_server(tritonserver):
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8")
    server = serve_disaggregated(tritonserver, dict(engine, kv_transfer="tcp"), engine)
    try:
        yield server
    finally:
        server.stop()


def test_tcp_transfer_gives_the_aggregated_servers_tokens_and_leaves_nothing(tcp_server, triton_server):
    shm_before = {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}
    aggregated = greedy_tokens_and_texts(triton_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    assert greedy_tokens_and_texts(tcp_server.grpc_url, "llm", PROMPTS, MAX_TOKENS) == aggregated
    outcome = generate(tcp_server.grpc_url, "llm", inputs_for(PROMPTS[1], {"temperature": 0, "max_tokens": MAX_TOKENS,
                                                                          "ignore_eos": True}, stream=True))
    assert outcome.error is None, outcome.message
    assert outcome.finals == 1 and outcome.after_final == 0 and len(outcome.responses) > 1
    for model in MODELS:
        wait_idle(tcp_server.metrics_port, model)
    metrics = scrape(tcp_server.metrics_port)
    assert metrics.has("inflight_kv_transfers_pending") and metrics.has("inflight_kv_transfers_expired_total")
    exported, imported = ({name: metrics.get(name, model=model) for name in (
        "inflight_kv_transfers_total", "inflight_kv_transfer_bytes_total", "inflight_kv_transfers_pending")}
        for model in MODELS)
    assert exported == imported and exported["inflight_kv_transfers_total"] >= len(PROMPTS) + 1
    assert exported["inflight_kv_transfer_bytes_total"] > 0 and exported["inflight_kv_transfers_pending"] == 0
    assert metrics.get("inflight_kv_transfers_expired_total", model="llm_prefill") == 0
    # Nothing went through shared memory.
    assert {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)} == shm_before


def test_a_stream_cancelled_mid_decode_over_tcp_leaves_no_transfer_held(tcp_server):
    metrics_port = tcp_server.metrics_port
    cancel_mid_decode(tcp_server)
    metrics = scrape(metrics_port)
    assert [metrics.get("inflight_kv_transfers_pending", model=model) for model in MODELS] == [0, 0]
    assert metrics.get("inflight_kv_transfers_expired_total", model="llm_prefill") == 0
