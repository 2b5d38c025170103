"""The servers a serving benchmark starts fresh for each system it measures, and stops after:
tritonserver behind the OpenAI frontend (client/openai/), and llama.cpp's llama-server, both
on the CPUs they are given. Q3 (client/bench/gguf_serving.py) and W9 against llama-server
(client/bench/speculative_serving.py) run their workloads against both through
client.bench.targets' `openai` client.

Each context manager yields (the OpenAI address, the server's version) and writes the
server's log into the folder it is given, naming that folder on stderr when it fails;
`started` gives one of them a fresh folder, records its version and says when it is ready.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, ContextManager, Mapping, Sequence

from backend.paths import REPO_ROOT
from client.bench import llama_cpp
from client.bench.records import git_commit
from tools.launch import (
    PATH_PARAMETERS,
    free_ports,
    launch_frontend,
    launch_tritonserver,
    set_parameters,
    stop,
    wait_frontend,
    wait_tritonserver,
)


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",") if c]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency {text!r}: comma-separated integers >= 1")
    return values


def add_run_arguments(parser, default_json: str) -> None:
    """The options every benchmark of fresh servers takes: where they run, the run's seed and
    timeout, and where its report goes."""
    parser.add_argument("--cores", type=int, help="how many of this process's CPUs the servers use (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--note", help="free text kept in the report")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", help=f"the report (default: bench/results/<cpu kind>/{default_json})")


def add_llama_server_arguments(parser) -> None:
    """The option of every benchmark that starts llama-server: flags added to its command."""
    parser.add_argument("--llama-server-args", type=str.split, default=[],
                        help="flags added to llama-server's command, space-separated (e.g. --no-repack where its "
                             "repacked AMX kernels die with SIGILL)")


def report_header(benchmark: str, module: str, argv: list[str] | None, info: dict, cpus: list[int],
                  versions: dict, checkpoint: str) -> dict:
    """What every fresh-server benchmark's report starts with: what ran, how to run it again, where,
    and each server's version (`versions`, filled in as the servers start)."""
    return {
        "benchmark": benchmark,
        "command": f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": info,
        "cpus": cpus,
        "versions": versions,
        "checkpoint": os.path.relpath(checkpoint, REPO_ROOT),
    }


def first_cpus(cores: int | None) -> list[int]:
    """The first `cores` CPUs this process may run on (all of them when None)."""
    available = sorted(os.sched_getaffinity(0))
    count = cores or len(available)
    if not 1 <= count <= len(available):
        raise ValueError(f"--cores {count}: this process may use {len(available)} CPUs")
    return available[:count]


def write_repository(dst: Path, base: Path, parameters: Mapping[str, str], cpus: list[int], slots: int) -> Path:
    """A model repository at `dst` whose one model, `llm`, is the model folder `base`'s
    config.pbtxt with `parameters` set (paths made absolute: the copy lives elsewhere), its
    engine threads bound to `cpus` and `slots` sequences at once."""
    text = re.sub(r'^name:\s*"[^"]*"', 'name: "llm"', (base / "config.pbtxt").read_text(), count=1, flags=re.M)
    values = {k: os.path.abspath(v) if k in PATH_PARAMETERS else v for k, v in parameters.items()}
    text = set_parameters(text, {**values, "omp_threads_bind": ",".join(map(str, cpus)), "max_num_seqs": str(slots)})
    (dst / "llm" / "1").mkdir(parents=True)
    (dst / "llm" / "config.pbtxt").write_text(text)
    return dst


def triton_version(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2", timeout=5) as resp:
        return json.load(resp).get("version", "unknown")


@contextmanager
def tritonserver(base: Path, parameters: Mapping[str, str], cpus: list[int], slots: int, workdir: Path):
    """tritonserver on write_repository's model behind the OpenAI frontend: yields (OpenAI
    address, tritonserver's version)."""
    repository = write_repository(workdir / "repository", base, parameters, cpus, slots)
    http, grpc, metrics, openai = free_ports(4)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    servers = []
    try:
        with open(workdir / "tritonserver.log", "w") as log:
            servers.append(launch_tritonserver(repository, "127.0.0.1", http, grpc, metrics, env=env, stdout=log,
                                               stderr=subprocess.STDOUT))
        wait_tritonserver(http, timeout=600, proc=servers[0])
        with open(workdir / "frontend.log", "w") as log:
            servers.append(launch_frontend(f"127.0.0.1:{grpc}", "127.0.0.1", openai, model_repository=repository,
                                           stdout=log, stderr=subprocess.STDOUT))
        wait_frontend(openai, proc=servers[1])
        yield f"127.0.0.1:{openai}", triton_version(http)
    except Exception:
        print(f"tritonserver: its logs are in {workdir}", file=sys.stderr)
        raise
    finally:
        for server in reversed(servers):
            stop(server)


def llama_server_command(gguf: str, port: int, cpus: list[int], slots: int, extra: Sequence[str] = (),
                         dtype: str = "float32", slot_context: int = 2048) -> list[str]:
    """llama_cpp.server_command's settings with a thread on each of `cpus` and the KV cache in
    `dtype` (float32: the engine's with dtype auto on a CPU), then the flags `extra`."""
    return [*llama_cpp.server_command(gguf, dtype, port, slots=slots, slot_context=slot_context, threads=len(cpus)),
            *extra]


@contextmanager
def llama_server(gguf: str, cpus: list[int], slots: int, workdir: Path, extra: Sequence[str] = (),
                 dtype: str = "float32", slot_context: int = 2048):
    """llama-server on `gguf` (llama_server_command's) confined to `cpus`: yields (its address, its version)."""
    (port,) = free_ports(1)
    command = llama_server_command(gguf, port, cpus, slots, extra, dtype, slot_context)
    with open(workdir / "llama-server.log", "w") as log:
        server = llama_cpp.launch(command, cpus, log)
    try:
        llama_cpp.wait_ready(port, server)
        yield f"127.0.0.1:{port}", llama_cpp.version()
    except Exception:
        print(f"llama-server: its log is {workdir / 'llama-server.log'}", file=sys.stderr)
        raise
    finally:
        stop(server)


@contextmanager
def started(label: str, system: str, start: Callable[[Path], ContextManager], tmp: str, versions: dict):
    """`start(workdir)` (`tritonserver` or `llama_server` with every argument but the folder) in a
    fresh folder of `tmp` named by `label`: yields its OpenAI address while it serves, with its
    version in versions[system]."""
    workdir = Path(tmp) / re.sub(r"\W+", "-", label)
    workdir.mkdir()
    begin = time.perf_counter()
    with start(workdir) as (address, version):
        versions[system] = version
        print(f"{label}: ready in {time.perf_counter() - begin:.1f} s", flush=True)
        yield address
