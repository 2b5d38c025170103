"""Checkpoint loading: Hugging Face config + safetensors weights into our modules.

Safetensors only (a single file or shards with an index); no pickle, no remote code.
`load_arch` refuses, naming it, every architecture or config field this implementation
would get wrong. `load_model` checks that every tensor the model expects is present with
the expected shape and that every tensor in the checkpoint is used, so a wrong or
truncated checkpoint fails at load time, not with garbage text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, GenerationConfig

import kernels
from backend.models.llama import LlamaForCausalLM, ModelArch


@dataclass(frozen=True)
class _Family:
    """How one architecture wires the optional parts: a fixed bool, or the config field that decides."""

    qkv_bias: bool | str
    o_proj_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool
    # Where the sliding window comes from: "always" (Mistral: every layer when
    # sliding_window is set), "layer_types" (Qwen2/3: layers marked sliding_attention), or None.
    sliding: str | None


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": _Family("attention_bias", "attention_bias", "mlp_bias", qk_norm=False, sliding=None),
    "MistralForCausalLM": _Family(False, False, False, qk_norm=False, sliding="always"),
    "Qwen2ForCausalLM": _Family(True, False, False, qk_norm=False, sliding="layer_types"),
    "Qwen3ForCausalLM": _Family("attention_bias", "attention_bias", False, qk_norm=True, sliding="layer_types"),
}
# What kernels.build_cos_sin_cache computes exactly as transformers does.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # the same function under two names
# Buffers some exporters save that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Show a progress bar when the weights are at least this big.
PROGRESS_MIN_BYTES = 1 << 30


class CheckpointError(ValueError):
    pass


def _read_config_json(model_path: str) -> dict:
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
    try:
        hf = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"invalid config.json for {name} in {model_path}: {exc}") from None

    def refuse(field: str, value, why: str) -> CheckpointError:
        return CheckpointError(f"unsupported config field {field}={value!r} in {model_path}/config.json: {why}")

    hidden_act = getattr(hf, "hidden_act", "silu")
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        raise refuse("hidden_act", hidden_act, f"only {' / '.join(SUPPORTED_ACTIVATIONS)} is implemented")
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse("rope_scaling.rope_type", rope_type, f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise refuse("partial_rotary_factor", partial, "rotary embedding over the whole head only")
    if getattr(hf, "quantization_config", None):
        method = dict(hf.quantization_config).get("quant_method", "?")
        raise refuse("quantization_config", method, "quantized checkpoints are not supported")
    sliding_window = _sliding_window(hf, family, refuse)
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
        o_proj_bias=_flag(hf, family.o_proj_bias),
        mlp_bias=_flag(hf, family.mlp_bias),
        sliding_window=sliding_window,
    )
    return arch, hf


def _sliding_window(hf, family: _Family, refuse) -> int | None:
    """The attention window the checkpoint asks for, or None when attention is full.

    A window at least as long as max_position_embeddings can never be reached, so it is
    full attention.
    """
    window = getattr(hf, "sliding_window", None)
    if family.sliding is None:
        return None
    if family.sliding == "layer_types":
        layer_types = list(getattr(hf, "layer_types", None) or [])
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise refuse("layer_types", unknown, "only full_attention and sliding_attention layers exist here")
        if "sliding_attention" not in layer_types:
            return None
    if not window or window >= hf.max_position_embeddings:
        return None
    return int(window)


def _rope_parameters(hf) -> dict:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    params = getattr(hf, "rope_parameters", None)
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
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
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


def _part_shapes(arch: ModelArch, param_name: str, shape: torch.Size) -> list[tuple[int, ...]]:
    """The shape each checkpoint tensor of a (possibly fused) parameter must have."""
    if ".qkv_proj." in param_name:
        rows = [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    elif ".gate_up_proj." in param_name:
        rows = [arch.intermediate_size] * 2
    else:
        return [tuple(shape)]
    return [(r, *shape[1:]) for r in rows]


def _listing(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_model(model_path: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               pack_weights: bool = True) -> tuple[LlamaForCausalLM, object]:
    """Build the model for `model_path` with weights in `dtype` on `device`.

    With `pack_weights` (the serving default) the projections are packed for the CPU's GEMM
    library and their `weight` parameters keep only shapes: inspect weights with False.

    Each tensor is read once, checked, converted and moved to the device; a fused
    parameter is assembled as soon as its last part arrives, so peak memory stays near
    one copy of the weights. Raises CheckpointError naming what is wrong.
    """
    arch, hf_config = load_arch(model_path)
    if arch.sliding_window is not None and max_positions > arch.sliding_window:
        raise CheckpointError(
            f"{arch.architecture} in {model_path} uses sliding-window attention (sliding_window="
            f"{arch.sliding_window}), which this engine implements only for contexts within the window: "
            f"set max_model_len <= {arch.sliding_window} (it is {max_positions})"
        )
    files = _weight_files(model_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions)

    # checkpoint name -> (our parameter, position among its parts, expected shape)
    expected: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    parts_of: dict[str, list[str]] = {}
    for param_name, param in model.named_parameters():
        names = _checkpoint_names(param_name)
        parts_of[param_name] = names
        for i, (ckpt, shape) in enumerate(zip(names, _part_shapes(arch, param_name, param.shape))):
            expected[ckpt] = (param_name, i, shape)
    skipped = {"lm_head.weight"} if arch.tie_word_embeddings else set()

    state: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    seen: set[str] = set()
    leftover: list[str] = []
    total_bytes = sum(os.path.getsize(p) for p in files)
    with tqdm(total=total_bytes, desc="loading weights", unit="B", unit_scale=True,
              disable=total_bytes < PROGRESS_MIN_BYTES) as progress:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key not in expected:
                        if key not in skipped and not key.endswith(IGNORED_SUFFIXES):
                            leftover.append(key)
                        continue
                    if key in seen:
                        raise CheckpointError(f"tensor {key} appears twice in {model_path} (second time in {os.path.basename(path)})")
                    seen.add(key)
                    param_name, i, shape = expected[key]
                    tensor = f.get_tensor(key)
                    progress.update(tensor.numel() * tensor.element_size())
                    if tuple(tensor.shape) != shape:
                        raise CheckpointError(
                            f"tensor {key} in {os.path.basename(path)} has shape {tuple(tensor.shape)}, but "
                            f"{model_path}/config.json implies {shape}"
                        )
                    if not tensor.is_floating_point():
                        raise CheckpointError(f"tensor {key} has dtype {tensor.dtype}; expected floating-point weights")
                    parts = pending.setdefault(param_name, [None] * len(parts_of[param_name]))
                    parts[i] = tensor.to(device=device, dtype=dtype)
                    if all(p is not None for p in parts):
                        del pending[param_name]
                        state[param_name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
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
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers were made on the meta device; build the real one (float32).
    model.cos_sin_cache = kernels.build_cos_sin_cache(
        arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, torch.float32
    ).to(device)
    model.eval()
    if pack_weights:
        model.pack_weights()
    return model, hf_config
