"""Write new K/V rows into the paged KV cache.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; token t goes to
slot `slot_mapping[t] = block_id * block_size + offset`; slots < 0 are padding and skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import launch, next_power_of_2


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: `k_cache[slot // bs, slot % bs] = key[t]` (and V) for every slot >= 0."""
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    num_heads, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of `store_kv_reference` (same signature, in place)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slot_mapping.shape[0] == num_tokens
    launch(
        _store_kv_kernel, (num_tokens,),
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_heads, k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_heads), BLOCK_D=next_power_of_2(head_dim),
    )
