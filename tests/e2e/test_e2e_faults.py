"""Faults and the vLLM backend's config switches, through the real tritonserver.

- `ENABLE_VLLM_HEALTH_CHECK`: a step that never ends (the test-only switch
  `INFLIGHT_FAULT_STALL_AT_BATCH`) makes the engine unhealthy after `health_check_stall_s`;
  its live requests end with the vLLM backend's error and the model is unloaded (the
  server runs with --model-control-mode=explicit, which Triton needs for that).
- `REPORT_CUSTOM_METRICS` false: none of the backend's metric families on /metrics,
  Triton's own still there.
- The stub killed under 16 live streams: what tritonserver 2.51 does (README, Reliability).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import requests

from tests.checkpoints import make_tiny_checkpoint
from tests.e2e.e2e_util import Stream, generate, inputs_for, output, scrape, wait_for, wait_until

pytestmark = pytest.mark.e2e

SICK, QUIET = "sick", "quiet"
STALL_S = 2.0
UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("faults-ckpt") / "tiny-llama"), "llama",
                                max_position_embeddings=4096)


def tiny(checkpoint: str, **extra: str) -> dict[str, str]:
    return {"model_path": checkpoint, "max_num_seqs": "16", "kv_cache_memory_mb": "16", **extra}


@pytest.fixture(scope="module")
def server(tritonserver, checkpoint):
    models = {
        SICK: tiny(checkpoint, ENABLE_VLLM_HEALTH_CHECK="true", health_check_stall_s=str(STALL_S)),
        QUIET: tiny(checkpoint, REPORT_CUSTOM_METRICS="false"),
    }
    # Any step of 2 requests or more never ends: only the health check's test sends two at once.
    with tritonserver(models, env={"INFLIGHT_FAULT_STALL_AT_BATCH": "2"},
                      args=["--model-control-mode=explicit", "--load-model=*"]) as srv:
        yield srv


def ready(srv, model: str) -> int:
    return requests.get(f"{srv.http_url}/v2/models/{model}/ready", timeout=10).status_code


def request(i: int, max_tokens: int = 8, stream: bool = True) -> list:
    return inputs_for(f"request {i}", {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True},
                      stream=stream, returns=("return_finish_reason", "return_num_output_tokens"))


def test_report_custom_metrics_false_drops_every_backend_family(server):
    served = generate(server.grpc_url, QUIET, request(0))
    assert served.error is None and output(served.last, "finish_reason") == "length"
    m = scrape(server.metrics_port)
    ours = [(n, ls) for n, ls, _ in m.samples if ls.get("model") == QUIET and not n.startswith("nv_inference_")
            and not n.startswith("nv_cache_") and not n.startswith("nv_gpu_") and not n.startswith("nv_cpu_")]
    assert ours == [], ours
    # Triton's own per-model metrics stay; the other model (metrics on by default) keeps all three families.
    assert m.get("nv_inference_request_success", model=QUIET) >= 1
    for family in ("vllm:num_requests_running", "nv_trt_llm_kv_cache_block_metrics", "inflight_requests_running"):
        assert any(n == family and ls.get("model") == SICK for n, ls, _ in m.samples), family


def test_health_check_fails_live_requests_and_unloads_a_hung_engine(server):
    assert ready(server, SICK) == 200
    # Healthy: one request at a time is served (the stall needs a batch of two).
    alone = generate(server.grpc_url, SICK, request(1))
    assert alone.error is None and alone.total("num_output_tokens") == 8

    streams = [Stream(server.grpc_url) for _ in range(2)]
    try:
        t0 = time.monotonic()
        outcomes = [s.send(SICK, request(10 + i, max_tokens=500)) for i, s in enumerate(streams)]
        for o in outcomes:
            wait_for(o, 60)
        seconds = max(o.times[-1] for o in outcomes) - t0
    finally:
        for s in streams:
            s.close()
    for o in outcomes:
        assert o.error is not None and o.finals == 1, o.text
        assert UNHEALTHY in o.message, o.message
    # The stall threshold, then at most one health poll (0.5 s) and the delivery.
    assert STALL_S <= seconds < STALL_S + 5, seconds
    wait_until(lambda: ready(server, SICK) != 200, 30, 0.2, "the unhealthy model not ready")
    later = generate(server.grpc_url, SICK, request(2))
    assert later.error is not None
    # The other model is untouched.
    assert ready(server, QUIET) == 200
    assert generate(server.grpc_url, QUIET, request(3)).error is None
    assert "engine is not healthy" in server.log()
