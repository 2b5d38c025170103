"""The engine's running totals (backend/stats.py) over hand-made steps (tests/engine/test_stats.py
has the snapshots of a real engine)."""

from __future__ import annotations

from backend.stats import StepStats, Totals


def test_totals_count_preemptions_and_lookups_of_every_step_but_iterations_only_when_a_pass_ran():
    ran = StepStats(ran=True, num_running=3, num_scheduled_tokens=10, num_generated_tokens=2, num_preempted=1,
                    prefix_query_tokens=16, prefix_hit_tokens=8, schedule_time_s=0.5, forward_time_s=2.0)
    idle = StepStats(num_running=1, num_scheduled_tokens=4, num_preempted=2, prefix_query_tokens=16)
    totals = Totals().with_step(ran).with_step(idle)
    assert (totals.steps, totals.sum_running, totals.sum_scheduled_tokens, totals.generation_tokens) == (1, 3, 10, 2)
    assert (totals.preemptions, totals.prefix_query_tokens, totals.prefix_hit_tokens) == (3, 32, 8)
    assert (totals.sum_schedule_time_s, totals.sum_forward_time_s) == (0.5, 2.0)
    assert totals.prefix_hit_rate == 0.25 and Totals().prefix_hit_rate == 0.0
    assert totals.since(totals) == Totals()
