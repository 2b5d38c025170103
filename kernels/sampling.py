"""Running sums for the sampler's inverse-CDF draw, and its top-p cut (CPU only: the sampler
runs on the CPU whatever the model's device).

`cumsum_rows(x, out)` writes torch.cumsum(x, -1)'s bits into `out`: each row summed left to
right in double, every partial sum rounded to float32. The C++ path (kernels/cpu/sampling.cpp)
sums eight rows in one AVX-512 vector, where torch runs one scalar chain per row: 0.33 against
0.85 ms for 32 rows x 49k (2-core AVX512-BF16 EPYC). Without AVX-512 (or capped below it by
`INFLIGHT_CPU_ISA`) it is torch's own.

`keep_nucleus_(probs, top_p)` zeroes the probabilities outside each row's top-p nucleus. The
C++ path sums each row's probabilities by buckets of their leading bits and sorts only the
bucket where the cut falls, where the reference sorts the row; both work in float64 and give
the same nucleus but where a sum lands within rounding of top_p.
"""

from __future__ import annotations

import torch

from . import cpu_ext


def cumsum_rows_reference(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=-1, out=out)


def cumsum_rows_cpu(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The C++ path where it applies ([rows, n] float32, contiguous, on the CPU), else the reference."""
    # isa() is NONE where the module could not be built.
    takes = (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
             and out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous())
    if not takes or cpu_ext.vector_isa() < cpu_ext.Isa.AVX512:
        return cumsum_rows_reference(x, out)
    return cpu_ext.load().cumsum_rows(x, out)


cumsum_rows = cumsum_rows_cpu


def nucleus_thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [rows, n], the smallest probability in its top-p nucleus: the tokens
    whose larger probabilities sum (in float64) to less than top_p [rows]. Equal probabilities
    are all in or all out, and the most likely token is always in."""
    ranked = probs.double().sort(dim=-1, descending=True).values
    before = ranked.cumsum(dim=-1) - ranked
    # The mass above a run of equal probabilities is the one before the run's first.
    first_of_run = torch.searchsorted(-ranked, -ranked, right=False)
    above = before.gather(1, first_of_run)
    kept = (above < top_p.double().unsqueeze(1)).sum(dim=1).clamp(min=1)
    return ranked.gather(1, (kept - 1).unsqueeze(1)).squeeze(1).to(probs.dtype)


def keep_nucleus_reference(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the probabilities outside each row's top-p nucleus (`nucleus_thresholds`);
    rows whose top_p is 1 or more keep every token."""
    rows = (top_p < 1.0).nonzero().squeeze(1)
    if len(rows):
        subset = probs[rows]
        threshold = nucleus_thresholds(subset, top_p[rows]).unsqueeze(1)
        probs[rows] = subset.masked_fill_(subset < threshold, 0.0)
    return probs


def keep_nucleus_cpu(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The C++ path (kernels/cpu/sampling.cpp: the probabilities summed by buckets, no sort)
    where the module is built, else the reference: 1.4 against 134 ms for 32 rows x 49k
    (2-core AVX512-BF16 EPYC, bench/results/avx512_bf16/sampler_parameters.json)."""
    takes = (probs.dim() == 2 and probs.dtype == torch.float32 and probs.device.type == "cpu"
             and probs.is_contiguous() and probs.shape[1] > 0)
    if not takes or cpu_ext.isa() == cpu_ext.Isa.NONE:
        return keep_nucleus_reference(probs, top_p)
    return cpu_ext.load().keep_nucleus_(probs, top_p.to(torch.float64).contiguous())


keep_nucleus_ = keep_nucleus_cpu
