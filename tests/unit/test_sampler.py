"""The sampler: greedy, the random path's masks and distribution, seeds, penalties,
min_tokens and logprobs, on small hand-made logits (no model)."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from backend.request import Request, SamplingParams
from backend.sampler import Sampler, argmax_rows, banned_token_ids, sample_from_probs

EOS = 2


def req(rid: str = "r", prompt=(5, 6, 7), output=(), eos=(EOS,), needs_logprobs=False, **params) -> Request:
    r = Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),
        max_tokens=100,
        arrival_time=0.0,
        arrival_seq=0,
        eos_token_ids=frozenset(eos),
        needs_logprobs=needs_logprobs or params.get("logprobs") is not None,
    )
    for t in output:
        r.append_output_token(t)
    if r.params.seed is not None:
        r.generator = Sampler.make_request_generator(r.params.seed)
    return r


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


# --------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(8)
    requests = [req(f"r{i}", temperature=0.0) for i in range(8)]
    out = Sampler(seed=1)(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = random_logits(16, seed=3)
    requests = [req(f"r{i}", temperature=temperature, top_k=1) for i in range(16)]
    for seed in range(3):
        assert Sampler(seed=seed)(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_are_unaffected_by_random_rows_in_the_batch():
    logits = random_logits(6, seed=4)
    requests = [req(f"r{i}", temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler(seed=0)(logits, requests)
    for i in (1, 3, 5):
        assert out.token_ids[i] == int(logits[i].argmax())


# --------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------


def _seeded_run(batch_builder, steps: int = 12) -> list[int]:
    """Sample `steps` times for a seeded request placed in a batch; return its tokens."""
    target = req("target", temperature=1.0, seed=1234)
    tokens = []
    for step in range(steps):
        batch, logits = batch_builder(target, step)
        out = Sampler(seed=step * 31 + 7)(logits, batch)
        tokens.append(out.token_ids[batch.index(target)])
        target.append_output_token(tokens[-1])
    return tokens


def _flat_logits(step: int) -> torch.Tensor:
    # Nearly uniform over 50 tokens: the draw decides everything.
    return torch.randn(50, generator=torch.Generator().manual_seed(1000 + step)) * 0.2


def test_seeded_sampling_is_reproducible_regardless_of_batch():
    def alone(target, step):
        return [target], _flat_logits(step).unsqueeze(0)

    def crowded(target, step):
        others = [req("u1", temperature=1.0), req("s2", temperature=0.7, seed=99), req("g", temperature=0.0),
                  req("u3", temperature=1.5, top_p=0.9)]
        batch = others[:2] + [target] + others[2:]
        logits = torch.stack([torch.randn(50) for _ in others[:2]] + [_flat_logits(step)] + [torch.randn(50) for _ in others[2:]])
        return batch, logits

    def reversed_batch(target, step):
        batch, logits = crowded(target, step)
        return batch[::-1], logits.flip(0)

    reference = _seeded_run(alone)
    assert _seeded_run(crowded) == reference
    assert _seeded_run(reversed_batch) == reference
    assert len(set(reference)) > 3, "near-uniform logits should give varied tokens"


def test_different_seeds_differ_and_unseeded_rows_use_the_engine_generator():
    def tokens_for(seed):
        r = req("x", temperature=1.0, seed=seed)
        out = []
        for step in range(10):
            tok = Sampler()(_flat_logits(step).unsqueeze(0), [r]).token_ids[0]
            r.append_output_token(tok)
            out.append(tok)
        return out

    assert tokens_for(1) != tokens_for(2)
    logits = _flat_logits(0).expand(64, -1).contiguous()
    rows = [req(f"u{i}", temperature=1.0) for i in range(64)]
    a = Sampler(seed=5)(logits, rows).token_ids
    assert a == Sampler(seed=5)(logits, rows).token_ids, "the engine seed makes unseeded sampling reproducible"
    assert len(set(a)) > 10, "each unseeded row draws its own noise"


# --------------------------------------------------------------------------------------
# The distribution and its masks (statistical, on a small vocabulary)
# --------------------------------------------------------------------------------------

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS = PROBS.log()
DRAWS = 6000


def draw(**params) -> torch.Tensor:
    """Token frequencies over DRAWS rows of the same logits, one unseeded request per row."""
    logits = LOGITS.expand(DRAWS, -1).contiguous()
    shared = SamplingParams(**params)
    requests = [Request(f"r{i}", [5], shared, 10, 0.0, i) for i in range(DRAWS)]
    tokens = torch.tensor(Sampler(seed=42)(logits, requests).token_ids)
    return torch.bincount(tokens, minlength=len(PROBS)).float() / DRAWS


def assert_frequencies(freq: torch.Tensor, expected: torch.Tensor) -> None:
    expected = expected / expected.sum()
    for token, (f, p) in enumerate(zip(freq.tolist(), expected.tolist())):
        if p == 0:
            assert f == 0, f"token {token} is masked but was drawn ({f:.4f})"
        else:
            sigma = math.sqrt(p * (1 - p) / DRAWS)
            assert abs(f - p) < 5 * sigma + 1e-3, f"token {token}: frequency {f:.4f}, expected {p:.4f}"


def test_plain_sampling_follows_the_softmax():
    assert_frequencies(draw(temperature=1.0), PROBS)
    # top_k -1 / 0, top_p 1 and min_p 0 all mean "no mask".
    assert_frequencies(draw(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0), PROBS)


def test_temperature_sharpens_and_flattens():
    for t in (0.5, 2.0):
        assert_frequencies(draw(temperature=t), (LOGITS / t).softmax(-1))


def test_top_k_keeps_only_the_k_most_likely():
    assert_frequencies(draw(temperature=1.0, top_k=3), torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.40 + 0.25 = 0.65 >= 0.6: two tokens.
    assert_frequencies(draw(temperature=1.0, top_p=0.6), torch.tensor([0.40, 0.25, 0, 0, 0, 0]))
    # 0.40 + 0.25 + 0.15 = 0.80 >= 0.7 (0.65 is not enough): three tokens.
    assert_frequencies(draw(temperature=1.0, top_p=0.7), torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]))
    # A tiny top_p still keeps the most likely token.
    assert_frequencies(draw(temperature=1.0, top_p=0.01), torch.tensor([1.0, 0, 0, 0, 0, 0]))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # 0.3 * 0.40 = 0.12: tokens with p >= 0.12 stay.
    assert_frequencies(draw(temperature=1.0, min_p=0.3), torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]))


def test_top_k_and_top_p_combined():
    # top_k=4 renormalises to 0.4/0.9, 0.25/0.9, 0.15/0.9, 0.1/0.9; top_p=0.5 then keeps 0.444 + 0.278.
    assert_frequencies(draw(temperature=1.0, top_k=4, top_p=0.5), torch.tensor([0.40, 0.25, 0, 0, 0, 0]))


def test_masks_apply_per_row():
    logits = LOGITS.expand(4000, -1).contiguous()
    requests = [req(f"r{i}", temperature=1.0, top_k=2) if i % 2 else req(f"r{i}", temperature=1.0) for i in range(4000)]
    tokens = torch.tensor(Sampler(seed=3)(logits, requests).token_ids)
    assert set(tokens[1::2].tolist()) <= {0, 1}
    assert len(set(tokens[0::2].tolist())) == 6, "the unrestricted rows must still reach every token"



def test_top_k_selects_only_as_wide_as_the_rows_that_ask(monkeypatch):
    """Rows without top-k beside rows with one must not turn the selection into a sort of
    the whole vocabulary (k = vocab for every row, ~57 ms for 32 x 49k on two cores)."""
    widths = []
    topk = torch.Tensor.topk

    def spy(self, k, *args, **kwargs):
        widths.append((self.shape[0], k))
        return topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    logits = random_logits(6, vocab=1000, seed=4)
    requests = [req(f"r{i}", temperature=1.0, seed=i, top_k=(0, 7, 0, 3, -1, 1000)[i]) for i in range(6)]
    mixed = Sampler()(logits, requests).token_ids
    assert widths == [(2, 7)], "one selection over the two rows with 0 < k < vocab, 7 wide"
    for i, r in enumerate(requests):  # each row as it would be alone
        alone = req(f"r{i}", temperature=1.0, seed=i, top_k=r.params.top_k)
        assert Sampler()(logits[i:i + 1], [alone]).token_ids == [mixed[i]]


# --------------------------------------------------------------------------------------
# Inverse-CDF sampling: the draw, and the uniform's extremes
# --------------------------------------------------------------------------------------

def test_a_scan_that_is_not_monotone_never_yields_a_token_without_mass(monkeypatch):
    """CUDA sums a single row as a tree: a token of probability zero can get a running sum a
    rounding step above its predecessor's, and the search can stop on it. The token kept is
    then the last one before it with mass."""
    import backend.sampler as sampler

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.25, 0.0]])

    def tree_rounded(x, out):
        sums = torch.cumsum(x, dim=-1, out=out)
        sums[0, 3] = sums[0, 2] + 1e-7   # a masked token a rounding step above the one before
        return sums

    monkeypatch.setattr(sampler, "cumsum_rows", tree_rounded)
    target = torch.tensor([0.25 / 1.0 + 0.5e-7])   # between the two sums at tokens 2 and 3
    assert sampler.sample_from_probs(probs, target).tolist() == [3]   # left to right, trusted: stops on it
    monkeypatch.setattr(sampler, "_scan_is_sequential", lambda probs: False)
    assert sampler.sample_from_probs(probs, target).tolist() == [1]
    index = torch.tensor([[0], [1], [2], [3], [5], [7]])
    moved = sampler.last_token_with_mass(probs.expand(6, -1), index).squeeze(1).tolist()
    assert moved == [0, 1, 1, 1, 4, 6]   # a leading zero (never chosen) stays in the row


# The largest float32 below 1: the largest value torch.rand returns.
BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))


def test_one_uniform_per_row_per_step_from_the_rows_own_generator():
    """A seeded row takes one float32 uniform from its own generator per step; the unseeded
    rows take theirs from the engine's generator, in one draw, in row order."""
    logits = random_logits(5, seed=8)
    rows = [req("u0", temperature=1.0), req("s1", temperature=1.0, seed=11), req("u2", temperature=1.0),
            req("s3", temperature=1.0, seed=12), req("u4", temperature=1.0)]
    sampler = Sampler(seed=3)
    engine_generator = torch.Generator().manual_seed(3)
    own = {1: torch.Generator().manual_seed(11), 3: torch.Generator().manual_seed(12)}
    probs = logits.softmax(dim=-1)
    for _ in range(4):
        u = torch.empty(5)
        u[[0, 2, 4]] = torch.rand(3, generator=engine_generator)
        for row, generator in own.items():
            u[row] = torch.rand(1, generator=generator)[0]
        assert sampler(logits, rows).token_ids == sample_from_probs(probs, u).tolist()


