"""Shared fixtures. `triton_server` starts the real tritonserver once per session.

It serves a temporary copy of `model_repository/llm` (the default SmolLM2 checkpoint,
model_path made absolute, a smaller batch so that 16 streams queue) on free ports via
the same launcher as `make serve` (`tools.serve.launch`), and stops it by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT

SERVER_READY_TIMEOUT_S = 300

# Engine parameters the e2e server runs with (on top of model_repository/llm/config.pbtxt).
E2E_PARAMETERS = {
    "model_path": str(DEFAULT_CHECKPOINT),
    "max_num_seqs": "8",
    "kv_cache_memory_mb": "128",
}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def set_parameters(config_text: str, parameters: dict[str, str]) -> str:
    """Replace (or add) `parameters` entries of a config.pbtxt."""
    for key, value in parameters.items():
        entry = f'{{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(r'\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*"[^"]*"\s*\}\s*\}')
        if pattern.search(config_text):
            config_text = pattern.sub(lambda _m: entry, config_text)
        else:
            config_text += f"\nparameters [ {entry} ]\n"
    return config_text


def make_model_repository(root: Path, parameters: dict[str, str], name: str = "llm") -> Path:
    """Copy model_repository/llm into `root`/`name` with `parameters` set; returns `root`."""
    src = REPO_ROOT / "model_repository" / "llm"
    dst = root / name
    shutil.copytree(src, dst)
    config = (dst / "config.pbtxt").read_text()
    config = re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', config, flags=re.M)
    (dst / "config.pbtxt").write_text(set_parameters(config, parameters))
    return root


@dataclass
class TritonServer:
    http_port: int
    grpc_port: int
    metrics_port: int
    pid: int
    log_path: Path
    model: str = "llm"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small tensors (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    intra-op threads only add overhead there, ~10x of it on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory) -> TritonServer:
    from tools import serve

    if not (DEFAULT_CHECKPOINT / "config.json").exists():
        pytest.fail(f"{DEFAULT_CHECKPOINT} is missing: run `make setup` first", pytrace=False)
    root = tmp_path_factory.mktemp("triton")
    repository = make_model_repository(root / "model_repository", E2E_PARAMETERS)
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = root / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = serve.launch(
            repository, "127.0.0.1", http_port, grpc_port, metrics_port, log_verbose=0,
            stdout=log, stderr=subprocess.STDOUT,
        )
    server = TritonServer(http_port, grpc_port, metrics_port, proc.pid, log_path)
    try:
        serve.wait_ready(http_port, SERVER_READY_TIMEOUT_S, proc=proc, metrics_port=metrics_port)
    except (RuntimeError, TimeoutError) as exc:
        serve.stop(proc)
        pytest.fail(f"{exc}\n--- tritonserver log (tail) ---\n{server.log_tail()}", pytrace=False)
    try:
        yield server
    finally:
        code = serve.stop(proc)
        if os.environ.get("INFLIGHT_SHOW_SERVER_LOG"):
            print(f"\n--- tritonserver exited with {code}; log tail ---\n{server.log_tail()}", file=sys.stderr)
