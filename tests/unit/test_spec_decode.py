"""The pieces of speculative decoding that need no model: the config's checks, the n-gram
proposer, the rejection rule's distribution, and the KV manager's tail truncation."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backend.config import EngineConfig
from backend.kv_cache import KVCacheManager
from backend.request import Request, RequestError, SamplingParams
from backend.sampler import Sampler
from backend.spec_decode import SpeculativeConfig
from backend.spec_decode.adaptive import CostCurve, DraftBudget
from backend.spec_decode.ngram import propose_ngram
from backend.spec_decode.suffix import SuffixProposer
from backend.spec_decode.verify import verify
from backend.validation import parse_sampling_params


def test_off_by_default_and_parsed_from_json_text(tmp_path):
    assert EngineConfig(model_path="m").speculative_config is None
    assert SpeculativeConfig.parse(None) is None
    config = EngineConfig.from_parameters(
        {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'}, str(tmp_path))
    assert SpeculativeConfig.parse(config.speculative_config) == SpeculativeConfig(
        "ngram", 3, prompt_lookup_min=1, prompt_lookup_max=5)


@pytest.mark.parametrize("value, names", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "['lookahead']"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer in [1, 8]"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens=9 must be an integer in [1, 8]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 17}, "prompt_lookup_max=17"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_configs_refused_naming_the_key(value, names):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineConfig(model_path="m", speculative_config=value)
    assert names in str(info.value)


def test_bad_json_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig.from_parameters({"speculative_config": "{method: ngram}"}, str(tmp_path))


def test_request_switch_is_a_validated_sampling_parameter():
    assert parse_sampling_params({"speculative": "false"}).speculative is False
    assert parse_sampling_params({}).speculative is True
    with pytest.raises(RequestError, match="speculative") as info:
        parse_sampling_params({"speculative": "sometimes"})
    assert info.value.code == RequestError.INVALID_ARG


def test_ngram_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 9]  # the longest n-gram first: "1 2 3"
    assert propose_ngram(tokens, 3, 1, 2) == [7, 8, 1]  # "2 3": its latest occurrence
    assert propose_ngram([1, 2, 3, 4, 1, 2, 5, 1, 2], 3, 2, 2) == [5, 1, 2]
    assert propose_ngram([1, 2, 3, 1, 2, 3], 2, 3, 3) == [1, 2]
    assert propose_ngram([5, 6, 7, 8], 4, 1, 3) == []  # nothing recurs
    assert propose_ngram([4, 4], 3, 1, 1) == [4]  # never past the end
    assert propose_ngram([1, 2, 1], 0, 1, 2) == []


def _request(params: SamplingParams, drafts: list[int], seed: int | None = None) -> Request:
    request = Request("r", [0], params, max_tokens=100, arrival_time=0.0, arrival_seq=0)
    request.spec_token_ids = drafts
    if seed is not None:
        request.generator = Sampler.make_request_generator(seed)
    return request


def test_greedy_accepts_the_longest_agreeing_prefix_then_the_targets_token():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 5]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0.0)
    (all_in,) = verify(Sampler(0), logits, [_request(params, [2, 3, 1])], [4])
    assert all_in.token_ids == [2, 3, 1, 5] and all_in.num_accepted == 3
    (broken,) = verify(Sampler(0), logits, [_request(params, [2, 4, 1])], [4])
    assert broken.token_ids == [2, 3] and broken.num_accepted == 1


def test_rejection_rule_keeps_the_target_distribution():
    """A one-hot draft accepted with probability p(t), else a draw from p without t: the
    first emitted token is distributed as p, whichever token was drafted."""
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = torch.log(p).repeat(2, 1)
    sampler = Sampler(7)
    draws = 6000
    for draft in (1, 2):
        counts = torch.zeros(4)
        accepted = 0
        for _ in range(draws):
            (result,) = verify(sampler, logits, [_request(SamplingParams(temperature=1.0), [draft])], [2])
            counts[result.token_ids[0]] += 1
            accepted += result.num_accepted
        assert torch.allclose(counts / draws, p, atol=0.025), (draft, counts / draws)
        assert abs(accepted / draws - float(p[draft])) < 0.025


def test_seeded_verification_repeats():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, seed=5)
    runs = [verify(Sampler(i), logits, [_request(params, [7, 8], seed=5)], [3])[0].token_ids for i in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_truncate_frees_the_tail_and_keeps_the_table_in_step():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = _request(SamplingParams(), [])
    request.token_ids = list(range(6))
    assert kv.allocate(request, 6 + 5)  # 6 tokens and 5 drafts: 3 blocks
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 6
    kv.truncate(request, 7)  # one draft accepted: 7 tokens, 2 blocks
    assert len(request.block_ids) == 2 and kv.pool.num_free == 6
    kv.check_invariants()
    kv.truncate(request, 7)  # nothing more to free
    assert len(request.block_ids) == 2
    kv.free(request)
    kv.check_invariants()
    assert kv.pool.num_free == 8


SUFFIX = {"method": "suffix"}


def test_suffix_config_takes_vllms_keys_and_defaults():
    assert SpeculativeConfig.parse(SUFFIX) == SpeculativeConfig(
        "suffix", 8, suffix_decoding_max_tree_depth=24, suffix_decoding_max_cached_requests=10_000,
        suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1)
    parsed = SpeculativeConfig.parse({**SUFFIX, "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 32,
                                      "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2,
                                      "suffix_decoding_min_token_prob": 0.5})
    assert (parsed.num_speculative_tokens, parsed.suffix_decoding_max_tree_depth) == (5, 32)
    assert (parsed.suffix_decoding_max_cached_requests, parsed.suffix_decoding_max_spec_factor) == (0, 2.0)
    assert parsed.suffix_decoding_min_token_prob == 0.5


@pytest.mark.parametrize("value, names", [
    ({**SUFFIX, "prompt_lookup_max": 3}, "['prompt_lookup_max']"),
    ({**SUFFIX, "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth=0 must be an integer in [1, 64]"),
    ({**SUFFIX, "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests=-1"),
    ({**SUFFIX, "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob=1.5 must be a number in [0.0, 1.0]"),
    ({**SUFFIX, "suffix_decoding_max_spec_factor": "1"}, "suffix_decoding_max_spec_factor='1'"),
    ({**SUFFIX, "adaptive": "yes"}, "adaptive='yes' must be true or false"),
    ({**SUFFIX, "disable_by_batch_size": 0}, "disable_by_batch_size=0 must be an integer"),
])
def test_bad_suffix_configs_refused_naming_the_key(value, names):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineConfig(model_path="m", speculative_config=value)
    assert names in str(info.value)


def _with_tokens(tokens: list[int], prompt_len: int | None = None, tenant: str = "default", lora: str | None = None) -> Request:
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    request = Request("r", tokens[:prompt_len], SamplingParams(max_tokens=64, tenant=tenant), max_tokens=64,
                      arrival_time=0.0, arrival_seq=0)
    for token in tokens[prompt_len:]:
        request.append_output_token(token)
    request.lora_name = lora
    return request


def _proposer(**overrides) -> SuffixProposer:
    options = dict(max_tree_depth=24, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    return SuffixProposer(**{**options, **overrides})


def test_suffix_follows_the_longest_match_in_the_requests_own_tokens():
    # "5 6 7" occurs once before, followed by 8 9; the 1-token match "7" alone also follows 7 -> 3.
    proposer = _proposer()
    assert proposer.propose_one(_with_tokens([7, 3, 5, 6, 7, 8, 9, 1, 5, 6, 7]), 4) == [8, 9, 1]
    # max_spec_factor caps the drafts at the match's length times the factor.
    assert _proposer(max_spec_factor=0.5).propose_one(_with_tokens([7, 3, 5, 6, 7, 8, 9, 1, 5, 6, 7]), 4) == [8]
    assert proposer.propose_one(_with_tokens([1, 2, 3, 4]), 4) == []


def test_suffix_votes_by_frequency_and_stops_below_min_token_prob():
    proposer = _proposer(min_token_prob=0.5)
    for output in ([1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4, 10], [9, 2, 3, 5]):
        proposer.request_finished(_with_tokens([100] + output, prompt_len=1))
    # After "2 3": 4 three times in four, then 10 in two of those three: 3/4 * 2/3 = 0.5, then
    # each occurrence ends (a vote to stop).
    assert proposer.propose_one(_with_tokens([50, 2, 3]), 8) == [4, 10]
    assert _proposer(min_token_prob=0.6).propose_one(_with_tokens([50, 2, 3]), 8) == []
    strict = _proposer(min_token_prob=0.6)
    for output in ([1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4, 10], [9, 2, 3, 5]):
        strict.request_finished(_with_tokens([100] + output, prompt_len=1))
    assert strict.propose_one(_with_tokens([50, 2, 3]), 8) == [4]


def test_suffix_cache_is_scoped_by_tenant_and_adapter_and_evicts_oldest_first():
    proposer = _proposer(max_cached_requests=2)
    proposer.request_finished(_with_tokens([0, 1, 2, 3, 4, 5], prompt_len=1, tenant="a"))
    assert proposer.propose_one(_with_tokens([9, 1, 2], tenant="a"), 3) == [3, 4]
    assert proposer.propose_one(_with_tokens([9, 1, 2], tenant="b"), 3) == []
    assert proposer.propose_one(_with_tokens([9, 1, 2], tenant="a", lora="sql"), 3) == []
    proposer.request_finished(_with_tokens([0, 6, 7, 8], prompt_len=1, tenant="b"))
    proposer.request_finished(_with_tokens([0, 6, 7, 9], prompt_len=1, tenant="b"))
    assert proposer.num_cached_requests == 2
    assert proposer.propose_one(_with_tokens([9, 1, 2], tenant="a"), 3) == []  # evicted
    assert proposer.propose_one(_with_tokens([9, 6, 7], tenant="b"), 3) == [8]  # the lowest id of equals
    assert _proposer(max_cached_requests=0).request_finished(_with_tokens([0, 1, 2, 3], prompt_len=1)) is None


def _reference_drafts(outputs: list[list[int]], context: list[int], k: int, depth: int, factor: float,
                      min_prob: float) -> list[int]:
    """The suffix-tree walk spelled out on lists: occurrences of the longest matching suffix in
    the context itself (ending before its last token; any length) and in the cached outputs
    (two tokens or more), each source's greedy walk, the better score wins."""
    def occurrences(texts: list[list[int]], m: int, own: bool) -> list[tuple[int, int]]:
        suffix = context[len(context) - m:]
        return [(t, e) for t, text in enumerate(texts) for e in range(m - 1, len(text) - (1 if own else 0))
                if text[e - m + 1: e + 1] == suffix]

    def walk(texts: list[list[int]], own: bool, shortest: int) -> tuple[list[int], float]:
        for m in range(min(depth, len(context)), shortest - 1, -1):
            found = occurrences(texts, m, own)
            if found:
                break
        else:
            return [], 0.0
        drafts, probability, score = [], 1.0, 0.0
        limit = min(k, int(m * factor))
        while len(drafts) < limit and found:
            following = [texts[t][e + 1] for t, e in found if e + 1 < len(texts[t])]
            if not following:
                break
            counts = collections.Counter(following)
            token = min(counts, key=lambda tok: (-counts[tok], tok))
            probability *= counts[token] / len(found)
            if probability < min_prob:
                break
            drafts.append(token)
            score += probability
            found = [(t, e + 1) for t, e in found if e + 1 < len(texts[t]) and texts[t][e + 1] == token]
        return drafts, score

    own, own_score = walk([context], True, 1)
    cached, cached_score = walk(outputs, False, 2) if outputs else ([], 0.0)
    return cached if cached_score > own_score else own


