"""Speculative decoding (backend/spec_decode/) inside the continuous batch.

Greedy output with n-gram speculation must be token-identical to transformers and to the
same engine without speculation, whatever shares the batch (arrivals, chunked prefill,
preemption by recompute and by swap); with batch_invariant every logprob bitwise the same;
a seeded sampled request repeats exactly; stops are honoured on every accepted token; the
KV manager's invariants hold after every step and nothing leaks.
"""

from __future__ import annotations

import collections
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kernels
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models.llama import Linear
from backend.request import SamplingParams
from tests.checkpoints import hf_greedy
from tests.engine.test_engine_equivalence import assert_matches_oracle, run_engine, spread_arrivals

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152
# `adaptive` off: these tests need every proposed draft verified, whatever the steps cost.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def _repetitive_prompt(rng: random.Random, segment: int, repeats: int, tail: int) -> list[int]:
    """A text that repeats itself (as a prompt that quotes what is to be rewritten), so that
    the n-gram proposer finds matches in the prompt as well as in the output."""
    piece = [rng.randrange(3, VOCAB) for _ in range(segment)]
    return piece * repeats + [rng.randrange(3, VOCAB) for _ in range(tail)]


_rng = random.Random(4321)
PROMPTS = [_repetitive_prompt(_rng, s, r, t) for s, r, t in
           [(5, 3, 2), (9, 2, 0), (3, 6, 1), (17, 2, 5), (1, 1, 0), (12, 3, 3), (7, 4, 7), (20, 2, 1)]]
MAX_TOKENS = [24, 17, 30, 9, 21, 26, 13, 30]
MAX_NEW = max(MAX_TOKENS)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): out for p, out in zip(PROMPTS, hf_greedy(tiny_checkpoint, PROMPTS, MAX_NEW))}


def check_every_step(engine: LLMEngine) -> None:
    """The scheduler's and the KV manager's invariants after every step: no leaked or
    doubly-held block, block tables in step with the requests' lists."""
    step = engine.step

    def checked(*args, **kwargs):
        outputs = step(*args, **kwargs)
        engine.scheduler.check_invariants()
        for request in engine.scheduler.running:
            # Only verified tokens are computed; rejected drafts leave no block behind (a
            # protected request holds the blocks of its whole life).
            assert request.num_computed_tokens <= request.num_tokens
            assert engine.scheduler.is_protected(request) or len(request.block_ids) <= max(1, engine.kv.blocks_needed(
                request.num_tokens + len(request.spec_token_ids)))
        return outputs

    engine.step = checked


def assert_speculated(engine: LLMEngine) -> None:
    totals = engine.stats.totals
    assert totals.spec_draft_tokens > 0, "nothing was drafted"
    assert 0 < totals.spec_accepted_tokens < totals.spec_draft_tokens, "acceptance and rejection both needed"
    assert sum(totals.spec_accepted_per_position) == totals.spec_accepted_tokens
    assert list(totals.spec_accepted_per_position) == sorted(totals.spec_accepted_per_position, reverse=True)


@pytest.mark.parametrize("scenario", ["chunked", "recompute", "swap"])
def test_greedy_speculation_matches_transformers_and_plain_decoding(tiny_checkpoint, oracle, scenario):
    """Continuous arrivals into 4 seats with prefill chunks of 7 beside verifications;
    then a pool so small that requests are preempted, by recompute and by swap."""
    config = dict(max_num_seqs=4, long_prefill_token_threshold=7, max_num_batched_tokens=40, num_kv_blocks=64)
    if scenario != "chunked":
        config.update(num_kv_blocks=9, preemption_mode=scenario, swap_space_mb=64)
    arrivals = spread_arrivals(len(PROMPTS))
    plain, plain_out, prompts = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, **config)
    spec, spec_out, _ = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=check_every_step,
                                   speculative_config=NGRAM, **config)
    assert spec_out == plain_out
    assert_matches_oracle(oracle, spec_out, prompts, MAX_TOKENS)
    assert_speculated(spec)
    if scenario != "chunked":
        assert spec.stats.totals.preemptions > 0, "no preemption happened"


SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "adaptive": False}


@pytest.mark.parametrize("scenario", ["chunked", "recompute"])
def test_suffix_decoding_drafts_from_earlier_outputs_and_stays_exact(tiny_checkpoint, oracle, scenario):
    """The prompts once, then again after the first wave has ended: the second wave's greedy
    outputs are the first's, which suffix decoding has cached, so most of their tokens come as
    accepted drafts; every output is still transformers' token for token, beside prefill
    chunks and, with a small pool, preemptions."""
    config = dict(max_num_seqs=4, long_prefill_token_threshold=7, max_num_batched_tokens=40, num_kv_blocks=64)
    if scenario == "recompute":
        config.update(num_kv_blocks=9, preemption_mode="recompute")
    arrivals = spread_arrivals(len(PROMPTS))
    second_wave = 400
    prompts, max_tokens = PROMPTS * 2, MAX_TOKENS * 2
    arrivals = arrivals + [second_wave + a for a in arrivals]
    accepted_at_second_wave = []

    def watch(engine: LLMEngine) -> None:
        check_every_step(engine)
        step = engine.step
        steps = iter(range(10**6))

        def counted(*args, **kwargs):
            outputs = step(*args, **kwargs)
            if next(steps) == second_wave - 1:
                assert not engine.has_unfinished(), "the first wave was still running"
                accepted_at_second_wave.append(engine.stats.totals.spec_accepted_tokens)
            return outputs
        engine.step = counted

    spec, spec_out, by_id = run_engine(tiny_checkpoint, prompts, max_tokens, arrivals, on_engine=watch,
                                       speculative_config=SUFFIX, **config)
    assert_matches_oracle(oracle, spec_out, by_id, max_tokens)
    assert_speculated(spec)
    assert spec.proposer.num_cached_requests == 2 * len(PROMPTS)
    second_wave_accepted = spec.stats.totals.spec_accepted_tokens - accepted_at_second_wave[0]
    # Each repeated output's tokens after its first two (the first bigram the cache can match).
    repeatable = sum(max(0, n - 2) for n in MAX_TOKENS)
    assert second_wave_accepted >= 0.6 * repeatable, (second_wave_accepted, repeatable)
    if scenario == "recompute":
        assert spec.stats.totals.preemptions > 0, "no preemption happened"


