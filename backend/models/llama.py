"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3; Mixtral, Qwen3-MoE and OLMoE experts;
Gemma 2 and 3 text) over a paged KV cache.

Our own torch modules; every hot operation goes through `kernels`, which runs the
OpenAI Triton kernels on CUDA tensors and the torch references on CPU. Projections are
fused at load time (q|k|v and gate|up) so a layer makes three large matmuls, not five.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kernels


class StepInterrupted(Exception):
    """A forward pass abandoned between two layers: nothing after it may use its KV writes."""


@dataclass(frozen=True)
class ModelArch:
    """The fields of a Hugging Face config this implementation honours."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q, k and v (Qwen2 always; Llama/Qwen3 when attention_bias)
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias: o_proj has a bias too
    mlp_bias: bool = False  # Llama with mlp_bias: gate, up and down projections have biases
    # Mixture of experts (Mixtral, Qwen3-MoE): the layers in `moe_layers` route each token to
    # `num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size`; the
    # others hold a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    # OLMoE: one RMSNorm over all of q's heads and one over all of k's, before the split into heads.
    qk_norm_over_heads: bool = False
    # Qwen2-MoE: beside the routed experts, one expert every token takes, scaled by a sigmoid gate.
    shared_expert_intermediate_size: int = 0
    # Mixtral scales the experts' outputs by float32 routing weights; Qwen3-MoE first rounds
    # them to the activations' dtype.
    router_weights_in_float32: bool = False
    # Gemma 2/3: the embedding times sqrt(hidden_size); RMSNorms that scale by (1 + weight) in
    # float32; norms after attention and around the MLP too; GELU-tanh gated MLP; scores scaled
    # by query_pre_attn_scalar ** -0.5; q and k normed per head (Gemma 3).
    gemma: bool = False
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Attention and final logit soft-capping, tanh(x / cap) * cap (Gemma 2), 0: none.
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Per layer, the sliding window attention masks to (each token sees its last `window`
    # positions, at any context length), 0: full attention. Empty: every layer full.
    # Mistral, Phi-3, Mixtral, Qwen with use_sliding_window, Gemma 2/3 (backend/models/loader.py).
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the RoPE base of its sliding-window layers (the others take rope_theta and rope_scaling).
    local_rope_theta: float | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window every layer slides with, when all share one (Mistral, Phi-3 with a window,
        Qwen with every layer sliding): then no token ever reads a key more than `window - 1`
        positions back, and the KV cache may release the blocks behind that. None when some
        layer attends to the whole context (Gemma's global layers, Qwen's full layers)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and 0 not in windows else None


@dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch, shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 = do not store
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length including the new tokens
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    # Attention reduces in the same order for a token whatever chunk or batch it is in.
    batch_invariant: bool = False
    # Which tokens run which LoRA adapter; None when no scheduled request has one.
    lora: LoRABatch | None = None


@dataclass
class LoRABatch:
    """The step's tokens cut into runs that share one adapter (kernels/lora.py's segments);
    tokens of no adapter are in none."""

    seg_indptr: torch.Tensor  # int32 [num_segments + 1]
    seg_adapter: torch.Tensor  # int32 [num_segments], index into the stacked adapters
    max_seg_len: int  # tokens in the longest segment (the GPU kernels' grid, known without a sync)


@dataclass
class LoRAWeights:
    """Every loaded adapter's weights for one projection, stacked in kernels/lora.py's layout:
    one slice per part of a fused projection (q|k|v, gate|up), rank padded to the largest."""

    lora_a: torch.Tensor  # [num_adapters, num_slices * rank, in]
    lora_b: list[torch.Tensor]  # per slice [num_adapters, slice_out, rank], scaling folded in
    slice_offsets: list[int]
    # CPU: per adapter, (lora_a, [lora_b per slice]) packed for the panel GEMM.
    packed: list | None = None


class Linear(nn.Linear):
    """nn.Linear whose weight can be packed once for the CPU's GEMM library (kernels.linear).

    A quantized projection (backend/models/quantization.py) holds its weight in `quantized`,
    always packed; `weight` then only has the shape and the dtype the layer computes in."""

    packed: kernels.PackedWeight | None = None
    lora: LoRAWeights | None = None  # set by backend/lora.py when adapters are loaded
    quantized: kernels.QuantizedWeight | None = None
    # Act-order GPTQ: the order the quantized weight's inputs are stored in (x[:, input_perm]).
    input_perm: torch.Tensor | None = None

    def pack(self, batch_invariant: bool = True, int8_activations: bool = False) -> None:
        """`batch_invariant`: the engine's mode, which the CPU paths of a few rows follow;
        `int8_activations`: a quantized weight's calls quantize x to int8 (kernels.pack_linear_weight)."""
        if self.quantized is not None:
            self.packed = kernels.pack_linear_weight(self.quantized, dtype=self.weight.dtype, device=self.weight.device,
                                                     batch_invariant=batch_invariant, int8_activations=int8_activations)
            self.weight = nn.Parameter(self.packed.shape_only, requires_grad=False)
            return
        self.packed = kernels.pack_linear_weight(self.weight, batch_invariant=batch_invariant)
        if self.packed is not None:
            # The packed copy is the weight from now on; keep only its shape and dtype.
            self.weight = nn.Parameter(self.packed.shape_only, requires_grad=False)

    def resident_bytes(self) -> int:
        held = self.packed.nbytes if self.packed is not None else _tensor_bytes(self.weight)
        return held + (_tensor_bytes(self.bias) if self.bias is not None else 0)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gemm_input = x if self.input_perm is None else x.index_select(-1, self.input_perm)
        y = kernels.linear(gemm_input, self.weight, self.bias, self.packed)
        if lora is not None and self.lora is not None:
            w = self.lora
            kernels.lora_delta(x, y, w.lora_a, w.lora_b, w.slice_offsets, lora.seg_indptr, lora.seg_adapter,
                               w.packed, lora.max_seg_len)
        return y


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds (a shape-only view of one element: one)."""
    return t.untyped_storage().nbytes()


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be quantized (`quantized`): rows de-quantized as they are
    looked up; `weight` then only has the shape and dtype."""

    quantized: kernels.QuantizedWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(ids)
        return self.quantized.dequantize(ids.cpu()).to(device=self.weight.device, dtype=self.weight.dtype)

    def resident_bytes(self) -> int:
        return self.quantized.nbytes if self.quantized is not None else _tensor_bytes(self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised and scaled by (1 + weight) in float32, then rounded to the
    input's dtype once (Llama's rounds before its weight)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, index: int = 0):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.attention_scale if arch.attention_scale is not None else arch.head_dim**-0.5
        self.window = arch.layer_windows[index] if arch.layer_windows else 0
        self.softcap = arch.attn_logit_softcapping
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.qk_norm_over_heads = arch.qk_norm_over_heads
        if arch.qk_norm_over_heads:
            self.q_norm = RMSNorm(self.q_size, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, arch.rms_norm_eps)
        elif arch.qk_norm:
            norm = GemmaRMSNorm if arch.gemma else RMSNorm
            self.q_norm = norm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = norm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, hidden, cos_sin_cache, k_cache, v_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, meta.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_over_heads:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_over_heads:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = kernels.rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        out = kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            self.scale, meta.max_seqlen_q, meta.max_seqlen_k, meta.batch_invariant, self.window, self.softcap,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size), meta.lora)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x, lora: LoRABatch | None = None):
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x, lora)), lora)


