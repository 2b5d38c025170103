"""Linear layers with weights prepacked for the CPU.

On CPU most of a decode step is the projections' matmuls at a few dozen rows, where how
the weight is laid out in memory decides the speed: `F.linear` hands MKL the row-major
weight and it re-blocks it on every call. The weight is packed once at load time, into the
panel layout of our own GEMM (`panel_gemm`, kernels/cpu/gemm.cpp), one code path per
instruction set, chosen here once per weight (`cpu_ext.isa()`, the best the machine has):

- bfloat16 on Xeons with AMX: the tiles' `tdpbf16ps` on the bf16 weight itself, by default
  (every bf16 GEMM the engine runs is this one: the projections, LoRA's two matmuls, the
  output head, tied or not); where Linux refuses the process the tiles, or elsewhere with
  AVX512-BF16 (AVX-512 EPYCs), `vdpbf16ps` on the same packed weight (kernels/cpu_ext.py);
- float32 on AVX-512, else AVX2: FMAs on float32 panels. A bfloat16 weight on a CPU
  without bf16 dot products (AVX2 EPYC) is packed as its exact float32 upcast (`upcast`):
  the input is widened, the GEMM accumulates in float32 and the output is rounded to
  bfloat16 once, which is what a bf16 GEMM with float32 accumulation computes, up to
  summation order (torch's own bf16 GEMM runs at ~16 GFLOP/s there against ~120 in
  float32). The cost is twice the weight memory.

GFLOP/s on a 2-core Zen 4 EPYC (AVX512-BF16), SmolLM2-135M's projections, this kernel /
oneDNN packed / F.linear: bf16 at 8 rows 387-437 / 177-324 / 128-192, at 32 rows 417-435 /
309-419 / 262-339, at 145-256 rows all three within 6%; float32 (AVX-512 path) at 8 rows
205-223 / 116-192 / 79-83, at 32 rows 224-227 / 175-212 / 139-149, 145-256 rows within 3%
(the output head 168 / 90 / 63 at 256 rows). The AVX2 path on a 2-core AVX2 EPYC:
SmolLM2's 960 x 576 at 32 rows 145 / 101 / 94.

Every output element of the panel GEMM is one chain of multiply-adds over k in order, so a
row's result never depends on the batch it is in (the engine's `batch_invariant` mode
relies on it), and the AVX2 and AVX-512 float32 paths give the same bits.

Where the C++ kernels could not be built or the CPU lacks AVX2 and FMA: oneDNN's blocked
layout (`torch.ops.mkldnn`), or MKL's packed-sgemm format where oneDNN is unavailable, for
weights large enough to pay for oneDNN's per-call cost; bf16 through oneDNN where the CPU
has bf16 dot products, else as the float32 upcast.

    packed = pack_linear_weight(weight)    # None where packing does not apply
    y = linear(x, weight, bias, packed)    # F.linear when packed is None

Quantized weights (`QuantizedWeight`, kernels/quantized.py: int8 or int4 with a scale, and
maybe a min, per group of inputs) are packed as they are, never widened to a float copy:
`quant_panels` (kernels/cpu/gemm_quant.cpp), int4 two to a byte, scales and mins in float16
where that is exact, de-quantized in registers on the AVX2 or AVX-512 path. Its result is the
float32 panel GEMM's on the de-quantized weight, to the bit (so batch invariance holds as
above); a bfloat16 input is widened and the output rounded to bfloat16 once, as `upcast`. On the
AMX tiles a bfloat16 input stays bfloat16: each panel is de-quantized, rounded to bfloat16 and
multiplied on the tiles, the bf16 tile GEMM's bits on `dequantize().bfloat16()`, for every row
count (so a row's bits are its own there too); on a 2-core Xeon with AMX 2.3-5.1x the float32
path's speed at 32 rows, 0.46-0.76x at one (client.bench.quant_gemm --bf16). Without tiles, a
bf16 model's weight of even groups (or one group: every format the engine loads) runs the bf16
dots at every row count (QUANT_BF16_DOTS: `vdpbf16ps` on the exact int8/int4 integers, each
group's scale and min applied to its sums; bits of their own, a row's its own), odd groups the
float32 path. Packed with `batch_invariant=False` (the engine's mode off), a bf16 model's calls of
up to VECTOR_ROWS_BESIDE_TILES rows run the bf16 dots (odd groups the float32 path), and more rows
run the de-quantized panels on the tiles or, without them, on vdpbf16ps (panel_gemm's bits of
that path on the rounded weight).
At one row, Llama-3.2-1B's MLP weights ran 2.5-4.9x faster than float32 panels on a 2-core AVX2
EPYC (the table in gemm_quant.cpp).
Without the C++ kernels (or AVX2 and FMA), kind `quant` keeps the QuantizedWeight and
de-quantizes it per call for torch's GEMM (slow, and correct).

    packed = pack_linear_weight(quantized, dtype=torch.bfloat16)   # the activations' dtype
    y = linear(x, packed.shape_only, bias, packed)

`INFLIGHT_CPU_ISA` caps the instruction set (kernels/cpu_ext.py), e.g. to run the AVX2 path
on an AVX-512 machine. On CUDA (and for other dtypes) nothing is
packed: cuBLAS takes the weight as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext
from .cpu_ext import QUANT_BF16_DOTS, QUANT_INT8_DOTS, Isa
from .linear_quant import linear_quant_triton, pack_quant_weight_triton
from .quantized import QuantizedWeight, int8_activation_linear

# A bf16 weight's calls of up to this many rows run vdpbf16ps beside the tiles when the engine is not
# batch invariant: at a few rows the tiles run far below the memory's speed (2-core AMX Xeon, twelve
# Llama-3.2-1B MLP weights, 400 MB, from memory: vdpbf16ps 2.0-2.3x the tiles at 1-4 rows, 1.2-1.8x
# at 6, even at 8, the tiles 1.7-2.1x at 16; a whole decode step at batch 1 in 98-115 ms against 154-193).
BF16_ROWS_BESIDE_TILES = 6

# Up to this many rows, a bf16 model's quantized weight runs its path for a few rows when the engine
# is not batch invariant: at a few rows the de-quantize-to-bf16 pass of the tiles (or of vdpbf16ps,
# without them) costs more than the vector path's de-quantizing in registers. On a 2-core AVX512-BF16
# EPYC, vdpbf16ps on the de-quantized panels against the float32 path: 0.57-0.71x at 1 row,
# 1.03-1.26x at 4, 1.8-2.9x at 32 (client.bench.quant_gemm --bf16 --rows 1 4 32 256; from 32 rows
# 0.82-1.16x the bf16 weight's own GEMM). (client.bench.quant_gemm --bf16 --rows 1 2 3 4 on a
# 2-core AMX Xeon, Llama-3.2-1B's MLP and SmolLM2's gate|up, int8/q8_0/q4_1/int4: the vector path
# 1.6-2.0x faster at 1 row, 1.1-1.8x at 2, 1.05-1.6x at 3, even at 4; the tiles 1.2-2.6x faster at 8).
# int4's bf16 dots there against the float32 path: 1.2-1.4x at 1 row, 1.0-1.2x at 2, 0.95-1.4x at 3,
# the tiles faster from 8 (client.bench.quant_gemm --bf16, bench/results/amx/quant_gemm_bf16_dots.json).
VECTOR_ROWS_BESIDE_TILES = 3

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


# Tensors smaller than a huge page would hold none of it.
_HUGE_PAGE = 2 << 20


def _on_huge_pages(data: torch.Tensor | None) -> torch.Tensor | None:
    """`data` copied onto transparent huge pages (kernels/cpu/huge_pages.cpp: a GEMM of a few rows
    streams several panels at once, and the page walks of 4 KiB pages slowed its reads), where it
    is a contiguous CPU tensor of a huge page or more and the C++ kernels are built."""
    if data is None or data.device.type != "cpu" or not data.is_contiguous():
        return data
    nbytes = data.numel() * data.element_size()
    module = cpu_ext.load() if nbytes >= _HUGE_PAGE else None
    if module is None:
        return data
    return module.huge_page_zeros(nbytes).view(data.dtype).view(data.shape).copy_(data)


class PackedWeight:
    """A weight in a CPU GEMM's own layout, with what `linear` needs to call it."""

    __slots__ = ("kind", "data", "upcast", "isa", "shape_only", "gemm_shape_only", "bits", "group_size", "scales",
                 "mins", "quantized", "vector_rows", "vector_isa")

    def __init__(self, kind: str, data: torch.Tensor | None, weight: torch.Tensor, upcast: bool = False,
                 isa: Isa = Isa.NONE):
        # "panels" (kernels/cpu/gemm.cpp), "onednn", "mkl", "quant_panels" (gemm_quant.cpp),
        # "quant" (a QuantizedWeight de-quantized per call) or "quant_triton" (on CUDA,
        # kernels/linear_quant.py)
        self.kind = kind
        # for quant_panels, the q panels; our own kernels' panels on huge pages
        self.data = _on_huge_pages(data) if kind in ("panels", "quant_panels") else data
        self.upcast = upcast  # a float32 GEMM on bf16 activations: widen the input, round the output
        self.isa = isa  # the panel GEMM's path, for kinds "panels" and "quant_panels"
        # A zero-stride view of one element with the weight's shape and dtype: what a module
        # can keep in its place so that the weight is not held twice.
        self.shape_only = weight.new_empty(1).as_strided(weight.shape, (0,) * weight.dim())
        # The same in the dtype the GEMM computes in: what MKL's call wants of the original weight.
        gemm_dtype = torch.float32 if upcast else weight.dtype
        self.gemm_shape_only = (weight.new_empty(1, dtype=gemm_dtype).as_strided(weight.shape, (0,) * weight.dim())
                                if kind == "mkl" else None)
        # Quantized weights: bits (4, 8), group size, the packed scales and mins (None: symmetric);
        # for kind "quant", the QuantizedWeight itself.
        self.bits = self.group_size = 0
        self.scales = self.mins = self.quantized = None
        # Outside the batch-invariant mode, calls of at most `vector_rows` rows run the path
        # `vector_isa` on the same panels instead: a bf16 weight's vdpbf16ps beside the tiles; a
        # quantized weight's bf16 dots (QUANT_BF16_DOTS, the input as it is) or float32 vector
        # path (the input widened).
        self.vector_rows = 0
        self.vector_isa = Isa.NONE

    def isa_for(self, rows: int) -> Isa:
        """The path a call of `rows` rows takes: `vector_isa` for a few, else `isa`."""
        return self.vector_isa if 0 < rows <= self.vector_rows else self.isa

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds resident."""
        if self.kind in ("quant", "quant_triton"):
            return self.quantized.nbytes
        tensors = [self.data] + ([self.scales, self.mins] if self.kind == "quant_panels" else [])
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _mkl_usable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


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


def _bf16_dots_take(weight: QuantizedWeight, isa: Isa, module) -> bool:
    """Whether the path on bf16 dot products (quant_panel_gemm's QUANT_BF16_DOTS) runs this
    weight: groups of an even size or one group, on a CPU with vdpbf16ps."""
    groups = -(-weight.shape[1] // weight.group_size)
    return (groups == 1 or weight.group_size % 2 == 0) and isa >= Isa.AVX512_BF16 and module.quant_bf16_built()


def _pack_quantized(weight: QuantizedWeight, isa: Isa, dtype: torch.dtype, device: torch.device,
                    batch_invariant: bool, int8_activations: bool) -> PackedWeight:
    # What a module keeps in the weight's place: its shape, in the activations' dtype.
    shape = torch.empty(0, dtype=dtype, device=device).new_empty(1).as_strided(weight.shape, (0, 0))
    if int8_activations:
        return _pack_for_int8_activations(weight, shape, device)
    if device.type == "cuda":  # the Triton W8A16/W4A16 kernel's own layout, on the GPU
        packed = PackedWeight("quant_triton", None, shape)
        packed.quantized = pack_quant_weight_triton(weight, device=device)
        packed.bits, packed.group_size = weight.bits, weight.group_size
        return packed
    module = cpu_ext.load()
    quant_isa = Isa.NONE if module is None else min(isa, Isa(module.quant_gemm_isa()))
    # The float32 vector path, below the bf16 ones.
    float_isa = Isa.NONE if module is None else min(Isa.AVX512, Isa(module.gemm_vector_isa()))
    # Above AVX-512 (vdpbf16ps, the tiles) the paths take bfloat16 activations only.
    if quant_isa >= Isa.AVX512_BF16 and dtype != torch.bfloat16:
        quant_isa = float_isa
    if quant_isa == Isa.AVX512_BF16 and batch_invariant:
        # Without tiles one path serves every row count: the bf16 dots read at the memory's speed at
        # one row, where de-quantizing to bfloat16 first made a decode step at batch 1 2.5x slower
        # than the float32 path, and from 8 rows on ran 1.9-2.6x the float32 path (int8 per channel
        # and int4 g128; groups of 32 1.1-2.2x; SmolLM2's and Llama-3.2-1B's projections, 2-core
        # AVX512-BF16 EPYC, client.bench.quant_gemm --bf16). Outside the mode the de-quantized panels run calls of more than
        # VECTOR_ROWS_BESIDE_TILES rows: groups of 32 ran 1.1-1.4x faster there from 32 rows.
        quant_isa = QUANT_BF16_DOTS if _bf16_dots_take(weight, isa, module) else float_isa
    upcast = dtype != torch.float32 and quant_isa < Isa.AVX512_BF16
    if quant_isa < Isa.AVX2:
        packed = PackedWeight("quant", None, shape, upcast)
        packed.quantized = weight
    else:
        q, scales, *mins = module.pack_quant_panels(weight.q, weight.scales, weight.mins, weight.bits,
                                                    weight.group_size, int(quant_isa))
        packed = PackedWeight("quant_panels", q, shape, upcast, quant_isa)
        packed.scales, packed.mins = scales, (mins[0] if mins else None)
        if not batch_invariant and quant_isa in (Isa.AVX512_BF16, Isa.AMX):
            # The panels are the same for every path; only the activations' dtype differs.
            if _bf16_dots_take(weight, isa, module):
                packed.vector_rows, packed.vector_isa = VECTOR_ROWS_BESIDE_TILES, QUANT_BF16_DOTS
            else:
                packed.vector_rows, packed.vector_isa = VECTOR_ROWS_BESIDE_TILES, float_isa
    packed.bits, packed.group_size = weight.bits, weight.group_size
    return packed


def _pack_for_int8_activations(weight: QuantizedWeight, shape: torch.Tensor, device: torch.device) -> PackedWeight:
    if device.type != "cpu":
        raise ValueError("int8 activations run on the CPU only")
    per_line = 8 if weight.bits == 4 else 4
    if weight.group_size % per_line and weight.group_size < weight.shape[1]:
        raise ValueError(f"int8 activations take {weight.bits}-bit groups of a multiple of {per_line} inputs, "
                         f"not {weight.group_size}")
    module = cpu_ext.load()
    if module is None:  # no C++ kernels: the same numbers in torch, per call
        packed = PackedWeight("quant", None, shape, isa=QUANT_INT8_DOTS)
        packed.quantized = weight
    else:
        q, scales, *mins = module.pack_quant_panels(weight.q, weight.scales, weight.mins, weight.bits,
                                                    weight.group_size, QUANT_INT8_DOTS)
        packed = PackedWeight("quant_panels", q, shape, isa=QUANT_INT8_DOTS)
        packed.scales, packed.mins = scales, (mins[0] if mins else None)
    packed.bits, packed.group_size = weight.bits, weight.group_size
    return packed


def pack_linear_weight(weight: torch.Tensor | QuantizedWeight, isa: Isa | None = None,
                       dtype: torch.dtype | None = None, device: torch.device | None = None,
                       batch_invariant: bool = True, int8_activations: bool = False) -> PackedWeight | None:
    """Pack `weight` [out, in] for fast CPU matmuls, or None where that does not apply or
    would not be faster. `isa`: the panel GEMM path to pack for (default `cpu_ext.isa()`;
    Isa.NONE: the libraries' layouts). A `QuantizedWeight` is packed as it is (kind
    `quant_panels`, or `quant` without the C++ kernels); `dtype` is then the dtype of the
    activations it will see (default float32), which `shape_only` carries, and `device` where
    they live (default the CPU; CUDA: kind `quant_triton`, kernels/linear_quant.py).
    `batch_invariant` False (the engine's mode off) lets a bf16 model's weight on the AMX tiles run
    calls of a few rows on a vector path (vdpbf16ps; a quantized one's, VECTOR_ROWS_BESIDE_TILES),
    faster there but not the tiles' bits. `int8_activations` (a quantized weight on the CPU): its
    calls quantize x to int8 in blocks of its groups and run integer dot products
    (`int8_activation_linear`'s numbers; kernels/cpu/gemm_int8_dots.cpp), batch invariant at every
    row count."""
    if isinstance(weight, QuantizedWeight):
        return _pack_quantized(weight, cpu_ext.isa() if isa is None else isa, dtype or torch.float32,
                               torch.device(device or "cpu"), batch_invariant, int8_activations)
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    weight = weight.detach().contiguous()
    isa = cpu_ext.isa() if isa is None else isa
    if weight.dtype == torch.bfloat16 and isa >= Isa.AVX512_BF16:
        packed = PackedWeight("panels", cpu_ext.load().pack_panels(weight, isa), weight, isa=isa)
        if isa == Isa.AMX and not batch_invariant and cpu_ext.load().gemm_vector_isa() >= Isa.AVX512_BF16:
            # The same panels serve both (gemm.cpp); the sums' order differs.
            packed.vector_rows, packed.vector_isa = BF16_ROWS_BESIDE_TILES, Isa.AVX512_BF16
        return packed
    if isa >= Isa.AVX2:
        # The vector path below the tiles (on a build whose tiles are a software model, AVX2).
        float_isa = min(isa, Isa.AVX512, Isa(cpu_ext.load().gemm_vector_isa()))
        upcast = weight.dtype == torch.bfloat16
        return PackedWeight("panels", cpu_ext.load().pack_panels(weight.float(), float_isa), weight, upcast, float_isa)
    upcast = weight.dtype == torch.bfloat16 and not _native_bf16()
    if upcast:
        return _pack_for_library(weight, upcast=True)
    if weight.numel() < _MIN_PACKED_ELEMENTS:
        return None
    return _pack_for_library(weight, upcast=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` when given. x: [..., in]."""
    if packed is not None and packed.kind == "quant_triton":
        return linear_quant_triton(x, packed.quantized, bias, batch_invariant=False)
    if packed is None or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if packed.kind in ("quant_panels", "quant"):  # bf16 on the tiles; elsewhere float32, bf16 widened, rounded once
        isa = packed.isa_for(rows.shape[0])
        if isa < Isa.AVX512_BF16:  # the paths below the tiles and the bf16 dots take float32; int8 dots x as it is
            rows = rows.float()
            bias = None if bias is None else bias.float()
        if isa == QUANT_INT8_DOTS and packed.kind == "quant":  # no C++ kernels: the same numbers in torch
            out = int8_activation_linear(rows, packed.quantized, bias)
        elif packed.kind == "quant_panels":
            out = cpu_ext.load().quant_panel_gemm(rows, packed.data, packed.scales, packed.mins, bias,
                                                  packed.shape_only.shape[0], packed.bits, packed.group_size,
                                                  int(isa))
        else:  # no C++ kernels: the float weight exists only during the call
            out = F.linear(rows, packed.quantized.dequantize(), bias)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    if packed.kind == "panels":  # takes row strides; adds the bias in float32 before its one rounding
        isa = packed.isa_for(rows.shape[0])
        if packed.upcast:
            rows = rows.float()
            bias = None if bias is None else bias.float()
        out = cpu_ext.load().panel_gemm(rows, packed.data, bias, packed.shape_only.shape[0], isa)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    gemm_bias = bias
    if packed.upcast:
        rows = rows.to(torch.float32, memory_format=torch.contiguous_format)
        gemm_bias = None  # added in float32 below, before the one rounding
    elif not rows.is_contiguous():
        rows = rows.contiguous()
    if packed.kind == "onednn":
        out = torch.ops.mkldnn._linear_pointwise(rows, packed.data, gemm_bias, "none", [], "")
    else:
        out = torch.ops.mkl._mkl_linear(rows, packed.data, packed.gemm_shape_only, gemm_bias, rows.shape[0])
    if packed.upcast:
        if bias is not None:
            out.add_(bias)
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])
