"""Multi-LoRA: PEFT adapters served beside one base model, chosen per request by name.

Adapters are local PEFT checkpoints (`adapter_config.json` + `adapter_model.safetensors`),
listed in the model folder's `multi_lora.json` as {"name": "/path"} (Triton's vLLM
backend's convention; backend/config.py reads it) and loaded with the engine. Each is
checked against the base model here, so a wrong adapter fails at load time with what is
wrong, never with garbage text: LoRA only (no DoRA, no biases, no modules_to_save), rank
<= max_lora_rank, targets among q/k/v/o/gate/up/down_proj, every tensor's shape what the
base model implies.

The weights are never merged into the base model. Every projection an adapter targets gets
all adapters' weights stacked (`LoRAWeights`, kernels/lora.py's layout: ranks padded to the
largest, PEFT's scaling folded into B); a fused projection (q|k|v, gate|up) gets one slice
per part, so the delta of q_proj lands on the q columns of the fused output. A step's
tokens are cut into runs that share an adapter (`LoRABatch`, built by the model runner) and
each projection adds its delta per run.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

import kernels
from backend.models.llama import LlamaForCausalLM, LoRAWeights, ModelArch

# PEFT's module name -> (our module within a decoder layer, slice of its output).
TARGET_MODULES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# Our modules and the PEFT modules that are its slices, in output order.
SLICES = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    pass


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, PEFT module) -> (A [rank, in], B [out, rank]), as stored (scaling not applied).
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def module_shape(arch: ModelArch, module: str) -> tuple[int, int]:
    """(in, out) features of one PEFT target module of the base model."""
    q, kv, h, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def load_adapter(name: str, path: str, arch: ModelArch, max_lora_rank: int) -> LoRAAdapter:
    """Read and check one PEFT LoRA checkpoint against the base model; LoRAError says what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    config_path = os.path.join(path, ADAPTER_CONFIG)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(config_path):
        raise LoRAError(f"{where}: no {ADAPTER_CONFIG}")
    if not os.path.isfile(weights_path):
        bins = [f for f in os.listdir(path) if f.endswith(".bin")]
        extra = " (pickle .bin weights are not loaded: save with safe_serialization)" if bins else ""
        raise LoRAError(f"{where}: no {ADAPTER_WEIGHTS}{extra}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{where}: cannot read {ADAPTER_CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")

    def refuse(field: str, value, why: str) -> LoRAError:
        return LoRAError(f"{where}: {ADAPTER_CONFIG} {field}={value!r}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", config.get("peft_type"), "only LORA adapters are supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", rank, "must be a positive integer")
    if rank > max_lora_rank:
        raise refuse("r", rank, f"exceeds max_lora_rank={max_lora_rank} (config.pbtxt parameter)")
    for field, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(field, ok) not in (ok, None):
            raise refuse(field, config[field], f"only {field}={ok!r} is supported")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_pattern", "layer_replication"):
        if config.get(field):
            raise refuse(field, config[field], "not supported (only plain per-module LoRA)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise refuse("target_modules", unknown, f"supported target modules: {', '.join(TARGET_MODULES)}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse("lora_alpha", alpha, "must be a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or match.group(3) not in TARGET_MODULES:
                raise LoRAError(
                    f"{where}: tensor {key} is not a LoRA weight of {'/'.join(TARGET_MODULES)} in a decoder layer"
                )
            layer, module, which = int(match.group(1)), match.group(3), match.group(4)
            if layer >= arch.num_layers:
                raise LoRAError(f"{where}: tensor {key} is for layer {layer}; the base model has {arch.num_layers} layers")
            tensor = f.get_tensor(key)
            features_in, features_out = module_shape(arch, module)
            want = (rank, features_in) if which == "A" else (features_out, rank)
            if tuple(tensor.shape) != want:
                raise LoRAError(
                    f"{where}: tensor {key} has shape {tuple(tensor.shape)}; r={rank} and the base model imply {want}"
                )
            parts.setdefault((layer, module), {})[which] = tensor.float()
    if not parts:
        raise LoRAError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise LoRAError(f"{where}: layer {layer} {module} has lora_{set(ab).pop()} but no lora_{missing}")
        weights[(layer, module)] = (ab["A"], ab["B"])
    return LoRAAdapter(name=name, path=path, rank=rank, scaling=float(scaling), weights=weights)


def install_adapters(model: LlamaForCausalLM, adapters: list[LoRAAdapter], dtype: torch.dtype,
                     device: torch.device) -> None:
    """Stack `adapters` (index i = adapters[i]) into every projection any of them targets."""
    if not adapters:
        return
    arch = model.arch
    rank = max(a.rank for a in adapters)
    pack = device.type == "cpu"
    for layer_index, layer in enumerate(model.layers):
        for module_path, slice_names in SLICES.items():
            if not any((layer_index, m) in a.weights for a in adapters for m in slice_names):
                continue
            if module_path.startswith("mlp.") and not hasattr(layer.mlp, module_path.split(".")[1]):
                raise LoRAError(f"an adapter targets {'/'.join(slice_names)} of layer {layer_index}, which routes its "
                                "MLP to experts: LoRA applies to the attention projections of a mixture-of-experts "
                                "model (target_modules among q_proj, k_proj, v_proj, o_proj)")
            features_in = module_shape(arch, slice_names[0])[0]
            outs = [module_shape(arch, m)[1] for m in slice_names]
            lora_a = torch.zeros(len(adapters), len(slice_names) * rank, features_in)
            lora_b = [torch.zeros(len(adapters), n, rank) for n in outs]
            for i, adapter in enumerate(adapters):
                for s, module in enumerate(slice_names):
                    ab = adapter.weights.get((layer_index, module))
                    if ab is None:
                        continue
                    a, b = ab
                    lora_a[i, s * rank:s * rank + adapter.rank] = a
                    lora_b[s][i, :, :adapter.rank] = b * adapter.scaling
            lora_a = lora_a.to(device=device, dtype=dtype).contiguous()
            lora_b = [b.to(device=device, dtype=dtype).contiguous() for b in lora_b]
            packed = None
            if pack:
                packed = [(kernels.pack_linear_weight(lora_a[i]), [kernels.pack_linear_weight(b[i]) for b in lora_b])
                          for i in range(len(adapters))]
            target = layer.get_submodule(module_path)
            target.lora = LoRAWeights(lora_a, lora_b, [sum(outs[:s]) for s in range(len(outs))], packed)
    model.build_cpu_layers()
