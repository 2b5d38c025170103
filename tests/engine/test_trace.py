"""The per-request trace (`return_trace`, backend/trace.py): what it says about a request's
life must be what the engine did to it, and asking for it must change nothing else."""

from __future__ import annotations

import random

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams
from backend.trace import MAX_EVENTS, RequestTrace

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 49152


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def run(engine: LLMEngine, requests: list[tuple[str, list[int], int, bool]], arrivals: list[int] | None = None):
    """Step the engine with (id, prompt, max_tokens, traced) arriving at the given steps;
    return ({id: output tokens}, {id: final trace or None})."""
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, requests), key=lambda a: a[0])
    tokens, traces, step = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, (rid, ids, max_tokens, traced) = pending.pop(0)
            engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               trace=traced)
            tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids_delta)
            if out.finished:
                assert out.error is None
                traces[out.request_id] = out.trace
        step += 1
        assert step < 2000
    return tokens, traces


def events(trace: dict, kind: str) -> list[dict]:
    return [e for e in trace["events"] if e["event"] == kind]


def test_chunked_prefill_first_token_decode_and_finish(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=16,
                                    num_kv_blocks=64, long_prefill_token_threshold=32))
    tokens, traces = run(engine, [("traced", prompt(1, 100), 12, True), ("plain", prompt(2, 20), 12, False)])
    assert traces["plain"] is None
    trace = traces["traced"]
    kinds = [e["event"] for e in trace["events"]]
    assert kinds == ["queued", "first_scheduled"] + ["prefill_chunk"] * 4 + ["first_token", "finished"]
    chunks = events(trace, "prefill_chunk")
    assert [c["tokens"] for c in chunks] == [32, 32, 32, 4]
    assert [c["prompt_tokens_done"] for c in chunks] == [32, 64, 96, 100]
    assert [c["step"] for c in chunks] == list(range(chunks[0]["step"], chunks[0]["step"] + 4))
    # The first chunk shared its step with the other request's whole 20-token prompt.
    assert chunks[0]["batch_requests"] == 2 and chunks[0]["batch_tokens"] == 52
    assert events(trace, "first_token")[0]["step"] == chunks[-1]["step"]
    decode = trace["decode"]
    assert decode["steps"] == 11 and decode["first_step"] == chunks[-1]["step"] + 1
    assert decode["last_step"] == decode["first_step"] + 10
    assert 1 <= decode["batch_requests"]["min"] <= decode["batch_requests"]["max"] <= 2
    assert decode["step_ms"]["min"] > 0
    finished = trace["events"][-1]
    assert finished["reason"] == "length" and finished["output_tokens"] == 12 == len(tokens["traced"])
    times = [e["t_ms"] for e in trace["events"]]
    assert times == sorted(times) and times[0] >= 0
    assert trace["dropped"] is None and trace["max_events"] == MAX_EVENTS


def test_prefix_cache_hits_and_waiting_behind_a_full_batch(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=16,
                                    num_kv_blocks=64, max_num_seqs=1))
    shared = prompt(3, 40)
    _, traces = run(engine, [("first", shared + [5, 6], 4, True), ("second", shared + [7], 4, True)])
    first, second = traces["first"], traces["second"]
    assert not events(first, "prefix_cache_hit")
    hit = events(second, "prefix_cache_hit")
    assert hit == [{**hit[0], "blocks": 2, "tokens": 32}]
    # One seat: the second request waited, behind the first, until the first finished.
    assert events(second, "queued")[0]["waiting_ahead"] == 1
    assert events(second, "first_scheduled")[0]["waiting_steps"] >= 4
    assert events(second, "first_scheduled")[0]["step"] > first["events"][-1]["step"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_are_traced_and_tracing_changes_no_token(tiny_checkpoint, mode):
    def engine():
        return LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=8,
                                      num_kv_blocks=14, max_num_seqs=6, long_prefill_token_threshold=13,
                                      preemption_mode=mode, swap_space_mb=1, max_preemptions=3))
    requests = [(f"r{i}", prompt(10 + i, 5 + 3 * i), 14, True) for i in range(10)]
    arrivals = list(range(10))
    traced_tokens, traces = run(engine(), requests, arrivals)
    plain_tokens, plain_traces = run(engine(), [(r, p, m, False) for r, p, m, _ in requests], arrivals)
    assert traced_tokens == plain_tokens and not any(plain_traces.values())
    preemptions = [e for t in traces.values() for e in events(t, "preempted")]
    assert preemptions, "the tiny pool must preempt"
    assert {e["reason"] for e in preemptions} == {"kv_blocks_exhausted"}
    assert {e["mode"] for e in preemptions} <= {mode, "recompute"}  # swap falls back when swap space is full
    for trace in traces.values():
        left = events(trace, "preempted")
        back = [e for e in trace["events"] if e["event"] in ("readmitted", "swapped_in")]
        assert len(back) == len(left), trace["events"]
        for gone, returned in zip(left, back):
            assert returned["step"] > gone["step"]
            assert returned["event"] == ("swapped_in" if gone["mode"] == "swap" else "readmitted")
            assert gone["computed_tokens_lost"] >= 0 if gone["mode"] == "recompute" else gone["computed_tokens_lost"] == 0
    if mode == "swap":
        assert any(e["mode"] == "swap" for e in preemptions)


def test_the_trace_is_bounded_and_always_closed_by_its_finish():
    trace = RequestTrace(arrival_time=0.0)
    trace.queued(1, running=0, waiting_ahead=0)
    for step in range(2, 400):
        trace.scheduled(step, 1.0, tokens=8, prefill=True, prompt_done=8 * step, prompt_tokens=4000,
                        batch_requests=1, batch_tokens=8, step_ms=1.0)
    trace.finished(400, reason="stop", output_tokens=1)
    body = trace.to_json()
    assert len(body["events"]) == MAX_EVENTS and body["events"][-1]["event"] == "finished"
    assert body["dropped"] == {"prefill_chunk": 398 - (MAX_EVENTS - 2)}
