"""Engine configuration: one frozen dataclass, built once from config.pbtxt parameters.

Every engine knob lives here with its default and its limits, so `model.py`, tests and
benchmarks construct the engine the same way and a typo in config.pbtxt is refused at
load time instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from backend import thread_binding
from backend.spec_decode.config import SpeculativeConfig


class SchedulingPolicy(enum.StrEnum):
    """How the scheduler orders waiting requests and picks victims; each member has one
    policy class in backend/policies.py. The values are config.pbtxt's spelling."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    STATIC = "static"
    FAIR = "fair"


PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATION_MODES = ("none", "int8", "int4")
# activation_quantization: "int8" quantizes the activations of every quantized weight's GEMM per
# row (W8A8, W4A8: kernels/cpu/gemm_int8_dots.cpp); "none" keeps them in the model's dtype.
ACTIVATION_QUANTIZATIONS = ("none", "int8")
# kv_cache_dtype: "auto" keeps KV in the model's dtype; the others store each (token, KV head)
# row as one byte a value with a float32 scale (kernels/kv_store.py's KVQuantDtype and QuantizedKV).
# "fp8" is vLLM's name for fp8_e4m3, which it stands for from load on (cache_config_info and all).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# What the engine does with a request (backend/disagg.py): "both" serves it whole; "prefill"
# runs its prompt and first token, then exports it; "decode" imports such a request and
# generates the rest.
ROLES = ("both", "prefill", "decode")
# How a transfer crosses from a prefill engine to a decode engine: "shm", a POSIX shared-memory
# segment on one host (backend/disagg.py); "tcp", pulled from the prefill engine over ZeroMQ,
# across hosts (backend/disagg_tcp.py). The decode engine takes either: the handle says which.
KV_TRANSFERS = ("shm", "tcp")
# The address a prefill engine listens on and names in its handles, so one that its decode
# engines reach (not a wildcard): an IPv4 address or a host name.
KV_TRANSFER_ADDRESS_PATTERN = r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?"
GROUP_SIZES = (32, 64, 128)
# A tenant name (sampling_parameters `tenant`, config.pbtxt `tenant_weights`): short and
# printable, since it becomes a metric label.
TENANT_PATTERN = r"[A-Za-z0-9_.:@-]{1,64}"
TENANT_RULE = "must be a string of 1 to 64 characters among A-Z a-z 0-9 _ . : @ -"
DEFAULT_TENANT = "default"
MAX_TENANT_WEIGHTS = 256

# Longest context we size for when the checkpoint does not say, or says something huge:
# the KV pool on a 2-core CPU box would never hold 128k tokens anyway.
MAX_MODEL_LEN_CAP = 8192
# LoRA adapters a model serves, in its model folder (beside config.pbtxt), as Triton's vLLM
# backend names it: {"adapter name": "path"}, a relative path from that folder.
MULTI_LORA_FILE = "multi_lora.json"