def propose_from(continuation: list[int]):
    """An engine hook: drafts from `continuation` (what the request will produce), the one at
    position (output tokens mod (k + 1)) corrupted, so that every acceptance length happens
    on a random-weight model, whose own output seldom repeats its context."""
    def install(engine: LLMEngine) -> None:
        def propose():
            for request in engine.scheduler.running:
                request.spec_token_ids = []
                room = min(NGRAM["num_speculative_tokens"], request.max_tokens - request.num_output_tokens - 1)
                if room <= 0 or request.num_computed_tokens != request.num_tokens - 1 or request.request_id != "q0":
                    continue
                drafts = continuation[request.num_output_tokens:][:room]
                wrong = request.num_output_tokens % (room + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % VOCAB
                request.spec_token_ids = drafts
        engine._propose = propose
    return install


def _run(model_path: str, requests: list[tuple[list[int], SamplingParams]], on_engine=None, **config) -> dict[str, dict]:
    """Each request's tokens, logprob entries and final output, all arriving at once."""
    engine = LLMEngine(EngineConfig(model_path=model_path, device="cpu", dtype="float32", num_kv_blocks=64, **config))
    if on_engine is not None:
        on_engine(engine)
    check_every_step(engine)
    got: dict[str, dict] = collections.defaultdict(lambda: {"tokens": [], "logprobs": []})
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"q{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id]["tokens"] += out.token_ids_delta
            got[out.request_id]["logprobs"] += out.logprobs_delta or []
            if out.finished:
                got[out.request_id]["final"] = out
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    got["engine"] = engine
    return got


def test_logprobs_bitwise_identical_with_batch_invariance(tiny_checkpoint):
    """The verification rows reduce as decode rows do: every token's logprob and top-5 the
    same bits with and without speculation, alone and beside other requests."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
    others = [(p, SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)) for p in PROMPTS[3:6]]
    alone = _run(tiny_checkpoint, [(PROMPTS[0], params)], batch_invariant=True)
    drafts = propose_from(alone["q0"]["tokens"])
    spec_alone = _run(tiny_checkpoint, [(PROMPTS[0], params)], on_engine=drafts, batch_invariant=True,
                      speculative_config=NGRAM)
    spec_busy = _run(tiny_checkpoint, [(PROMPTS[0], params)] + others, on_engine=drafts, batch_invariant=True,
                     speculative_config=NGRAM, long_prefill_token_threshold=5)
    assert_speculated(spec_alone["engine"])
    for run in (spec_alone, spec_busy):
        assert run["q0"]["tokens"] == alone["q0"]["tokens"]
        assert run["q0"]["logprobs"] == alone["q0"]["logprobs"]
        assert run["q0"]["final"].cumulative_logprob == alone["q0"]["final"].cumulative_logprob


def test_seeded_sampled_request_repeats_exactly(tiny_checkpoint):
    """A seeded request draws every acceptance and every token from its own generator: the
    same tokens whatever else runs, with acceptance and rejection both happening."""
    params = SamplingParams(temperature=0.6, top_k=40, seed=1234, max_tokens=30, ignore_eos=True)
    first = _run(tiny_checkpoint, [(PROMPTS[2], params)], speculative_config=NGRAM)
    busy = _run(tiny_checkpoint, [(PROMPTS[2], params)] +
                [(p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)) for p in PROMPTS[4:7]],
                speculative_config=NGRAM)
    assert first["q0"]["tokens"] == busy["q0"]["tokens"]
    assert len(first["q0"]["tokens"]) == 30
    assert first["engine"].stats.totals.spec_draft_tokens > 0


def test_stops_inside_an_accepted_run(tiny_checkpoint):
    """A stop token or max_tokens that falls among the tokens one verification accepts ends
    the request there: nothing is emitted past it, exactly as without speculation."""
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = _run(tiny_checkpoint, [(PROMPTS[2], base)])["q0"]["tokens"]
    for stop_at in (3, 7, 11):
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[plain[stop_at]])
        want = plain[: plain.index(plain[stop_at]) + 1]
        for config in ({}, {"speculative_config": NGRAM}):
            got = _run(tiny_checkpoint, [(PROMPTS[2], params)], **config)["q0"]
            assert got["tokens"] == want
            assert got["final"].finish_reason == "stop"
    for max_tokens in (2, 5, 6, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        got = _run(tiny_checkpoint, [(PROMPTS[2], params)], speculative_config=NGRAM)["q0"]
        assert got["tokens"] == plain[:max_tokens] and got["final"].finish_reason == "length"


def test_a_request_may_turn_speculation_off(tiny_checkpoint):
    off = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False)
    run = _run(tiny_checkpoint, [(PROMPTS[2], off)], speculative_config=NGRAM)
    assert run["engine"].stats.totals.spec_drafts == 0
    on = _run(tiny_checkpoint, [(PROMPTS[2], off.model_copy(update={"speculative": True}))], speculative_config=NGRAM)
    assert on["engine"].stats.totals.spec_drafts > 0
    assert on["q0"]["tokens"] == run["q0"]["tokens"]


def test_trace_counts_drafts(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                    speculative_config=NGRAM))
    engine.add_request("t", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), trace=True)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    decode = final.trace["decode"]
    totals = engine.stats.totals
    assert decode["draft_tokens"] == totals.spec_draft_tokens > 0
    assert decode["accepted_draft_tokens"] == totals.spec_accepted_tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_drafts_arrivals_and_preemptions_keep_the_kv_manager_consistent(tiny_checkpoint, oracle, data):
    """Drafts made from the oracle's own continuation, corrupted at a random position (so any
    acceptance length happens), random arrivals and max_tokens into a pool small enough to
    preempt: after every step the KV manager's invariants hold, and the output is the oracle's."""
    block_size = data.draw(st.sampled_from([8, 16]), label="block_size")
    num_blocks = data.draw(st.integers(12, 40), label="num_kv_blocks")
    mode = data.draw(st.sampled_from(["recompute", "swap"]), label="preemption_mode")
    chosen = data.draw(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=6), label="prompts")
    prompts = [PROMPTS[i] for i in chosen]
    max_tokens = [data.draw(st.integers(1, MAX_NEW), label="max_tokens") for _ in chosen]
    arrivals = sorted(data.draw(st.integers(0, 8), label="arrival") for _ in chosen)
    rng = random.Random(data.draw(st.integers(0, 2**16), label="draft seed"))
    k = data.draw(st.integers(1, 8), label="num_speculative_tokens")

    def propose_from_oracle(engine):
        def propose():
            for request in engine.scheduler.running:
                request.spec_token_ids = []
                room = min(k, request.max_tokens - request.num_output_tokens - 1)
                if room <= 0 or request.num_computed_tokens != request.num_tokens - 1:
                    continue
                want = oracle[tuple(request.prompt_token_ids)][request.num_output_tokens:][:room]
                drafts = list(want)
                wrong = rng.randrange(len(drafts) + 1)
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
                request.spec_token_ids = drafts
        engine._propose = propose
        check_every_step(engine)

    engine, streamed, by_id = run_engine(
        tiny_checkpoint, prompts, max_tokens, arrivals, on_engine=propose_from_oracle, block_size=block_size,
        num_kv_blocks=num_blocks, preemption_mode=mode, swap_space_mb=64, max_num_seqs=4,
        long_prefill_token_threshold=11, speculative_config={**NGRAM, "num_speculative_tokens": k})
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)
    engine.scheduler.check_invariants()


def test_vllm_spec_decode_counters_follow_the_totals(tiny_checkpoint):
    from backend.metrics import EngineMetrics
    from tests.engine.test_metrics import FakeMetricFamily, FakePbUtils, value

    FakeMetricFamily.registry = {}
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                    speculative_config=NGRAM))
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    propose_from(_run(tiny_checkpoint, [(PROMPTS[2], params)])["q0"]["tokens"])(engine)
    engine.add_request("q0", PROMPTS[2], params)
    while engine.has_unfinished():
        engine.step()
        metrics.on_step()
    totals = engine.stats.totals
    assert value("vllm:spec_decode_num_drafts_total").value == totals.spec_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens_total").value == totals.spec_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total").value == totals.spec_accepted_tokens > 0
    assert value("inflight_spec_decode_num_trimmed_draft_tokens_total").value == totals.spec_trimmed_draft_tokens
    per_position = [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)).value
                    for p in range(NGRAM["num_speculative_tokens"])]
    assert per_position == list(totals.spec_accepted_per_position) + [0] * (4 - len(totals.spec_accepted_per_position))
    assert value("vllm:spec_decode_num_drafts_total").labels["model_name"] == "llm"


def test_no_drafts_while_the_batch_reaches_disable_by_batch_size(tiny_checkpoint, oracle):
    """vLLM's disable_by_batch_size: no request drafts in a step that runs that many."""
    drafted_with = []

    def watch(engine: LLMEngine) -> None:
        propose = engine._propose

        def recorded():
            propose()
            drafted_with.extend(len(engine.scheduler.running) for r in engine.scheduler.running if r.spec_token_ids)
        engine._propose = recorded

    arrivals = [6 * i for i in range(len(PROMPTS))]  # from one request running to four
    spec, spec_out, by_id = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=watch, max_num_seqs=4,
                                       num_kv_blocks=64, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    assert drafted_with and max(drafted_with) < 3, drafted_with
    assert spec.max_running >= 3


