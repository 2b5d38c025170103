"""The proposer that `speculative_config`'s method names."""

from __future__ import annotations

from backend.spec_decode.base import Proposer
from backend.spec_decode.config import SpeculativeConfig
from backend.spec_decode.draft_model import DraftModelProposer
from backend.spec_decode.ngram import NgramProposer
from backend.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig, **draft_model_context) -> Proposer:
    """The config's proposer; `draft_model_context` is what DraftModelProposer needs of the
    served model (its vocabulary, dtype, device, max_model_len)."""
    if config.method == "draft_model":
        return DraftModelProposer(config, **draft_model_context)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
