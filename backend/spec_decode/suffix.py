"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; vLLM's `suffix` method): drafts from
the longest suffix of the request's context that occurred before, in its own prompt and output
or in the outputs of recent requests, following the most frequent continuation of every
occurrence, token by token, while the continuation's estimated probability stays above
`min_token_prob`.

A suffix tree answers "every occurrence of this suffix and what followed" from counts kept at
its nodes. Here the same answer comes from numpy over token arrays: a scan of the request's own
tokens, and a bigram index into the cached outputs. A Python tree of depth 24 over a 2,000-token
prompt would hold ~50,000 nodes (megabytes a request); the scan costs microseconds and keeps no
state per request. The walk and its probabilities are the tree's: at each step every
occurrence still alive votes for its next token, and one whose text ran out votes for stopping.

The cache of recent outputs is scoped by tenant and LoRA adapter, so that one tenant's
acceptance rate (and thus latency) never depends on another tenant's text.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from backend.spec_decode.base import Proposer

if TYPE_CHECKING:
    from backend.request import Request

# Between cached outputs in a scope's buffer: no token id, so no match or walk crosses it.
_SEPARATOR = -1


def longest_match(buffer: np.ndarray, end: int, context: np.ndarray, max_len: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest m <= max_len such that context's last m tokens occur in
    buffer[:end], and the positions where those occurrences end. (0, empty) if none."""
    ends = np.flatnonzero(buffer[:end] == context[-1])
    return extend_match(buffer, ends, 1, context, max_len) if ends.size else (0, ends)


def extend_match(buffer: np.ndarray, ends: np.ndarray, m: int, context: np.ndarray,
                 max_len: int) -> tuple[int, np.ndarray]:
    """From occurrences (ending at `ends`) of context's last m tokens, the longest match up to
    max_len tokens that still occurs, and where its occurrences end."""
    limit = min(max_len, len(context))
    while m < limit:
        candidates = ends[ends >= m]
        extended = candidates[buffer[candidates - m] == context[-1 - m]]
        if not extended.size:
            break
        ends, m = extended, m + 1
    return m, ends


def follow(buffer: np.ndarray, ends: np.ndarray, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """Up to `limit` tokens: from the occurrences ending at `ends`, the most frequent next
    token (the lowest id among equals), again and again, while the product of each step's
    share of the votes stays >= min_token_prob. With the score (the sum of those products:
    the expected number of drafts accepted), by which two sources' drafts are compared."""
    drafts: list[int] = []
    probability, score = 1.0, 0.0
    positions = ends + 1
    while len(drafts) < limit and positions.size:
        votes = positions.size
        alive = positions[positions < buffer.size]
        tokens = buffer[alive]
        tokens = tokens[tokens != _SEPARATOR]
        if not tokens.size:
            break
        values, counts = np.unique(tokens, return_counts=True)
        best = int(np.argmax(counts))
        probability *= counts[best] / votes
        if probability < min_token_prob:
            break
        token = int(values[best])
        drafts.append(token)
        score += probability
        positions = alive[buffer[alive] == token] + 1
    return drafts, score


class _ScopeCache:
    """The cached outputs of one scope, end to end, each followed by a separator, and where
    each bigram of them ends: a lookup costs the bigram's occurrences, not the cache's size.
    Positions are absolute (they never change as the oldest outputs leave)."""

    def __init__(self) -> None:
        self._tokens = np.empty(256, dtype=np.int32)
        self._base = 0  # the absolute position of _tokens[0]
        self._end = 0  # one past the last absolute position written
        self._spans: deque[int] = deque()  # where each cached output starts, oldest first
        self._bigram_ends: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._spans)

    def add(self, output: list[int]) -> None:
        need = self._end + len(output) + 1 - self._base
        if need > self._tokens.size:
            grown = np.empty(max(need, 2 * self._tokens.size), dtype=np.int32)
            grown[: self._end - self._base] = self._tokens[: self._end - self._base]
            self._tokens = grown
        start = self._end
        offset = start - self._base
        self._tokens[offset : offset + len(output)] = output
        self._tokens[offset + len(output)] = _SEPARATOR
        for i in range(1, len(output)):
            self._bigram_ends.setdefault((output[i - 1], output[i]), []).append(start + i)
        self._spans.append(start)
        self._end = start + len(output) + 1

    def evict_oldest(self) -> None:
        self._spans.popleft()
        live = self._spans[0] if self._spans else self._end
        if 2 * (live - self._base) > self._end - self._base:
            # Most of the array is dead: drop it, and every dead position from the index.
            self._tokens = self._tokens[live - self._base : self._end - self._base].copy()
            self._base = live
            for key in list(self._bigram_ends):
                ends = self._bigram_ends[key]
                del ends[: bisect_left(ends, live)]
                if not ends:
                    del self._bigram_ends[key]

    def match(self, context: np.ndarray, max_len: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(m, ends, buffer) as `longest_match` over the live outputs, for m >= 2 only."""
        buffer = self._tokens[: self._end - self._base]
        none = (0, np.empty(0, dtype=np.int64), buffer)
        if len(context) < 2 or max_len < 2:
            return none
        ends = self._bigram_ends.get((int(context[-2]), int(context[-1])))
        if not ends:
            return none
        live = self._spans[0]
        ends = np.asarray(ends[bisect_left(ends, live):], dtype=np.int64) - self._base
        if not ends.size:
            return none
        m, ends = extend_match(buffer, ends, 2, context, max_len)
        return m, ends, buffer


class SuffixProposer(Proposer):
    """Drafts for a request from its own tokens and from its scope's cache of the outputs of
    the last `max_cached_requests` requests that ended (all scopes together; 0: no cache).
    The cache answers matches of two tokens or more: a one-token match among thousands of
    outputs says little about what comes next."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._order: deque[tuple] = deque()  # the scope of each cached output, oldest first
        self._scopes: dict[tuple, _ScopeCache] = {}

    @staticmethod
    def _scope(request: Request) -> tuple:
        return request.params.tenant, request.lora_name

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in zip(requests, ks)]

    def propose_one(self, request: Request, k: int) -> list[int]:
        context = np.asarray(request.token_ids, dtype=np.int64)
        m, ends = longest_match(context, len(context) - 1, context, self.max_depth)
        best, best_score = self._follow(context, m, ends, k)
        cache = self._scopes.get(self._scope(request))
        if cache is not None:
            m, ends, buffer = cache.match(context, self.max_depth)
            drafts, score = self._follow(buffer, m, ends, k)
            if score > best_score:
                best = drafts
        return best

    def _follow(self, buffer: np.ndarray, m: int, ends: np.ndarray, k: int) -> tuple[list[int], float]:
        limit = min(k, int(m * self.max_spec_factor))
        return follow(buffer, ends, limit, self.min_token_prob) if limit > 0 else ([], 0.0)

    def request_finished(self, request: Request) -> None:
        if self.max_cached_requests <= 0 or not request.output_token_ids:
            return
        scope = self._scope(request)
        self._scopes.setdefault(scope, _ScopeCache()).add(request.output_token_ids)
        self._order.append(scope)
        while len(self._order) > self.max_cached_requests:
            evicted = self._order.popleft()
            cache = self._scopes[evicted]
            cache.evict_oldest()
            if not len(cache):
                del self._scopes[evicted]

    @property
    def num_cached_requests(self) -> int:
        return len(self._order)
