"""The tests' tritonservers.

`start_tritonserver` lays out a model repository of the test's own (each model a copy of
model_repository/llm with its config.pbtxt parameters replaced) and starts tritonserver on
it, on free ports, through the launcher of `make serve` and of the cluster
(`tools.launch.launch_tritonserver`), so the tests run the server exactly as users do. Tests
reach it through the `tritonserver` factory fixture of tests/e2e/conftest.py, which also stops
whatever a test leaves running.

    with tritonserver({"tiny": {"model_path": path}}, env={...}, args=["--log-verbose=1"]) as server:
        server.grpc_url, server.http_url, server.metrics_url, server.log_tail()
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from tools import launch
from tools.launch import free_ports, set_parameters

READY_TIMEOUT_S = 300.0

# Engine parameters of the session's default server (on top of model_repository/llm's):
# a batch small enough that 16 streams queue, and a KV pool that fits beside the tests.
E2E_PARAMETERS = {
    "model_path": str(DEFAULT_CHECKPOINT),
    "max_num_seqs": "8",
    "kv_cache_memory_mb": "128",
}


def set_instance_count(config_text: str, count: int) -> str:
    """`count` CPU instances of the model, each an engine of its own in a stub process."""
    new, n = re.subn(r"instance_group\s*\[[^\]]*\]", f"instance_group [ {{ kind: KIND_CPU, count: {count} }} ]",
                     config_text)
    assert n == 1, "instance_group not found in model_repository/llm/config.pbtxt"
    return new


def make_model_repository(root: Path, parameters: Mapping[str, str], name: str = "llm",
                          instances: int | None = None, files: Mapping[str, str] | None = None,
                          source: str = "llm", source_repository: Path = REPO_ROOT / "model_repository") -> Path:
    """Copy `source_repository`/`source` into `root`/`name` with `parameters` set (and `instances`
    CPU instances when given), and `files` (name -> text) written into the model's folder
    (e.g. multi_lora.json); returns `root`."""
    dst = root / name
    shutil.copytree(source_repository / source, dst)
    config = (dst / "config.pbtxt").read_text()
    config = re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', config, flags=re.M)
    config = set_parameters(config, parameters)
    if instances is not None:
        config = set_instance_count(config, instances)
    (dst / "config.pbtxt").write_text(config)
    for filename, text in (files or {}).items():
        (dst / filename).write_text(text)
    return root


@dataclass
class TritonServer:
    """A started tritonserver. `stop()` (or leaving its `with` block) ends it and whatever
    its process group left behind; stopping twice is harmless."""

    http_port: int
    grpc_port: int
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path
    models: tuple[str, ...]
    exit_code: int | None = None  # set by stop()

    @property
    def model(self) -> str:
        """The first model's name: the only one of a one-model server."""
        return self.models[0]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after the server's exit timeout; returns the exit code. Only
        the first call signals: the process group's id may belong to another group by then."""
        if self.exit_code is None:
            self.exit_code = launch.stop(self.proc)
        return self.exit_code

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_tritonserver(root: Path, models: Mapping[str, Mapping[str, str]], env: Mapping[str, str] | None = None,
                       args: Sequence[str] = (), *, instances: Mapping[str, int] | None = None, log_verbose: int = 0,
                       ready_timeout: float = READY_TIMEOUT_S,
                       model_files: Mapping[str, Mapping[str, str]] | None = None,
                       sources: Mapping[str, str] | None = None,
                       source_repository: Path = REPO_ROOT / "model_repository") -> TritonServer:
    """tritonserver on free ports serving one inflight model per entry of `models` (name ->
    config.pbtxt parameters), with `env` added to this process's environment and `args`
    after the launcher's own options, and `model_files` (model -> {file name: text}) in the
    models' folders, each model a copy of `source_repository`/llm or of the folder `sources`
    names for it there; returns once it and its /metrics answer, or raises
    RuntimeError with the log's tail."""
    repository = root / "model_repository"
    for name, parameters in models.items():
        make_model_repository(repository, parameters, name=name, instances=(instances or {}).get(name),
                              files=(model_files or {}).get(name), source=(sources or {}).get(name, "llm"),
                              source_repository=source_repository)
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = root / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = launch.launch_tritonserver(repository, "127.0.0.1", http_port, grpc_port, metrics_port,
                                          log_verbose=log_verbose, extra_args=tuple(args), stdout=log,
                                          stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = TritonServer(http_port, grpc_port, metrics_port, proc, log_path, tuple(models))
    try:
        launch.wait_tritonserver(http_port, ready_timeout, proc=proc, metrics_port=metrics_port)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise RuntimeError(f"{exc}\n--- tritonserver log (tail) ---\n{server.log_tail()}") from None
    return server
