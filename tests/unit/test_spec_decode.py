"""The pieces of speculative decoding that need no model: the config's checks, the n-gram
proposer, the rejection rule's distribution, and the KV manager's tail truncation."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.kv_cache import KVCacheManager
from backend.request import Request, RequestError, SamplingParams
from backend.sampler import Sampler
from backend.spec_decode import SpeculativeConfig
from backend.spec_decode.ngram import propose_ngram
from backend.spec_decode.verify import verify
from backend.validation import parse_sampling_params


def test_off_by_default_and_parsed_from_json_text(tmp_path):
    assert EngineConfig(model_path="m").speculative_config is None
    assert SpeculativeConfig.parse(None) is None
    config = EngineConfig.from_parameters(
        {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'}, str(tmp_path))
    assert SpeculativeConfig.parse(config.speculative_config) == SpeculativeConfig("ngram", 3, 1, 5)


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
