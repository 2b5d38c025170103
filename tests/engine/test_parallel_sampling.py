"""Parallel sampling (`n`, `best_of`) in the engine, on a tiny random-weight Llama.

Sequence i of a request with seed s is token-identical, logprobs bitwise, to a request of
its own with seed s + i (batch_invariant is on by default here), whatever the group goes
through: prefix caching on or off, copy-on-write of the prompt's partial block, preemption
of the whole group by recompute or swap, cancellation. The block pool's invariants,
reference counts equal to the block tables holding each block among them, are checked
after every step.
"""

from __future__ import annotations

import collections
import random

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.output import RequestOutput
from backend.request import RequestError, RequestStatus, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152
_rng = random.Random(25)
# 37 tokens: two full blocks of 16 and a partial one that the sequences share, then copy.
PROMPT = [_rng.randrange(3, VOCAB) for _ in range(37)]
OTHER = [_rng.randrange(3, VOCAB) for _ in range(21)]


def make_engine(model_path: str, **config) -> LLMEngine:
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model_path=model_path, **config))


def sampled(seed: int | None = None, **values) -> SamplingParams:
    values.setdefault("max_tokens", 12)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **values)


class Run:
    """Drives `engine.step()` until idle; per request id its outputs, per sequence its tokens."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.outputs: dict[str, list[RequestOutput]] = collections.defaultdict(list)
        self.tokens: dict[str, dict[int, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.peak_blocks = 0
        self.steps = 0

    def step(self) -> None:
        for out in self.engine.step():
            assert not any(o.finished for o in self.outputs[out.request_id]), f"output after the final one: {out}"
            self.outputs[out.request_id].append(out)
            for i, seq in enumerate(out.sequences if out.sequences is not None else [out]):
                if seq is not None:
                    self.tokens[out.request_id][i].extend(seq.token_ids_delta)
        self.engine.scheduler.check_invariants()  # reference counts == block tables holding each block
        self.peak_blocks = max(self.peak_blocks, self.engine.kv.pool.num_used)
        self.steps += 1
        assert self.steps < 3000, "engine did not finish"

    def until_idle(self) -> "Run":
        while self.engine.has_unfinished():
            self.step()
        assert self.engine.kv.pool.num_free == self.engine.kv.num_blocks, "blocks leaked"
        assert not self.engine.scheduler.requests and not self.engine.detokenizers
        for rid, outs in self.outputs.items():
            assert sum(o.finished for o in outs) == 1, f"{rid}: {sum(o.finished for o in outs)} final outputs"
        return self

    def final(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]


def single_runs(model_path: str, prompt: list[int], seeds: list[int], **config) -> dict[int, tuple[list[int], float]]:
    """Per seed: the tokens and cumulative logprob of a request of its own, all sent together."""
    engine = make_engine(model_path, **config)
    requests = {seed: engine.add_request(f"s{seed}", prompt, sampled(seed), needs_logprobs=True) for seed in seeds}
    Run(engine).until_idle()
    return {seed: (r.output_token_ids, r.cumulative_logprob) for seed, r in requests.items()}


@pytest.fixture(scope="module")
def singles(tiny_checkpoint):
    return single_runs(tiny_checkpoint, PROMPT, list(range(7, 15)))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_sequence_equals_a_single_request_with_its_derived_seed(tiny_checkpoint, singles, prefix_caching):
    engine = make_engine(tiny_checkpoint, enable_prefix_caching=prefix_caching)
    copies = collections.Counter()
    runner_swap = engine.runner.swap

    def count_copies(plan):
        copies["blocks"] += len(plan.block_copies)
        runner_swap(plan)

    engine.runner.swap = count_copies
    engine.add_request("other", OTHER, sampled(3))
    group = engine.add_request("g", PROMPT, sampled(7, n=4), needs_logprobs=True)
    run = Run(engine)
    run.step()
    engine.add_request("late", OTHER[:9], sampled(5))  # joins the group's decodes
    run.until_idle()

    final = run.final("g")
    assert final.finished and final.finish_reason == "length" and final.returned == [0, 1, 2, 3]
    seqs = group.group.seqs
    for i in range(4):
        tokens, cumulative = singles[7 + i]
        assert run.tokens["g"][i] == tokens, f"sequence {i} differs from a request with seed {7 + i}"
        assert seqs[i].cumulative_logprob == cumulative  # bitwise: batch invariance
    assert len({tuple(run.tokens["g"][i]) for i in range(4)}) > 1, "the sequences sampled alike"
    # The partial third block was shared at the fork, and 3 of the 4 sequences copied it.
    assert copies["blocks"] == 3
    assert final.num_output_tokens == 4 * 12
    # Counted once: one request, one prompt, one first token.
    assert engine.stats.totals.prompt_tokens == len(PROMPT) + len(OTHER) + 9


def test_n8_on_a_512_token_prompt_shares_the_prompt_blocks(tiny_checkpoint):
    """Measured: peak KV blocks of one n=8 request against one request's prompt blocks plus
    every sequence's decode blocks (the issue's bound is 1.3x the prompt's plus those)."""
    engine = make_engine(tiny_checkpoint, max_num_seqs=8, num_kv_blocks=400)
    prompt = [random.Random(512).randrange(3, VOCAB) for _ in range(512)]
    max_tokens = 40
    engine.add_request("g", prompt, sampled(1, n=8, max_tokens=max_tokens))
    run = Run(engine).until_idle()
    kv = engine.kv
    prompt_blocks = kv.blocks_needed(512)
    decode_blocks = kv.blocks_needed(512 + max_tokens - 1) - prompt_blocks
    bound = 1.3 * prompt_blocks + 8 * decode_blocks
    print(f"n=8, 512-token prompt: peak {run.peak_blocks} blocks; prompt {prompt_blocks}, decode {decode_blocks} "
          f"per sequence; bound {bound}; 8 separate requests would hold {8 * (prompt_blocks + decode_blocks)}")
    assert run.peak_blocks == prompt_blocks + 8 * decode_blocks
    assert run.peak_blocks < bound


