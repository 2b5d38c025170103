"""Sliding-window attention past the window (Mistral, Phi-3, Qwen2), against `transformers`.

tests/engine/test_model_families.py checks each family's logits and greedy tokens; here windows
of 16 positions (every prompt but the shortest crosses them) go through what changes the
attention's inputs: staggered arrivals with chunked prefill, prefix-cache hits, preemption by
recompute and by swap, parallel sampling. Where every layer slides with the one window (Mistral,
Phi-3) the KV cache releases the blocks behind it: a long generation holds a bounded number of
blocks, and a later request's prefix-cache hit on blocks released that way gives transformers'
tokens, and admission counts a window's blocks, not a request's length: a request longer than
the whole pool is served. Qwen2 here keeps a full-attention layer 0 (max_window_layers=1), so it
keeps every block, and its admission counts every block.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from backend import kv_events
from backend.models.loader import load_arch
from backend.request import RequestError, SamplingParams
from tests.checkpoints import hf_greedy, make_tiny_checkpoint
from tests.engine.test_engine_equivalence import probe_logprobs, run_engine
from tests.engine.test_parallel_sampling import Run, make_engine, sampled
from tests.engine.windowed_scenarios import (
    CHOSEN,
    MAX_NEW,
    checkpoint_and_oracle,
    chunked_prefill_with_arrivals,
    preemption_under_a_tiny_kv_pool,
    prefix_cache_hits,
    with_config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16
CASES = {
    # Seed 1: at seed 0 the suffix cache's drafts past the window are all accepted, and
    # test_speculative_decoding_past_the_window needs rejections too.
    "mistral": ("mistral", dict(sliding_window=WINDOW, seed=1)),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


@pytest.fixture(scope="module", params=list(CASES))
def windowed(request, tmp_path_factory):
    """(checkpoint, {prompt: transformers' greedy continuation})."""
    family, overrides = CASES[request.param]
    return checkpoint_and_oracle(tmp_path_factory.mktemp(request.param), family, **overrides)


def test_the_window_changes_the_output(windowed, tmp_path):
    """Otherwise the tests here would pass with full attention."""
    path, _ = windowed
    arch, _ = load_arch(path)
    assert WINDOW in arch.layer_windows
    longest = max(CHOSEN, key=len)
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    full = with_config(path, tmp_path / "full", sliding_window=4096)
    model = transformers.AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert (model(torch.tensor([longest])).logits - original(torch.tensor([longest])).logits).abs().max() > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("triton-on-cpu", marks=pytest.mark.slow)])
def test_chunked_prefill_across_the_window_with_arrivals(windowed, device):
    engine = chunked_prefill_with_arrivals(*windowed, device)
    assert engine.max_model_len == 256 > WINDOW


def test_prefix_cache_hits(windowed):
    prefix_cache_hits(*windowed)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_kv_pool(windowed, mode):
    preemption_under_a_tiny_kv_pool(*windowed, mode)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_past_the_window(windowed, mode):
    """n=4 sequences share the prompt's blocks (those behind the window already released at the
    fork), copy the partial one on write, release their own behind the window, and are preempted
    together by a more urgent request: each equals a request of its own with its derived seed."""
    path, _ = windowed
    prompt = CHOSEN[-1] + CHOSEN[0]   # 72 tokens
    config = dict(block_size=8, preemption_mode=mode, swap_space_mb=1, long_prefill_token_threshold=13,
                  max_model_len=128, num_kv_blocks=64)
    singles = make_engine(path, **config)
    want = [singles.add_request(f"s{i}", prompt, sampled(7 + i, max_tokens=20)) for i in range(4)]
    Run(singles).until_idle()
    # Five seats: the group and one other fill them, and a more urgent arrival takes the group's.
    engine = make_engine(path, **config, scheduling_policy="priority", max_num_seqs=5)
    engine.add_request("other", CHOSEN[3], sampled(1, max_tokens=20, priority=1))
    engine.add_request("g", prompt, sampled(7, n=4, max_tokens=20, priority=1))
    run = Run(engine)   # checks the pool's invariants after every step
    while len([r for r in engine.scheduler.running if r.group is not None]) < 4:   # until the fork
        run.step()
    for _ in range(3):
        run.step()
    seqs = [r for r in engine.scheduler.running if r.group is not None]
    assert len(seqs) == 4
    if engine.arch.sliding_window is not None:
        assert all(r.num_freed_blocks >= 6 for r in seqs)   # 75 tokens computed: 7 blocks behind
    engine.add_request("urgent", CHOSEN[1], sampled(2, max_tokens=5, priority=0))
    run.until_idle()
    assert engine.stats.totals.preemptions >= 4
    for i in range(4):
        assert run.tokens["g"][i] == want[i].output_token_ids, f"sequence {i} ({mode})"


