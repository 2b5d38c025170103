"""The metrics' arithmetic without an engine (tests/engine/test_metrics.py has EngineMetrics on one)."""

from __future__ import annotations

import pytest


def test_jain_index():
    from backend.metrics import jain_index

    assert jain_index([]) == jain_index([5.0]) == jain_index([0.0, 0.0]) == 1.0
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([2.0, 1.0]) == pytest.approx(9 / 10)
