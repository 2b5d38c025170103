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

Row j is adjusted as the plain decode step after drafts 0..j-1 would adjust it: penalties
count those drafts among the output, bad words and min_tokens see them (`RowView`), and a
grammar masks the row by its state after them (`mask_drafted_rows`). Each sequence of a
parallel-sampling group speculates on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.request import Request
from backend.sampler import Sampler, argmax_rows, sample_from_probs
from backend.structured_output import mask_drafted_rows


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
    return request.params.speculative


class RowView:
    """A speculating request as of one verification row: its drafts before the row taken as
    output. What the sampler's adjustments read (`Sampler.adjust_logits`)."""

    __slots__ = ("params", "token_ids", "output_token_ids", "eos_token_ids", "bad_words_token_ids")
    grammar = None

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.params = request.params
        self.token_ids = request.token_ids + drafts
        self.output_token_ids = request.output_token_ids + drafts
        self.eos_token_ids = request.eos_token_ids
        self.bad_words_token_ids = request.bad_words_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _adjusts(request: Request) -> bool:
    params = request.params
    return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                or request.bad_words_token_ids or request.num_output_tokens < params.min_tokens)


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request], num_rows: list[int]) -> list[Verified]:
    """Each request's outcome from its `num_rows` consecutive logits rows (1 + its drafts
    scheduled this step; `request.spec_token_ids` holds the drafts)."""
    row_requests = [r for r, n in zip(requests, num_rows) for _ in range(n)]
    adjusted = logits
    if any(map(_adjusts, requests)):
        views = [RowView(r, r.spec_token_ids[:j]) for r, n in zip(requests, num_rows) for j in range(n)]
        adjusted = sampler.adjust_logits(logits, views, logits)
    if any(r.grammar is not None for r in requests):
        if adjusted is logits:
            adjusted = logits.clone()  # never write into the caller's tensor
        mask_drafted_rows(adjusted, requests, num_rows)
    greedy = argmax_rows(adjusted).tolist()
    sampled_rows = [row for row, r in enumerate(row_requests) if not r.params.greedy]
    probs = None
    if sampled_rows:
        probs = sampler.target_probs(adjusted[sampled_rows], [row_requests[row] for row in sampled_rows])
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