@settings(max_examples=150, deadline=None)
@given(outputs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), max_size=12),
       context=st.lists(st.integers(0, 4), min_size=1, max_size=40),
       k=st.integers(1, 8), depth=st.integers(1, 10), keep=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 3.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_suffix_drafts_equal_the_suffix_tree_walk(outputs, context, k, depth, keep, factor, min_prob):
    proposer = _proposer(max_tree_depth=depth, max_cached_requests=keep, max_spec_factor=factor,
                         min_token_prob=min_prob)
    for output in outputs:
        proposer.request_finished(_with_tokens([99] + output, prompt_len=1))
    live = outputs[len(outputs) - keep:] if len(outputs) > keep else outputs
    assert proposer.propose_one(_with_tokens(context), k) == _reference_drafts(live, context, k, depth, factor, min_prob)


def test_suffix_cache_memory_follows_what_it_keeps():
    proposer = _proposer(max_cached_requests=4)
    rng = random.Random(7)
    for _ in range(2000):
        proposer.request_finished(_with_tokens([0] + [rng.randrange(50_000) for _ in range(40)], prompt_len=1))
    (cache,) = proposer._scopes.values()
    assert len(cache) == 4
    assert cache._tokens.size <= 4 * 2 * 41 * 2  # the live outputs, at most doubled twice
    assert sum(map(len, cache._bigram_ends.values())) <= 2 * 4 * 40  # no dead position kept long


