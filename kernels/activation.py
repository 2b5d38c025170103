"""SiLU-and-mul for gated MLPs: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import cpu_ext
from .triton_utils import launch, next_power_of_2


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """HF LlamaMLP: act_fn(gate) * up, in the input dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU production path: one C++ pass (kernels/cpu/activation.cpp), bit-identical to
    the reference (torch's expf and roundings). The reference where the C++ kernels could
    not be built."""
    module = cpu_ext.load()
    return silu_and_mul_reference(x) if module is None else module.silu_and_mul(x)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_and_mul_reference` (computes in float32, rounds once)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(1024, next_power_of_2(d))
        launch(_silu_and_mul_kernel, (x2.shape[0], triton.cdiv(d, block)),
               x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)
