"""With `batch_invariant` on, one request's per-token logprobs are bitwise the same whatever
shares its batch: its composition and size, the step the request arrives at, the prefill
chunk size and token budget, a prefix-cache hit or miss, preemption by recompute or swap,
the scheduling policy, the torch thread count. Seeded sampling then gives the same tokens.

A probe request is run alone, then again under random and hand-picked schedules (engine
`step()` driven directly, as the engine's own tests do); its logprobs are compared with
`==` on the floats. Tiny random Llama, float32 and bfloat16.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams

VOCAB = 49152
PROBE_TOKENS = 24
_rng = random.Random(99)
PROBE = [_rng.randrange(3, VOCAB) for _ in range(70)]
# Long enough that, without batch invariance, its chunks would go to SDPA (64 tokens or more
# at a mean context of 320 or more).
LONG_PROBE = [_rng.randrange(3, VOCAB) for _ in range(420)]


def run(model: str, dtype: str, probe: list[int], probe_params: SamplingParams, others: list[tuple[int, list[int]]],
        probe_step: int = 0, **config) -> tuple[list[int], list[float], LLMEngine]:
    """Drive the engine with `others` ((arrival step, prompt)) and the probe arriving at
    `probe_step`; the probe's tokens and sampled-token logprobs."""
    config.setdefault("num_kv_blocks", 256)
    engine = LLMEngine(EngineConfig(model_path=model, dtype=dtype, device="cpu", **config))
    arrivals = sorted([(step, f"other{i}", prompt) for i, (step, prompt) in enumerate(others)]
                      + [(probe_step, "probe", probe)], key=lambda a: a[0])
    tokens: list[int] = []
    logprobs: list[float] = []
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, request_id, prompt = arrivals.pop(0)
            params = probe_params if request_id == "probe" else SamplingParams(
                temperature=0.0, max_tokens=1 + len(prompt) % 13, ignore_eos=True)
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.request_id == "probe":
                assert out.error is None, out.error
                tokens.extend(out.token_ids_delta)
                logprobs.extend(next(iter(entry.values()))["logprob"] for entry in out.logprobs_delta or [])
        step += 1
        assert step < 20000, "the engine did not finish"
    assert len(tokens) == probe_params.max_tokens
    return tokens, logprobs, engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=0)

_alone: dict = {}


def alone(model: str, dtype: str, probe: list[int], params: SamplingParams, **config) -> tuple[list[int], list[float]]:
    key = (model, dtype, tuple(probe), params.model_dump_json(), tuple(sorted(config.items())))
    if key not in _alone:
        tokens, logprobs, _ = run(model, dtype, probe, params, [], **config)
        _alone[key] = tokens, logprobs
    return _alone[key]


def assert_same_as_alone(model, dtype, probe, params, others, shared: dict | None = None, **kwargs) -> LLMEngine:
    """The probe beside `others` under `kwargs` gives its tokens and logprobs alone, bitwise;
    `shared` configures both runs (e.g. the KV dtype)."""
    shared = shared or {}
    want_tokens, want_logprobs = alone(model, dtype, probe, params, **shared)
    tokens, logprobs, engine = run(model, dtype, probe, params, others, **shared, **kwargs)
    different = [i for i, (a, b) in enumerate(zip(want_logprobs, logprobs)) if a != b]
    assert not different, f"logprobs at {different} differ: {[(want_logprobs[i], logprobs[i]) for i in different][:4]}"
    assert tokens == want_tokens
    return engine


def crowd(seed: int, count: int, shortest: int = 1, longest: int = 120, last_step: int = 6) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    return [(rng.randint(0, last_step), [rng.randrange(3, VOCAB) for _ in range(rng.randint(shortest, longest))])
            for _ in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), count=st.integers(0, 12), probe_step=st.integers(0, 8),
       chunk=st.integers(1, 96), budget=st.integers(8, 512), seats=st.integers(1, 16),
       kv_blocks=st.integers(24, 256), policy=st.sampled_from(["fcfs", "priority", "static"]),
       preemption=st.sampled_from(["recompute", "swap"]), prefix_caching=st.booleans(),
       shares_prefix=st.booleans(), seeded=st.booleans())
