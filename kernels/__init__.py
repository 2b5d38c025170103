"""Compute kernels of the engine: tensors in, tensors out; nothing here knows the engine.

Every operation exists twice with the same signature: `<op>_triton` (an OpenAI Triton
kernel) and `<op>_reference` (plain torch, vectorised; the production path on CPU). The
exported `<op>` dispatches on the device: CUDA tensors run the Triton kernel, anything
else the reference, or, where one exists, `<op>_cpu`: the CPU production path in C++
(kernels/cpu/, built by kernels/cpu_ext.py; paged attention (SDPA for long chunks at long
contexts), RMSNorm, RoPE fused with the KV store, SiLU-and-mul, and the panel GEMM behind
`linear`).
Tests run the Triton kernels on CPU tensors through Triton's interpreter and compare them
with the references (and the references with naive loops); inside `triton_kernels_on_cpu()`
the dispatchers send CPU tensors to the Triton kernels too, which lets a test drive the
whole engine through the CUDA path's kernels on a machine without a GPU.

    store_kv(key, value, k_cache, v_cache, slot_mapping)                      in place
        (a cache is a tensor in the model's dtype or a QuantizedKV, int8 or fp8 rows and their scales,
        which every store quantizes and every attention path de-quantizes; see kv_store.py)
    paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                    max_seqlen_q=None, max_seqlen_k=None, batch_invariant=False, window=0, softcap=0.0) -> out
    rms_norm(x, weight, eps, residual=None) -> out | (out, x + residual)
    rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True) -> (query, key)
    rotary_store_kv(positions, query, key, value, cos_sin_cache, k_cache, v_cache,
                    slot_mapping, is_neox=True) -> query     RoPE, then key and value stored
    silu_and_mul(x) -> out
    build_cos_sin_cache(head_dim, max_position, base, rope_scaling=None, dtype=float32)
    linear(x, weight, bias=None, packed=None) -> out; pack_linear_weight(weight) -> packed | None
        (CPU: weights in the GEMM library's own layout; see linear.py). `weight` may be a
        QuantizedWeight (quantized.py: int8/int4, w = scale * q + min per group), packed for
        the CPU's int8/int4 GEMM (cpu/gemm_quant.cpp) or, on CUDA, for the Triton W8A16/W4A16
        kernel (`linear_quant_triton`, linear_quant.py); both give the float GEMM's result on
        `dequantize()`'s weight (`linear_quant_reference`)
    lora_delta(x, y, lora_a, lora_b, slice_offsets, seg_indptr, seg_adapter, packed=None, max_seg_len=None)
        in place: y += each segment's adapter delta (multi-LoRA, SGMV; see lora.py)
    cpu_decoder_layer(...) -> layer | None; cpu_step_meta(...) (CPU only: a Llama decoder layer's
        kernels above in one C++ call, the same bits; see decoder_layer.py)
    cpu_moe_experts(router, gate_up, down, top_k, renormalize, float32_weights) -> block | None
        (CPU only: a mixture-of-experts MLP in one C++ call, the modules' bits)
    moe_experts(x, chosen, weights, gate_up, down) -> out (the routed experts of stacked weights,
        summed per token: the grouped Triton kernel, or the per-expert reference; see moe.py)
    cumsum_rows(x, out) -> out (CPU only: the sampler's running sums, torch.cumsum's bits;
        see sampling.py)
    keep_nucleus_(probs, top_p) -> probs, with the probabilities outside each row's top-p
        nucleus zeroed (CPU only; see sampling.py)
"""

from __future__ import annotations

import contextlib

import torch

from .activation import silu_and_mul_cpu, silu_and_mul_reference, silu_and_mul_triton
from .decoder_layer import cpu_decoder_layer, cpu_moe_experts, cpu_step_meta
from .kv_store import QuantizedKV, kv_storage, store_kv_reference, store_kv_triton
from .linear import PackedWeight, linear, pack_linear_weight
from .lora import lora_delta_cpu, lora_delta_reference, lora_delta_triton
from .moe import moe_experts_reference, moe_experts_triton
from .paged_attention import (
    paged_attention_cpu,
    paged_attention_cpu_kernel_only,
    paged_attention_reference,
    paged_attention_triton,
)
from .quantized import QuantizedWeight, quantize
from .rms_norm import rms_norm_cpu, rms_norm_reference, rms_norm_triton
from .rotary import build_cos_sin_cache, rotary_embedding_reference, rotary_embedding_triton, rotary_store_kv_cpu
from .sampling import (
    cumsum_rows,
    cumsum_rows_cpu,
    cumsum_rows_reference,
    keep_nucleus_,
    keep_nucleus_cpu,
    keep_nucleus_reference,
)

