"""The proposers behind one interface, chosen by `speculative_config`'s method."""

from __future__ import annotations

from typing import Protocol

from backend.request import Request
from backend.spec_decode.adaptive import CostCurve
from backend.spec_decode.config import SpeculativeConfig
from backend.spec_decode.draft_model import DraftModelProposer
from backend.spec_decode.ngram import NgramProposer
from backend.spec_decode.suffix import SuffixProposer


class Proposer(Protocol):
    # The measured seconds of the proposer's own model passes by their tokens, for the draft
    # budget to weigh before drafting; None where no model runs (a scan of token ids, small
    # beside a step).
    pass_cost: CostCurve | None

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """For each request, up to its `k` draft tokens to follow its tokens."""

    def request_finished(self, request: Request) -> None:
        """The request ended (its final tokens are in it): forget it, or learn from it."""


def make_proposer(config: SpeculativeConfig, **draft_model_context) -> Proposer:
    """The config's proposer; `draft_model_context` is what DraftModelProposer needs of the
    served model (its vocabulary, dtype, device, KV pool shape)."""
    if config.method == "draft_model":
        return DraftModelProposer(config, **draft_model_context)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