def test_adaptive_budget_trims_drafts_and_output_stays_exact(tiny_checkpoint, oracle):
    """A budget that has measured compute-bound steps (each token adds a millisecond) and
    drafts that are never accepted keeps none of them; the output is unchanged."""
    def steep(engine: LLMEngine) -> None:
        budget = engine.draft_budget
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            budget.observe_step(tokens, 0.001 * tokens)
        budget.acceptance = [0.01] * len(budget.acceptance)
        budget.observe_step = lambda num_tokens, seconds: None  # keep the measured costs as set
        budget.observe_verification = lambda num_drafts, num_accepted: None

    adaptive = {**NGRAM, "adaptive": True}
    arrivals = spread_arrivals(len(PROMPTS))
    spec, spec_out, by_id = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=steep,
                                       max_num_seqs=4, num_kv_blocks=64, speculative_config=adaptive)
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    totals = spec.stats.totals
    assert totals.spec_trimmed_draft_tokens > 0 and totals.spec_draft_tokens == 0
    free, _, _ = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=4, num_kv_blocks=64,
                            speculative_config=adaptive)
    assert free.stats.totals.spec_draft_tokens > 0, "with its own measurements the budget verified no draft"


def draft_model_config(path: str, **extra) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "adaptive": False, **extra}


@pytest.mark.parametrize("scenario", ["chunked", "recompute"])
def test_the_served_model_as_its_own_draft_is_accepted_and_exact(tiny_checkpoint, oracle, scenario):
    """The target as its own draft proposes the target's own greedy tokens: nearly every draft
    is accepted, beside prefill chunks and (with a small pool) preemptions, the output is
    transformers' token for token, and the draft's cache gives back every block."""
    config = dict(max_num_seqs=4, long_prefill_token_threshold=7, max_num_batched_tokens=40, num_kv_blocks=64)
    if scenario == "recompute":
        config.update(num_kv_blocks=9, preemption_mode="recompute")
    arrivals = spread_arrivals(len(PROMPTS))
    spec, spec_out, by_id = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=check_every_step,
                                       speculative_config=draft_model_config(tiny_checkpoint), **config)
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    totals = spec.stats.totals
    assert totals.spec_draft_tokens > 0
    assert totals.spec_accepted_tokens >= 0.9 * totals.spec_draft_tokens
    assert spec.proposer.num_free_blocks == spec.kv.num_blocks
    if scenario == "recompute":
        assert totals.preemptions > 0, "no preemption happened"


