"""Test helpers: run the OpenAI frontend (client/openai/) as a real process.

    with run_frontend(triton_server.grpc_url) as frontend:
        client = frontend.openai()          # the official `openai` client, no retries
        client.completions.create(model="llm", prompt="Hi", max_tokens=8)

Also `metric(port, name, **labels)`: one sample from Triton's Prometheus /metrics.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import requests

from tools import launch
from tools.launch import free_ports

READY_TIMEOUT_S = 60


@dataclass
class Frontend:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def run_frontend(triton_grpc_url: str, *args: str, wait_healthy: bool = True) -> Iterator[Frontend]:
    """Start the frontend (`tools.launch.launch_frontend`) on a free port; stop it afterwards.

    Waits until `/health` answers 200 (Triton reachable), or any answer with `wait_healthy` false.
    """
    (port,) = free_ports(1)
    log_path = Path(tempfile.mkdtemp(prefix="openai-frontend-")) / "frontend.log"
    with open(log_path, "wb") as log:
        proc = launch.launch_frontend(triton_grpc_url, "127.0.0.1", port, extra_args=args, stdout=log,
                                      stderr=subprocess.STDOUT)
    frontend = Frontend(port, proc, log_path)
    try:
        try:
            launch.wait_frontend(port, READY_TIMEOUT_S, proc=proc, healthy=wait_healthy)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}:\n{frontend.log_tail()}") from None
        yield frontend
    finally:
        launch.stop(proc, timeout=15)


def metrics_text(metrics_port: int) -> str:
    return requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text


def metric(metrics_port: int, name: str, text: str | None = None, **labels: str) -> float | None:
    """The value of the sample `name{labels...}` (labels matched as a subset), or None."""
    text = metrics_text(metrics_port) if text is None else text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1:line.rindex("}")]
        have = dict(re.findall(r'(\w+)="([^"]*)"', body))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.2):
    """Poll `predicate()` until it returns a truthy value; return it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