def _budget(cost_per_token: float, fixed: float, acceptance: list[float]) -> DraftBudget:
    budget = DraftBudget(len(acceptance))
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
        budget.observe_step(tokens, fixed + cost_per_token * tokens)
    budget.acceptance = list(acceptance)
    return budget


def test_budget_keeps_every_draft_until_it_has_measured_a_step():
    assert DraftBudget(4).trim([4, 2, 0], 3, 3) == [4, 2, 0]


def test_budget_keeps_every_draft_while_a_step_costs_the_same_whatever_its_tokens():
    assert _budget(0.0, 0.05, [0.1] * 4).trim([4, 4, 3], 3, 3) == [4, 4, 3]


def test_budget_keeps_the_drafts_likely_to_pay_when_each_row_costs_its_share():
    # Compute-bound: a row costs as much as the fixed part of 30 rows. With 32 decodes, a
    # draft pays when its expected acceptance beats (outputs so far) * (its share of the step).
    budget = _budget(0.001, 0.030, [0.9, 0.5, 0.2, 0.1])
    kept = budget.trim([4, 4], 32, 32)
    assert kept == [1, 1]  # 0.9 pays; 0.45 does not
    assert _budget(0.001, 0.030, [0.01] * 4).trim([4, 4], 32, 32) == [0, 0]
    # Alone, a row adds 3% to the step: the drafts down to 0.09 expected tokens pay, the fourth
    # (0.9 * 0.5 * 0.2 * 0.1 = 0.009) does not.
    assert _budget(0.001, 0.030, [0.9, 0.5, 0.2, 0.1]).trim([4], 1, 1) == [3]