def test_a_different_draft_model_keeps_the_output_exact_and_seeded_sampling_repeatable(tiny_checkpoint, oracle,
                                                                                          tmp_path):
    """A draft of another model (fewer layers, other weights) is mostly rejected; greedy output
    stays transformers', and a seeded sampled request repeats whatever shares its batch."""
    from backend.models.random_checkpoint import make_tiny_checkpoint

    draft = make_tiny_checkpoint(str(tmp_path / "draft"), seed=7, num_hidden_layers=1)
    spec_config = draft_model_config(draft)
    arrivals = spread_arrivals(len(PROMPTS))
    spec, spec_out, by_id = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=4,
                                       num_kv_blocks=64, speculative_config=spec_config)
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    assert spec.stats.totals.spec_draft_tokens > 0
    assert spec.stats.totals.spec_accepted_tokens < spec.stats.totals.spec_draft_tokens
    params = SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=25, ignore_eos=True)
    alone = _run(tiny_checkpoint, [(PROMPTS[1], params)], speculative_config=spec_config)
    busy = _run(tiny_checkpoint, [(PROMPTS[1], params)] +
                [(p, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)) for p in PROMPTS[5:8]],
                speculative_config=spec_config)
    assert alone["q0"]["tokens"] == busy["q0"]["tokens"] and len(alone["q0"]["tokens"]) == 25


