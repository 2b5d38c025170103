"""What a benchmark run records, and where it ran: the bottom of client/bench/.

`RequestRecord` is one request as its client saw it, `SystemRun` one system's pass over a
workload; every runner (in-process engine, Hugging Face, peers, servers) fills them the
same way, so one `client.bench.stats.summarize` measures all of them. `machine()` and
`git_commit()` describe the run for the report. Nothing here imports another module of
the client.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass, field

from backend.paths import REPO_ROOT


@dataclass
class RequestRecord:
    """One request as its client saw it (times from time.perf_counter()).

    `token_times` holds one time per output piece: per token in-process, per response
    (text chunk) from a server, whose chunks may carry several tokens; TPOT therefore
    divides by `num_output_tokens`, not by the number of pieces.
    """

    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    expected_output_tokens: int = 0
    queue_time: float | None = None
    finish_reason: str | None = None  # None: not completed
    label: str = ""
    end_time: float | None = None  # the final response; None: the last piece's time
    error: str | None = None
    text: str = ""  # the output text, as the server sent it (server clients)


@dataclass
class SystemRun:
    system: str
    records: list[RequestRecord]
    duration_s: float
    engine_kpis: dict = field(default_factory=dict)
    concurrency: int | None = None  # closed loop with this many in flight; None: open loop


# The CPU flags that decide which kernels run (and how fast), as /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_kind(flags: list[str] | set[str]) -> str:
    """The machine kind results are grouped by: ratios never mix kinds."""
    for flag, kind in (("amx_tile", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return "other"


def machine() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags")))
    except (OSError, StopIteration):
        pass
    present = [flag for flag in CPU_FLAGS if flag in flags]
    # The cores this process may run on (a taskset or a container's cpuset), not the host's.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu": cpu, "cpu_kind": cpu_kind(present), "cpu_flags": present, "cores": cores,
            "platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        from kernels import cpu_ext

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["kernels_isa"] = cpu_ext.isa().name.lower()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def git_commit() -> str:
    """HEAD, or `INFLIGHT_GIT_COMMIT` where the tree was copied without its history (a device
    machine's copy has a git directory of its own, at some older commit)."""
    if os.environ.get("INFLIGHT_GIT_COMMIT"):
        return os.environ["INFLIGHT_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(path: str, report: dict) -> None:
    """The report as JSON at `path` (its folder made), and a line saying so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")
