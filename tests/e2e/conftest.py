"""Fixtures of the end-to-end tests: `tritonserver`, the factory of every server they start,
and `triton_server`, the session's default server built on it.

`triton_server` serves a copy of model_repository/llm (the default SmolLM2 checkpoint,
model_path made absolute, a smaller batch so that 16 streams queue: `E2E_PARAMETERS`).
Tests that need other models, settings, environment or tritonserver flags start their own:

    with tritonserver({"tiny": {"model_path": path}}, env={"VAR": "1"}, args=["--exit-timeout-secs=5"],
                      instances={"tiny": 2}, log_verbose=1) as server:
        ...
"""

from __future__ import annotations

import os
import sys

import pytest

from backend.paths import DEFAULT_CHECKPOINT
from tests.e2e.e2e_util import scrape
from tests.e2e.server import E2E_PARAMETERS, TritonServer, start_tritonserver


@pytest.fixture(scope="session")
def tritonserver(tmp_path_factory):
    """`tritonserver(models, env=None, args=(), *, instances=None, log_verbose=0)` -> a started
    `TritonServer` (tests/e2e/server.py) in a temporary folder of its own. A server not
    stopped by its test (`with`, or `stop()`) is stopped at the end of the session."""
    started: list[TritonServer] = []

    def start(models, env=None, args=(), **options) -> TritonServer:
        root = tmp_path_factory.mktemp("tritonserver-" + "-".join(models))
        try:
            server = start_tritonserver(root, models, env, args, **options)
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def triton_server(tritonserver) -> TritonServer:
    if not (DEFAULT_CHECKPOINT / "config.json").exists():
        pytest.fail(f"{DEFAULT_CHECKPOINT} is missing: run `make setup` first", pytrace=False)
    server = tritonserver({"llm": E2E_PARAMETERS})
    try:
        yield server
    finally:
        code = server.stop()
        if os.environ.get("INFLIGHT_SHOW_SERVER_LOG"):
            print(f"\n--- tritonserver exited with {code}; log tail ---\n{server.log_tail()}", file=sys.stderr)


@pytest.fixture(scope="module")
def kv_blocks(triton_server) -> int:
    """Size of the session server's KV pool in blocks (from /metrics: it follows the dtype)."""
    return int(scrape(triton_server.metrics_port).get("nv_trt_llm_kv_cache_block_metrics", model=triton_server.model,
                                                      kv_cache_block_type="max"))