def test_inverse_cdf_returns_a_token_with_probability_at_the_uniforms_extremes():
    probs = torch.tensor([
        [0.0, 0.0, 0.3, 0.0, 0.5, 0.2, 0.0, 0.0],  # normalised; zeros at both ends and between
        [0.0, 0.4, 0.0, 0.35, 0.0, 0.0, 0.0, 0.0],  # not renormalised (as after min-p): total 0.75
        # For a normal float32 total, u * total < total for every u < 1; a subnormal total
        # is where the product rounds up to the total and the search runs past the row.
        [0.0, 2.0**-140, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    total = probs[2].sum()
    assert torch.tensor(BELOW_ONE) * total == total, "float32 rounding puts the target at the total"
    # u = 0 skips the leading zeros (the first entry strictly above 0); u just below 1 lands on
    # the last token with probability, not on the masked end of the vocabulary.
    assert sample_from_probs(probs, torch.zeros(3)).tolist() == [2, 1, 1]
    assert sample_from_probs(probs, torch.full((3,), BELOW_ONE)).tolist() == [5, 3, 1]
    # Between the extremes: each token owns its share of [0, total).
    u = torch.tensor([0.29, 0.31, 0.79, 0.81, 0.99])
    assert sample_from_probs(probs[0].expand(5, -1), u).tolist() == [2, 4, 4, 5, 5]


def test_the_reused_buffers_carry_nothing_between_calls():
    """The random path reuses its [rows, vocab] buffers: a call after a larger or a smaller
    batch, with other masks, samples what a fresh Sampler does, and the caller's logits stay."""
    def seeded(n: int, **params) -> list[Request]:
        return [req(f"s{i}", seed=i, **params) for i in range(n)]

    logits = random_logits(8, seed=12)
    before = logits.clone()
    used = Sampler()
    for n, params in ((8, dict(temperature=1.0)), (3, dict(temperature=0.7, top_k=5)),
                      (6, dict(temperature=1.3, min_p=0.1)), (8, dict(temperature=1.0, top_p=0.8))):
        assert used(logits[:n], seeded(n, **params)).token_ids == Sampler()(logits[:n], seeded(n, **params)).token_ids
        assert torch.equal(logits, before)


def test_bfloat16_logits_sample_what_their_float32_copy_does():
    """Logits of another dtype are widened into a reused float32 buffer (exact for bf16):
    tokens and logprobs are those of the float32 logits, call after call, and the caller's
    bf16 tensor stays as it was."""
    logits = random_logits(6, seed=21).bfloat16()
    before = logits.clone()
    used = Sampler()
    for n, params in ((6, dict(temperature=1.0)), (4, dict(temperature=0.6)), (6, dict(temperature=0.0))):
        def requests() -> list[Request]:  # each call its own generators, seeded alike
            return [req(f"s{i}", seed=i, needs_logprobs=True, **params) for i in range(n)]

        got, want = used(logits[:n], requests()), Sampler()(logits[:n].float(), requests())
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
        assert torch.equal(logits, before)


# Each case's mask keeps tokens from the middle of the vocabulary only: both ends are masked.
EDGE_LOGITS = torch.tensor([-1.0, 0.5, 2.0, 1.5, 1.0, 1.99, 0.0, -2.0])
EDGE_CASES = {  # name: (sampling params, the tokens left with probability)
    "top_k": (dict(temperature=1.0, top_k=3), {2, 3, 5}),
    # at t=0.7: p(2) = 0.344, p(5) = 0.339 reach 0.5 together
    "top_p": (dict(temperature=0.7, top_p=0.5), {2, 5}),
    # p >= 0.5 * p(2): logits within log 2 of the best
    "min_p": (dict(temperature=1.0, min_p=0.5), {2, 3, 5}),
    # EOS (0 here) and the stop tokens 6 and 7 are masked before min_tokens
    "min_tokens": (dict(temperature=1.0, min_tokens=5, stop_token_ids=[6, 7]), {1, 2, 3, 4, 5}),
    # no mask, but at t=0.004 exp((1.5 - 2) / 0.004) = exp(-125) underflows to exactly 0 in float32
    "underflow": (dict(temperature=0.004), {2, 5}),
}


def edge_requests(copies: int = 1) -> list[Request]:
    return [req(f"{name}{i}", eos=(0,), **params) for name, (params, _) in EDGE_CASES.items() for i in range(copies)]


def test_the_edge_cases_masks_keep_what_the_table_says():
    copies = 2000
    tokens = Sampler(seed=0)(EDGE_LOGITS.expand(len(EDGE_CASES) * copies, -1).contiguous(), edge_requests(copies)).token_ids
    for i, (name, (_, kept)) in enumerate(EDGE_CASES.items()):
        assert set(tokens[i * copies : (i + 1) * copies]) == kept, name
    probs = (EDGE_LOGITS / 0.004).softmax(dim=-1)
    assert (probs > 0).nonzero().flatten().tolist() == [2, 5], "the underflow case underflows"


@pytest.mark.parametrize("uniform", [0.0, BELOW_ONE], ids=["zero", "below_one"])
def test_masked_or_underflowed_tokens_are_never_drawn_at_the_uniforms_extremes(monkeypatch, uniform):
    """u = 0 must give the first token with probability, u just below 1 the last, whatever
    lies masked before or after them in the vocabulary."""
    sampler = Sampler()
    monkeypatch.setattr(sampler, "uniforms", lambda requests: torch.full((len(requests),), uniform))
    got = sampler(EDGE_LOGITS.expand(len(EDGE_CASES), -1).contiguous(), edge_requests()).token_ids
    assert got == [min(kept) if uniform == 0.0 else max(kept) for _, kept in EDGE_CASES.values()]


# --------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """vLLM's definitions, one token at a time."""
    out = logits.clone()
    p = r.params
    seen = set(r.token_ids)  # repetition: prompt and output
    for t in seen:
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_token_ids):  # presence / frequency: output only
        count = r.output_token_ids.count(t)
        out[t] -= p.presence_penalty + p.frequency_penalty * count
    return out


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=1.0),
        dict(presence_penalty=-0.5),
        dict(frequency_penalty=0.4),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    ],
)
def test_penalties_change_logits_as_defined(params):
    vocab = 12
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.5, 0.0, 4.0, -0.5, 3.0, -2.0, 1.0, 0.25])
    a = req("a", prompt=(0, 1, 1), output=(2, 3, 3, 3), **params)
    b = req("b", prompt=(9,), output=(0, 0, 8), **params)
    neutral = req("n", prompt=(4,), output=(4, 5))
    batch = [a, b, neutral]
    got = Sampler()._apply_penalties(logits.expand(3, vocab).clone(), batch)
    for row, r in enumerate(batch):
        assert torch.allclose(got[row], reference_penalties(logits, r), atol=1e-6), (r.request_id, got[row])


