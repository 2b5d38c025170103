"""The W10 crossover model's pieces (client/bench/disagg_model.py): the core-count extrapolation,
the step cost, and the simulated schedules, on made-up costs whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from client.bench.disagg_model import (
    Engine,
    SimRequest,
    at_cores,
    chat_metrics,
    fit,
    simulate,
    step_seconds,
)

FLAT = {"a": 0.01, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0, "overhead": 0.0}  # every step 10 ms, whatever it holds


def test_each_term_scales_by_the_power_of_the_cores_it_showed_from_one_to_two():
    one = {"a": 0.04, "b": 1e-3, "c": 1e-4, "d": 4e-3, "e": 0.0, "overhead": 0.002}
    two = {"a": 0.015, "b": 0.5e-3, "c": 1e-4, "d": 4e-3 / 2 ** 0.5, "e": 0.0, "overhead": 0.002}
    eight = at_cores(one, two, 8)
    assert eight["overhead"] == 0.002  # the engine's own work per step does not scale
    assert eight["a"] == pytest.approx(0.015 / 4)  # faster than linear from 1 to 2 cores: capped at linear
    assert eight["b"] == pytest.approx(0.5e-3 / 4)  # halved from 1 to 2 cores: linear
    assert eight["c"] == pytest.approx(1e-4)  # unchanged: not at all
    assert eight["d"] == pytest.approx(4e-3 / 8 ** 0.5)  # by sqrt(2): by the square root
    assert at_cores(one, two, 2) == pytest.approx(two)
    assert at_cores(one, two, 1) == pytest.approx({**one, "overhead": 0.002})


def test_the_fit_recovers_the_costs_it_was_made_from():
    true = {"a": 0.003, "b": 2e-4, "c": 5e-5, "d": 1e-3, "e": 2e-4, "overhead": 0.0}
    steps = [{"chunk": p, "chunk_context": ctx, "decodes": b, "decode_context": d,
              "seconds": step_seconds(true, [(p, ctx)] if p else [], [d] * b)}
             for p, ctx in ((0, 0), (128, 128), (512, 2000), (512, 512)) for b, d in ((0, 0), (4, 256), (16, 384))
             if p or b]
    fitted = fit({"steps": steps, "engine_overhead_s": 0.001})
    assert fitted["overhead"] == 0.001
    for term in "abcde":
        assert fitted[term] == pytest.approx(true[term], rel=1e-6)


def test_an_engine_prefills_in_chunks_then_decodes():
    r = SimRequest(0.0, 20, 3, "chat")
    engine = Engine(FLAT, chunk_cap=8, budget=10, waiting=[r])
    while engine.busy:
        engine.step()
    # 20 prompt tokens in chunks of 8, 8, 4 (3 steps, the first token with the last), then 2 decodes.
    assert r.tokens == pytest.approx([0.03, 0.04, 0.05])


def test_a_long_prompt_stretches_the_chats_steps_only_when_it_shares_their_engine():
    """Per-token costs: a 2000-token prompt's chunks make the aggregated engine's steps long while
    a chat decodes; in the disaggregated one the chat's decode steps never carry a chunk."""
    costs = {"a": 0.002, "b": 1e-4, "c": 0.0, "d": 1e-3, "e": 0.0, "overhead": 0.0}
    requests = [SimRequest(0.0, 16, 40, "chat"), SimRequest(0.01, 2000, 2, "long")]
    aggregated = simulate(requests, costs, costs, "aggregated", chunk_cap=512)
    disaggregated = simulate(requests, costs, costs, "disaggregated", chunk_cap=512, transfer=(1e-6, 1e-6))
    assert all(len(r.tokens) == r.output for r in aggregated + disaggregated)
    agg_gaps = np.diff(aggregated[0].tokens)
    dis_gaps = np.diff(disaggregated[0].tokens)
    assert agg_gaps.max() > 0.05  # a 512-token chunk: 2 + 51 ms
    assert dis_gaps.max() < 0.01
    metrics = chat_metrics(disaggregated, {"ttft_ms": 2000.0, "tpot_ms": 100.0})
    assert metrics["chats"] == 1 and metrics["itl_p99_ms"] < 10
    # The long prompt's first token comes after its prefill and its import on the decode side.
    assert disaggregated[1].tokens[0] > 2000 * 1e-4
