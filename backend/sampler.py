"""Turns a step's logits into one token per request, vectorised across the batch.

Order of operations (as vLLM): penalties, the grammar bitmask of rows with structured
outputs (backend/structured_output.py; the other rows are not touched), min_tokens and
bad_words masking, then greedy rows take the argmax; the others go through temperature,
top-k, top-p and min-p and are sampled by inverse CDF: one uniform u in [0, 1) per row, a float32 running
sum of the row's probabilities, and the first token whose running sum exceeds u times the
row's total (a binary search). That costs one random number per row instead of one per vocabulary entry:
an exponential race (argmax of p / Exp(1) noise) draws a 49k-value noise row per request,
~50-70 ms per call for 32 rows on one core against ~4-5 ms for the inverse CDF. A token of
probability zero (masked, or underflowed) adds nothing to the running sum, so it is never
the first to exceed the target. A request with a `seed` draws its uniform from its
own generator, so its output does not depend on what else is in the batch; unseeded rows
draw theirs from the engine's generator in one call. Seeded output repeats exactly for
bit-identical logits, which `batch_invariant` guarantees whatever the batch; unlike with a race,
a token can change with logits that differ in the last bits (without batch invariance, a
run whose long prompt chunks take SDPA against one whose do not). Every operation here
works row by row, so a row's logprobs do not depend on the other rows. Logprobs are of the
raw model output. Top-k masks the logits below each row's k-th largest (a top-k selection,
not a sort); top-p zeroes the probabilities outside the nucleus (kernels.keep_nucleus_, which
sums them by buckets instead of sorting), and the draw needs no renormalised row.

Everything runs where the logits are: on a GPU the [rows, vocab] work stays there and only
the sampled ids (and the asked-for logprobs) come back. The uniforms are drawn on the CPU
from the same generators on every device, so a seed means the same uniform everywhere (the
token can still differ where the devices' running sums round differently at its edge).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.request import Request
from backend.structured_output import GrammarMasker
from kernels import cumsum_rows, keep_nucleus_

NEGATIVE_INFINITY, ZERO = torch.tensor(float("-inf")), torch.tensor(0.0)


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


def banned_token_ids(request: Request) -> list[int]:
    """Tokens a request may not sample next: its stop and EOS tokens until it has
    `min_tokens`, and the last token of each of its bad words whose other tokens end its
    output (as vLLM: a bad word is a token sequence, matched against output tokens only)."""
    banned: list[int] = []
    output = request.output_token_ids
    # A grammar decides where its output may end: min_tokens does not hold it open.
    if len(output) < request.params.min_tokens and request.grammar is None:
        banned.extend(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            banned.extend(request.eos_token_ids)
    for word in request.bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len <= len(output) and (prefix_len == 0 or output[-prefix_len:] == list(word[:-1])):
            banned.append(word[-1])
    return banned


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        # Float32 buffers for the [rows, vocab] intermediates on the logits' device, grown to
        # the largest batch seen: the random path's two and the logprobs. malloc hands fresh
        # temporaries of that size back to the OS when they are freed, and faulting them in
        # again every step cost more than the arithmetic (~6 of ~10 ms for 32 rows x 49k; the
        # logprobs alone 4.6 ms against 0.9 ms in a reused buffer).
        # The fourth holds the float32 copy of logits of another dtype (or of float32 logits
        # about to be masked: the caller's tensor is never written), the fifth the logits
        # with the top-k mask, the sixth the penalised logits, the seventh output token counts.
        self._workspace = [torch.empty(0) for _ in range(7)]
        self._grammar_masker: GrammarMasker | None = None

    @staticmethod
    def make_request_generator(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        source = logits
        if logits.dtype != torch.float32:
            logits = self._buffer(3, logits).copy_(logits)
        params = [r.params for r in requests]
        num_rows = len(requests)
        wants_logprobs = [r.needs_logprobs for r in requests]
        raw_logprobs = None
        if any(wants_logprobs):
            # torch.log_softmax's bits, into a reused buffer (see __init__).
            raw_logprobs = torch._log_softmax(logits, -1, False, out=self._buffer(2, logits))

        logits = self.adjust_logits(logits, requests, source)
        constrained_rows = [row for row, r in enumerate(requests) if r.grammar is not None]
        if constrained_rows:
            if logits is source:
                logits = self._buffer(3, logits).copy_(logits)  # never write into the caller's tensor
            if self._grammar_masker is None:
                self._grammar_masker = GrammarMasker(logits.shape[1])
            self._grammar_masker(logits, constrained_rows, requests)

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            tokens = argmax_rows(logits)
        elif len(random_rows) == num_rows:  # no copy of the rows, no argmax that nobody takes
            tokens = self._sample(logits, requests)
        else:
            tokens = argmax_rows(logits)
            tokens[random_rows] = self._sample(logits[random_rows], [requests[i] for i in random_rows])

        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * num_rows
        top: list[list[tuple[int, float]] | None] = [None] * num_rows
        if raw_logprobs is not None:
            # One gather, and one top-k per distinct N (row-wise, so a row's top-N never
            # depends on its neighbours): few transfers back from a GPU.
            rows = [row for row in range(num_rows) if wants_logprobs[row]]
            for row, value in zip(rows, raw_logprobs[rows, [token_list[row] for row in rows]].tolist()):
                logprobs[row] = value
            by_n: dict[int, list[int]] = {}
            for row in rows:
                if params[row].logprobs:
                    by_n.setdefault(params[row].logprobs, []).append(row)
            for n, group in by_n.items():
                values, ids = raw_logprobs[group].topk(n)
                for row, row_ids, row_values in zip(group, ids.tolist(), values.tolist()):
                    top[row] = list(zip(row_ids, row_values))
        return SampleResult(token_list, logprobs, top)

    def adjust_logits(self, logits: torch.Tensor, requests: list[Request], source: torch.Tensor) -> torch.Tensor:
        """The logits each row samples from, before any grammar: penalties by the row's tokens,
        and the tokens it may not sample (`banned_token_ids`) at -inf. A row needs only what
        `_apply_penalties` and `banned_token_ids` read of its request, so speculative
        verification passes a view per drafted position. `source` is never written."""
        if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
               for r in requests):
            logits = self._apply_penalties(logits, requests)
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for row, r in enumerate(requests):
            banned = banned_token_ids(r)
            banned_rows += [row] * len(banned)
            banned_ids += banned
        if banned_ids:
            if logits is source:
                logits = self._buffer(3, logits).copy_(logits)
            logits[banned_rows, banned_ids] = float("-inf")  # one index_put for the batch
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Repetition, presence and frequency penalties (vLLM's), into a workspace buffer.
        Only the tokens a row has seen change, so only they are computed: the penalties ran
        over whole [rows, vocab] temporaries, ~25 ms for 32 x 49k on two Zen 4 cores. The
        arithmetic per token is the same: a seen token's logit is divided (positive) or
        multiplied by the repetition penalty, then less presence * (count > 0) and
        frequency * count, its count in the output."""
        num_rows, vocab = logits.shape
        longest_output = max(1, max(r.num_output_tokens for r in requests))
        longest_all = max(r.num_tokens for r in requests)
        # Padded with the row's own first token, which is seen: a pad writes the same value
        # as the token's own entry (a scatter of two different values would keep either).
        seen_ids = torch.empty((num_rows, longest_all), dtype=torch.int64)
        output_ids = torch.full((num_rows, longest_output), vocab, dtype=torch.int64)
        device = logits.device
        for row, r in enumerate(requests):
            seen_ids[row] = r.token_ids[0]
            seen_ids[row, : r.num_tokens] = torch.tensor(r.token_ids)
            if r.output_token_ids:
                output_ids[row, : r.num_output_tokens] = torch.tensor(r.output_token_ids)
        # Output counts per token; one spare column absorbs the padding id.
        seen_ids, output_ids = seen_ids.to(device), output_ids.to(device)
        counts = self._buffer(6, logits, (num_rows, vocab + 1)).zero_()
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
        rep = torch.tensor([r.params.repetition_penalty for r in requests], device=device).unsqueeze(1)
        presence = torch.tensor([r.params.presence_penalty for r in requests], device=device).unsqueeze(1)
        frequency = torch.tensor([r.params.frequency_penalty for r in requests], device=device).unsqueeze(1)
        seen = logits.gather(1, seen_ids)
        seen_counts = counts.gather(1, seen_ids)
        penalised = torch.where(seen > 0, seen / rep, seen * rep)
        penalised = penalised - presence * (seen_counts > 0) - frequency * seen_counts
        return self._buffer(5, logits).copy_(logits).scatter_(1, seen_ids, penalised)

    def _buffer(self, index: int, like: torch.Tensor, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """Workspace `index` as float32 of `shape` (default `like`'s) on `like`'s device."""
        rows, vocab = like.shape if shape is None else shape
        buffer = self._workspace[index]
        if buffer.numel() < rows * vocab or buffer.device != like.device:
            buffer = self._workspace[index] = torch.empty(rows * vocab, device=like.device)
        return buffer[: rows * vocab].view(rows, vocab)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self.target_probs(logits, requests)
        # The running sums overwrite the scaled logits, spent once the softmax is taken.
        uniforms = self.uniforms(requests).to(logits.device, non_blocking=True)
        return sample_from_probs(probs, uniforms, out=self._buffer(0, logits))

    def target_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """What each (sampled) row draws from: temperature, top-k, softmax, top-p, min-p; not
        renormalised (a draw scales by the row's total). In a workspace buffer, valid until
        the next call."""
        params = [r.params for r in requests]
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):  # x / 1.0 is x, bit for bit: no pass over the rows
            temperature = torch.tensor(temperatures, device=logits.device).unsqueeze(1)
            logits = torch.div(logits, temperature, out=self._buffer(0, logits))
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            logits = self._mask_top_k(logits, top_k)
        probs = torch.softmax(logits, dim=-1, out=self._buffer(1, logits))
        if any(p.top_p < 1.0 for p in params):
            # Zeroed, not renormalised: the draw scales its target by the row's own total.
            keep_nucleus_(probs, torch.tensor([p.top_p for p in params], dtype=torch.float64, device=logits.device))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
            torch.where(probs < min_p * probs.amax(dim=-1, keepdim=True), ZERO, probs, out=probs)
        return probs

    def _mask_top_k(self, logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        """`logits` with -inf below each row's k-th largest (top_k 0, or at least the
        vocabulary: the row is left alone), in a workspace buffer. The k-th comes from a top-k
        selection over the rows with a k, as wide as their largest k: sorting the vocabulary
        cost ~57 ms for 32 x 49k on two Zen 4 cores, more than the rest of a decode step."""
        vocab = logits.shape[1]
        rows = [row for row, k in enumerate(top_k) if 0 < k < vocab]
        if not rows:
            return logits
        masked = self._buffer(4, logits).copy_(logits)
        subset = logits[rows]
        kth_index = torch.tensor([top_k[row] - 1 for row in rows], device=logits.device).unsqueeze(1)
        kth = subset.topk(max(top_k[row] for row in rows), dim=-1).values.gather(1, kth_index)
        masked[rows] = torch.where(subset < kth, NEGATIVE_INFINITY, subset)
        return masked

    def uniforms(self, requests: list[Request]) -> torch.Tensor:
        """One float32 uniform in [0, 1) per row: a seeded request's from its own generator,
        the unseeded rows' from the engine's, in one draw."""
        u = torch.empty(len(requests), dtype=torch.float32)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float32, generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float32, generator=r.generator)[0]
        return u


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose float32 running sum of `probs`
    (non-negative, not necessarily normalised: min-p does not renormalise) exceeds
    uniform * the row's total, with `uniforms` in [0, 1).

    Summed left to right (`_scan_is_sequential`; elsewhere `last_token_with_mass` restores
    what follows), the running sum is non-decreasing, and a token of probability zero leaves
    it unchanged, so the first entry strictly above a target (searchsorted right=True) is
    always a token of nonzero probability; u = 0 skips leading masked tokens the same way. The target is
    scaled by the running sum's own last entry, not assumed to be 1 nor taken from another
    summation, so u < 1 keeps it below that entry for any normal float32 total; where
    rounding does put it at the total (a subnormal total can), the search runs past the
    row, and the index is clamped to the row's last token that carries mass (the first
    entry that reaches the total), never to the vocabulary's end, which may be masked.
    `out`, if given, receives the running sums (torch.cumsum's bits, kernels/sampling.py)."""
    cumulative = cumsum_rows(probs, out if out is not None else torch.empty_like(probs))
    total = cumulative[:, -1:].contiguous()
    target = uniforms.to(cumulative.dtype).unsqueeze(1) * total
    index = torch.searchsorted(cumulative, target, right=True)
    last = torch.searchsorted(cumulative, total, right=False)
    # The final clamp only matters for a row with no finite logit (NaN probabilities),
    # which has no right answer; it keeps the index inside the vocabulary.
    chosen = torch.minimum(index, last).clamp_(max=probs.shape[1] - 1)
    if not _scan_is_sequential(probs):
        chosen = last_token_with_mass(probs, chosen)
    return chosen.squeeze(1)


def _scan_is_sequential(probs: torch.Tensor) -> bool:
    """Whether `cumsum_rows` sums `probs` left to right: on the CPU (the C++ kernel and
    torch's) it does. CUDA's scan of a single row does not (a tree, in CUB's order), so it
    neither adds an exact 0 for a token of probability zero nor keeps its sums monotone."""
    return probs.device.type == "cpu"


def last_token_with_mass(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`index` [rows, 1], each entry that points at a token of probability zero moved back to
    the last token before it that has mass. Where the running sums are not monotone the
    search can stop on such a token (masked by a grammar, a ban, top-k or top-p) by a
    rounding step; the token before it is the one whose mass that step belongs to. A row
    whose leading tokens are all zero never stops among them (a sum of zeros is exactly 0)."""
    positions = torch.arange(probs.shape[1], device=probs.device).expand_as(probs)
    with_mass = torch.where(probs > 0, positions, -1).cummax(dim=1).values
    return with_mass.gather(1, index).clamp_(min=0)
