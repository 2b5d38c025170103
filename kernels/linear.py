"""Linear layers with weights prepacked for the CPU's GEMM library.

On CPU most of a decode step is the projections' matmuls at a few dozen rows, where how
the weight is laid out in memory decides the speed: `F.linear` hands MKL / oneDNN the
row-major weight and they re-block it on every call. Packing once at load time, into
MKL's packed-sgemm format (float32) or oneDNN's blocked format (bfloat16, which uses AMX
where the CPU has it), measured 1.3-1.8x faster for 4-128 rows on this project's CPU.

bfloat16 on a CPU without bf16 dot products (no AVX512-BF16 or AMX, e.g. AVX2-only AMD EPYC):
oneDNN refuses to pack, and torch's own bf16 GEMM runs at ~16 GFLOP/s there against MKL's
~120 in float32 (SmolLM2's 576 x 3072 projection, 256 rows). Such a weight is packed as its
exact float32 upcast for MKL ("mkl_upcast"): the input is widened, MKL accumulates in float32
and the output is rounded to bfloat16 once, which is what a bf16 GEMM with float32
accumulation computes, up to summation order. The cost is twice the weight memory.

    packed = pack_linear_weight(weight)    # None where packing does not apply
    y = linear(x, weight, bias, packed)    # F.linear when packed is None

On CUDA (and for other dtypes) nothing is packed: cuBLAS takes the weight as it is.
Results equal F.linear's up to float rounding order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# MKL chooses its blocking from an expected row count; any row count is correct, and
# measured speed varied little between hints of 4 and 256.
_MKL_BATCH_HINT = 64


class PackedWeight:
    """A weight in a CPU GEMM library's own layout, with what `linear` needs to call it."""

    __slots__ = ("kind", "data", "shape_only", "gemm_shape_only")

    def __init__(self, kind: str, data: torch.Tensor, weight: torch.Tensor):
        self.kind = kind  # "mkl" (float32), "onednn" (bfloat16) or "mkl_upcast" (bfloat16 as float32)
        self.data = data
        # A zero-stride view of one element with the weight's shape and dtype: what MKL's
        # call wants of the original weight, and what a module can keep in its place so
        # that the weight is not held twice.
        self.shape_only = weight.new_empty(1).as_strided(weight.shape, (0,) * weight.dim())
        # The same in the dtype the GEMM computes in (MKL's call checks it against the input).
        gemm_dtype = torch.float32 if kind == "mkl_upcast" else weight.dtype
        self.gemm_shape_only = weight.new_empty(1, dtype=gemm_dtype).as_strided(weight.shape, (0,) * weight.dim())


def _mkl_usable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _onednn_bf16_usable() -> bool:
    # oneDNN packs bf16 only with AVX512 (BW/VL/DQ) or AVX-NE-CONVERT, and is fast only with
    # native bf16 dot products (AVX512-BF16, AMX); without them float32 MKL is the fast path.
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return native_bf16 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight | None:
    """Pack `weight` [out, in] for fast CPU matmuls, or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    weight = weight.detach().contiguous()
    if weight.dtype == torch.float32 and _mkl_usable():
        return PackedWeight("mkl", torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_BATCH_HINT), weight)
    if weight.dtype == torch.bfloat16 and _onednn_bf16_usable():
        return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, _MKL_BATCH_HINT), weight)
    if weight.dtype == torch.bfloat16 and _mkl_usable():
        upcast = torch.ops.mkl._mkl_reorder_linear_weight(weight.float(), _MKL_BATCH_HINT)
        return PackedWeight("mkl_upcast", upcast, weight)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` when given. x: [..., in]."""
    if packed is None or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if packed.kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    if packed.kind == "mkl_upcast":
        rows = rows.to(torch.float32, memory_format=torch.contiguous_format)
        out = torch.ops.mkl._mkl_linear(rows, packed.data, packed.gemm_shape_only, None, rows.shape[0])
        if bias is not None:
            out.add_(bias)
        out = out.to(x.dtype)
    else:
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkl._mkl_linear(rows, packed.data, packed.gemm_shape_only, bias, rows.shape[0])
    return out.view(*x.shape[:-1], out.shape[-1])
