"""Running sums for the sampler's inverse-CDF draw and its top-p cut (CPU only: the sampler
runs on the CPU whatever the model's device).

`cumsum_rows(x, out)` writes torch.cumsum(x, -1)'s bits into `out`: each row summed left to
right in double, every partial sum rounded to float32. The C++ path (kernels/cpu/sampling.cpp)
sums eight rows in one AVX-512 vector, where torch runs one scalar chain per row: 0.33 against
0.85 ms for 32 rows x 49k (2-core AVX512-BF16 EPYC). Without AVX-512 (or capped below it by
`INFLIGHT_CPU_ISA`) it is torch's own.
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
    if not takes or cpu_ext.isa() < cpu_ext.Isa.AVX512:
        return cumsum_rows_reference(x, out)
    return cpu_ext.load().cumsum_rows(x, out)


cumsum_rows = cumsum_rows_cpu
