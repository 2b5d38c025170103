"""Write new K/V rows into the paged KV cache.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; token t goes to
slot `slot_mapping[t] = block_id * block_size + offset`; slots < 0 are padding and skipped.

A cache is either a tensor in the model's dtype or a `QuantizedKV` (kv_cache_dtype int8,
fp8_e4m3 or fp8_e5m2, a `KVQuantDtype`): every (token, KV head) row stored as one byte a
value with one float32 scale, symmetric, `row ~= decode(q) * scale`,
`scale = max|row| / KVQuantDtype.max`. The store quantizes as it writes and the attention
kernels de-quantize as they read, behind the same signatures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import cpu_ext
from .triton_utils import launch, next_power_of_2


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               pin_memory: bool = False) -> torch.Tensor:
    """A zeroed KV pool tensor. On the CPU it lies on transparent huge pages (huge_pages.cpp: the
    kernels read its blocks in no order, and on 4 KiB pages they wait on page walks); pinned
    memory is CUDA's allocation, and without the C++ kernels it is torch's."""
    module = cpu_ext.load() if torch.device(device).type == "cpu" and not pin_memory else None
    if module is None:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    return module.huge_page_zeros(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


@dataclass(frozen=True)
class KVQuantDtype:
    """A quantized KV element: `storage` bytes holding `row / scale`, `scale = max|row| / max`.
    int8 rounds half to even onto the integers; the fp8 formats round to nearest even in their
    own grid and saturate at their largest finite value (torch's cast of the clamped value, to
    the bit). Every format keeps a scale per (token, KV head): one block layout and one
    de-quantization (`decode(q) * scale`) on every path. vLLM stores fp8_e5m2 as a plain cast
    with no scale; here e5m2 scales too, which costs nothing the layout does not already hold
    and never loses to the plain cast: a row's largest value lands on e5m2's largest, so no row
    overflows to infinity and tiny rows stay out of e5m2's subnormals."""
    name: str             # the kv_cache_dtype value (vLLM's cache_dtype)
    storage: torch.dtype
    max: float            # the largest magnitude `storage` holds (what a row's largest maps to)

    @property
    def rounds_to_integers(self) -> bool:
        return not self.storage.is_floating_point

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their row's scale -> `storage`."""
        if self.rounds_to_integers:
            return torch.round(scaled).clamp_(-self.max, self.max).to(self.storage)
        return scaled.clamp(-self.max, self.max).to(self.storage)


INT8 = KVQuantDtype("int8", torch.int8, 127.0)
FP8_E4M3 = KVQuantDtype("fp8_e4m3", torch.float8_e4m3fn, 448.0)
FP8_E5M2 = KVQuantDtype("fp8_e5m2", torch.float8_e5m2, 57344.0)
KV_QUANT_DTYPES = {kind.name: kind for kind in (INT8, FP8_E4M3, FP8_E5M2)}
_BY_STORAGE = {kind.storage: kind for kind in KV_QUANT_DTYPES.values()}


@dataclass(frozen=True)
class QuantizedKV:
    """A paged K or V cache of quantized rows (one byte a value, `kind.storage`) and their
    float32 scales. Each block's bytes hold its rows ([block_size, Hkv, D]) and then their
    scales ([block_size, Hkv] float32), so a block is self-contained: swapping, copying
    (copy-on-write) or moving block b is moving `blocks[b]`. `data` and `scale` are views of
    `blocks` for the kernels."""
    blocks: torch.Tensor  # uint8 [num_blocks, block_bytes]
    data: torch.Tensor    # kind.storage [num_blocks, block_size, Hkv, D], block stride block_bytes
    scale: torch.Tensor   # float32 [num_blocks, block_size, Hkv], block stride block_bytes / 4

    @staticmethod
    def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return block_size * num_kv_heads * (head_dim + 4)

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kind: KVQuantDtype,
              device: torch.device | str = "cpu", pin_memory: bool = False) -> QuantizedKV:
        assert head_dim % 4 == 0, "the scales start at a 4-byte boundary"
        blocks = pool_zeros((num_blocks, cls.block_bytes(block_size, num_kv_heads, head_dim)), torch.uint8, device,
                            pin_memory)
        return cls.of(blocks, block_size, num_kv_heads, head_dim, kind)

    @classmethod
    def of(cls, blocks: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
           kind: KVQuantDtype) -> QuantizedKV:
        num_blocks, rows = blocks.shape[0], block_size * num_kv_heads * head_dim
        data = blocks[:, :rows].view(kind.storage).view(num_blocks, block_size, num_kv_heads, head_dim)
        scale = blocks[:, rows:].view(torch.float32).view(num_blocks, block_size, num_kv_heads)
        return cls(blocks, data, scale)

    @property
    def kind(self) -> KVQuantDtype:
        return _BY_STORAGE[self.data.dtype]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [len(block_ids) (default: all), block_size, Hkv, D]."""
        data, scale = self.data, self.scale
        if block_ids is not None:
            data, scale = data.index_select(0, block_ids), scale.index_select(0, block_ids)
        return dequantize_kv_rows(data, scale)


def kv_storage(cache: torch.Tensor | QuantizedKV) -> torch.Tensor:
    """The tensor whose rows are the cache's blocks (what swapping and copying move)."""
    return cache.blocks if isinstance(cache, QuantizedKV) else cache