def test_the_probe_is_bitwise_the_same_under_any_schedule(tiny_checkpoint, dtype, seed, count, probe_step, chunk, budget,
                                                         seats, kv_blocks, policy, preemption, prefix_caching,
                                                         shares_prefix, seeded):
    others = crowd(seed, count)
    if shares_prefix:  # an earlier request computes (and caches) the probe's first 3 blocks
        others.append((0, PROBE[:48] + [5, 6, 7]))
    assert_same_as_alone(
        tiny_checkpoint, dtype, PROBE, SEEDED if seeded else GREEDY, others, probe_step=probe_step,
        long_prefill_token_threshold=chunk, max_num_batched_tokens=budget, max_num_seqs=seats,
        num_kv_blocks=kv_blocks, scheduling_policy=policy, preemption_mode=preemption,
        enable_prefix_caching=prefix_caching, swap_space_mb=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_leaves_the_probe_as_it_was(tiny_checkpoint, dtype, preemption):
    # A pool of 20 blocks for 8 requests of up to ~100 tokens: the probe is preempted too.
    engine = assert_same_as_alone(tiny_checkpoint, dtype, PROBE, GREEDY, crowd(1, 8, 40, 100, 0), num_kv_blocks=20,
                                  preemption_mode=preemption, swap_space_mb=64)
    assert engine.stats.totals.preemptions > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_cache_hit_leaves_the_probe_as_it_was(tiny_checkpoint, dtype):
    engine = assert_same_as_alone(tiny_checkpoint, dtype, PROBE, GREEDY, [(0, PROBE[:64] + [9, 9])], probe_step=3)
    assert engine.stats.totals.prefix_hit_tokens > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_thread_count_leaves_the_probe_as_it_was(tiny_checkpoint, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_same_as_alone(tiny_checkpoint, dtype, PROBE, GREEDY, crowd(2, 10))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [16, 100, 512])
def test_long_prefill_chunks_at_long_contexts_stay_invariant(tiny_checkpoint, dtype, chunk):
    # Chunks of 64 tokens or more at contexts of 320 or more: where the engine would take SDPA.
    assert_same_as_alone(tiny_checkpoint, dtype, LONG_PROBE, GREEDY, crowd(3, 6, 200, 400), long_prefill_token_threshold=chunk,
                         num_kv_blocks=512)


def test_without_batch_invariance_long_chunks_take_another_order(tiny_checkpoint):
    """The switch is what makes the difference: off, SDPA computes the long chunks and the
    probe's logprobs move with the chunk size."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    _, chunked, _ = run(tiny_checkpoint, "float32", LONG_PROBE, greedy, [], batch_invariant=False,
                        long_prefill_token_threshold=16, num_kv_blocks=512)
    # 100-token chunks: the fourth, positions 300-399, has a mean context of 350.
    _, long_chunks, _ = run(tiny_checkpoint, "float32", LONG_PROBE, greedy, [], batch_invariant=False,
                            long_prefill_token_threshold=100, num_kv_blocks=512)
    assert chunked != long_chunks


# ---- the switch --------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("auto", None), ("true", True), ("False", False), (" AUTO ", None)])
def test_batch_invariant_parses_from_config_pbtxt(text, value):
    assert EngineConfig.from_parameters({"batch_invariant": text}, "/m").batch_invariant is value


def test_a_bad_batch_invariant_value_is_refused_by_name():
    with pytest.raises(ValueError, match="batch_invariant='maybe'"):
        EngineConfig.from_parameters({"batch_invariant": "maybe"}, "/m")


def test_batch_invariance_is_on_by_default_where_the_kernels_allow_it_and_refused_where_they_do_not(monkeypatch):
    import backend.model_runner as runner
    from kernels import cpu_ext

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert runner.resolve_batch_invariance(None, cpu) and runner.resolve_batch_invariance(True, cpu)
    assert not runner.resolve_batch_invariance(False, cpu)
    assert not runner.resolve_batch_invariance(None, cuda) and not runner.resolve_batch_invariance(False, cuda)
    with pytest.raises(ValueError, match="batch_invariant=true is not possible here: the cuda path's GEMMs"):
        runner.resolve_batch_invariance(True, cuda)
    monkeypatch.setattr(cpu_ext, "isa", lambda: cpu_ext.Isa.NONE)
    assert not runner.resolve_batch_invariance(None, cpu)
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        runner.resolve_batch_invariance(True, cpu)