def test_adaptive_budget_runs_no_draft_pass_that_would_not_pay(tiny_checkpoint, oracle):
    """A draft model whose passes cost as much as the target's step, and whose drafts are
    accepted at a coin toss's rate, never pays: the budget decides before drafting, so the draft
    model never runs, every draft it would have made counts as trimmed, and the output is
    transformers'."""
    passes = []

    def costly_draft(engine: LLMEngine) -> None:
        budget, proposer = engine.draft_budget, engine.proposer
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            budget.observe_step(tokens, 0.01)
            proposer.pass_cost.observe(tokens, 0.01)
        budget.observe_step = lambda num_tokens, seconds: None  # keep the measured costs as set
        proposer.pass_cost.observe = lambda num_tokens, seconds: None
        forward = proposer._forward
        proposer._forward = lambda batch, feeds: passes.append(len(batch)) or forward(batch, feeds)

    arrivals = spread_arrivals(len(PROMPTS))
    spec, spec_out, by_id = run_engine(
        tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=costly_draft, max_num_seqs=4, num_kv_blocks=64,
        speculative_config=draft_model_config(tiny_checkpoint, adaptive=True))
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    totals = spec.stats.totals
    assert passes == [] and totals.spec_draft_tokens == 0
    assert totals.spec_trimmed_draft_tokens > 0


def test_a_draft_models_kv_comes_out_of_the_pools_memory(tiny_checkpoint):
    """With kv_cache_memory_mb, the served model's blocks and the draft's together fit in it:
    a self-draft of the same shape halves the blocks instead of doubling the memory."""
    from backend.model_runner import kv_block_bytes

    alone = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", kv_cache_memory_mb=4))
    drafted = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", kv_cache_memory_mb=4,
                                     speculative_config=draft_model_config(tiny_checkpoint)))
    block_bytes = kv_block_bytes(alone.arch, alone.config.block_size, alone.dtype)
    assert alone.num_kv_blocks == 4 * 2**20 // block_bytes
    assert drafted.num_kv_blocks == 4 * 2**20 // (2 * block_bytes)
    draft_kv = drafted.proposer.kv_caches
    assert drafted.proposer.num_free_blocks == drafted.num_kv_blocks
    assert sum(k.nbytes + v.nbytes for k, v in draft_kv) == drafted.num_kv_blocks * block_bytes


@pytest.mark.parametrize("quantization, activations", [("int8", "none"), ("int4", "none"), ("int8", "int8")])
def test_the_served_model_quantized_drafts_for_itself(tiny_checkpoint, oracle, quantization, activations):
    """The served checkpoint, quantized at load (and with int8 activations), as its own draft. On
    this random-weight model the logits are nearly flat, so int4's rounding moves many argmaxes
    (about 15% accepted); int8 keeps most (about 80%)."""
    arrivals = spread_arrivals(len(PROMPTS))
    spec, spec_out, by_id = run_engine(
        tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=4, num_kv_blocks=64,
        speculative_config=draft_model_config(tiny_checkpoint, quantization=quantization,
                                              activation_quantization=activations))
    assert_matches_oracle(oracle, spec_out, by_id, MAX_TOKENS)
    totals = spec.stats.totals
    assert 0 < totals.spec_accepted_tokens < totals.spec_draft_tokens
    if quantization == "int8":
        assert totals.spec_accepted_tokens > 0.5 * totals.spec_draft_tokens
    packed = [m.packed for m in spec.proposer.model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert packed and all((p.isa == kernels.cpu_ext.QUANT_INT8_DOTS) == (activations == "int8") for p in packed)


def test_a_draft_of_another_vocabulary_is_refused_at_load(tiny_checkpoint, tmp_path):
    from backend.models.random_checkpoint import make_tiny_checkpoint

    draft = make_tiny_checkpoint(str(tmp_path / "small-vocab"), vocab_size=1024)
    with pytest.raises(ValueError, match="speculative_config: model=.*vocabulary of 1024 tokens"):
        LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=16,
                               speculative_config=draft_model_config(draft)))


