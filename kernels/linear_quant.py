"""GEMMs of float activations against int8 and int4 weights on the GPU (W8A16, W4A16).

    packed = pack_quant_weight_triton(qw)              # once, at load (a QuantizedWeight)
    out = linear_quant_triton(x, packed, bias=None)    # x [..., K] -> out [..., N], x's dtype
    out = linear_quant_reference(x, qw, bias=None)     # F.linear on qw.dequantize(), float32

The kernel de-quantizes each weight tile in registers, w = scale * q + min in float32, casts
it to the activations' dtype (float16 / bfloat16: the tensor cores' operands; float32: IEEE
dots, `dot_precision`) and accumulates x @ w.T in float32; the output is rounded once to x's
dtype, after the bias. The kernel is compiled without FMA contraction, so the float32 weight
it builds is `QuantizedWeight.dequantize()`'s to the bit (the product and the sum each
rounded, as kernels/quantized.py defines the format); a float32 model computes the
de-quantized model's GEMM up to summation order.

The device layout (`PackedQuantWeight`):
- q: bits=8: int8 [N, K], the QuantizedWeight's own. bits=4: uint8 [N, ceil(K / 2)], two
  weights a byte along K: byte j of a row holds q[2j] in its low nibble and q[2j + 1] in its
  high one (a zero nibble pads an odd K). Rows stay K-contiguous, the x @ w.T operand
  layout, so the packing does not depend on any block size. The kernel never interleaves
  the nibbles back: it multiplies the low nibbles by x's even columns and the high ones by
  its odd columns, two dots of half the tile.
- scales, mins: [ceil(K / g), N], transposed so that a tile's per-group scales are one
  contiguous load along N. float16 when every value converts to float16 exactly (GGUF's Q8_0,
  Q4_0, Q4_1 keep float16 scales; AWQ/GPTQ scales are float16 too, as the load-time
  quantizer's groups are where they fit), else float32 (Q4_K's products d * sc, per-channel
  int8 scales); mins likewise, on their own.
  Either way the kernel computes with the exact float32 values.

Block sizes are chosen in Python from M (the interpreter has no autotuning):
- decode, M <= 16: BLOCK_M = 16 and split-K, the K tiles shared among enough programs to
  fill the GPU's SMs (~2 programs each) when N alone gives too few; each split writes its
  float32 partial sums, and a second kernel adds them in split order, adds the bias and
  rounds (deterministic: no atomics).
- prefill: 64 x 128 tiles (128 x 128 from 256 rows), no split.
BLOCK_K divides the group size wherever it can (then a tile lies within one group and takes
one scale per column: BLOCK_K down to 16 for int8, Q6_K's groups of 16, and to 32 for int4,
whose half-tile dots need 16 each); otherwise (groups of 24 or 48) each weight looks up its
own group's scale. With `batch_invariant` the prefill configuration serves every M, so each
output element's k-order never depends on how many rows share the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .quantized import QuantizedWeight
from .triton_utils import dot_precision, launch

# Decode below this many rows (one BLOCK_M of 16, the smallest tile tl.dot takes).
DECODE_MAX_ROWS = 16
# What split-K aims for on a CPU (the interpreter), where there are no SMs to count: an H100's.
_DEFAULT_SMS = 132


@dataclass
class PackedQuantWeight:
    """A QuantizedWeight in the layout `linear_quant_triton` reads (the module docstring)."""

    q: torch.Tensor  # int8 [N, K] (bits=8) or uint8 [N, ceil(K / 2)] (bits=4)
    scales: torch.Tensor  # float16 or float32 [groups, N]
    mins: torch.Tensor | None  # float16 or float32 [groups, N], or None
    bits: int
    group_size: int
    in_features: int  # K
    out_features: int  # N

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        """Device bytes of the packed weight, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None)


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """float16 if every value survives the round trip (finite ones only), else float32."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t) else t


def pack_quant_weight_triton(qw: QuantizedWeight, device: torch.device | str | None = None) -> PackedQuantWeight:
    """The weight in the kernel's layout, on `device` (qw's own when None). Packing once at
    load; nothing here is done again per call."""
    device = qw.q.device if device is None else torch.device(device)
    n, k = qw.shape
    q = qw.q.to(device)
    if qw.bits == 4:
        if k % 2:
            q = F.pad(q, (0, 1))
        nibbles = q.view(n, -1, 2).to(torch.uint8)
        q = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous()
    else:
        q = q.contiguous()
    scales = _narrowest_exact(qw.scales.to(device).t().contiguous())
    mins = None if qw.mins is None else _narrowest_exact(qw.mins.to(device).t().contiguous())
    return PackedQuantWeight(q, scales, mins, qw.bits, qw.group_size, k, n)


def linear_quant_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The de-quantized float32 weight's F.linear in float32, rounded to x's dtype."""
    w = qw.dequantize().to(x.device)
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


