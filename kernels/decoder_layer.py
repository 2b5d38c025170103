"""A Llama-family decoder layer as one C++ call on the CPU (kernels/cpu/decoder_layer.cpp).

The layer's kernels are the ones `backend/models/llama.py`'s modules call, in the same order, so
its output is theirs to the bit; one call per layer spares the Python between them (nn.Module
calls, the wrappers' checks and no-op conversions): ~120 us a layer, a quarter of a decode step
at batch 1 for SmolLM2-135M.

    layer = cpu_decoder_layer(input_norm, post_norm, eps, qkv, o, gate_up, down, num_heads,
                              num_kv_heads, head_dim, scale, q_norm=None, k_norm=None, window=0)
    layer = cpu_decoder_layer(input_norm, post_norm, eps, qkv, o, None, None, num_heads, num_kv_heads,
                              head_dim, scale, experts=cpu_moe_experts(...))    (a MoE layer)
    step = cpu_step_meta(positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                         seg_indptr=None, seg_adapter=None)
    hidden, residual = layer.forward(hidden, residual_or_None, k_cache, v_cache, step)
    hidden, residual = layer.forward(hidden, residual_or_None, kv.data, vv.data, step, kv.scale, vv.scale)
                                                            (quantized KV: QuantizedKV kv and vv)

Each projection is a `(PackedWeight, bias, lora)` triple, `lora` None or, where LoRA adapters
are loaded on it, `(packed, slice_offsets, rank)` in kernels/lora.py's terms (`packed[a]`:
adapter a's `(lora_a, [lora_b per slice])`); a step's LoRA segments (`seg_indptr`,
`seg_adapter`) then go into its `cpu_step_meta`, and each segment's delta is added as
`lora_delta_cpu` adds it. `window` > 0: a sliding-window layer, each token attending to its last
`window` positions (paged_attention's). A mixture-of-experts layer passes its routed experts'
`cpu_moe_experts` block for gate_up and down. `cpu_decoder_layer` answers None where the layer cannot run in one
call: no C++ kernels, a weight not in a panel GEMM's layout (the float one's, or quantized
weights' `quant_panels`: LoRA adapters stay float over a quantized base), or norm weights of another dtype
than the layer's.
"""

from __future__ import annotations

import torch

from . import cpu_ext
from .linear import PackedWeight


def _projection(module, packed: PackedWeight | None, bias: torch.Tensor | None):
    if packed is None or packed.kind not in ("panels", "quant_panels"):
        return None
    if bias is not None and packed.upcast:
        bias = bias.float()
    n = packed.shape_only.shape[0]
    if packed.kind == "quant_panels":
        return module.Projection.quantized(packed.data, packed.scales, packed.mins, packed.bits, packed.group_size,
                                           bias, n, int(packed.isa), packed.upcast, packed.vector_rows,
                                           int(packed.vector_isa))
    return module.Projection(packed.data, bias, n, int(packed.isa), packed.upcast, packed.vector_rows,
                             int(packed.vector_isa))


def _lora_projection(module, lora):
    """None where any adapter weight is not in the panel GEMM's layout."""
    packed, slice_offsets, rank = lora
    a = [_projection(module, packed_a, None) for packed_a, _ in packed]
    b = [[_projection(module, packed_b, None) for packed_b in slices] for _, slices in packed]
    if any(p is None for p in a) or any(p is None for slices in b for p in slices):
        return None
    return module.LoraProjection(a, b, list(slice_offsets), rank)


def cpu_decoder_layer(input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                      qkv: tuple, o: tuple, gate_up: tuple | None, down: tuple | None, num_heads: int,
                      num_kv_heads: int, head_dim: int, scale: float, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, is_neox: bool = True, window: int = 0, experts=None):
    module = cpu_ext.load()
    if module is None:
        return None
    norms = [input_norm, post_norm] + ([q_norm, k_norm] if q_norm is not None else [])
    if any(n.dtype != qkv[0].shape_only.dtype for n in norms):
        return None  # the C++ RMSNorm wants the weight in x's dtype (rms_norm_cpu falls back to the reference)
    given = [qkv, o] if experts is not None else [qkv, o, gate_up, down]
    projections = [_projection(module, packed, bias) for packed, bias, _ in given]
    loras = [None if lora is None else _lora_projection(module, lora) for _, _, lora in given]
    if any(p is None for p in projections) or any(
            lora is None for (_, _, wanted), lora in zip(given, loras) if wanted is not None):
        return None
    if experts is not None:
        projections += [None, None]
    lanes = 16 if cpu_ext.vector_isa() >= cpu_ext.Isa.AVX512 else 8
    return module.DecoderLayer(input_norm, post_norm, eps, *projections, num_heads, num_kv_heads, head_dim, scale,
                               q_norm, k_norm, is_neox, lanes, loras, window, experts)


def cpu_step_meta(positions: torch.Tensor, cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seg_indptr: torch.Tensor | None = None, seg_adapter: torch.Tensor | None = None):
    """What every layer of a step shares: int64 positions and slot mapping, int32 block tables,
    sequence lengths and query offsets, the float32 cos/sin cache; in a step with LoRA
    adapters, its segments (kernels/lora.py)."""
    return cpu_ext.load().StepMeta(positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                                   seg_indptr, seg_adapter)


def cpu_moe_experts(router: PackedWeight | None, gate_up: list[PackedWeight | None], down: list[PackedWeight | None],
                    top_k: int, renormalize: bool, float32_weights: bool):
    """A mixture-of-experts MLP as one C++ call (kernels/cpu/decoder_layer.cpp's MoeExperts:
    `forward(x)`), the modules' bits without their Python per expert; None where any weight is
    not in a panel GEMM's layout or there are no C++ kernels."""
    module = cpu_ext.load()
    if module is None:
        return None
    projections = [_projection(module, packed, None) for packed in (router, *gate_up, *down)]
    if any(p is None for p in projections):
        return None
    experts = len(gate_up)
    return module.MoeExperts(projections[0], projections[1:1 + experts], projections[1 + experts:], top_k, renormalize,
                             float32_weights)