def test_a_tenant_is_charged_for_the_tokens_it_gets_not_for_the_drafts_verified(tiny_checkpoint):
    """Under the fair policy a speculating request's tenant is charged what it is without
    speculation: its prompt as input and every output token (accepted drafts included) as
    output; rejected drafts cost it nothing."""
    def service(**config) -> tuple[float, LLMEngine]:
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                        scheduling_policy="fair", tenant_input_token_cost=1.0,
                                        tenant_output_token_cost=4.0, **config))
        if "speculative_config" in config:
            propose_from(plain_tokens)(engine)
        engine.add_request("q0", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, tenant="t"))
        total = 0.0
        while engine.has_unfinished():
            engine.step()
            total += dict(engine.stats.step.service_by_tenant).get("t", 0.0)
        return total, engine

    plain_tokens = _run(tiny_checkpoint, [(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20,
                                                                       ignore_eos=True))])["q0"]["tokens"]
    plain, _ = service()
    spec, engine = service(speculative_config=NGRAM)
    assert_speculated(engine)
    assert plain == len(PROMPTS[2]) * 1.0 + 20 * 4.0
    assert spec == plain


def assert_seeded_request_repeats_beside_others(model_path: str, prompt: list[int], params: SamplingParams) -> dict:
    """A seeded sampled request, drafting from its own tokens of a run without speculation (one
    position corrupted), alone and beside other sampled requests: the same tokens, with drafts
    accepted. The alone run's results."""
    drafts = propose_from(_run(model_path, [(prompt, params)])["q0"]["tokens"])
    alone = _run(model_path, [(prompt, params)], on_engine=drafts, speculative_config=NGRAM)
    busy = _run(model_path, [(prompt, params)] +
                [(p, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)) for p in PROMPTS[4:7]],
                on_engine=drafts, speculative_config=NGRAM)
    assert alone["q0"]["tokens"] == busy["q0"]["tokens"]
    assert alone["engine"].stats.totals.spec_accepted_tokens > 0
    return alone


def test_penalties_and_min_tokens_apply_to_every_drafted_position(tiny_checkpoint):
    """Repetition, presence and frequency penalties and a pending min_tokens: verification row
    j counts the drafts before it as output, as the plain step after them would, so greedy
    output is token for token that of plain decoding, with drafts accepted and rejected; a
    seeded sampled request with penalties repeats exactly beside other requests."""
    free = _run(tiny_checkpoint, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30,
                                                               ignore_eos=True))])["q0"]["tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3, min_tokens=12, stop_token_ids=[free[1]])
    plain = _run(tiny_checkpoint, [(PROMPTS[0], params)])
    assert plain["q0"]["tokens"] != free
    drafts = propose_from(plain["q0"]["tokens"])
    spec = _run(tiny_checkpoint, [(PROMPTS[0], params)], on_engine=drafts, speculative_config=NGRAM)
    assert spec["q0"]["tokens"] == plain["q0"]["tokens"]
    assert spec["q0"]["final"].finish_reason == plain["q0"]["final"].finish_reason
    assert_speculated(spec["engine"])
    sampled = SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=25, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.5)
    assert_seeded_request_repeats_beside_others(tiny_checkpoint, PROMPTS[2], sampled)