@triton.jit
def _linear_quant_kernel(x_ptr, q_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr,
                         M, N, K, group_size, tiles_per_split,
                         stride_xm, stride_qn, stride_om, stride_os,
                         BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ONE_GROUP_PER_TILE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """out[split] = x[:, split's K tiles] @ w.T (+ bias) for one BLOCK_M x BLOCK_N tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    q_cols = q_ptr + cols[None, :].to(tl.int64) * stride_qn
    dtype = x_ptr.dtype.element_ty
    k_first = split * tiles_per_split * BLOCK_K
    k_last = tl.minimum(K, k_first + tiles_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, k_last, BLOCK_K):
        if ONE_GROUP_PER_TILE:
            # The whole tile is in group k0 // group_size: one scale (and min) per column.
            at = (k0 // group_size) * N + cols
            scale = tl.load(scales_ptr + at, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_MINS:
                low = tl.load(mins_ptr + at, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if BITS == 4:
            half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            k_even = 2 * half
            byte = tl.load(q_cols + half[:, None], mask=(k_even < K)[:, None] & col_ok[None, :], other=0)
            for nibble in tl.static_range(2):
                ks = k_even + nibble
                q = ((byte >> (4 * nibble)) & 15).to(tl.float32)
                if not ONE_GROUP_PER_TILE:
                    at = (ks // group_size)[:, None] * N + cols[None, :]
                    mask = (ks < K)[:, None] & col_ok[None, :]
                    scale = tl.load(scales_ptr + at, mask=mask, other=0.0).to(tl.float32)
                    if HAS_MINS:
                        low = tl.load(mins_ptr + at, mask=mask, other=0.0).to(tl.float32)
                w = q * scale
                if HAS_MINS:
                    w = w + low
                xs = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
                acc += tl.dot(xs, w.to(dtype), input_precision=DOT_PRECISION)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            q = tl.load(q_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0).to(tl.float32)
            if not ONE_GROUP_PER_TILE:
                at = (ks // group_size)[:, None] * N + cols[None, :]
                mask = k_ok[:, None] & col_ok[None, :]
                scale = tl.load(scales_ptr + at, mask=mask, other=0.0).to(tl.float32)
                if HAS_MINS:
                    low = tl.load(mins_ptr + at, mask=mask, other=0.0).to(tl.float32)
            w = q * scale
            if HAS_MINS:
                w = w + low
            xs = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(xs, w.to(dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, size, N, num_splits,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over splits of the float32 partials, in split order, + bias, rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block_k(preferred: int, minimum: int, group_size: int, k: int) -> tuple[int, bool]:
    """The largest BLOCK_K from `preferred` down to `minimum` (powers of two) whose tiles each
    lie within one group, and whether one was found (else `preferred`, scales per weight)."""
    if group_size >= k:
        return preferred, True
    block = preferred
    while block >= minimum:
        if group_size % block == 0:
            return block, True
        block //= 2
    return preferred, False


def linear_quant_config(m: int, n: int, k: int, bits: int, group_size: int, num_sms: int = _DEFAULT_SMS,
                        batch_invariant: bool = False) -> dict:
    """Tile sizes, split-K and warps for an [m, k] x [n, k].T product (the module docstring)."""
    # Each of the two int4 half-tile dots needs K >= 16.
    minimum_k = 32 if bits == 4 else 16
    if m <= DECODE_MAX_ROWS and not batch_invariant:
        block_m, block_n, num_warps, num_stages = 16, 64, 4, 4
        block_k, one_group = _block_k(128, minimum_k, group_size, k)
        k_tiles = triton.cdiv(k, block_k)
        programs = triton.cdiv(n, block_n)
        wanted = max(1, min(k_tiles, triton.cdiv(2 * num_sms, programs)))
        tiles_per_split = triton.cdiv(k_tiles, wanted)
        split_k = triton.cdiv(k_tiles, tiles_per_split)
    else:
        block_m = 128 if m >= 256 and not batch_invariant else 64
        block_n, num_warps, num_stages = 128, 8 if block_m == 128 else 4, 3
        block_k, one_group = _block_k(64, minimum_k, group_size, k)
        tiles_per_split = triton.cdiv(k, block_k)
        split_k = 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ONE_GROUP_PER_TILE=one_group,
                split_k=split_k, tiles_per_split=tiles_per_split, num_warps=num_warps, num_stages=num_stages)


def linear_quant_triton(x: torch.Tensor, packed: PackedQuantWeight, bias: torch.Tensor | None = None,
                        batch_invariant: bool = False) -> torch.Tensor:
    """Triton version of `linear_quant_reference` on the packed weight: x [..., K] float16,
    bfloat16 or float32 -> [..., N] in x's dtype, accumulated in float32. `batch_invariant`:
    one tiling for every M (no split-K), so a row's result never depends on the others'."""
    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        out.copy_((bias if bias is not None else torch.zeros(n, device=x.device)).to(x.dtype).expand(m, n))
        return out.view(*x.shape[:-1], n)
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else _DEFAULT_SMS
    config = linear_quant_config(m, n, k, packed.bits, packed.group_size, num_sms, batch_invariant)
    split_k = config.pop("split_k")
    tiles_per_split = config.pop("tiles_per_split")
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    has_bias = bias is not None and split_k == 1
    mins = packed.mins if packed.mins is not None else packed.scales
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), split_k)
    launch(_linear_quant_kernel, grid,
           x2, packed.q, packed.scales, mins, bias if has_bias else out, target,
           m, n, k, packed.group_size, tiles_per_split,
           x2.stride(0), packed.q.stride(0), n, m * n,
           BITS=packed.bits, HAS_MINS=packed.mins is not None, HAS_BIAS=has_bias,
           DOT_PRECISION=dot_precision(x.element_size()),
           # Separate roundings of scale * q and of + min: dequantize()'s weight to the bit.
           enable_fp_fusion=False, **config)
    if split_k > 1:
        block = 1024
        launch(_sum_splits_kernel, (triton.cdiv(m * n, block),),
               target, bias if bias is not None else out, out, m * n, n, split_k,
               HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)