def quantize_kv_rows(x: torch.Tensor, kind: KVQuantDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (kind.storage [..., D], float32 scales [...]): each row over its own largest
    magnitude, in float32."""
    x = x.float()
    scale = x.abs().amax(-1) / kind.max
    return kind.encode(x / torch.where(scale > 0, scale, 1.0)[..., None]), scale


def dequantize_kv_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                       v_cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """In place: `k_cache[slot // bs, slot % bs] = key[t]` (and V) for every slot >= 0."""
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if isinstance(k_cache, QuantizedKV):
        for x, cache in ((key, k_cache), (value, v_cache)):
            q, scale = quantize_kv_rows(x, cache.kind)
            cache.data[blocks, offsets] = q
            cache.scale[blocks, offsets] = scale
        return
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    num_heads, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT_MAX: tl.constexpr,        # KVQuantDtype.max; 0: a cache in the model's dtype
    MANTISSA_BITS: tl.constexpr,    # fp8's; -1: int8 (a grid of the integers)
    MIN_EXPONENT: tl.constexpr,     # fp8's smallest normal exponent (its subnormals' step: 2^(it - mantissa bits))
):
    # One program per token: all of its heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A padding token (slot < 0) masks out all of its heads. (Folding the condition into the
    # head bound keeps every mask a comparison of blocks: the interpreter mis-types
    # `block_mask & scalar_mask` as int32.)
    heads = tl.where(slot >= 0, num_heads, 0)
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if QUANT_MAX > 0:
        # Each row over its largest magnitude, as `quantize_kv_rows`, then each value rounded half
        # to even onto the format's grid: steps of 1 (int8) or of 2^(exponent - mantissa bits)
        # (fp8; below the normals, the smallest normal's), spelled out on the magnitude (the
        # interpreter has no rint, and its float32 -> fp8 cast drops the carry of a mantissa that
        # rounds up into the exponent), so that the cast to fp8 is exact; then the clamp to the
        # format's largest, and the sign put back bit for bit (a value that rounds to zero keeps
        # it, as torch's cast does).
        # Written out for K and V: a jit helper of this module would not run in the interpreter
        # that a CPU launch wraps the kernel in.
        k = k.to(tl.float32)
        k_scale = tl.max(tl.abs(k), 1) / QUANT_MAX
        k = k / tl.where(k_scale > 0.0, k_scale, 1.0)[:, None]
        if MANTISSA_BITS >= 0:
            k_exp = tl.maximum((k.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXPONENT + 127)
            k_step = ((k_exp - MANTISSA_BITS) << 23).to(tl.float32, bitcast=True)
        else:
            k_step = tl.full(k.shape, 1.0, tl.float32)
        k_sign = (k.to(tl.int32, bitcast=True) >> 31) << 31
        k = tl.abs(k) / k_step
        k_round = tl.floor(k + 0.5)
        k_odd = (k_round - 2.0 * tl.floor(k_round * 0.5)) != 0.0
        k = tl.minimum(tl.where(((k_round - k) == 0.5) & k_odd, k_round - 1.0, k_round) * k_step, QUANT_MAX)
        k = (k.to(tl.int32, bitcast=True) | k_sign).to(tl.float32, bitcast=True)
        v = v.to(tl.float32)
        v_scale = tl.max(tl.abs(v), 1) / QUANT_MAX
        v = v / tl.where(v_scale > 0.0, v_scale, 1.0)[:, None]
        if MANTISSA_BITS >= 0:
            v_exp = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXPONENT + 127)
            v_step = ((v_exp - MANTISSA_BITS) << 23).to(tl.float32, bitcast=True)
        else:
            v_step = tl.full(v.shape, 1.0, tl.float32)
        v_sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
        v = tl.abs(v) / v_step
        v_round = tl.floor(v + 0.5)
        v_odd = (v_round - 2.0 * tl.floor(v_round * 0.5)) != 0.0
        v = tl.minimum(tl.where(((v_round - v) == 0.5) & v_odd, v_round - 1.0, v_round) * v_step, QUANT_MAX)
        v = (v.to(tl.int32, bitcast=True) | v_sign).to(tl.float32, bitcast=True)
        hs = tl.arange(0, BLOCK_H)
        tl.store(k_scale_ptr + blk * stride_ksb + off * stride_kss + hs, k_scale, mask=hs < heads)
        tl.store(v_scale_ptr + blk * stride_vsb + off * stride_vss + hs, v_scale, mask=hs < heads)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor | QuantizedKV,
                    v_cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Triton version of `store_kv_reference` (same signature, in place)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    kind = k_cache.kind if isinstance(k_cache, QuantizedKV) else None
    if kind is not None:
        k_scale, v_scale = k_cache.scale, v_cache.scale
        k_cache, v_cache = k_cache.data, v_cache.data
    else:
        k_scale = v_scale = k_cache  # not read
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slot_mapping.shape[0] == num_tokens
    launch(
        _store_kv_kernel, (num_tokens,),
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        num_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads), BLOCK_D=next_power_of_2(head_dim),
        **store_kv_quant_constants(kind),
    )


def store_kv_quant_constants(kind: KVQuantDtype | None) -> dict:
    """`_store_kv_kernel`'s constants for a cache of `kind` (None: the model's dtype)."""
    if kind is None:
        return dict(QUANT_MAX=0.0, MANTISSA_BITS=-1, MIN_EXPONENT=0)
    if kind.rounds_to_integers:
        return dict(QUANT_MAX=kind.max, MANTISSA_BITS=-1, MIN_EXPONENT=0)
    info = torch.finfo(kind.storage)
    return dict(QUANT_MAX=kind.max, MANTISSA_BITS=round(-math.log2(info.eps)),
                MIN_EXPONENT=round(math.log2(info.smallest_normal)))
