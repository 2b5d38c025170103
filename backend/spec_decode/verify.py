"""Verification of drafted tokens against the target model's logits.

A speculating request's step computes 1 + m logits rows: row j is the target's distribution
for the token after its last token and drafts 0..j-1. Greedy requests accept the longest
prefix of drafts that equals each row's argmax, then take the argmax of the first row that
disagreed (or of the last row: the bonus token), so their output is exactly what m + 1
plain decode steps would produce. Sampled requests use the rejection rule of Leviathan et al.
and Chen et al. (2023) for a one-hot draft distribution (the n-gram proposer is
deterministic): draft t is accepted with probability p(t), and on rejection the token is
drawn from p with t removed, renormalised; then each emitted token is distributed exactly
as p. Every uniform comes from the request's own generator when it has a seed
(Sampler.uniforms), so a seeded request repeats exactly. Logprobs are the target's.

Only requests whose target distribution does not depend on their previous output
(no penalties, bad words, pending min_tokens or grammar: `can_speculate`) speculate, so
every row of a request is processed as its plain decode row would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.request import Request
from backend.sampler import Sampler, argmax_rows, sample_from_probs


@dataclass
class Verified:
    """One speculating request's outcome: its accepted drafts, then one token more."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def can_speculate(request: Request) -> bool:
    """Whether the request's rows are all processed alike: nothing in its sampling depends
    on the tokens it has produced so far, so a drafted position's row needs no state that
    only accepting the drafts before it would create."""
    params = request.params
    return (params.speculative and request.group is None and request.grammar is None
            and not request.bad_words_token_ids and request.num_output_tokens >= params.min_tokens
            and params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty)


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request], num_rows: list[int]) -> list[Verified]:
    """Each request's outcome from its `num_rows` consecutive logits rows (1 + its drafts
    scheduled this step; `request.spec_token_ids` holds the drafts)."""
    greedy = argmax_rows(logits).tolist()
    row_requests = [r for r, n in zip(requests, num_rows) for _ in range(n)]
    sampled_rows = [row for row, r in enumerate(row_requests) if not r.params.greedy]
    probs = None
    if sampled_rows:
        probs = sampler.target_probs(logits[sampled_rows], [row_requests[row] for row in sampled_rows])
    prob_row = {row: i for i, row in enumerate(sampled_rows)}
    raw_logprobs = None
    if any(r.needs_logprobs for r in requests):
        raw_logprobs = torch.log_softmax(logits, -1)
    results = []
    first = 0
    for request, n in zip(requests, num_rows):
        drafts = request.spec_token_ids[: n - 1]
        if request.params.greedy:
            emitted = _accept_greedy(drafts, greedy[first : first + n])
        else:
            emitted = _accept_sampled(sampler, request, drafts, probs[prob_row[first] : prob_row[first] + n])
        logprobs: list[float | None] = [None] * len(emitted)
        top: list[list[tuple[int, float]] | None] = [None] * len(emitted)
        if request.needs_logprobs:
            rows = raw_logprobs[first : first + len(emitted)]
            logprobs = rows[torch.arange(len(emitted)), torch.tensor(emitted)].tolist()
            if request.params.logprobs:
                values, ids = rows.topk(request.params.logprobs)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        results.append(Verified(emitted, logprobs, top, len(drafts)))
        first += n
    return results


def _accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return argmax[: accepted + 1]


def _accept_sampled(sampler: Sampler, request: Request, drafts: list[int], probs: torch.Tensor) -> list[int]:
    emitted = []
    for j, draft in enumerate(drafts):
        row = probs[j]
        u = float(sampler.uniforms([request])[0])
        if u * float(row.sum()) < float(row[draft]):
            emitted.append(draft)
            continue
        residual = row.clone()
        residual[draft] = 0.0
        emitted.append(int(sample_from_probs(residual.unsqueeze(0), sampler.uniforms([request]))[0]))
        return emitted
    emitted.append(int(sample_from_probs(probs[len(drafts)].unsqueeze(0).clone(), sampler.uniforms([request]))[0]))
    return emitted
