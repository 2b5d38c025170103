"""Checkpoint loading: Hugging Face config + safetensors weights into our modules.

Safetensors only (a single file or shards with an index); no pickle, no remote code.
Every tensor the model expects must be present and every tensor in the checkpoint must
be used, so a wrong or truncated checkpoint fails at load time, not with garbage text.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

import kernels
from backend.models.llama import LlamaForCausalLM, ModelArch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(attention_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(attention_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(attention_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(attention_bias=None, qk_norm=True),
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Buffers some exporters save that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


def load_arch(model_path: str) -> tuple[ModelArch, object]:
    """Read config.json and refuse whatever this implementation would get wrong."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise CheckpointError(f"no config.json in model_path {model_path!r}")
    hf = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    archs = getattr(hf, "architectures", None) or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {archs} in {model_path}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    name = archs[0]
    traits = SUPPORTED_ARCHITECTURES[name]
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "mlp_bias", False):
        raise CheckpointError("unsupported config field mlp_bias=true")
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        # Mistral/Qwen sliding window attention changes results past the window.
        window = hf.sliding_window
        if window < getattr(hf, "max_position_embeddings", 0):
            raise CheckpointError(f"unsupported config field sliding_window={window} (full attention only)")
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if getattr(hf, "quantization_config", None):
        raise CheckpointError("quantized checkpoints are not supported (quantization_config present)")
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    attention_bias = traits["attention_bias"]
    if attention_bias is None:
        attention_bias = bool(getattr(hf, "attention_bias", False))
    arch = ModelArch(
        architecture=name,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rope_scaling=rope if rope_type != "default" else None,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=traits["qk_norm"],
    )
    return arch, hf


def _rope_parameters(hf) -> dict:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf, "rope_scaling", None) or {})
    scaling.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return scaling


def _weight_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    if any(name.endswith((".bin", ".pt", ".pth")) for name in os.listdir(model_path)):
        raise CheckpointError(f"{model_path} has only pickle weights; convert them to safetensors")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_path}")


# Our fused parameters and the checkpoint tensors stacked into each, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _checkpoint_names(param_name: str) -> list[str]:
    """Checkpoint tensor names that make up one of our parameters."""
    if param_name.startswith("lm_head."):
        return [param_name]
    full = "model." + param_name
    for fused, parts in _FUSED.items():
        marker = f".{fused}."
        if marker in full:
            head, tail = full.split(marker)
            return [f"{head}.{part}.{tail}" for part in parts]
    return [full]


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, max_positions: int) -> tuple[LlamaForCausalLM, object]:
    arch, hf_config = load_arch(model_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)
    wanted: dict[str, list[str]] = {name: _checkpoint_names(name) for name, _ in model.named_parameters()}
    needed = {ckpt for names in wanted.values() for ckpt in names}

    tensors: dict[str, torch.Tensor] = {}
    files = _weight_files(model_path)
    leftover = []
    with tqdm(total=len(needed), desc="loading weights", unit="tensor", disable=len(needed) < 500) as progress:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in needed:
                        tensors[key] = f.get_tensor(key).to(dtype)
                        progress.update(1)
                    elif not key.endswith(IGNORED_SUFFIXES) and not (key == "lm_head.weight" and arch.tie_word_embeddings):
                        leftover.append(key)
    missing = sorted(needed - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {model_path} lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    if leftover:
        raise CheckpointError(f"checkpoint {model_path} has {len(leftover)} unexpected tensor(s), e.g. {sorted(leftover)[:5]}")

    state = {name: torch.cat([tensors.pop(p) for p in parts], dim=0).to(device) for name, parts in wanted.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers were made on the meta device; build the real one (float32).
    model.cos_sin_cache = kernels.build_cos_sin_cache(
        arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, torch.float32
    ).to(device)
    model.eval()
    return model, hf_config
