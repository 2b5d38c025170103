"""Checkpoint loading: Hugging Face config + safetensors weights, or a GGUF file, into our modules.

Safetensors (a single file or shards with an index) or GGUF; no pickle, no remote code.
Quantized checkpoints (GGUF blocks, AWQ, GPTQ, compressed-tensors) are read as integers and
served as such (backend/models/quantization.py), and the `quantization` engine parameter
quantizes a float checkpoint's projections at load.
`load_arch` refuses, naming it, every architecture or config field this implementation
would get wrong. `load_model` checks that every tensor the model expects is present with
the expected shape and that every tensor in the checkpoint is used, so a wrong or
truncated checkpoint fails at load time, not with garbage text.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import kernels
from backend.models.llama import LlamaForCausalLM, ModelArch
from backend.models.quantization import (
    PACKED_SUFFIXES,
    GgufCheckpoint,
    QuantizationError,
    check_packed_config,
    quantize_weight,
    read_packed_linear,
    resolve_gguf_path,
)
from kernels import QuantizedWeight


@dataclass(frozen=True)
class _Family:
    """How one architecture wires the optional parts: a fixed bool, or the config field that decides."""

    qkv_bias: bool | str
    o_proj_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool
    # Where the sliding window comes from (_layer_windows): "always" (Mistral, Phi-3, Mixtral,
    # Qwen3-MoE: every layer when sliding_window is set), "layer_types" (Qwen2, Qwen3, Qwen2-MoE:
    # the layers marked sliding_attention), or None (no window, or Gemma's own reading).
    sliding: str | None
    # Whether the checkpoint stores q|k|v and gate|up fused, as this model holds them (Phi-3).
    fused_checkpoint: bool = False
    # Mixture of experts: "mixtral" (every layer; block_sparse_moe.experts.E.w1/w3/w2, top-k
    # always renormalised), "qwen3_moe" (layers by decoder_sparse_step and mlp_only_layers;
    # mlp.experts.E.gate/up/down_proj, renormalised when norm_topk_prob), "qwen2_moe" (as
    # qwen3_moe, with a gated shared expert), "olmoe" (every layer), or None.
    moe: str | None = None
    # OLMoE: q and k normed over all their heads at once (qk_norm per head otherwise).
    qk_norm_over_heads: bool = False
    # Gemma: "gemma2" or "gemma3" (text); their sliding windows come from layer_types and are
    # masked in attention at any context length (ModelArch.layer_windows).
    gemma: str | None = None


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": _Family("attention_bias", "attention_bias", "mlp_bias", qk_norm=False, sliding=None),
    "MistralForCausalLM": _Family(False, False, False, qk_norm=False, sliding="always"),
    "Qwen2ForCausalLM": _Family(True, False, False, qk_norm=False, sliding="layer_types"),
    "Qwen3ForCausalLM": _Family("attention_bias", "attention_bias", False, qk_norm=True, sliding="layer_types"),
    "Phi3ForCausalLM": _Family(False, False, False, qk_norm=False, sliding="always", fused_checkpoint=True),
    "MixtralForCausalLM": _Family(False, False, False, qk_norm=False, sliding="always", moe="mixtral"),
    "Qwen3MoeForCausalLM": _Family("attention_bias", "attention_bias", False, qk_norm=True, sliding="always",
                                   moe="qwen3_moe"),
    "Qwen2MoeForCausalLM": _Family(True, False, False, qk_norm=False, sliding="layer_types", moe="qwen2_moe"),
    "OlmoeForCausalLM": _Family(False, False, False, qk_norm=False, sliding=None, moe="olmoe", qk_norm_over_heads=True),
    "Gemma2ForCausalLM": _Family("attention_bias", "attention_bias", False, qk_norm=False, sliding=None, gemma="gemma2"),
    "Gemma3ForCausalLM": _Family("attention_bias", "attention_bias", False, qk_norm=True, sliding=None, gemma="gemma3"),
}
# What kernels.build_cos_sin_cache computes exactly as transformers does.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function under two names
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
# Buffers some exporters save that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
log = logging.getLogger("inflight")

# Show a progress bar when the weights are at least this big.
PROGRESS_MIN_BYTES = 1 << 30


class CheckpointError(ValueError):
    pass


# GGUF architectures (general.architecture) -> the Hugging Face class they load as.
_GGUF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _gguf_config(gguf_path: str):
    """The model config of a GGUF file, from its metadata."""
    try:
        fields = GgufCheckpoint(gguf_path).config_fields()
        return AutoConfig.for_model(**fields)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot make a model config of {gguf_path}: {exc}") from None


def _read_config_json(model_path: str) -> dict:
    gguf_path = resolve_gguf_path(model_path)
    if gguf_path is not None:
        hf = _gguf_config(gguf_path)
        return {**hf.to_dict(), "architectures": [_GGUF_CLASSES.get(hf.model_type, hf.model_type)]}
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json in model_path {model_path!r}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def _flag(hf, value: bool | str) -> bool:
    return bool(getattr(hf, value, False)) if isinstance(value, str) else value


def load_arch(model_path: str) -> tuple[ModelArch, object]:
    """Read config.json and refuse whatever this implementation would get wrong."""
    raw = _read_config_json(model_path)
    # Check the architecture on the raw JSON first: AutoConfig would fail on an unknown
    # model_type with a message about remote code, which is not the point.
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        if len(archs) == 1:
            shown = repr(archs[0])
        else:
            shown = repr(archs) if archs else f"(none listed; model_type {raw.get('model_type')!r})"
        raise CheckpointError(
            f"unsupported architecture {shown} in {model_path}/config.json; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    name = archs[0]
    family = SUPPORTED_ARCHITECTURES[name]
    gguf_path = resolve_gguf_path(model_path)
    try:
        hf = _gguf_config(gguf_path) if gguf_path else AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"invalid config.json for {name} in {model_path}: {exc}") from None

    def refuse(field: str, value, why: str) -> CheckpointError:
        return CheckpointError(f"unsupported config field {field}={value!r} in {model_path}/config.json: {why}")

    if family.gemma:
        hidden_act = getattr(hf, "hidden_activation", None)
        if hidden_act not in GEMMA_ACTIVATIONS:
            raise refuse("hidden_activation", hidden_act, f"only {' / '.join(GEMMA_ACTIVATIONS)} is implemented")
    else:
        hidden_act = getattr(hf, "hidden_act", "silu")
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise refuse("hidden_act", hidden_act, f"only {' / '.join(SUPPORTED_ACTIVATIONS)} is implemented")
    gemma = _gemma_fields(hf, family, refuse) if family.gemma else {}
    rope = _rope_parameters(hf, family)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse("rope_scaling.rope_type", rope_type, f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("yarn", "longrope"):
        if not rope.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = getattr(hf, "original_max_position_embeddings", None)
        if not rope.get("original_max_position_embeddings"):
            raise refuse("rope_scaling.original_max_position_embeddings", None,
                         f"{rope_type} needs the pretraining context")
        if rope.get("factor") is None:  # transformers' reading: the context's growth over pretraining
            rope["factor"] = hf.max_position_embeddings / rope["original_max_position_embeddings"]
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise refuse("partial_rotary_factor", partial, "rotary embedding over the whole head only")
    qcfg = packed_quantization_config(hf)
    if qcfg is not None:
        try:
            check_packed_config(qcfg, f"{model_path}/config.json")
        except QuantizationError as exc:
            raise CheckpointError(str(exc)) from None
    layer_windows = gemma.pop("layer_windows") if family.gemma else _layer_windows(hf, family, refuse)
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise refuse("num_key_value_heads", num_kv_heads, f"must divide num_attention_heads={num_heads}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    arch = ModelArch(
        architecture=name,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rope_scaling=rope if rope_type != "default" else None,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=_flag(hf, family.qkv_bias),
        qk_norm=family.qk_norm,
        qk_norm_over_heads=family.qk_norm_over_heads,
        o_proj_bias=_flag(hf, family.o_proj_bias),
        mlp_bias=_flag(hf, family.mlp_bias),
        **_moe_fields(hf, family, refuse),
        layer_windows=layer_windows,
        **gemma,
    )
    return arch, hf


def _gemma_fields(hf, family: _Family, refuse) -> dict:
    """The ModelArch fields of Gemma 2 and Gemma 3 (text)."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise refuse("use_bidirectional_attention", True, "attention is causal here")
    layer_types = list(hf.layer_types)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise refuse("layer_types", unknown, "only full_attention and sliding_attention layers exist here")
    window = getattr(hf, "sliding_window", None)
    if "sliding_attention" in layer_types and not window:
        raise refuse("sliding_window", window, "layer_types has sliding_attention layers, which need a window")
    fields = dict(
        gemma=True,
        attention_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        attn_logit_softcapping=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        final_logit_softcapping=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        layer_windows=tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types),
    )
    if family.gemma == "gemma3":
        local = dict(hf.rope_parameters.get("sliding_attention") or {})
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            raise refuse("rope_parameters.sliding_attention.rope_type", local_type,
                         "the sliding-window layers' RoPE is unscaled here")
        fields["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
    return fields


def _moe_fields(hf, family: _Family, refuse) -> dict:
    """The ModelArch fields of a mixture-of-experts family (none for a dense one)."""
    if family.moe is None:
        return {}
    layers, shared = hf.num_hidden_layers, {}
    if family.moe == "mixtral":
        experts, moe_layers = hf.num_local_experts, tuple(range(layers))
        intermediate, norm_topk_prob, float32_weights = hf.intermediate_size, True, True
    elif family.moe == "olmoe":
        if getattr(hf, "clip_qkv", None) is not None:
            raise refuse("clip_qkv", hf.clip_qkv, "q, k and v are served unclipped")
        experts, moe_layers = hf.num_experts, tuple(range(layers))
        intermediate, norm_topk_prob, float32_weights = hf.intermediate_size, bool(hf.norm_topk_prob), False
    else:
        experts, intermediate, norm_topk_prob = hf.num_experts, hf.moe_intermediate_size, bool(hf.norm_topk_prob)
        skipped = set(getattr(hf, "mlp_only_layers", None) or ())
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        moe_layers = tuple(i for i in range(layers) if i not in skipped and experts > 0 and (i + 1) % step == 0)
        float32_weights = False
        if family.moe == "qwen2_moe":
            shared = dict(shared_expert_intermediate_size=hf.shared_expert_intermediate_size)
    top_k = hf.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise refuse("num_experts_per_tok", top_k, f"must be 1 to the number of experts ({experts})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=intermediate,
                moe_layers=moe_layers, norm_topk_prob=norm_topk_prob, router_weights_in_float32=float32_weights,
                **shared)


def packed_quantization_config(hf) -> dict | None:
    qcfg = getattr(hf, "quantization_config", None)
    if not qcfg:
        return None
    return qcfg if isinstance(qcfg, dict) else qcfg.to_dict()


def _layer_windows(hf, family: _Family, refuse) -> tuple[int, ...]:
    """Per layer, the sliding window its attention masks to (0: full), as transformers reads the
    config; () when every layer attends to the whole context.

    "always" families (Mistral, Phi-3, Mixtral, Qwen3-MoE) slide every layer whenever
    `sliding_window` is set (Qwen3-MoE's config clears it unless `use_sliding_window`);
    "layer_types" families (Qwen2, Qwen3, Qwen2-MoE) slide the layers `layer_types` marks, which
    their configs derive from `use_sliding_window` and `max_window_layers` when it is absent.
    A window at least as long as max_position_embeddings can never be reached (max_model_len is
    within it), so it is full attention.
    """
    if family.sliding is None:
        return ()
    window = getattr(hf, "sliding_window", None)
    if family.sliding == "layer_types":
        layer_types = list(getattr(hf, "layer_types", None) or [])
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise refuse("layer_types", unknown, "only full_attention and sliding_attention layers exist here")
        sliding = [t == "sliding_attention" for t in layer_types]
    else:
        sliding = [window is not None] * hf.num_hidden_layers
    if not any(sliding):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse("sliding_window", window, "sliding-window layers need a window of at least 1 position")
    if window >= hf.max_position_embeddings:
        return ()
    return tuple(window if s else 0 for s in sliding)


def _rope_parameters(hf, family: _Family | None = None) -> dict:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters (Gemma 3: one set per
    # layer type; its full-attention layers' is the model's rope_theta and rope_scaling).
    params = getattr(hf, "rope_parameters", None)
    if params and family is not None and family.gemma == "gemma3":
        return dict(params.get("full_attention") or {})
    if params:
        return dict(params)
    scaling = dict(getattr(hf, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return scaling


def eos_token_ids(model_path: str, hf_config, tokenizer) -> frozenset[int]:
    """The tokens that end a generation: generation_config.json's, else the model config's,
    else the tokenizer's."""
    ids: set[int] = set()
    try:
        eos = None if resolve_gguf_path(model_path) else GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def checkpoint_dtype(model_path: str) -> torch.dtype | None:
    """The floating dtype the weights are stored in (from config.json), or None if it does not say."""
    if resolve_gguf_path(model_path):
        return None
    raw = _read_config_json(model_path)
    name = raw.get("dtype") or raw.get("torch_dtype")
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _weight_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read the shard index {index}: {exc!r}") from None
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not os.path.isfile(os.path.join(model_path, s))]
        if absent:
            raise CheckpointError(f"{model_path}: shard(s) {absent} named in model.safetensors.index.json are missing")
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    pickles = sorted(n for n in os.listdir(model_path) if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(
            f"{model_path} has only pickle weights ({', '.join(pickles[:3])}); pickle is not loaded "
            "(it can run code): convert them to safetensors"
        )
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_path}")


# Our fused parameters and the checkpoint tensors stacked into each (along dim 0), in order.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Mixtral's names for its experts' parts and the block that holds them.
_MIXTRAL_NAMES = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                  (".down_proj.", ".w2."))


def _checkpoint_names(param_name: str, family: _Family) -> list[str]:
    """Checkpoint tensor names that make up one of our parameters."""
    if param_name.startswith("lm_head."):
        return [param_name]
    names = ["model." + param_name]
    if not family.fused_checkpoint:
        for fused, parts in _FUSED.items():
            marker = f".{fused}."
            if marker in names[0]:
                head, tail = names[0].split(marker)
                names = [f"{head}.{part}.{tail}" for part in parts]
                break
    if family.moe == "mixtral":  # every layer's MLP is its experts
        for ours, theirs in _MIXTRAL_NAMES:
            names = [n.replace(ours, theirs) for n in names]
    return names


def _part_shapes(arch: ModelArch, param_name: str, shape: torch.Size, fused_checkpoint: bool) -> list[tuple[int, ...]]:
    """The shape each checkpoint tensor of a (possibly fused) parameter must have."""
    if fused_checkpoint:
        return [tuple(shape)]
    if ".qkv_proj." in param_name:
        rows = [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    elif ".gate_up_proj." in param_name:
        rows = [shape[0] // 2] * 2
    else:
        return [tuple(shape)]
    return [(r, *shape[1:]) for r in rows]


def _listing(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_tokenizer(model_path: str, tokenizer: str = ""):
    """The tokenizer in the folder `tokenizer` names, else the checkpoint's own (a GGUF file's
    vocabulary, which transformers takes ~15 s to convert for a 49k-token one)."""
    if tokenizer:
        return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=False)
    gguf_path = resolve_gguf_path(model_path)
    if gguf_path is not None:
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path) or ".", gguf_file=os.path.basename(gguf_path))
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)


Weight = torch.Tensor | QuantizedWeight


def _may_be_quantized(param_name: str) -> bool:
    """Whether a checkpoint may store this parameter quantized: the projections, the output
    head and the embedding."""
    return param_name.endswith("_proj.weight") or param_name in ("lm_head.weight", "embed_tokens.weight")


def _quantization_at_load(param_name: str, tied: bool, quantization: str, group_size: int) -> tuple[str, int] | None:
    """What the `quantization` parameter makes of this parameter: the projections in its mode;
    the output head (the embedding, when tied) int8 per output channel in either mode, as
    llama.cpp keeps Q6_K and OpenVINO int8 for it: a decode step reads the head whole, so it is
    worth its bytes, and it is the layer most sensitive to rounding. An untied embedding stays
    float (a step reads only its batch's rows)."""
    if quantization == "none":
        return None
    if param_name.endswith("_proj.weight"):
        return quantization, group_size
    if param_name == ("embed_tokens.weight" if tied else "lm_head.weight"):
        return "int8", group_size
    return None


def _safetensors_source(model_path: str, files: list[str], hf_config, progress: tqdm
                        ) -> Iterator[tuple[str, Weight | None, torch.Tensor | None, str]]:
    """(checkpoint name, tensor, input permutation, file) for every tensor; the linear layers of
    a packed checkpoint (AWQ, GPTQ, compressed-tensors) as one QuantizedWeight under
    `<layer>.weight`, after every file was read (their parts may sit in different shards)."""
    qcfg = packed_quantization_config(hf_config)
    method = bits = group = None
    if qcfg is not None:
        method, bits, group = check_packed_config(qcfg, f"{model_path}/config.json")
    suffixes = PACKED_SUFFIXES.get(method, ())
    packed: dict[str, dict[str, torch.Tensor]] = {}
    packed_file: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                prefix, _, suffix = key.rpartition(".")
                if suffix in suffixes:
                    packed.setdefault(prefix, {})[suffix] = f.get_tensor(key)
                    packed_file[prefix] = os.path.basename(path)
                    continue
                tensor = f.get_tensor(key)
                progress.update(tensor.numel() * tensor.element_size())
                yield key, tensor, None, os.path.basename(path)
    for prefix, parts in packed.items():
        required = [s for s in suffixes if s not in ("g_idx", "weight_zero_point")]
        missing = [s for s in required if s not in parts]
        if missing:
            raise CheckpointError(f"{model_path}: {prefix} lacks {', '.join(missing)} of its {method} weight")
        try:
            weight, perm = read_packed_linear(method, bits, group, parts, qcfg, prefix)
        except QuantizationError as exc:
            raise CheckpointError(str(exc)) from None
        yield prefix + ".weight", weight, perm, packed_file[prefix]


def _gguf_source(gguf_path: str, arch: ModelArch
                 ) -> Iterator[tuple[str, Weight | None, torch.Tensor | None, str]]:
    name = os.path.basename(gguf_path)
    try:
        for key, value in GgufCheckpoint(gguf_path).tensors(arch.num_heads, arch.num_kv_heads):
            yield key, value, None, name
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None


def _fuse(param_name: str, parts: list[Weight], perms: list[torch.Tensor | None]) -> tuple[Weight, torch.Tensor | None]:
    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return a is b or (a is not None and b is not None and torch.equal(a, b))

    if not all(same(perms[0], p) for p in perms):
        raise CheckpointError(f"{param_name}: its parts read their inputs in different act-order permutations; "
                              "they must share one (they share their input)")
    if len(parts) == 1:
        return parts[0], perms[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0), perms[0]
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts), perms[0]
    raise CheckpointError(f"{param_name}: some of its parts are quantized and some are not; they must all be one or the other")