# ---- blocks behind the window are released -----------------------------------------------


def test_a_long_generation_holds_a_bounded_number_of_blocks(windowed):
    """400 tokens through a 16-position window in blocks of 8: Mistral and Phi-3 hold at most
    the window's blocks plus the one being written and the one partly behind the window; the
    KV usage gauge says so at every step. Qwen2's full layer 0 keeps every block."""
    path, _ = windowed
    prompt = CHOSEN[-1]   # 41 tokens
    max_tokens = 400 - len(prompt)
    expected = hf_greedy(path, [prompt], max_tokens)[0]
    engine = make_engine(path, block_size=8, num_kv_blocks=64, max_model_len=512, long_prefill_token_threshold=13)
    request = engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    run = Run(engine)
    peak_usage = 0.0
    while engine.has_unfinished():
        run.step()
        peak_usage = max(peak_usage, engine.stats.kv_usage)
    run.until_idle()
    assert request.output_token_ids == expected
    if engine.arch.sliding_window is None:
        assert run.peak_blocks == 400 // 8   # every block kept
        return
    # A prefill chunk of 13 tokens may still need its first query's window: (16 + 13) / 8 + 2.
    bound = (WINDOW + 13) // 8 + 2
    assert run.peak_blocks <= bound, f"{run.peak_blocks} blocks held for a {WINDOW}-position window"
    assert peak_usage <= bound / 64


def test_a_prefix_hit_on_blocks_released_behind_the_window(windowed):
    """A request's blocks released behind its window keep their prefix-cache entries (the KV
    events announce each block once, and no removal while nothing is evicted): a later request
    whose prompt is that request's prompt and output hits them, and gives transformers' tokens."""
    path, _ = windowed
    first = CHOSEN[-1]
    engine = make_engine(path, block_size=8, num_kv_blocks=64, max_model_len=256)
    engine.kv.pool.events = []   # what a kv_events_endpoint publishes
    a = engine.add_request("a", first, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    Run(engine).until_idle()
    events = engine.kv.pool.take_events()
    assert [type(e) for e in events] == [kv_events.BlockStored] * ((len(first) + 60 - 1) // 8)
    second = first + a.output_token_ids
    b = engine.add_request("b", second, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    Run(engine).until_idle()
    assert b.num_cached_prompt_tokens >= len(first)
    assert b.output_token_ids == hf_greedy(path, [second], MAX_NEW)[0]


def test_speculative_decoding_past_the_window(windowed):
    """Suffix-decoding drafts verified past the window: a prompt, then the same prompt once the
    first has ended, whose output the suffix cache drafts. Accepted drafts are computed tokens,
    after which the blocks behind the window go; rejected ones leave no block. Both equal
    transformers', and the pool's invariants hold after every step."""
    from tests.engine.test_spec_decode import SUFFIX, assert_speculated, check_every_step

    path, _ = windowed
    prompt = CHOSEN[-1]
    expected = hf_greedy(path, [prompt], 150)[0]
    engine, streamed, _ = run_engine(path, [prompt, prompt], [150, 150], [0, 200], on_engine=check_every_step,
                                     block_size=8, num_kv_blocks=64, long_prefill_token_threshold=13,
                                     max_model_len=256, speculative_config=SUFFIX)
    assert streamed["r0"] == streamed["r1"] == expected
    assert_speculated(engine)


def test_logprobs_are_the_same_bits_alone_and_in_a_busy_batch(windowed):
    """Batch invariance past the window: the probe's released blocks read as block 0, whatever
    another request wrote there, and weigh exactly 0."""
    path, _ = windowed
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    probe = max(CHOSEN, key=len)

    def logprobs_beside(others: list[list[int]]) -> list[float]:
        engine = make_engine(path, batch_invariant=True, block_size=8, num_kv_blocks=64, max_model_len=256,
                             max_num_batched_tokens=40, long_prefill_token_threshold=16)
        return probe_logprobs(engine, probe, params,
                              [(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for p in others])

    alone = logprobs_beside([])
    assert len(alone) == 40
    assert logprobs_beside(CHOSEN[:6]) == alone


# ---- admission counts the blocks held at once -------------------------------------------------

# A pool of 8 blocks of 8 tokens (64 tokens); prefill chunks of 13: a 16-position window holds at
# most (16 - 1 + 13) / 8 + 1 = 5 blocks at once.
SMALL_POOL = dict(block_size=8, num_kv_blocks=8, long_prefill_token_threshold=13, max_model_len=256)
LONGER_THAN_THE_POOL = 150   # prompt + max_tokens, in tokens


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def every_layer_windowed(request, tmp_path_factory) -> str:
    family, overrides = CASES[request.param]
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"{request.param}-admission")), family=family,
                                **overrides)


def long_request(prompt: list[int]) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=LONGER_THAN_THE_POOL - len(prompt), ignore_eos=True)


