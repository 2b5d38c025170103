"""Weights stored as integers: what `linear` computes with when a model is quantized.

One logical format covers every quantized checkpoint the engine reads and its own load-time
quantization: the weight [out, in] is split along `in` into groups of `group_size` (the last
group may be shorter), and

    w[n, k] = scales[n, k // group_size] * q[n, k] + mins[n, k // group_size]

rounded to float32 after the product and again after the sum (no fused multiply-add), so
`dequantize()` here and the kernels de-quantizing in registers give the same bits. `q` is
int8 in -128..127 for 8-bit weights and 0..15 for 4-bit ones (held one to a byte until a
kernel packs them); `mins` is None for symmetric weights. The GGUF block types map onto it
exactly (Q8_0: scale d; Q4_0: d and -8d; Q4_1: d and m; Q4_K: d*sc and -dmin*m over groups of
32; Q6_K: d*sc over groups of 16, q - 32), as do AWQ/GPTQ (scale s, min -s*z) and
compressed-tensors, so a checkpoint is served as its own numbers, never widened to float in
memory (backend/models/quantization.py reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """A weight [out, in] as integers per group along `in` (the module docstring's formula)."""

    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, ceil(in / group_size)]
    mins: torch.Tensor | None  # float32 like scales, or None (symmetric)
    bits: int  # 8 or 4
    group_size: int  # in, for one scale per output channel

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, not {self.bits}")
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, not {self.q.dtype} {tuple(self.q.shape)}")
        groups = -(-self.q.shape[1] // self.group_size)
        expected = (self.q.shape[0], groups)
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != expected or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {expected}, not {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        """Bytes this object holds: q one integer a byte (4-bit ones too, until a kernel packs
        them two to a byte), scales and mins in float32."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None)

    def _per_weight(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None:
            t = t[rows]
        return t.repeat_interleave(self.group_size, dim=-1)[..., : self.q.shape[1]]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (its `rows` only, when given: an embedding lookup)."""
        q = self.q if rows is None else self.q[rows]
        w = q.float() * self._per_weight(self.scales, rows)
        if self.mins is not None:
            w = w + self._per_weight(self.mins, rows)
        return w

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered (a fused projection's parts, GGUF's
        rotary permutation undone)."""
        return QuantizedWeight(self.q[index], self.scales[index],
                               None if self.mins is None else self.mins[index], self.bits, self.group_size)

    def regroup(self, group_size: int, bits: int, with_mins: bool) -> QuantizedWeight:
        """The same numbers in smaller groups (`group_size` dividing this one's), wider integers
        or with zero mins: w = scale * q + 0 is scale * q to the bit. For fusing parts of
        different block types (a Q4_K_M file's q|k|v with a Q6_K v)."""
        k = self.shape[1]
        if self.group_size % group_size or (k % self.group_size and self.group_size != group_size) or bits < self.bits:
            raise ValueError(f"cannot regroup {self.bits}-bit groups of {self.group_size} as {bits}-bit groups of {group_size}")
        repeat = self.group_size // group_size
        scales = self.scales.repeat_interleave(repeat, dim=1)
        mins = self.mins.repeat_interleave(repeat, dim=1) if self.mins is not None else (
            torch.zeros_like(scales) if with_mins else None)
        return QuantizedWeight(self.q, scales.contiguous(), None if mins is None else mins.contiguous(), bits, group_size)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts stacked along `out` (q|k|v, gate|up), in the widest integers and the smallest
        groups among them, with mins if any has them."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("fused parts must share their input size")
        bits, group = max(p.bits for p in parts), min(p.group_size for p in parts)
        with_mins = any(p.mins is not None for p in parts)
        parts = [p if (p.bits, p.group_size, p.mins is not None) == (bits, group, with_mins)
                 else p.regroup(group, bits, with_mins) for p in parts]
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.mins for p in parts]) if with_mins else None, bits, group)


def _group_values(scales: torch.Tensor, mins: torch.Tensor | None, grouped: bool):
    """A quantizer's scales (and mins), float32 tensors of values float16 holds where every one
    fits it (normal, or a group of one value's), as GGUF, AWQ and GPTQ store theirs: then the CPU
    packing keeps them in half the bytes (a group of 128 int4 weights reads 68 bytes, not 72), which
    a decode step that streams its weights from memory runs in proportionally less time. Per output
    channel there is one scale a row, no bytes worth saving: float32 as computed."""
    half = torch.finfo(torch.float16)
    flat = scales == 0  # a group of one value: its min carries it, any scale will do
    fits = grouped and bool(((scales >= half.tiny) | flat).all()) and bool((scales <= half.max).all()) and (
        mins is None or bool((mins.abs() <= half.max).all()))
    if not fits:
        return scales.clamp_min(torch.finfo(torch.float32).tiny), mins
    scales = scales.masked_fill(flat, half.tiny).half().float()
    return scales, None if mins is None else mins.half().float()


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [out, in]: 8 bits symmetric, one scale
    per group (per output channel when group_size is None); 4 bits asymmetric, a scale and a
    min per group, the group's range mapped onto 0..15."""
    w = weight.detach().float()
    out, k = w.shape
    group = k if group_size is None else group_size
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - k))
    g = padded.view(out, groups, group)
    if bits == 8:
        # The padding's zeros change no group's max.
        scales, _ = _group_values(g.abs().amax(dim=-1) / 127.0, None, group_size is not None)
        q = torch.round(g / scales[..., None]).clamp(-127, 127)
        mins = None
    elif bits == 4:
        # The padding must not widen the last group's range: repeat its last real value.
        if groups * group != k:
            padded[:, k:] = w[:, -1:]
            g = padded.view(out, groups, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scales, mins = _group_values((hi - lo) / 15.0, lo, group_size is not None)
        # Codes against the scale and min as stored: a min rounded up puts the group's low end below 0.
        q = torch.round((g - mins[..., None]) / scales[..., None]).clamp(0, 15)
    else:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    q = q.reshape(out, groups * group)[:, :k].to(torch.int8).contiguous()
    return QuantizedWeight(q, scales.contiguous(), None if mins is None else mins.contiguous(), bits, group)


def quantize_rows_int8(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as int8 in blocks of `block` inputs along each row (None: each row whole), each
    block symmetric: inv = 127 / max|block| (float32), q = round(x * inv) (ties to even; a block of
    zeros stays zero), and the block's scale max|block| * fl(1 / 127) (a product, which no
    compiler's fast math rewrites). Returns (q int8 [M, K], scales float32 [M, blocks]): the
    activations of `int8_activation_linear`."""
    xf = x.float()
    k = xf.shape[-1]
    size = k if block is None else block
    blocks = -(-k // size)
    padded = torch.nn.functional.pad(xf, (0, blocks * size - k)).view(xf.shape[0], blocks, size)
    amax = padded.abs().amax(dim=-1)
    # A quotient of two tensors: torch runs a scalar over a tensor as a reciprocal times the scalar.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(padded * inv[..., None]).to(torch.int8).view(xf.shape[0], -1)[:, :k]
    scales = amax * torch.tensor(1.0 / 127.0, dtype=torch.float32)
    return q, scales


def int8_activation_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) with int8 activations (the engine's `activation_quantization`
    int8, kernels/cpu/gemm_int8_dots.cpp's numerics, to the bit): x quantized by
    `quantize_rows_int8` in blocks of the weight's groups (scales t); per group g in order, the
    exact integer dot product d of the integers and, with mins, the group's sum s of x's integers,
    acc = fma(fl(scale_g * t_g), float(d), acc) then acc = fma(min_g, fl(t_g * float(s)), acc) from
    zero; out = acc (+ bias), in x's dtype. The integers are summed exactly in float64; a fused
    multiply-add is a float64 product and sum rounded once to float32 (the product of two float32
    is exact in float64)."""
    shape, k = x.shape, x.shape[-1]
    rows = x.reshape(-1, k)
    group = weight.group_size
    groups = -(-k // group)
    q, scales = quantize_rows_int8(rows, group)
    pad = groups * group - k
    qx = torch.nn.functional.pad(q.double(), (0, pad)).view(-1, groups, group)
    qw = torch.nn.functional.pad(weight.q.double(), (0, pad)).view(-1, groups, group)
    dots = torch.einsum("mgk,ngk->mgn", qx, qw).float().double()  # float(d): int32 to float32
    min_factors = scales * qx.sum(dim=-1).float()
    acc = torch.zeros(rows.shape[0], weight.q.shape[0], dtype=torch.float32)
    for g in range(groups):
        factor = weight.scales[None, :, g] * scales[:, g, None]  # float32 [M, N]
        acc = (factor.double() * dots[:, g] + acc.double()).float()
        if weight.mins is not None:
            acc = (weight.mins[:, g].double() * min_factors[:, g, None].double() + acc.double()).float()
    out = acc
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], -1)
