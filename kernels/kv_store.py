"""Write new K/V rows into the paged KV cache.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; token t goes to
slot `slot_mapping[t] = block_id * block_size + offset`; slots < 0 are padding and skipped.

A cache is either a tensor in the model's dtype or a `QuantizedKV` (kv_cache_dtype int8):
every (token, KV head) row stored as int8 with one float32 scale, symmetric,
`row ~= q * scale`, `scale = max|row| / 127`. The store quantizes as it writes and the
attention kernels de-quantize as they read, behind the same signatures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_utils import launch, next_power_of_2

_INT8_MAX = 127.0


@dataclass(frozen=True)
class QuantizedKV:
    """A paged K or V cache of int8 rows and their float32 scales. Each block's bytes hold
    its rows ([block_size, Hkv, D] int8) and then their scales ([block_size, Hkv] float32),
    so a block is self-contained: swapping, copying (copy-on-write) or moving block b is
    moving `blocks[b]`. `data` and `scale` are views of `blocks` for the kernels."""
    blocks: torch.Tensor  # uint8 [num_blocks, block_bytes]
    data: torch.Tensor    # int8 [num_blocks, block_size, Hkv, D], block stride block_bytes
    scale: torch.Tensor   # float32 [num_blocks, block_size, Hkv], block stride block_bytes / 4

    @staticmethod
    def block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
        return block_size * num_kv_heads * (head_dim + 4)

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              device: torch.device | str = "cpu", pin_memory: bool = False) -> QuantizedKV:
        assert head_dim % 4 == 0, "the scales start at a 4-byte boundary"
        blocks = torch.zeros(num_blocks, cls.block_bytes(block_size, num_kv_heads, head_dim), dtype=torch.uint8,
                             device=device, pin_memory=pin_memory)
        return cls.of(blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def of(cls, blocks: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int) -> QuantizedKV:
        num_blocks, rows = blocks.shape[0], block_size * num_kv_heads * head_dim
        data = blocks[:, :rows].view(torch.int8).view(num_blocks, block_size, num_kv_heads, head_dim)
        scale = blocks[:, rows:].view(torch.float32).view(num_blocks, block_size, num_kv_heads)
        return cls(blocks, data, scale)

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


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [...]): each row over its own largest
    magnitude, in float32, rounded half to even."""
    x = x.float()
    scale = x.abs().amax(-1) / _INT8_MAX
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-_INT8_MAX, _INT8_MAX)
    return q.to(torch.int8), scale


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
            q, scale = quantize_kv_rows(x)
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
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZED: tl.constexpr,
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
    if QUANTIZED:
        # Each row over its largest magnitude, as `quantize_kv_rows`: round half to even spelled
        # out (the interpreter has no rint). Written out for K and V: a jit helper of this module
        # would not run in the interpreter that a CPU launch wraps the kernel in.
        k = k.to(tl.float32)
        k_scale = tl.max(tl.abs(k), 1) / 127.0
        k = k / tl.where(k_scale > 0.0, k_scale, 1.0)[:, None]
        k_round = tl.floor(k + 0.5)
        k_odd = (k_round - 2.0 * tl.floor(k_round * 0.5)) != 0.0
        k = tl.where(((k_round - k) == 0.5) & k_odd, k_round - 1.0, k_round)
        k = tl.minimum(tl.maximum(k, -127.0), 127.0)
        v = v.to(tl.float32)
        v_scale = tl.max(tl.abs(v), 1) / 127.0
        v = v / tl.where(v_scale > 0.0, v_scale, 1.0)[:, None]
        v_round = tl.floor(v + 0.5)
        v_odd = (v_round - 2.0 * tl.floor(v_round * 0.5)) != 0.0
        v = tl.where(((v_round - v) == 0.5) & v_odd, v_round - 1.0, v_round)
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
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
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized:
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
        QUANTIZED=quantized,
    )
