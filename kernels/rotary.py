"""Rotary position embedding (RoPE) with a precomputed cos/sin cache.

`cos_sin_cache[p]` = [cos(p * inv_freq), sin(p * inv_freq)] (rotary_dim / 2 each), built
once by `build_cos_sin_cache` exactly as HF `LlamaRotaryEmbedding` computes its cos/sin
(float32, `position.float() * inv_freq`), including HF's "llama3", "linear", "yarn" and
"longrope" (within the pretraining context) scaling; YaRN's and LongRoPE's attention factor
scales cos and sin, as HF does.
Neox style (`is_neox=True`, HF Llama's `rotate_half`) rotates pairs (i, i + rotary_dim/2);
GPT-J style rotates pairs (2i, 2i + 1). Dimensions past rotary_dim pass through.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cpu_ext
from .kv_store import QuantizedKV, store_kv_reference
from .triton_utils import launch, next_power_of_2


def _inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are scaled by (YaRN's attention
    factor; 1 for the others), in transformers' operations and order."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    dim = int(head_dim * scaling.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        # Same operations, in the same order, as transformers' _compute_llama3_parameters.
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0
    if rope_type == "yarn":
        return _yarn(dim, base, scaling)
    if rope_type == "longrope":
        return _longrope_short(dim, base, scaling)
    raise NotImplementedError(f"rope scaling type {rope_type!r} (supported: default, linear, llama3, yarn, longrope)")


def _longrope_short(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's "su"/"longrope") within the pretraining context: the short factors,
    which transformers uses until a sequence passes original_max_position_embeddings (the loader
    keeps max_model_len within it), and the attention factor of the extended context. Same
    operations, in the same order, as transformers' _compute_longrope_parameters."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**inv_freq_shape), attention_factor


def _yarn(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies past the correction range interpolated by `factor`,
    those below it kept, a linear ramp between; cos and sin scaled by the attention factor.
    Same operations, in the same order, as transformers' _compute_yarn_parameters."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        def mscale_of(scale: float, mscale: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else mscale_of(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def build_cos_sin_cache(head_dim: int, max_position: int, base: float,
                        rope_scaling: dict | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[max_position, rotary_dim]: cos in the first half, sin in the second.

    Computed in float32 like HF (then cast to `dtype`, float32 by default; HF casts cos/sin
    to the activations' dtype at use, which `rotary_embedding_reference` does too).
    """
    inv_freq, attention_factor = _inv_freq(head_dim, base, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1).to(dtype)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                      head_size: int | None, is_neox: bool) -> torch.Tensor:
    shape = x.shape
    num_tokens = shape[0]
    x3 = x if x.dim() == 3 else x.view(num_tokens, -1, head_size or rotary_dim)
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = rotary_dim // 2
    if is_neox:
        x1, x2 = x3[..., :half], x3[..., half:rotary_dim]
    else:
        x1, x2 = x3[..., 0:rotary_dim:2], x3[..., 1:rotary_dim:2]
    # HF: q * cos + rotate_half(q) * sin, term by term in the activations' dtype.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    if rotary_dim < x3.shape[-1]:
        rotated = torch.cat([rotated, x3[..., rotary_dim:]], dim=-1)
    return rotated.reshape(shape)


def rotary_embedding_reference(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               cos_sin_cache: torch.Tensor, is_neox: bool = True,
                               head_size: int | None = None):
    """Returns rotated (query, key), new tensors of the input shapes ([T, H*D] or [T, H, D]).

    For 2-D inputs the head size is `head_size`, or rotary_dim when not given.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.reshape(-1).to(torch.int64))
    cos, sin = cs[:, :rotary_dim // 2], cs[:, rotary_dim // 2:]
    return (_rotate_reference(query, cos, sin, rotary_dim, head_size, is_neox),
            _rotate_reference(key, cos, sin, rotary_dim, head_size, is_neox))


def rotary_store_kv_cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """The CPU production path of `kernels.rotary_store_kv`: one C++ pass per token
    (kernels/cpu/layer_ops.cpp), bit-identical to `rotary_embedding_reference` followed by
    `store_kv_reference`, which it is where the C++ kernels could not be built."""
    module = cpu_ext.load()
    if module is None or cos_sin_cache.dtype != torch.float32 or query.dim() != 3:
        query, key = rotary_embedding_reference(positions, query, key, cos_sin_cache, is_neox)
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
        return query
    if isinstance(k_cache, QuantizedKV):
        return module.rotary_store_kv(positions.to(torch.int64), query, key, value, cos_sin_cache, k_cache.data,
                                      v_cache.data, slot_mapping.to(torch.int64), is_neox, k_cache.scale, v_cache.scale)
    return module.rotary_store_kv(positions.to(torch.int64), query, key, value, cos_sin_cache, k_cache, v_cache,
                                  slot_mapping.to(torch.int64), is_neox)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, IS_NEOX: tl.constexpr,
):
    # One program per token: all query heads, then all key heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_valid = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_valid, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_valid, other=0.0).to(tl.float32)[None, :]
    if IS_NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1

    h = tl.arange(0, BLOCK_HQ)[:, None]
    mask = (h < num_q_heads) & i_valid[None, :]
    src = q_ptr + t * stride_qt + h * stride_qh
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * stride_qot + h * stride_qoh
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    h = tl.arange(0, BLOCK_HK)[:, None]
    mask = (h < num_k_heads) & i_valid[None, :]
    src = k_ptr + t * stride_kt + h * stride_kh
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = k_out_ptr + t * stride_kot + h * stride_koh
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)


def rotary_embedding_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            cos_sin_cache: torch.Tensor, is_neox: bool = True,
                            head_size: int | None = None):
    """Triton version of `rotary_embedding_reference` (computes in float32, rounds once)."""
    rotary_dim = cos_sin_cache.shape[-1]
    num_tokens = query.shape[0]
    size = head_size or rotary_dim

    def heads(x):
        x3 = x if x.dim() == 3 else x.view(num_tokens, -1, size)
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
        # Dimensions past rotary_dim pass through: start from a copy when there are any.
        out = x3.clone() if rotary_dim < x3.shape[-1] else torch.empty_like(x3)
        return x3, out

    q3, q_out = heads(query)
    k3, k_out = heads(key)
    if num_tokens > 0:
        cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
        pos = positions.reshape(-1)
        launch(
            _rotary_kernel, (num_tokens,),
            pos, q3, k3, q_out, k_out, cache,
            q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
            q3.shape[1], k3.shape[1],
            HALF=rotary_dim // 2, HALF_PAD=next_power_of_2(rotary_dim // 2),
            BLOCK_HQ=next_power_of_2(q3.shape[1]), BLOCK_HK=next_power_of_2(k3.shape[1]),
            IS_NEOX=is_neox, num_warps=4,
        )
    return q_out.view(query.shape), k_out.view(key.shape)