def resolve_max_model_len(max_model_len: int, arch) -> int:
    """The engine's max_model_len: `max_model_len` when given (within the model's
    max_position_embeddings), else the model's, capped at MAX_MODEL_LEN_CAP."""
    model_max = arch.max_position_embeddings
    if max_model_len:
        if max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
        return max_model_len
    return min(model_max, MAX_MODEL_LEN_CAP)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # Size of the paged KV pool: an explicit block count wins over a memory budget.
    num_kv_blocks: int = 0
    kv_cache_memory_mb: int = 1024
    # Fraction of free GPU memory for the KV pool when on CUDA and num_kv_blocks is 0.
    gpu_memory_utilization: float = 0.0
    max_num_seqs: int = 32
    # Tokens one iteration computes; 0: by device (token_budget below).
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    default_max_tokens: int = 256
    long_prefill_token_threshold: int = 512
    enable_prefix_caching: bool = True
    # A string (config.pbtxt, tests) is accepted and stored as the enum member.
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    preemption_mode: str = "recompute"
    swap_space_mb: int = 256
    max_preemptions: int = 4
    max_queue_len: int = 1024
    # Fair share (scheduling_policy "fair"): tenant -> weight (JSON in config.pbtxt; a tenant
    # not listed weighs 1), and the service one input (prefill) and one output token cost.
    # Only the listed tenants (and "default") get their own per-tenant metric label.
    tenant_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    tenant_input_token_cost: float = 1.0
    tenant_output_token_cost: float = 2.0
    # Seed of the generator for requests that bring no seed of their own.
    seed: int = 0
    # On CUDA, every decode-only step as an eager forward pass instead of a replayed CUDA graph
    # (backend/cuda_graphs.py); vLLM's name. Ignored on the CPU, which has no graphs.
    enforce_eager: bool = False
    # Every reduction in an order fixed per row and per token, never chosen from the batch's
    # shape: a request's logprobs are bitwise the same whatever shares its batch. None
    # ("auto"): on where the kernels allow it (CPU with the C++ kernels), off elsewhere.
    batch_invariant: bool | None = None
    # KV-cache events in vLLM's ZMQ format (backend/kv_events.py), off when empty. Both
    # sockets are bound (tcp://127.0.0.1:5557, tcp://*:5557, ipc://...) and routers connect.
    # One engine per endpoint: with instance_group count > 1 the second bind fails.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    # Multi-LoRA (backend/lora.py), with vLLM's names. `lora_modules` {name: adapter folder}
    # comes from the model folder's multi_lora.json; `enable_lora` None ("auto"): on when
    # that file exists. `max_loras`: adapters in one step (a request of a further adapter
    # waits); `max_lora_rank`: the largest rank an adapter may have.
    enable_lora: bool | None = None
    lora_modules: dict | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    # Pinning the engine's OpenMP threads, one per CPU (backend/thread_binding.py): "auto",
    # "nobind" or a CPU list ("0-3"), as vLLM's VLLM_CPU_OMP_THREADS_BIND.
    omp_threads_bind: str = "auto"
    # Weights quantized at load (backend/models/quantization.py): "int8" (one scale per output
    # channel) or "int4" (a scale and a min per quantization_group_size inputs) for the
    # projections and an untied output head; "none" serves the checkpoint as stored (a
    # quantized checkpoint, GGUF/AWQ/GPTQ/compressed-tensors, is always served as stored).
    quantization: str = "none"
    quantization_group_size: int = 128
    # int8 activations for the quantized weights (ACTIVATION_QUANTIZATIONS; CPU only): numbers of
    # their own, faster where the integer dot products are.
    activation_quantization: str = "none"
    # The KV pool's element type (KV_CACHE_DTYPES); the pool's size in blocks follows from it.
    kv_cache_dtype: str = "auto"
    # The folder of the tokenizer, when not model_path's own (vLLM's --tokenizer): a GGUF
    # file's vocabulary takes transformers ~15 s to convert.
    tokenizer: str = ""
    # Speculative decoding (backend/spec_decode/), vLLM's object: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}; None: off.
    speculative_config: dict | None = None
    # Disaggregated serving (ROLES): this engine's part of a request.
    role: str = "both"
    # Role prefill: how it hands its transfers over (KV_TRANSFERS; a decode engine takes
    # either, whatever its own). With "tcp" it serves them
    # on kv_transfer_address:kv_transfer_port (0: a free port), the address decode instances
    # reach it at (it goes into each handle).
    kv_transfer: str = "shm"
    kv_transfer_address: str = "127.0.0.1"
    kv_transfer_port: int = 0
    # role decode: how long a handed-over request waits, its transfer held, for room in a full
    # running batch or KV pool before it is refused with UNAVAILABLE; 0 refuses it at once.
    kv_transfer_wait_timeout_s: float = 30.0
    # How long an exported transfer waits to be taken by a decode engine (role prefill): a
    # shared-memory one is then removed by any engine of role prefill or decode on the host
    # (backend/disagg.py), a TCP one freed by its server. A pull that gets no answer for this
    # long ends its request with UNAVAILABLE (role decode).
    kv_transfer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"invalid engine parameter: {message}")

        check(self.dtype in DTYPES, f"dtype={self.dtype!r}, expected one of {DTYPES}")
        check(self.device in DEVICES, f"device={self.device!r}, expected one of {DEVICES}")
        check(self.block_size in (8, 16, 32, 64, 128), f"block_size={self.block_size}, expected 8, 16, 32, 64 or 128")
        check(self.num_kv_blocks >= 0, f"num_kv_blocks={self.num_kv_blocks} must be >= 0")
        check(self.kv_cache_memory_mb > 0, f"kv_cache_memory_mb={self.kv_cache_memory_mb} must be > 0")
        check(0.0 <= self.gpu_memory_utilization < 1.0, f"gpu_memory_utilization={self.gpu_memory_utilization} must be in [0, 1)")
        check(1 <= self.max_num_seqs <= 4096, f"max_num_seqs={self.max_num_seqs} must be in [1, 4096]")
        check(self.max_num_batched_tokens >= 0, f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 0 (0: by device)")
        check(self.max_model_len >= 0, f"max_model_len={self.max_model_len} must be >= 0")
        check(self.default_max_tokens >= 1, f"default_max_tokens={self.default_max_tokens} must be >= 1")
        check(self.long_prefill_token_threshold >= 1, f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 1")
        policies = tuple(p.value for p in SchedulingPolicy)
        check(self.scheduling_policy in policies, f"scheduling_policy={self.scheduling_policy!r}, expected one of {policies}")
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        check(self.preemption_mode in PREEMPTION_MODES, f"preemption_mode={self.preemption_mode!r}, expected one of {PREEMPTION_MODES}")
        check(self.swap_space_mb >= 0, f"swap_space_mb={self.swap_space_mb} must be >= 0")
        check(self.max_preemptions >= 0, f"max_preemptions={self.max_preemptions} must be >= 0")
        check(self.max_queue_len >= 1, f"max_queue_len={self.max_queue_len} must be >= 1")
        check(isinstance(self.tenant_weights, dict), f"tenant_weights={self.tenant_weights!r} must be a JSON object")
        check(len(self.tenant_weights) <= MAX_TENANT_WEIGHTS,
              f"tenant_weights has {len(self.tenant_weights)} tenants, at most {MAX_TENANT_WEIGHTS}")
        for tenant, weight in self.tenant_weights.items():
            check(isinstance(tenant, str) and re.fullmatch(TENANT_PATTERN, tenant) is not None,
                  f"tenant_weights: tenant {tenant!r} {TENANT_RULE}")
            check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight <= 1e6,
                  f"tenant_weights: weight of {tenant!r} is {weight!r}, must be a number in (0, 1e6]")
        for name in ("tenant_input_token_cost", "tenant_output_token_cost"):
            cost = getattr(self, name)
            check(0 < cost <= 1e6, f"{name}={cost} must be in (0, 1e6]")
        check(not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
              "kv_events_replay_endpoint needs kv_events_endpoint")
        check(not self.kv_events_endpoint or self.enable_prefix_caching,
              "kv_events_endpoint needs enable_prefix_caching (the events describe the prefix cache)")
        check(1 <= self.max_loras <= 1024, f"max_loras={self.max_loras} must be in [1, 1024]")
        check(1 <= self.max_lora_rank <= 512, f"max_lora_rank={self.max_lora_rank} must be in [1, 512]")
        modules = self.lora_modules or {}
        check(isinstance(modules, dict) and all(isinstance(k, str) and k and isinstance(v, str) and v
                                                for k, v in modules.items()),
              f"lora_modules must map adapter names to paths, got {self.lora_modules!r}")
        check(not (modules and self.enable_lora is False), "lora_modules given but enable_lora=false")
        check(self.quantization in QUANTIZATION_MODES,
              f"quantization={self.quantization!r}, expected one of {QUANTIZATION_MODES}")
        object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype={self.kv_cache_dtype!r}, expected one of {KV_CACHE_DTYPES} (or 'fp8': fp8_e4m3)")
        check(self.activation_quantization in ACTIVATION_QUANTIZATIONS,
              f"activation_quantization={self.activation_quantization!r}, expected one of {ACTIVATION_QUANTIZATIONS}")
        check(self.quantization_group_size in GROUP_SIZES,
              f"quantization_group_size={self.quantization_group_size}, expected one of {GROUP_SIZES}")
        check(self.role in ROLES, f"role={self.role!r}, expected one of {ROLES}")
        check(self.kv_transfer in KV_TRANSFERS, f"kv_transfer={self.kv_transfer!r}, expected one of {KV_TRANSFERS}")
        check(self.kv_transfer == "shm" or self.role != "both",
              f"kv_transfer={self.kv_transfer!r} needs role 'prefill' (or 'decode'), not {self.role!r}")
        check(isinstance(self.kv_transfer_address, str)
              and re.fullmatch(KV_TRANSFER_ADDRESS_PATTERN, self.kv_transfer_address) is not None,
              f"kv_transfer_address={self.kv_transfer_address!r} must be an IPv4 address or a host name")
        check(0 <= self.kv_transfer_port <= 65535, f"kv_transfer_port={self.kv_transfer_port} must be in [0, 65535]")
        check(0 <= self.kv_transfer_wait_timeout_s <= 3600,
              f"kv_transfer_wait_timeout_s={self.kv_transfer_wait_timeout_s} must be in [0, 3600]")
        check(0 < self.kv_transfer_timeout_s <= 3600,
              f"kv_transfer_timeout_s={self.kv_transfer_timeout_s} must be in (0, 3600]")
        SpeculativeConfig.parse(self.speculative_config)  # refuses a bad one, naming the key
        bind_problem = thread_binding.check_spec(self.omp_threads_bind)
        check(bind_problem is None, str(bind_problem))

    @classmethod
    def from_parameters(cls, params: dict[str, str], model_dir: str) -> "EngineConfig":
        """Build from config.pbtxt `parameters` (all strings).

        `model_path` is absolute or relative to `model_dir` (the model's version folder);
        when absent the version folder itself is the checkpoint.
        """
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(known) - set(ServingOptions.PARAMETERS))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known parameters: "
                             f"{sorted(known) + sorted(ServingOptions.PARAMETERS)}")
        values: dict[str, Any] = {}
        for name, raw in params.items():
            if name in known:
                values[name] = _parse(name, known[name].type, raw)
        model_path = values.get("model_path") or ""
        if not model_path:
            model_path = model_dir
        elif not os.path.isabs(model_path):
            model_path = os.path.normpath(os.path.join(model_dir, model_path))
        values["model_path"] = model_path
        tokenizer = values.get("tokenizer") or ""
        if tokenizer and not os.path.isabs(tokenizer):
            values["tokenizer"] = os.path.normpath(os.path.join(model_dir, tokenizer))
        values["speculative_config"] = _draft_model_path_resolved(values.get("speculative_config"), model_dir)
        if values.get("enable_lora") is not False and "lora_modules" not in values:
            lora_file = os.path.join(os.path.dirname(os.path.normpath(model_dir)), MULTI_LORA_FILE)
            if os.path.isfile(lora_file):
                values["lora_modules"] = read_multi_lora(lora_file)
            elif values.get("enable_lora"):
                raise ValueError(f"invalid engine parameter: enable_lora=true but there is no {lora_file}")
        return cls(**values)