def dense_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The penalties over whole rows, in float32 as the sampler computes them for a seen token."""
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for row, r in enumerate(requests):
        seen[row, list(r.token_ids)] = True
        for t in r.output_token_ids:
            counts[row, t] += 1
    rep = torch.tensor([r.params.repetition_penalty for r in requests]).unsqueeze(1)
    presence = torch.tensor([r.params.presence_penalty for r in requests]).unsqueeze(1)
    frequency = torch.tensor([r.params.frequency_penalty for r in requests]).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    penalised = penalised - presence * (counts > 0) - frequency * counts
    return torch.where(seen, penalised, logits)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.sampled_from([3, 50, 2000]), rows=st.integers(1, 6))
def test_penalties_touch_only_seen_tokens_with_whole_row_arithmetic(data, vocab, rows):
    # The sampler computes the seen tokens alone; a whole-row computation gives the same bits.
    tokens = st.integers(0, vocab - 1)
    batch = [req(f"r{i}", prompt=data.draw(st.lists(tokens, min_size=1, max_size=40)),
                 output=data.draw(st.lists(tokens, max_size=30)),
                 repetition_penalty=data.draw(st.sampled_from([1.0, 0.7, 1.1, 2.0])),
                 presence_penalty=data.draw(st.sampled_from([0.0, 0.5, -1.5])),
                 frequency_penalty=data.draw(st.sampled_from([0.0, 0.3, -0.8])))
             for i in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999)))) * 3
    before = logits.clone()
    sampler = Sampler()
    sampler._apply_penalties(torch.randn(rows + 3, vocab), [req("w", prompt=(0,), output=(0, 1))] * (rows + 3))  # a used workspace
    got = sampler._apply_penalties(logits, batch)
    assert torch.equal(got, dense_penalties(logits, batch))
    assert torch.equal(logits, before)  # the caller's tensor is never written


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    assert Sampler()(logits, [req(temperature=0.0, prompt=(0,), output=(1,))]).token_ids == [1]
    assert Sampler()(logits, [req(temperature=0.0, prompt=(0,), output=(1,), repetition_penalty=1.2)]).token_ids == [2]
    assert Sampler()(logits, [req(temperature=0.0, prompt=(0,), output=(1,), presence_penalty=0.2)]).token_ids == [2]
    assert Sampler()(logits, [req(temperature=0.0, prompt=(0,), output=(1, 1), frequency_penalty=0.06)]).token_ids == [2]
    # Prompt tokens count for the repetition penalty only.
    assert Sampler()(logits, [req(temperature=0.0, prompt=(1,), presence_penalty=2.0)]).token_ids == [1]
    assert Sampler()(logits, [req(temperature=0.0, prompt=(1,), repetition_penalty=1.2)]).token_ids == [2]


# --------------------------------------------------------------------------------------
# min_tokens
# --------------------------------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros((1, 10))
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 4] = 8.0
    early = req(temperature=0.0, output=(5,), min_tokens=3, stop_token_ids=[7])
    assert Sampler()(logits, [early]).token_ids == [4], "EOS and stop tokens are masked before min_tokens"
    random_early = [req(f"s{i}", temperature=1.0, output=(5,), min_tokens=3, stop_token_ids=[7]) for i in range(500)]
    drawn = set(Sampler(seed=0)(logits.expand(500, -1).contiguous(), random_early).token_ids)
    assert EOS not in drawn and 7 not in drawn
    reached = req(temperature=0.0, output=(5, 5, 5), min_tokens=3)
    assert Sampler()(logits, [reached]).token_ids == [EOS]
    ignore = req(temperature=0.0, output=(5,), min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    # ignore_eos: EOS is not a stop anyway, so it is not masked; stop tokens still are.
    assert Sampler()(logits, [ignore]).token_ids == [EOS]
    logits[0, EOS] = -1.0
    assert Sampler()(logits, [ignore]).token_ids == [4]


def test_bad_words_block_the_last_token_once_the_rest_ends_the_output():
    r = req(temperature=0.0, output=(5, 8))
    r.bad_words_token_ids = ((4,), (8, 6), (7, 8, 9), (1, 2, 3, 9))
    # (4,) always; (8, 6) because the output ends with 8; (7, 8, 9) does not match (5, 8);
    # (1, 2, 3, 9) is longer than the output plus one.
    assert sorted(banned_token_ids(r)) == [4, 6]
    logits = torch.zeros((1, 10))
    logits[0, 4], logits[0, 6], logits[0, 9] = 9.0, 8.0, 7.0
    assert Sampler()(logits, [r]).token_ids == [9]
    fresh = req(temperature=0.0)
    fresh.bad_words_token_ids = ((8, 6),)
    assert banned_token_ids(fresh) == [] and Sampler()(logits, [fresh]).token_ids == [4]
    drawn = set(Sampler(seed=0)(logits.expand(300, -1).contiguous(), [r] * 300).token_ids)
    assert 4 not in drawn and 6 not in drawn


def test_min_tokens_masks_every_eos_id():
    logits = torch.zeros((1, 10))
    logits[0, 2] = 5.0
    logits[0, 3] = 4.0
    r = req(temperature=0.0, eos=(2, 3), min_tokens=1)
    assert Sampler()(logits, [r]).token_ids not in ([2], [3])


# --------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    """torch.log_softmax's very bits, also from a sampler whose logprob buffer a bigger
    batch of another vocabulary left behind."""
    logits = random_logits(4, vocab=30, seed=9)
    requests = [
        req("a", temperature=0.0, logprobs=3),
        req("b", temperature=0.7, top_k=5, repetition_penalty=1.5, output=(1, 2), logprobs=5),
        req("c", temperature=1.0),  # did not ask
        req("d", temperature=1.0, needs_logprobs=True),  # cumulative logprob only
    ]
    used = Sampler(seed=2)
    used(random_logits(9, vocab=41, seed=1), [req(f"x{i}", temperature=1.0, needs_logprobs=True) for i in range(9)])
    raw = torch.log_softmax(logits, dim=-1)
    for sampler in (Sampler(seed=2), used):
        out = sampler(logits, requests)
        for row in (0, 1, 3):
            assert out.logprobs[row] == float(raw[row, out.token_ids[row]])
        assert out.logprobs[2] is None and out.top_logprobs[2] is None
        assert out.top_logprobs[3] is None
        for row, n in ((0, 3), (1, 5)):
            values, ids = raw[row].topk(n)
            assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
            assert [v for _, v in out.top_logprobs[row]] == values.tolist()
        assert out.token_ids[0] == out.top_logprobs[0][0][0], "greedy picks the top logprob"


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = random_logits(1, seed=11)
    out = Sampler()(logits, [req(temperature=0.0, logprobs=0)])
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0].max()), abs=1e-6)
    assert not out.top_logprobs[0]


def test_the_callers_logits_are_never_modified():
    logits = random_logits(3, vocab=10, seed=5)
    logits[:, EOS] = 50.0
    before = logits.clone()
    requests = [req("a", temperature=0.0, min_tokens=2), req("b", temperature=0.8, min_tokens=2, top_k=3, top_p=0.5),
                req("c", temperature=1.0, repetition_penalty=1.4, output=(1,))]
    Sampler()(logits, requests)
    assert torch.equal(logits, before)


def test_argmax_rows_matches_torch_on_ties_nan_and_strided_rows():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-3, 3, (64, 1000), generator=generator).float()  # many ties per row
    values[5, 17] = float("nan")
    values[6, :] = float("-inf")
    for rows in (values, values[::3], values[:, 100:]):
        assert argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist()


def test_a_rows_logprobs_and_token_are_the_same_bits_in_any_batch():
    """Batch invariance: log-softmax and top-k run per row, so a row's results alone equal
    its results among 32 others; a seeded row samples the same token."""
    logits = 4 * random_logits(33, vocab=49152, seed=9)
    requests = [req(f"r{i}", logprobs=3, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(33)]
    batch = Sampler()(logits, requests)
    for row in (0, 16, 31, 32):
        single = [req(f"r{row}", logprobs=3, temperature=0.0 if row % 2 else 0.8, seed=row)]
        alone = Sampler()(logits[row:row + 1].clone(), single)
        assert alone.token_ids[0] == batch.token_ids[row]
        assert alone.logprobs[0] == batch.logprobs[row] and alone.top_logprobs[0] == batch.top_logprobs[row]