@pytest.mark.parametrize("constraint", [{"json": {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False}}, {"regex": r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"}],
    ids=["json", "regex"])
def test_structured_outputs_mask_every_drafted_position(tiny_checkpoint, constraint):
    """A constrained request speculates: row j is masked by the grammar after drafts 0..j-1
    (a draft the grammar refuses is masked in its own row, so rejected), the matcher is rolled
    back, and the accepted tokens advance it. Greedy output is plain decoding's token for
    token; a seeded sampled one repeats beside other requests and stays in the language."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    plain = _run(tiny_checkpoint, [(PROMPTS[0], greedy)])
    spec = _run(tiny_checkpoint, [(PROMPTS[0], greedy)], on_engine=propose_from(plain["q0"]["tokens"]),
                speculative_config=NGRAM)
    assert spec["q0"]["tokens"] == plain["q0"]["tokens"]
    assert spec["q0"]["final"].finish_reason == plain["q0"]["final"].finish_reason == "stop"
    assert_speculated(spec["engine"])
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=constraint)
    alone = assert_seeded_request_repeats_beside_others(tiny_checkpoint, PROMPTS[1], sampled)
    engine = alone["engine"]
    for run, params in ((spec, greedy), (alone, sampled)):
        text = engine.tokenizer.decode(run["q0"]["tokens"], skip_special_tokens=True)
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], text), text
        else:
            value = json.loads(text)
            assert set(value) == {"name", "n"} and 0 <= value["n"] <= 99


def test_each_sequence_of_a_parallel_sampling_group_speculates_on_its_own(tiny_checkpoint):
    """n = 3 (and best_of = 4 for n = 2): the sequences fork from the shared prompt blocks and
    each verifies its own drafts (copy-on-write of the shared last prompt block before the
    first write); every sequence has its tokens, the group one final output, a seeded group
    the same tokens beside other requests, and every block comes back."""
    drafted: set[int] = set()

    def run(params: SamplingParams, others: int) -> tuple[dict[int, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                        speculative_config=NGRAM))
        def propose():  # every sequence of q0 drafts from the greedy continuation, one position corrupted
            for request in engine.scheduler.running:
                request.spec_token_ids = []
                room = min(4, request.max_tokens - request.num_output_tokens - 1)
                if room > 0 and request.num_computed_tokens == request.num_tokens - 1 and request.request_id.split("/")[0] == "q0":
                    drafts = continuation[request.num_output_tokens:][:room]
                    wrong = (request.num_output_tokens + request.seq_index) % (room + 1)
                    if wrong < len(drafts):
                        drafts[wrong] = (drafts[wrong] + 1) % VOCAB
                    request.spec_token_ids = drafts
                    drafted.add(request.seq_index)
        engine._propose = propose
        check_every_step(engine)
        engine.add_request("q0", PROMPTS[3], params)
        for i in range(others):
            engine.add_request(f"o{i}", PROMPTS[4 + i], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
        tokens: dict[int, list[int]] = collections.defaultdict(list)
        finals = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != "q0":
                    continue
                for index, sequence in enumerate(out.sequences or []):
                    if sequence is not None:
                        tokens[index] += sequence.token_ids_delta
                finals += out.finished
        assert finals == 1
        assert engine.kv.pool.num_free == engine.kv.num_blocks
        return dict(tokens), engine

    continuation = _run(tiny_checkpoint, [(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=20,
                                                                       ignore_eos=True))])["q0"]["tokens"]
    for params in (SamplingParams(n=3, temperature=0.01, seed=11, max_tokens=20, ignore_eos=True),
                   SamplingParams(n=2, best_of=4, temperature=0.01, seed=12, max_tokens=20, ignore_eos=True)):
        drafted.clear()
        alone, engine = run(params, 0)
        assert drafted == set(range(params.best_of or params.n)), "not every sequence drafted"
        busy, _ = run(params, 3)
        assert alone == busy
        assert len(alone) == (params.best_of or params.n) and all(len(t) == 20 for t in alone.values())
        totals = engine.stats.totals
        assert 0 < totals.spec_accepted_tokens < totals.spec_draft_tokens