def _draft_model_path_resolved(spec: Any, model_dir: str) -> Any:
    """speculative_config with its draft `model` path, when relative, taken from `model_dir`
    as `model_path` is; anything else as it came (SpeculativeConfig.parse judges it)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec) if spec.strip() else spec
        except json.JSONDecodeError:
            return spec
    model = spec.get("model") if isinstance(spec, dict) else None
    if isinstance(model, str) and model and not os.path.isabs(model):
        spec = {**spec, "model": os.path.normpath(os.path.join(model_dir, model))}
    return spec


@dataclass(frozen=True)
class ServingOptions:
    """Switches of the Triton adapter (backend/model.py) rather than of the engine, from the
    same config.pbtxt `parameters`. The upper-case names are Triton's vLLM backend's, with
    its meaning, so that a model moved from `backend: "vllm"` keeps its config.pbtxt."""

    # False: the backend registers no metric family at all (vllm:*, nv_trt_llm_*, inflight_*);
    # Triton's own nv_inference_* stay. Unlike the vLLM backend, on when absent.
    report_custom_metrics: bool = True
    # True: once the engine loop has died, or has finished no step for
    # `health_check_stall_s` while requests wait on it, the model reports not ready and
    # every request is refused (UNAVAILABLE) with the vLLM backend's words.
    enable_health_check: bool = False
    # Longer than any one step may take: a 2,048-token prefill of SmolLM2-135M on 2 CPU
    # cores takes about a second, a 7B model's far longer.
    health_check_stall_s: float = 60.0
    # True: when the responses of a stream queue up faster than tritonserver takes them (a fast
    # engine, many streams: each send is a round trip to tritonserver), the queued ones go as
    # one response with all their tokens, as vLLM's server merges the outputs its client has
    # not yet taken. False: one response per engine output that adds text, however late.
    merge_queued_responses: bool = True
    # vLLM's --stream-interval: after a stream's first text, each response gathers this many
    # tokens (or the rest, at the end); a request's `stream_interval` may raise it. 1: a
    # response per token.
    stream_interval: int = 1

    # config.pbtxt name -> field
    PARAMETERS = {
        "REPORT_CUSTOM_METRICS": "report_custom_metrics",
        "ENABLE_VLLM_HEALTH_CHECK": "enable_health_check",
        "health_check_stall_s": "health_check_stall_s",
        "merge_queued_responses": "merge_queued_responses",
        "stream_interval": "stream_interval",
    }

    def __post_init__(self) -> None:
        if not self.health_check_stall_s > 0:
            raise ValueError(f"invalid engine parameter: health_check_stall_s={self.health_check_stall_s} must be > 0")
        if self.stream_interval < 1:
            raise ValueError(f"invalid engine parameter: stream_interval={self.stream_interval} must be >= 1")

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServingOptions":
        """Its own keys of config.pbtxt `parameters`; EngineConfig.from_parameters refuses unknown ones."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {field: _parse(name, fields[field].type, params[name])
                  for name, field in cls.PARAMETERS.items() if name in params}
        return cls(**values)