def _shape_only(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A parameter that only has a shape: where the weight lives quantized in `module.quantized`."""
    return torch.empty(1, dtype=dtype, device=device).as_strided(shape, (0,) * len(shape))


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               pack_weights: bool = True, quantization: str = "none",
               quantization_group_size: int = 128, batch_invariant: bool = True,
               activation_quantization: str = "none") -> tuple[LlamaForCausalLM, object]:
    """Build the model for `model_path` with weights in `dtype` on `device`.

    With `pack_weights` (the serving default) the projections are packed for the CPU's GEMM
    library and their `weight` parameters keep only shapes: inspect weights with False.
    Quantized weights (a quantized checkpoint, or `quantization` "int8"/"int4", the latter with
    groups of `quantization_group_size` inputs) live in their module's `quantized` and are
    packed either way; their `weight` keeps only the shape. `batch_invariant`: whether the engine
    will run batch invariant (resolve_batch_invariance's answer), which their CPU path follows.
    `activation_quantization` "int8": the quantized weights' GEMMs take x quantized to int8 in
    blocks of their groups (CPU only; refused for a model without quantized weights).

    Each tensor is read once, checked, converted and moved to the device; a fused
    parameter is assembled as soon as its last part arrives, so peak memory stays near
    one copy of the weights. Raises CheckpointError naming what is wrong.
    """
    arch, hf_config = load_arch(model_path)
    rope = arch.rope_scaling or {}
    if rope.get("rope_type") == "longrope" and max_positions > rope["original_max_position_embeddings"]:
        raise CheckpointError(
            f"{arch.architecture} in {model_path} uses LongRoPE, which this engine implements within the pretraining "
            f"context only (transformers switches to the long factors past it): set max_model_len <= "
            f"{rope['original_max_position_embeddings']} (it is {max_positions})"
        )
    gguf_path = resolve_gguf_path(model_path)
    already = "GGUF" if gguf_path else (packed_quantization_config(hf_config) or {}).get("quant_method")
    if quantization != "none" and already:
        raise CheckpointError(f"quantization={quantization!r} asks to quantize {model_path}, which is already "
                              f"quantized ({already}); set quantization to none")
    files = [gguf_path] if gguf_path else _weight_files(model_path)
    family = SUPPORTED_ARCHITECTURES[arch.architecture]
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)

    # checkpoint name -> (our parameter, position among its parts, expected shape)
    expected: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    parts_of: dict[str, list[str]] = {}
    for param_name, param in model.named_parameters():
        names = _checkpoint_names(param_name, family)
        parts_of[param_name] = names
        for i, (ckpt, shape) in enumerate(zip(names, _part_shapes(arch, param_name, param.shape,
                                                                 family.fused_checkpoint))):
            expected[ckpt] = (param_name, i, shape)
    skipped = {"lm_head.weight"} if arch.tie_word_embeddings else set()

    state: dict[str, Weight] = {}
    perms: dict[str, torch.Tensor] = {}
    pending: dict[str, list] = {}
    seen: set[str] = set()
    leftover: list[str] = []
    total_bytes = sum(os.path.getsize(p) for p in files)
    with tqdm(total=total_bytes, desc="loading weights", unit="B", unit_scale=True,
              disable=total_bytes < PROGRESS_MIN_BYTES) as progress:
        source = (_gguf_source(gguf_path, arch) if gguf_path
                  else _safetensors_source(model_path, files, hf_config, progress))
        for key, tensor, perm, where in source:
            if key not in expected:
                if key not in skipped and not key.endswith(IGNORED_SUFFIXES):
                    leftover.append(key)
                continue
            if key in seen:
                raise CheckpointError(f"tensor {key} appears twice in {model_path} (second time in {where})")
            seen.add(key)
            param_name, i, shape = expected[key]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"tensor {key} in {where} has shape {tuple(tensor.shape)}, but "
                    f"{model_path}/config.json implies {shape}"
                )
            if isinstance(tensor, torch.Tensor):
                if not tensor.is_floating_point():
                    raise CheckpointError(f"tensor {key} has dtype {tensor.dtype}; expected floating-point weights")
                tensor = tensor.to(device=device, dtype=dtype)
            elif not _may_be_quantized(param_name):
                raise CheckpointError(f"tensor {key} in {where} is quantized; only the projections, the output "
                                      "head and the embedding may be")
            parts = pending.setdefault(param_name, [[None] * len(parts_of[param_name]), [None] * len(parts_of[param_name])])
            parts[0][i], parts[1][i] = tensor, perm
            if all(p is not None for p in parts[0]):
                del pending[param_name]
                value, fused_perm = _fuse(param_name, parts[0], parts[1])
                at_load = _quantization_at_load(param_name, arch.tie_word_embeddings, quantization,
                                                quantization_group_size)
                if at_load is not None:
                    value = quantize_weight(value, *at_load)
                state[param_name] = value
                if fused_perm is not None:
                    perms[param_name] = fused_perm
        progress.update(progress.total - progress.n)  # file headers and skipped tensors
    missing = sorted(set(expected) - seen)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
    if leftover:
        problems.append(f"{len(leftover)} unexpected tensor(s) the model does not use: {_listing(sorted(leftover))}")
    if problems:
        raise CheckpointError(
            f"checkpoint {model_path} does not match its config ({arch.architecture}): " + "; ".join(problems)
        )
    quantized = {name: w for name, w in state.items() if isinstance(w, QuantizedWeight)}
    for name, w in quantized.items():
        state[name] = _shape_only(tuple(w.shape), dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    for name, w in quantized.items():
        module = model.get_submodule(name.rpartition(".")[0])
        module.quantized = w
        module.input_perm = perms.get(name)
    # Non-persistent buffers were made on the meta device; build the real one (float32).
    model.cos_sin_cache = kernels.build_cos_sin_cache(
        arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, torch.float32
    ).to(device)
    local = model.build_local_cos_sin_cache(max_positions)
    model.local_cos_sin_cache = local.to(device) if local is not None else None
    model.eval()
    int8_activations = activation_quantization == "int8"
    if int8_activations and not quantized:
        raise CheckpointError(f"activation_quantization={activation_quantization!r} applies to quantized weights, and "
                              f"{model_path} is served in float: set quantization to int8 or int4, or serve a "
                              "quantized checkpoint")
    if int8_activations and device.type != "cpu":
        raise CheckpointError(f"activation_quantization={activation_quantization!r} runs on the CPU only, not on "
                              f"{device.type}")
    if pack_weights:
        model.pack_weights(batch_invariant, int8_activations)
    else:
        model.pack_quantized_weights(batch_invariant, int8_activations)
    log.info("model weights: %.1f MiB resident (%s)", model.resident_weight_bytes() / 2**20,
             (quantization if quantization != "none" else (already or "float"))
             + (", int8 activations" if int8_activations else ""))
    return model, hf_config