def assert_refused_for_the_pool(path: str) -> None:
    engine = make_engine(path, **SMALL_POOL)
    with pytest.raises(RequestError) as refused:
        engine.add_request("long", CHOSEN[-1], long_request(CHOSEN[-1]))
    assert refused.value.code == RequestError.INVALID_ARG and refused.value.param == "max_tokens"
    assert str(refused.value) == (f"max_tokens: prompt ({len(CHOSEN[-1])} tokens) + max_tokens "
                                  f"({LONGER_THAN_THE_POOL - len(CHOSEN[-1])}) needs 19 KV blocks of 8 tokens; "
                                  "the whole pool has 8")


def test_a_request_longer_than_the_whole_pool(every_layer_windowed, tmp_path):
    """A request of 150 tokens from a pool of 64 gives transformers' tokens, holding at most 5
    blocks, and every block is back in the pool at the end. The same checkpoint without its
    window refuses it, naming max_tokens and the pool."""
    path = every_layer_windowed
    prompt = CHOSEN[-1]
    engine = make_engine(path, **SMALL_POOL)
    request = engine.add_request("long", prompt, long_request(prompt))
    run = Run(engine).until_idle()   # checks the pool's invariants after every step, and that none leaked
    assert request.output_token_ids == hf_greedy(path, [prompt], LONGER_THAN_THE_POOL - len(prompt))[0]
    assert 0 < run.peak_blocks <= 5 and engine.kv.pool.num_used == 0
    global_path = with_config(path, tmp_path / "global", sliding_window=None)
    assert load_arch(global_path)[0].sliding_window is None
    assert_refused_for_the_pool(global_path)


def test_windowed_and_global_layers_count_every_block(tmp_path):
    """Qwen2 with a full-attention layer 0 keeps every block: the long request is refused."""
    family, overrides = CASES["qwen2"]
    path = make_tiny_checkpoint(str(tmp_path / "qwen2"), family=family, **overrides)
    assert WINDOW in load_arch(path)[0].layer_windows
    assert_refused_for_the_pool(path)


def test_a_window_that_does_not_fit_the_pool_is_refused(every_layer_windowed):
    """Four blocks cannot hold a 16-position window's five: the refusal says what it counted."""
    engine = make_engine(every_layer_windowed, **{**SMALL_POOL, "num_kv_blocks": 4})
    with pytest.raises(RequestError) as refused:
        engine.add_request("long", CHOSEN[-1], SamplingParams(temperature=0.0, max_tokens=100))
    assert refused.value.param == "max_tokens"
    assert str(refused.value) == (f"max_tokens: prompt ({len(CHOSEN[-1])} tokens) + max_tokens (100) needs 5 KV "
                                  "blocks of 8 tokens "
                                  "at once (a sliding window of 16 positions, steps of up to 13 tokens); "
                                  "the whole pool has 4")
    engine.add_request("short", CHOSEN[0], SamplingParams(temperature=0.0, max_tokens=10))   # 2 blocks: fits
    Run(engine).until_idle()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_requests_longer_than_the_pool_preempt_each_other(every_layer_windowed, mode):
    """Three requests of 150 tokens each through the pool of 64: they preempt one another, a
    request preempted once is protected and reserves a window's blocks (which move with its
    window), and each gives transformers' tokens."""
    path = every_layer_windowed
    prompts = [CHOSEN[-1], CHOSEN[-2], CHOSEN[-3]]
    expected = [hf_greedy(path, [p], LONGER_THAN_THE_POOL - len(p))[0] for p in prompts]
    engine = make_engine(path, **SMALL_POOL, preemption_mode=mode, swap_space_mb=1, max_preemptions=1)
    requests = [engine.add_request(f"r{i}", p, long_request(p)) for i, p in enumerate(prompts)]
    Run(engine).until_idle()
    assert engine.stats.totals.preemptions > 0
    assert [r.output_token_ids for r in requests] == expected
