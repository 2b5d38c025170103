"""The one-minute soak (client/soak.py) against the session's server: 16 streams in a closed
loop with random lengths and sampling, a cancel every 10 requests and a bad request every
20. `tools/soak.py --minutes 30` runs the long one (docs/operations.md, "Bad input and soak")."""

from __future__ import annotations

import pytest

from client.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.alone]


def test_one_minute_soak_has_no_unexpected_error_and_leaves_the_engine_empty(triton_server):
    config = SoakConfig(grpc_url=triton_server.grpc_url, metrics_url=triton_server.metrics_url,
                        model=triton_server.model, server_pid=triton_server.proc.pid, minutes=1.0,
                        max_prompt_words=120, max_tokens=(4, 48))
    report = run_soak(config)
    totals = report.totals
    assert totals["unexpected_errors"] == 0, report.unexpected
    # The loop did each kind of request: served, cancelled and refused ones.
    assert totals["completed"] >= 10 and totals["cancelled"] >= 1 and totals["refused"] >= 1, totals
    assert report.end_state == {"used_blocks": 0.0, "running": 0.0, "waiting": 0.0}
    minute = report.minutes[0]
    assert minute["server_rss_mb"] > minute["server_rss_anon_mb"] > 100 and minute["itl_samples"] > 0 and minute["itl_p99_ms"] > 0, minute
    # Too short to judge RSS growth or ITL drift: those criteria need three minutes.
    assert report.criteria["rss_growth_after_warmup_mb"]["passed"] is None
    assert report.passed
