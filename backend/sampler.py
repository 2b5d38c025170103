"""Turns a step's logits into one token per request, vectorised across the batch.

Order of operations (as vLLM): penalties, min_tokens masking, then greedy rows take the
argmax; the others go through temperature, top-k, top-p and min-p and are sampled with
the exponential race (argmax of p / Exp(1) noise), which draws exactly one noise row per
request. A request with a `seed` draws its noise from its own generator, so its output
does not depend on what else is in the batch. Logprobs are of the raw model output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: logprob of the sampled token, or None when the request did not ask.
    logprobs: list[float | None]
    # Per row: [(token id, logprob)] of the top-N, or None.
    top_logprobs: list[list[tuple[int, float]] | None]


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's argmax. On CPU numpy's vectorised argmax is ~5x faster than torch's (5 ms
    against 28 ms for 256 rows of a 49k vocabulary on one core), with the same ties (the
    first maximum) and NaN handling (a NaN wins)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.argmax(values.numpy(), axis=-1))
    return values.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def make_request_generator(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        source = logits
        logits = logits.float().cpu()
        params = [r.params for r in requests]
        num_rows = len(requests)
        wants_logprobs = [r.needs_logprobs for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._apply_penalties(logits, requests)
        for row, r in enumerate(requests):
            if r.num_output_tokens < r.params.min_tokens:
                banned = list(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    banned.extend(r.eos_token_ids)
                if banned:
                    if logits is source:
                        logits = logits.clone()  # never write into the caller's tensor
                    logits[row, banned] = float("-inf")

        tokens = argmax_rows(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows], [requests[i] for i in random_rows])

        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * num_rows
        top: list[list[tuple[int, float]] | None] = [None] * num_rows
        if raw_logprobs is not None:
            for row in range(num_rows):
                if not wants_logprobs[row]:
                    continue
                logprobs[row] = float(raw_logprobs[row, token_list[row]])
                n = params[row].logprobs
                if n:
                    values, ids = raw_logprobs[row].topk(n)
                    top[row] = list(zip(ids.tolist(), values.tolist()))
        return SampleResult(token_list, logprobs, top)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        num_rows, vocab = logits.shape
        longest_output = max(1, max(r.num_output_tokens for r in requests))
        longest_all = max(r.num_tokens for r in requests)
        output_ids = torch.full((num_rows, longest_output), vocab, dtype=torch.int64)
        all_ids = torch.full((num_rows, longest_all), vocab, dtype=torch.int64)
        for row, r in enumerate(requests):
            if r.output_token_ids:
                output_ids[row, : r.num_output_tokens] = torch.tensor(r.output_token_ids)
            all_ids[row, : r.num_tokens] = torch.tensor(r.token_ids)
        # One spare column absorbs the padding id.
        counts = torch.zeros((num_rows, vocab + 1)).scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))[:, :vocab]
        seen = torch.zeros((num_rows, vocab + 1), dtype=torch.bool).scatter_(1, all_ids, True)[:, :vocab]
        rep = torch.tensor([r.params.repetition_penalty for r in requests]).unsqueeze(1)
        presence = torch.tensor([r.params.presence_penalty for r in requests]).unsqueeze(1)
        frequency = torch.tensor([r.params.frequency_penalty for r in requests]).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - presence * (counts > 0) - frequency * counts

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k = torch.tensor([k if k else logits.shape[1] for k in top_k])
            k = k.clamp(max=logits.shape[1])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1])).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return argmax_rows(probs / noise)
