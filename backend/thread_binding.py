"""Pinning the engine's OpenMP threads to CPUs: config.pbtxt `omp_threads_bind`, vLLM's
`VLLM_CPU_OMP_THREADS_BIND` with the same values.

A CPU step is a chain of parallel regions, each ending at a barrier. Through tritonserver
other threads wake on the engine's cores for every response (tritonserver's, the stub's
response thread, the load generator's), and the kernel's scheduler then sometimes moves an
engine thread onto the core its teammate runs on: the two take turns on one core, one
spinning at the barrier while the other computes, until the load balancer parts them (a
profile of the unbound stub caught the engine thread waiting 2.5 ms at one barrier while its
worker sat on the same core). Pinned, each engine thread keeps its core and the other threads
only borrow it for a moment.

- ``auto``: when the team has one thread per physical core of the CPUs this process may
  use, and more than one thread, thread i runs on core i (its first CPU); otherwise
  nothing is bound. A smaller team shares the machine with something unknown, and binding
  it would stack every such engine on the same first cores.
- ``nobind``: nothing is bound.
- a CPU list, ``0-3`` or ``0,2,4,6``: one CPU per OpenMP thread, each one this process may use.

`EngineLoop` binds its own thread's team once the engine is built: that thread starts every
parallel region of every step (GNU OpenMP keeps a team per thread), and no other thread's
affinity changes; a thread the loop thread starts afterwards would inherit its one CPU. The
Triton adapter then keeps the stub's other threads off the engine thread's CPU
(`keep_other_threads_off_the_engine_cpu`).

Measured through tritonserver (genai-perf, 128 in / 128 out, concurrency 32, bf16
SmolLM2-135M, 2-core Zen 4 EPYC with AVX512-BF16), against `nobind`: within the run-to-run
noise. 5 rounds restarting one server at a time gave 463 against 446 output tok/s (medians;
the rounds' ratios 0.94-1.05, median 1.03); 5 interleaved runs against a second server
gave 1.00x (0.94-1.05; bench/results/avx512_bf16/genai_perf_omp_threads_bind_auto_vs_nobind_bf16.json).
It is on by default as in vLLM's CPU backend, which binds its OpenMP threads the same way,
and an explicit list gives models that share a machine cores of their own.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger("inflight")

AUTO = "auto"
NOBIND = "nobind"
CPU_LIST_PATTERN = r"\d+(-\d+)?(,\d+(-\d+)?)*"
RULE = f'must be "{AUTO}", "{NOBIND}" or a CPU list such as "0-3" or "0,2,4,6"'
SYSFS_CPUS = "/sys/devices/system/cpu"


def check_spec(spec: str) -> str | None:
    """None when `spec` is a valid omp_threads_bind, else what is wrong with it."""
    if spec in (AUTO, NOBIND) or re.fullmatch(CPU_LIST_PATTERN, spec):
        return None
    return f"omp_threads_bind={spec!r} {RULE}"


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"omp_threads_bind: CPU range {part!r} runs backwards")
        cpus.extend(range(low, high + 1))
    return cpus


def first_cpu_of_each_core(cpus: set[int], sysfs: str = SYSFS_CPUS) -> list[int]:
    """The lowest CPU of each physical core among `cpus` (hyperthreads share a core), in
    order; every CPU is its own core where sysfs does not say."""
    first: dict[tuple[str, str], int] = {}
    for cpu in sorted(cpus):
        topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topology, "core_id")) as f:
                core = f.read().strip()
        except OSError:
            package, core = "cpu", str(cpu)
        first.setdefault((package, core), cpu)
    return sorted(first.values())


def resolve(spec: str, threads: int, allowed: set[int], sysfs: str = SYSFS_CPUS) -> list[int] | None:
    """The CPU for each of `threads` OpenMP threads, or None for no binding. Raises
    ValueError naming the parameter when an explicit list does not fit."""
    if spec == NOBIND:
        return None
    if spec == AUTO:
        cores = first_cpu_of_each_core(allowed, sysfs)
        return cores if threads > 1 and threads == len(cores) else None
    cpus = parse_cpu_list(spec)
    if len(cpus) != threads:
        raise ValueError(f"omp_threads_bind={spec!r} names {len(cpus)} CPU(s), but the engine runs {threads} "
                         "OpenMP thread(s) (torch.get_num_threads(), OMP_NUM_THREADS): give one CPU per thread")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"omp_threads_bind={spec!r} names a CPU twice: one CPU per thread")
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(f"omp_threads_bind={spec!r}: CPU(s) {outside} are not among this process's CPUs "
                         f"{sorted(allowed)}")
    return cpus


@dataclass(frozen=True)
class Binding:
    """Where an engine's OpenMP team runs: thread i on cpus[i], the engine's own thread first."""

    cpus: list[int]
    thread_ids: list[int]  # Linux thread ids, as /proc/self/task lists them

    @property
    def engine_cpu(self) -> int:
        return self.cpus[0]


def bind_openmp_threads(spec: str) -> Binding | None:
    """Pin the calling thread's OpenMP team as `spec` says, or return None where nothing is
    bound. Without the C++ kernels (the torch reference path) nothing is bound."""
    import torch

    from kernels import cpu_ext

    cpus = resolve(spec, torch.get_num_threads(), os.sched_getaffinity(0))
    if cpus is None:
        return None
    module = cpu_ext.load()
    if module is None:
        log.warning("omp_threads_bind=%s: the C++ kernels are unavailable; OpenMP threads are not bound", spec)
        return None
    thread_ids = list(module.bind_openmp_team(cpus))
    team = [list(team_cpus) for team_cpus in module.openmp_team_cpus()]
    if team != [[cpu] for cpu in cpus]:  # libgomp made a team other than the one bound
        raise RuntimeError(f"omp_threads_bind={spec!r}: OpenMP threads run on {team} after binding them to {cpus}")
    log.info("OpenMP threads bound to CPUs %s (omp_threads_bind=%s)", cpus, spec)
    return Binding(cpus, thread_ids)


def keep_other_threads_off_the_engine_cpu(binding: Binding) -> list[int]:
    """Take the engine thread's CPU out of every other thread of this process that may run
    elsewhere (threads it starts later inherit that); the ids of the threads moved.

    The engine thread runs each step's serial part (the scheduler, sampling's bookkeeping,
    the outputs) and its share of every parallel region: while another thread holds its core the
    whole team waits, whereas a worker that loses its core leaves its share of a GEMM's
    chunks to the others. For the Triton stub, a process of the model's own (tritonserver's
    threads are another process's and stay where the kernel puts them); an in-process user of
    the engine keeps its threads where it wants them."""
    moved = []
    team = set(binding.thread_ids)
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in team:
            continue
        try:
            allowed = os.sched_getaffinity(tid)
            elsewhere = allowed - {binding.engine_cpu}
            if elsewhere and elsewhere != allowed:
                os.sched_setaffinity(tid, elsewhere)
                moved.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return moved