def test_budget_prefers_the_requests_with_the_likelier_drafts_and_keeps_prefixes():
    budget = _budget(0.0002, 0.030, [0.9, 0.8, 0.7, 0.6])
    kept = budget.trim([1, 4, 2], 32, 32)
    assert all(0 <= k <= n for k, n in zip(kept, [1, 4, 2]))
    assert sum(kept) and kept[1] >= kept[2]


def test_budget_learns_acceptance_per_position_and_cost_by_bucket():
    budget = DraftBudget(3)
    for _ in range(400):
        budget.observe_verification(3, 1)  # the first accepted, the second rejected, the third never reached
    assert budget.acceptance[0] > 0.99 and budget.acceptance[1] < 0.01 and budget.acceptance[2] == 0.5
    for _ in range(100):
        budget.observe_step(10, 0.2)
        budget.observe_step(40, 0.8)
    assert budget.step_seconds(5) == pytest.approx(0.2)
    assert budget.step_seconds(35) == pytest.approx(0.7)  # in a measured bucket: interpolated
    assert budget.step_seconds(70) == pytest.approx(1.4)  # past the largest: the last two's slope
    # 25 falls in a bucket never measured: priced by what lies below it (one point: flat).
    assert budget.step_seconds(25) == pytest.approx(0.2)
    budget.observe_step(20, 0.45)
    assert budget.step_seconds(25) == pytest.approx(0.45 + 0.35 * 5 / 20)


def test_budget_tries_the_rows_of_a_bucket_it_has_not_measured_at_the_slope_below_it():
    # One request on a bandwidth-bound model: a row adds 0.2 ms to a 15 ms step, and the only
    # larger steps measured are 40-token prefill chunks. Priced by the slope up to those, the
    # seventh and eighth drafts would seem to cost 1 ms each and never be tried.
    budget = DraftBudget(8)
    for _ in range(50):
        for tokens, seconds in ((1, 0.0150), (2, 0.0152), (5, 0.0158), (40, 0.050)):
            budget.observe_step(tokens, seconds)
    budget.acceptance = [0.8] * 8
    assert budget.trim([8], 1, 1) == [8]
    # Once steps of 8 to 15 tokens are measured dear, the budget trims by them.
    for _ in range(200):
        budget.observe_step(9, 0.030)
    assert budget.trim([8], 1, 1)[0] < 8