def test_best_of_returns_the_n_highest_cumulative_logprobs(tiny_checkpoint, singles):
    engine = make_engine(tiny_checkpoint)
    engine.add_request("g", PROMPT, sampled(7, n=2, best_of=5))
    run = Run(engine).until_idle()
    final = run.final("g")
    ranked = sorted(range(5), key=lambda i: -singles[7 + i][1])
    assert final.returned == ranked[:2]
    for i in range(5):
        assert run.tokens["g"][i] == singles[7 + i][0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_the_whole_group_and_output_stays_identical(tiny_checkpoint, mode):
    """16 blocks of 8 tokens: the group (5 prompt blocks shared, then 4 tails) and two other
    requests cannot all fit, so requests keep evicting each other."""
    config = dict(block_size=8, num_kv_blocks=16, max_num_seqs=6, preemption_mode=mode, swap_space_mb=1,
                  max_preemptions=3, long_prefill_token_threshold=13)
    seeds = [7, 8, 9, 10]
    want = single_runs(tiny_checkpoint, PROMPT, seeds, **{**config, "num_kv_blocks": 64})
    engine = make_engine(tiny_checkpoint, **config)
    preempted_together = []
    schedule = engine.scheduler.schedule

    def record():
        plan = schedule()
        for r in plan.preempted:
            if r.group is not None:  # none of its group runs on, but a protected sequence
                preempted_together.append(all(s.status is not RequestStatus.RUNNING or engine.scheduler.is_protected(s)
                                              for s in r.group.seqs))
        return plan

    engine.scheduler.schedule = record
    engine.add_request("a", OTHER, sampled(1, max_tokens=20))
    engine.add_request("g", PROMPT, sampled(7, n=4, max_tokens=12), needs_logprobs=True)
    engine.add_request("b", OTHER[:13], sampled(2, max_tokens=20))
    run = Run(engine).until_idle()
    assert engine.stats.totals.preemptions > 0
    assert preempted_together and all(preempted_together)
    for i, seed in enumerate(seeds):
        assert run.tokens["g"][i] == want[seed][0], f"sequence {i} after preemption ({mode})"


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_cancelling_a_group_frees_every_sequence(tiny_checkpoint, when):
    engine = make_engine(tiny_checkpoint, long_prefill_token_threshold=8)
    engine.add_request("g", PROMPT, sampled(7, n=4, max_tokens=50))
    run = Run(engine)
    for _ in range(2 if when == "prefill" else 9):
        run.step()
    assert engine.kv.pool.num_used > 0
    assert len(engine.scheduler.running) == (1 if when == "prefill" else 4)
    assert engine.abort("g")
    assert engine.kv.pool.num_used == 0  # freed in the call
    run.until_idle()
    final = run.final("g")
    assert final.finished and final.finish_reason == "abort" and final.returned == [0, 1, 2, 3]
    assert engine.stats.totals.aborts == 1


def test_seedless_sequences_draw_from_the_engine_generator(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    engine.add_request("g", PROMPT, sampled(None, n=3))
    run = Run(engine).until_idle()
    assert len({tuple(run.tokens["g"][i]) for i in range(3)}) == 3


def test_greedy_sequences_are_all_the_greedy_output(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = engine.add_request("one", PROMPT, greedy)
    Run(engine).until_idle()
    engine.add_request("g", PROMPT, greedy.model_copy(update={"n": 3}))
    run = Run(engine).until_idle()
    assert all(run.tokens["g"][i] == single.output_token_ids for i in range(3))


@pytest.mark.parametrize("values, param, words", [
    ({"n": 4}, "n", "max_num_seqs"),
    ({"n": 2, "best_of": 5}, "best_of", "max_num_seqs"),
    ({"n": 3, "max_tokens": 200}, "n", "KV blocks"),
])
def test_groups_that_can_never_run_are_refused(tiny_checkpoint, values, param, words):
    engine = make_engine(tiny_checkpoint, max_num_seqs=3, num_kv_blocks=30)
    with pytest.raises(RequestError) as info:
        engine.add_request("g", PROMPT, SamplingParams(**values))
    assert info.value.param == param and words in str(info.value), str(info.value)
