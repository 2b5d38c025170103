"""RMSNorm with an optional fused residual add, numerically matching HF `LlamaRMSNorm`.

HF: h = x.float(); h = h * rsqrt(mean(h^2) + eps); return weight * h.to(x.dtype).
With a residual: r = x + residual (in the input dtype, as the HF decoder layer adds it),
then the norm of r; both are returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cpu_ext
from .triton_utils import launch, next_power_of_2


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """`rmsnorm(x) * weight`, or `(rmsnorm(x + residual) * weight, x + residual)`."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, x)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The CPU production path: one C++ pass per row (kernels/cpu/layer_ops.cpp), equal to the
    reference to the bit (its roundings, and a row's squares added up in torch's order).
    The reference where the C++ kernels could not be built or the dtypes differ."""
    module = cpu_ext.load()
    if module is None or weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps, residual)
    if residual is None:
        return module.rms_norm(x, weight, eps)
    return module.add_rms_norm(x, residual, weight, eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per row; the whole row fits in one block (hidden sizes up to 16K or so).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    # All arithmetic in float32, rounding to the input dtype exactly where HF rounds
    # (the residual sum, the normalised value); a float32 op followed by one rounding gives
    # the same bits as torch's 16-bit op. (Triton's interpreter cannot do 16-bit float math.)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    h = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * h
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Triton version of `rms_norm_reference` (same signature and results)."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, n_cols), dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == shape and residual.dtype == x.dtype
        r2 = residual.reshape(-1, n_cols)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        r_out = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    else:
        r2 = r_out = x2   # unused by the kernel
    if rows > 0:
        block_n = next_power_of_2(n_cols)
        launch(
            _rms_norm_kernel, (rows,),
            x2, r2, weight, out, r_out,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0),
            n_cols, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
            num_warps=min(16, max(1, block_n // 256)),
        )
    out = out.view(shape)
    return out if residual is None else (out, r_out.view(shape))
