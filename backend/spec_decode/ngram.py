"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min), from its
prompt and output alike. Costs no model: it pays where the output repeats its context
(rewriting, editing, quoting a given text or code)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from backend.spec_decode.base import Proposer

if TYPE_CHECKING:
    from backend.request import Request


def propose_ngram(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` draft tokens for what follows `token_ids`; [] when no n-gram recurs."""
    length = len(token_ids)
    if k <= 0 or length < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n:]
        # Windows that start at 0 .. length-n-1: each is followed by at least one token, and
        # none is the suffix itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [propose_ngram(r.token_ids, k, self.lookup_min, self.lookup_max) for r, k in zip(requests, ks)]

    def request_finished(self, request: Request) -> None:
        pass  # drafts come from the request's own tokens only