def _curve(cost_per_token: float, fixed: float) -> CostCurve:
    curve = CostCurve()
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128):
        curve.observe(tokens, fixed + cost_per_token * tokens)
    return curve


def test_budget_expects_the_accepted_tokens_of_a_draft_run_as_products_of_the_rates():
    budget = DraftBudget(3)
    budget.acceptance = [0.8, 0.5, 0.25]
    assert budget.expected_accepted(0) == 0.0
    assert budget.expected_accepted(3) == pytest.approx(0.8 + 0.4 + 0.1)


def test_draft_length_is_the_longest_until_both_costs_are_measured():
    assert DraftBudget(4).draft_length(8, 8, 8, 4, _curve(0.0, 0.01)) == 4
    assert _budget(0.0, 0.05, [0.9] * 4).draft_length(8, 8, 8, 4, CostCurve()) == 4


def test_draft_length_counts_the_draft_models_own_passes():
    # A bandwidth-bound target (every step 50 ms) and a draft at a tenth of it accepted 90%:
    # every further draft adds more than it costs.
    assert _budget(0.0, 0.050, [0.9] * 4).draft_length(1, 1, 1, 4, _curve(0.0, 0.005)) == 4
    # The same rows are free for the target, but a draft pass costs as much as its step:
    # one draft earns at most 0.9 tokens for two passes' time, so none pays.
    assert _budget(0.0, 0.050, [0.9] * 4).draft_length(1, 1, 1, 4, _curve(0.0, 0.050)) == 0
    # At 32 decodes on a compute-bound target, verification rows alone would keep the 0.9
    # drafts (see the trim test above), but a draft pass of 32 tokens at half the target's
    # per-token cost tips it: drafting does not pay.
    step = _budget(0.001, 0.030, [0.9, 0.5, 0.2, 0.1])
    assert step.trim([4] * 32, 32, 32)[0] >= 1
    assert step.draft_length(32, 32, 32, 4, _curve(0.0005, 0.015)) == 0
    # Alone on that target with a cheap draft, the first drafts pay and the fourth does not.
    assert 1 <= step.draft_length(1, 1, 1, 4, _curve(0.0001, 0.002)) < 4


@pytest.mark.parametrize("value, names", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model=None: draft_model needs the draft checkpoint's path"),
    ({"method": "draft_model", "model": "d"}, "num_speculative_tokens is required"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "quantization": "awq"},
     "quantization='awq', expected one of ['none', 'int8', 'int4']"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
     "['prompt_lookup_min']"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "activation_quantization": "fp8"},
     "activation_quantization='fp8', expected one of ['none', 'int8']"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "activation_quantization": "int8"},
     "activation_quantization='int8' needs the draft quantized"),
])
def test_bad_draft_model_configs_refused_naming_the_key(value, names):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineConfig(model_path="m", speculative_config=value)
    assert names in str(info.value)


def test_a_relative_draft_model_path_is_taken_from_the_model_folder(tmp_path):
    config = EngineConfig.from_parameters(
        {"speculative_config": '{"method": "draft_model", "model": "../draft", "num_speculative_tokens": 3}'},
        str(tmp_path / "1"))
    parsed = SpeculativeConfig.parse(config.speculative_config)
    assert parsed.model == str(tmp_path / "draft") and parsed.quantization == "none"


def test_a_bad_word_completed_by_the_drafts_before_a_row_is_banned_in_that_row():
    params = SamplingParams(temperature=0.0, max_tokens=10)
    request = _request(params, [5, 7])
    request.bad_words_token_ids = ((5, 7),)
    logits = torch.full((3, 10), -5.0)
    logits[0, 5] = 3.0
    logits[1, 7], logits[1, 2] = 3.0, 2.0  # 7 would finish the bad word 5 7: the row takes 2
    logits[2, 1] = 3.0
    (verified,) = verify(Sampler(), logits, [request], [3])
    assert verified.token_ids == [5, 2] and verified.num_accepted == 1