class GeluTanhMLP(LlamaMLP):
    """Gemma's gated MLP: gelu(gate, tanh approximation) * up."""

    def forward(self, x, lora: LoRABatch | None = None):
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, lora)


def _sigmoid_by_row(gate: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid of a [T, 1] gate whose every element's bits are its own, whatever T.

    On the CPU torch's elementwise kernels run a vector body and a scalar tail whose results
    differ in the last bit (SLEEF's expf against glibc's), and a contiguous [T, 1] tensor is one
    run of T elements: where a token's gate lands, body or tail, depends on the batch around it.
    Through a view with a row stride of 2 every element takes the scalar loop."""
    if gate.device.type != "cpu":
        return torch.sigmoid(gate)
    spaced = gate.new_empty(*gate.shape[:-1], 2)[..., :1]
    spaced.copy_(gate)
    return torch.sigmoid(spaced)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts, computed as transformers computes Mixtral and Qwen3-MoE:
    router softmax in float32, top-k, optionally renormalised; each expert runs once on all the
    batch's tokens routed to it (a GEMM over those rows, through the projections' own kernels,
    so experts pack and quantize as any projection); a token's outputs are summed in expert
    order. A token's result depends only on its own row: batch-invariant wherever the GEMMs are."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(arch.hidden_size, arch.moe_intermediate_size, bias=False)
                                     for _ in range(arch.num_experts))
        if arch.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(arch.hidden_size, arch.shared_expert_intermediate_size, bias=False)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.router_weights_in_float32 = arch.router_weights_in_float32
        # CPU: the block as one C++ call (kernels.cpu_moe_experts), set by build_cpu_layers.
        self.cpu_block = None
        # GPU: every expert's gate|up and down weights stacked [E, ...] for the grouped kernel
        # (kernels.moe_experts), set by stack_experts; the experts' own weights are views of them.
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def stack_experts(self) -> None:
        """Stack float experts' weights once, for the grouped kernel (quantized ones keep the loop)."""
        projections = [p for e in self.experts for p in (e.gate_up_proj, e.down_proj)]
        if any(p.quantized is not None or p.packed is not None or p.bias is not None for p in projections):
            return
        gate_up = torch.stack([e.gate_up_proj.weight.detach() for e in self.experts])
        down = torch.stack([e.down_proj.weight.detach() for e in self.experts])
        for i, expert in enumerate(self.experts):
            expert.gate_up_proj.weight = nn.Parameter(gate_up[i], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self.stacked = (gate_up, down)

    def build_cpu_block(self) -> None:
        self.cpu_block = kernels.cpu_moe_experts(
            self.gate.packed, [e.gate_up_proj.packed for e in self.experts], [e.down_proj.packed for e in self.experts],
            self.top_k, self.norm_topk_prob, self.router_weights_in_float32)

    def forward(self, x, lora: LoRABatch | None = None):
        routed = self.cpu_block.forward(x) if self.cpu_block is not None else self._routed(x)
        if self.shared_expert is None:
            return routed
        return routed + _sigmoid_by_row(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _routed(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_in_float32:
            weights = weights.to(x.dtype)
        if self.stacked is not None:
            return kernels.moe_experts(x, chosen, weights, *self.stacked)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending: each token sums in expert order
            tokens, slot = torch.where(chosen == expert)
            y = self.experts[expert](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = (SparseMoeBlock(arch) if index in arch.moe_layers
                    else LlamaMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias))

    def forward(self, positions, hidden, residual, cos_sin_cache, k_cache, v_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, meta.lora), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3: each sublayer's output normed before it joins the residual stream (four
    norms a layer); sliding-window layers of Gemma 3 rotate with their own RoPE base."""

    def __init__(self, arch: ModelArch, index: int = 0):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, index)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GeluTanhMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.local_rope = arch.local_rope_theta is not None and self.self_attn.window > 0

    def forward(self, positions, hidden, residual, cos_sin_cache, k_cache, v_cache, meta):
        # The residual stream is `hidden` itself: `residual` is always None here.
        attn = self.self_attn(positions, self.input_layernorm(hidden), cos_sin_cache, k_cache, v_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), meta.lora)
        return hidden + self.post_feedforward_layernorm(mlp), None


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        layer = GemmaDecoderLayer if arch.gemma else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer(arch, i) for i in range(arch.num_layers))
        self.norm = (GemmaRMSNorm if arch.gemma else RMSNorm)(arch.hidden_size, arch.rms_norm_eps)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # The tied embedding packed as an output projection (the embedding keeps its own).
        self.tied_lm_head_packed: kernels.PackedWeight | None = None
        # CPU: each layer as one C++ call (kernels.cpu_decoder_layer), set by build_cpu_layers
        # where every layer can run that way; the modules stay for the steps that cannot (SDPA).
        self.cpu_layers: list | None = None
        self.register_buffer(
            "cos_sin_cache",
            kernels.build_cos_sin_cache(
                arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, torch.float32
            ),
            persistent=False,
        )
        # Gemma 3's sliding-window layers: RoPE of their own base, unscaled.
        self.register_buffer("local_cos_sin_cache", self.build_local_cos_sin_cache(max_positions), persistent=False)
        self.requires_grad_(False)

    def build_local_cos_sin_cache(self, max_positions: int) -> torch.Tensor | None:
        if self.arch.local_rope_theta is None:
            return None
        return kernels.build_cos_sin_cache(self.arch.head_dim, max_positions, self.arch.local_rope_theta, None,
                                           torch.float32)

    def pack_weights(self, batch_invariant: bool = True, int8_activations: bool = False) -> None:
        """Pack every projection for the CPU's GEMM library (on CUDA: stack the experts of a
        mixture of experts for the grouped kernel); call once, after the weights are loaded.
        `batch_invariant`: whether the engine runs batch invariant; `int8_activations`: whether the
        quantized weights take int8 activations (kernels.pack_linear_weight)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(batch_invariant, int8_activations)
        if self.embed_tokens.weight.device.type == "cuda":
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoeBlock):
                    layer.mlp.stack_experts()
        if self.lm_head is None:
            embed = self.embed_tokens
            self.tied_lm_head_packed = (kernels.pack_linear_weight(embed.weight, batch_invariant=batch_invariant)
                                        if embed.quantized is None else
                                        kernels.pack_linear_weight(embed.quantized, dtype=embed.weight.dtype,
                                                                   device=embed.weight.device,
                                                                   batch_invariant=batch_invariant,
                                                                   int8_activations=int8_activations))
        self.build_cpu_layers()

    def pack_quantized_weights(self, batch_invariant: bool = True, int8_activations: bool = False) -> None:
        """Pack only the quantized weights (which exist only packed), leaving the float ones
        inspectable."""
        for module in self.modules():
            if isinstance(module, Linear) and module.quantized is not None:
                module.pack(batch_invariant, int8_activations)
        embed = self.embed_tokens
        if self.lm_head is None and embed.quantized is not None:
            self.tied_lm_head_packed = kernels.pack_linear_weight(embed.quantized, dtype=embed.weight.dtype,
                                                                  device=embed.weight.device,
                                                                  batch_invariant=batch_invariant,
                                                                  int8_activations=int8_activations)

    def is_quantized(self) -> bool:
        return self.embed_tokens.quantized is not None or any(
            isinstance(m, Linear) and m.quantized is not None for m in self.modules())

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads as they are held: every projection and norm
        and the output head once; the embedding table only at the batch's rows (nothing)."""
        return self.resident_weight_bytes() - self.embed_tokens.resident_bytes()

    def resident_weight_bytes(self) -> int:
        """Bytes the weights hold as they are served: packed, quantized or plain."""
        total = 0
        for module in self.modules():
            if isinstance(module, (Linear, Embedding)):
                total += module.resident_bytes()
            elif isinstance(module, (RMSNorm, GemmaRMSNorm)):
                total += _tensor_bytes(module.weight)
        if self.tied_lm_head_packed is not None:
            total += self.tied_lm_head_packed.nbytes
        return total

    def build_cpu_layers(self) -> None:
        """Each layer as one C++ call where all can be (their weights packed, and LoRA adapters
        installed when there are any); call again after installing adapters."""
        if self.embed_tokens.weight.device.type != "cpu":
            self.cpu_layers = None
            return
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.build_cpu_block()
        layers = [self._cpu_layer(layer) for layer in self.layers]
        self.cpu_layers = layers if all(layer is not None for layer in layers) else None

    @staticmethod
    def _cpu_layer(layer: LlamaDecoderLayer | GemmaDecoderLayer):
        if isinstance(layer, GemmaDecoderLayer):
            return None  # Gemma's norms, GELU, window and soft-capping: the modules run them
        attn, mlp = layer.self_attn, layer.mlp
        routed = isinstance(mlp, SparseMoeBlock)
        if attn.qk_norm_over_heads or (routed and (mlp.cpu_block is None or mlp.shared_expert is not None)):
            return None  # q/k norms over all heads, or experts beyond the C++ block: the modules run them
        projections = (attn.qkv_proj, attn.o_proj) + (() if routed else (mlp.gate_up_proj, mlp.down_proj))
        if any(p.lora is not None and p.lora.packed is None for p in projections):
            return None  # adapters kept as plain tensors (not on the CPU): the modules run them
        if any(p.input_perm is not None for p in projections):
            return None  # act-order inputs: the modules gather them

        def lora(p: Linear):
            w = p.lora
            return None if w is None else (w.packed, w.slice_offsets, w.lora_a.shape[1] // len(w.lora_b))

        mlp_projections = (None, None) if routed else ()
        return kernels.cpu_decoder_layer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
            *((p.packed, p.bias, lora(p)) for p in projections), *mlp_projections,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None,
            window=attn.window, experts=mlp.cpu_block if routed else None,
        )

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        """Hidden states of every scheduled token, after the final norm. `interrupt`, asked
        before each layer, abandons the pass (StepInterrupted) when it answers True."""
        hidden = self.embed_tokens(input_ids)
        if self.arch.gemma:
            # transformers' scaled embedding: sqrt(hidden_size) rounded to the weights' dtype first.
            hidden = hidden * torch.tensor(self.arch.hidden_size**0.5).to(hidden.dtype)
        residual = None
        if (self.cpu_layers is not None
                and kernels.paged_attention_cpu_kernel_only(meta.max_seqlen_q, meta.max_seqlen_k, meta.batch_invariant)):
            lora = meta.lora
            step = kernels.cpu_step_meta(positions, self.cos_sin_cache, meta.slot_mapping, meta.block_tables,
                                         meta.seq_lens, meta.cu_seqlens_q,
                                         None if lora is None else lora.seg_indptr, None if lora is None else lora.seg_adapter)
            for layer, (k_cache, v_cache) in zip(self.cpu_layers, kv_caches):
                if interrupt is not None and interrupt():
                    raise StepInterrupted()
                if isinstance(k_cache, kernels.QuantizedKV):
                    hidden, residual = layer.forward(hidden, residual, k_cache.data, v_cache.data, step,
                                                     k_cache.scale, v_cache.scale)
                else:
                    hidden, residual = layer.forward(hidden, residual, k_cache, v_cache, step)
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                if interrupt is not None and interrupt():
                    raise StepInterrupted()
                cos_sin = self.local_cos_sin_cache if getattr(layer, "local_rope", False) else self.cos_sin_cache
                hidden, residual = layer(positions, hidden, residual, cos_sin, k_cache, v_cache, meta)
        if residual is None:  # Gemma's layers keep no separate residual
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = kernels.linear(hidden, self.embed_tokens.weight, None, self.tied_lm_head_packed)
        if self.arch.final_logit_softcapping:
            logits = soft_cap(logits, self.arch.final_logit_softcapping)
        return logits.float()