# The token budget of an iteration where max_num_batched_tokens is 0. On a CPU an iteration of
# 2048 prompt tokens takes over a second (SmolLM2-135M bf16, 2 cores), during which every running
# request waits for its next token and new ones for their first: through tritonserver at 32
# streams (genai-perf, 128 in / 128 out), 512 gave a mean TTFT of 1.0 s against 2.1 s and 1.07x
# the output tokens/s. A GPU computes 2048 tokens in a few milliseconds (vLLM's online default).
TOKEN_BUDGET = {"cpu": 512, "cuda": 2048}


def token_budget(config: EngineConfig, device_type: str) -> int:
    """max_num_batched_tokens, or the device's default when it is 0."""
    return config.max_num_batched_tokens or TOKEN_BUDGET.get(device_type, TOKEN_BUDGET["cuda"])


def read_multi_lora(path: str) -> dict[str, str]:
    """{adapter name: absolute folder} from a multi_lora.json; relative paths are from its folder."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in raw.items()):
        raise ValueError(f'{path} must be a JSON object {{"adapter name": "path", ...}}')
    base = os.path.dirname(os.path.abspath(path))
    return {name: os.path.normpath(os.path.join(base, folder)) for name, folder in raw.items()}


def _parse(name: str, annotation: Any, raw: str) -> Any:
    text = str(raw).strip()
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if kind == "bool | None":
        if text.lower() == "auto":
            return None
        kind = "bool"
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind in ("str", "SchedulingPolicy"):  # an enum is checked, with its choices, by EngineConfig
            return text
        value = json.loads(text)
        if kind.startswith("dict") and not isinstance(value, dict):
            raise ValueError(text)
        return value
    except ValueError:
        raise ValueError(f"invalid engine parameter: {name}={text!r} is not a valid {kind}") from None