__all__ = [
    "store_kv", "paged_attention", "rms_norm", "rotary_embedding", "rotary_store_kv", "silu_and_mul",
    "build_cos_sin_cache", "linear", "pack_linear_weight", "PackedWeight", "QuantizedWeight", "quantize",
    "store_kv_reference", "store_kv_triton", "QuantizedKV", "kv_storage",
    "paged_attention_reference", "paged_attention_triton", "paged_attention_cpu",
    "rms_norm_reference", "rms_norm_triton", "rms_norm_cpu",
    "rotary_embedding_reference", "rotary_embedding_triton", "rotary_store_kv_cpu",
    "silu_and_mul_reference", "silu_and_mul_triton", "silu_and_mul_cpu",
    "lora_delta", "lora_delta_reference", "lora_delta_triton", "lora_delta_cpu",
    "cpu_decoder_layer", "cpu_moe_experts", "cpu_step_meta", "moe_experts", "moe_experts_reference",
    "moe_experts_triton", "paged_attention_cpu_kernel_only",
    "cumsum_rows", "cumsum_rows_reference", "cumsum_rows_cpu", "triton_kernels_on_cpu",
    "keep_nucleus_", "keep_nucleus_reference", "keep_nucleus_cpu",
]


_triton_on_cpu = False


@contextlib.contextmanager
def triton_kernels_on_cpu():
    """While open, the dispatchers below run the Triton kernels for CPU tensors as well
    (in Triton's interpreter, so float32 and float16 only: it has no bfloat16 arithmetic).
    For tests: the engine on a CPU then takes the kernels, strides and metadata of its CUDA
    path. Not thread-safe; the caller drives the engine from the thread that opened it."""
    global _triton_on_cpu
    previous, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = previous


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda or _triton_on_cpu


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if _triton(key):
        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    return store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float,
                    max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, batch_invariant: bool = False, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """`batch_invariant` (CPU): every token through the C++ kernel, whose order of reduction
    depends only on the token's context length, never SDPA for long chunks. `window` (> 0):
    each token sees its last `window` positions; `softcap` (> 0): Gemma 2's tanh cap on the
    scores (paged_attention.py)."""
    if _triton(query):
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                      max_seqlen_q, max_seqlen_k, window, softcap)
    return paged_attention_cpu(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                               max_seqlen_q, max_seqlen_k, batch_invariant, window, softcap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    fn = rms_norm_triton if _triton(x) else rms_norm_cpu
    return fn(x, weight, eps, residual)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True,
                     head_size: int | None = None):
    fn = rotary_embedding_triton if _triton(query) else rotary_embedding_reference
    return fn(positions, query, key, cos_sin_cache, is_neox, head_size)


def rotary_store_kv(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, is_neox: bool = True) -> torch.Tensor:
    """RoPE on query [T, Hq, D] and key [T, Hkv, D]; the rotated key and the value go into
    the paged cache at `slot_mapping` (-1: skip); returns the rotated query. One pass on
    CPU; on CUDA the two Triton kernels."""
    if _triton(query):
        query, key = rotary_embedding_triton(positions, query, key, cos_sin_cache, is_neox)
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return query
    return rotary_store_kv_cpu(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if _triton(x) else silu_and_mul_cpu(x)


def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The routed experts' outputs summed per token (moe.py): the grouped Triton kernel on GPUs."""
    if _triton(x):
        return moe_experts_triton(x, chosen, weights, gate_up, down)
    return moe_experts_reference(x, chosen, weights, gate_up, down)


def lora_delta(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b, slice_offsets, seg_indptr: torch.Tensor,
               seg_adapter: torch.Tensor, packed=None, max_seg_len: int | None = None) -> None:
    """`packed` (CPU): per adapter, its weights packed for the panel GEMM; `max_seg_len`
    (CUDA): the longest segment, which spares reading it from the device (lora.py)."""
    if _triton(x):
        return lora_delta_triton(x, y, lora_a, lora_b, slice_offsets, seg_indptr, seg_adapter, max_seg_len)
    return lora_delta_cpu(x, y, lora_a, lora_b, slice_offsets, seg_indptr, seg_adapter, packed)
