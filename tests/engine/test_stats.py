"""The engine's stats snapshot (backend/stats.py): one immutable `EngineStats` per step, with
what the step did, where the engine stands after it and the running totals, checked over a
few steps whose every count is known in advance (tiny random Llama, `step()` driven directly).
"""

from __future__ import annotations

import dataclasses

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams
from backend.stats import StepStats, Totals

PROMPT_A = list(range(100, 140))  # 40 tokens: two full blocks of 16 and 8 more
PROMPT_B = PROMPT_A[:32] + list(range(500, 508))  # shares A's two full blocks
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_the_snapshot_counts_a_few_known_steps(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=16,
                                    num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
                                    long_prefill_token_threshold=32))
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks, stats.num_free_kv_blocks) == (0, 0, 64, 64)
    assert stats.totals == Totals() and stats.step == StepStats()

    # Step 1: A's first 32-token chunk (the chunk cap), in two blocks.
    engine.add_request("a", PROMPT_A, PARAMS)
    engine.step()
    first = engine.stats
    assert first.step.ran and (first.step.num_running, first.step.num_waiting) == (1, 0)
    assert (first.step.num_scheduled_tokens, first.step.num_generated_tokens) == (32, 0)
    assert (first.step.prefix_query_tokens, first.step.prefix_hit_tokens) == (40, 0)
    assert (first.num_running, first.num_waiting, first.num_prefilling) == (1, 0, 1)
    assert first.num_used_kv_blocks == 2 and first.kv_usage == 2 / 64
    assert (first.totals.steps, first.totals.prompt_tokens, first.totals.generation_tokens) == (1, 40, 0)
    assert first.step.schedule_time_s > 0 and first.step.forward_time_s > 0

    # Step 2: A's last 8 prompt tokens; B joins on A's two cached blocks and prefills its 8.
    engine.add_request("b", PROMPT_B, PARAMS)
    engine.step()
    second = engine.stats
    assert (second.step.num_running, second.step.num_scheduled_tokens, second.step.num_generated_tokens) == (2, 16, 2)
    assert (second.step.prefix_query_tokens, second.step.prefix_hit_tokens) == (40, 32)
    assert (second.num_running, second.num_prefilling) == (2, 0)
    assert second.num_used_kv_blocks == 4  # A's three, B's own third; the two shared count once
    assert (second.totals.prefix_query_tokens, second.totals.prefix_hit_tokens) == (80, 32)
    assert second.totals.prefix_hit_rate == 32 / 80 and second.totals.prompt_tokens == 80

    # Steps 3 and 4: one decode token each; both reach max_tokens at step 4 and free their blocks.
    engine.step()
    outputs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outputs if o.finished) == [("a", "length"), ("b", "length")]
    done = engine.stats
    assert (done.step.num_scheduled_tokens, done.step.num_generated_tokens) == (2, 2)
    assert (done.num_running, done.num_waiting, done.num_used_kv_blocks) == (0, 0, 0)
    totals = done.totals
    assert (totals.steps, totals.generation_tokens, totals.preemptions, totals.aborts) == (4, 6, 0, 0)
    assert (totals.sum_running, totals.sum_scheduled_tokens) == (1 + 2 + 2 + 2, 32 + 16 + 2 + 2)
    assert totals.sum_forward_time_s >= first.step.forward_time_s + second.step.forward_time_s

    # An idle step is a snapshot too, but not an iteration.
    engine.step()
    assert not engine.stats.step.ran and engine.stats.step.num_scheduled_tokens == 0
    assert engine.stats.totals.steps == 4

    # An abort counts at once and shows in the next step's snapshot.
    engine.add_request("c", PROMPT_A, PARAMS)
    assert engine.abort("c")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.stats.totals.aborts == 1 and engine.stats.totals.prompt_tokens == 120

    # Snapshots never change once published; `since` is what happened in between.
    assert first.totals.steps == 1 and first.num_running == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.num_running = 5
    window = engine.stats.totals.since(first.totals)
    assert (window.steps, window.generation_tokens, window.prompt_tokens, window.aborts) == (3, 6, 80, 1)
    assert (window.prefix_query_tokens, window.prefix_hit_tokens) == (40, 32)


def test_the_snapshot_times_each_first_token_and_each_interval_after_it(tiny_checkpoint):
    """A step lists, per request that received a token, the time from arrival to it when it
    was the first (with that request's prompt tokens), else the time since its previous one."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=16,
                                    num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
                                    long_prefill_token_threshold=32))
    engine.add_request("a", PROMPT_A, PARAMS)
    engine.step()  # A's first chunk: no token yet
    assert engine.stats.step.first_token_latencies_s == () and engine.stats.step.prefilled_prompt_tokens == 0
    engine.add_request("b", PROMPT_B, PARAMS)
    engine.step()  # both prompts complete: two first tokens
    step = engine.stats.step
    assert len(step.first_token_latencies_s) == 2 and all(t > 0 for t in step.first_token_latencies_s)
    assert step.inter_token_latencies_s == () and step.prefilled_prompt_tokens == 80
    for _ in range(2):  # one token each per step
        engine.step()
        step = engine.stats.step
        assert step.first_token_latencies_s == () and step.prefilled_prompt_tokens == 0
        assert len(step.inter_token_latencies_s) == 2 and all(t > 0 for t in step.inter_token_latencies_s)
    assert engine.stats.totals.prefilled_prompt_tokens == 80 and engine.stats.totals.generation_tokens == 6
    # A request cancelled before its first token never counts as prefilled.
    engine.add_request("c", PROMPT_A, PARAMS)
    engine.abort("c")
    engine.step()
    assert engine.stats.totals.prefilled_prompt_tokens == 80 and engine.stats.totals.prompt_tokens == 120


def test_a_cpu_engine_computes_at_most_512_tokens_a_step_by_default(tiny_checkpoint):
    """max_num_batched_tokens 0 (the default) is the device's budget: a 600-token prompt on the
    CPU is prefilled in two steps, 512 tokens then 88."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                    long_prefill_token_threshold=1024))
    assert engine.config.max_num_batched_tokens == 512
    engine.add_request("long", [100 + i % 400 for i in range(600)], PARAMS)
    scheduled = []
    while engine.has_unfinished():
        engine.step()
        scheduled.append(engine.stats.step.num_scheduled_tokens)
    assert scheduled[:2] == [512, 88]
