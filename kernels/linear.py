"""Linear layers with weights prepacked for the CPU.

On CPU most of a decode step is the projections' matmuls at a few dozen rows, where how
the weight is laid out in memory decides the speed: `F.linear` hands MKL the row-major
weight and it re-blocks it on every call. The weight is packed once at load time:

- float32 on an AVX2 CPU: into our own panel layout for `panel_gemm` (kernels/cpu/gemm.cpp;
  16 output columns per panel, one micro-kernel, no per-call setup). Measured on a 2-core
  AVX2 EPYC in GFLOP/s, this kernel / oneDNN packed / F.linear: SmolLM2's 960 x 576 at 32
  rows 145 / 101 / 94, 576 x 1536 184 / 117 / 110, its 49k-row output head 120 / 121 / 63;
  at 256 to 2048 rows all three within ~15% (the head 107 / 121 / 102 at 256). The small
  random Llama's 16 projections (128 x 128 to 1024 x 128, 128 x 512) at 32 rows take 0.67
  ms against 1.19 with F.linear (oneDNN is slower still on weights that small: its call
  costs ~40-100 us of setup), at 2 rows 0.25 ms against 0.89.
- otherwise (no AVX2, AVX-512 CPUs where the panel kernel was not measured, or the C++
  kernels could not be built): oneDNN's blocked layout (`torch.ops.mkldnn`: JIT kernels
  for the CPU at hand, AMX for bf16 where the CPU has it), or MKL's packed-sgemm format
  where oneDNN is unavailable, for weights large enough to pay for oneDNN's per-call cost.

bfloat16 on a CPU without bf16 dot products (no AVX512-BF16 or AMX, e.g. AVX2 EPYC):
oneDNN refuses to pack bf16 there, and torch's own bf16 GEMM runs at ~16 GFLOP/s against
~120 in float32 (576 x 3072, 256 rows). Such a weight is packed as its exact float32
upcast (`upcast`): the input is widened, the GEMM accumulates in float32 and the output
is rounded to bfloat16 once, which is what a bf16 GEMM with float32 accumulation
computes, up to summation order. The cost is twice the weight memory.

    packed = pack_linear_weight(weight)    # None where packing does not apply
    y = linear(x, weight, bias, packed)    # F.linear when packed is None

On CUDA (and for other dtypes) nothing is packed: cuBLAS takes the weight as it is.
Results equal F.linear's up to float rounding order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext

# The GEMM libraries choose their blocking from an expected row count; any row count is
# correct, and measured speed varied little between hints of 1 and 256.
_BATCH_HINT = 64

# Where the panel kernel is not used: a oneDNN call costs ~40-100 us more than the MKL
# sgemm behind F.linear, which its layout wins back only on larger weights. Measured on an
# AVX2 EPYC in float32 at 1, 32 and 144 rows: 128 x 128 to 1024 x 128 and 128 x 512 ran
# 1.5-13x faster unpacked (equal at 144 rows for the largest); 384 x 384 and 576 x 576 the
# same either way; 3072 x 576 and the 49k-row output head 1.1-3x faster packed. Below this
# size a weight stays as it is, unless the packing is a float32 upcast of bf16 (that path
# is 4-10x faster at every size measured).
_MIN_PACKED_ELEMENTS = 1 << 18


class PackedWeight:
    """A weight in a CPU GEMM library's own layout, with what `linear` needs to call it."""

    __slots__ = ("kind", "data", "upcast", "shape_only", "gemm_shape_only")

    def __init__(self, kind: str, data: torch.Tensor, weight: torch.Tensor, upcast: bool = False):
        self.kind = kind  # "panels" (kernels/cpu/gemm.cpp), "onednn" or "mkl"
        self.data = data
        self.upcast = upcast  # a bf16 weight packed as float32: widen the input, round the output
        # A zero-stride view of one element with the weight's shape and dtype: what a module
        # can keep in its place so that the weight is not held twice.
        self.shape_only = weight.new_empty(1).as_strided(weight.shape, (0,) * weight.dim())
        # The same in the dtype the GEMM computes in: what MKL's call wants of the original weight.
        gemm_dtype = torch.float32 if upcast else weight.dtype
        self.gemm_shape_only = (weight.new_empty(1, dtype=gemm_dtype).as_strided(weight.shape, (0,) * weight.dim())
                                if kind == "mkl" else None)


def _mkl_usable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _panels_usable() -> bool:
    # AVX2 exactly: on AVX-512 CPUs oneDNN's 512-bit kernels were not measured against it.
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    module = cpu_ext.load()
    return module is not None and module.panel_gemm_supported()


def _onednn_usable() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _native_bf16() -> bool:
    # oneDNN packs bf16 only with AVX512 (BW/VL/DQ) or AVX-NE-CONVERT, and is fast only with
    # bf16 dot products (AVX512-BF16, AMX); without them the float32 GEMM is the fast path.
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _pack_for_library(weight: torch.Tensor, upcast: bool) -> PackedWeight | None:
    gemm_weight = weight.float() if upcast else weight
    if _onednn_usable():
        return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(gemm_weight, _BATCH_HINT), weight, upcast)
    if gemm_weight.dtype == torch.float32 and _mkl_usable():
        return PackedWeight("mkl", torch.ops.mkl._mkl_reorder_linear_weight(gemm_weight, _BATCH_HINT), weight, upcast)
    return None


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight | None:
    """Pack `weight` [out, in] for fast CPU matmuls, or None where that does not apply or
    would not be faster."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    weight = weight.detach().contiguous()
    upcast = weight.dtype == torch.bfloat16 and not _native_bf16()
    if (weight.dtype == torch.float32 or upcast) and _panels_usable():
        return PackedWeight("panels", cpu_ext.load().pack_panels(weight.float()), weight, upcast)
    if upcast:
        return _pack_for_library(weight, upcast=True)
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.numel() < _MIN_PACKED_ELEMENTS:
        return None
    return _pack_for_library(weight, upcast=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` when given. x: [..., in]."""
    if packed is None or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    gemm_bias = bias
    if packed.upcast:
        rows = rows.to(torch.float32, memory_format=torch.contiguous_format)
        gemm_bias = None  # added in float32 below, before the one rounding
    elif not rows.is_contiguous() and packed.kind != "panels":  # panel_gemm takes row strides
        rows = rows.contiguous()
    if packed.kind == "panels":
        out = cpu_ext.load().panel_gemm(rows, packed.data, gemm_bias, packed.shape_only.shape[0])
    elif packed.kind == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(rows, packed.data, gemm_bias, "none", [], "")
    else:
        out = torch.ops.mkl._mkl_linear(rows, packed.data, packed.gemm_shape_only, gemm_bias, rows.shape[0])
    if packed.upcast:
        if bias is not None:
            out.add_(bias)
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])
