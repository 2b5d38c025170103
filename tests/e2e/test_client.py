"""The streaming CLI: a clear one-line error when no server listens; a real answer when one does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend.paths import REPO_ROOT
from tools.launch import free_ports


def run_client(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client.generate", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def test_client_reports_unreachable_server():
    (port,) = free_ports(1)
    proc = run_client("--url", f"127.0.0.1:{port}", "hello")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot reach Triton at 127.0.0.1:") and str(port) in lines[0]
    assert proc.stdout == ""


@pytest.mark.e2e
def test_client_streams_chat_answer(triton_server):
    proc = run_client("--url", triton_server.grpc_url, "--chat", "--max-tokens", "32", "--stats",
                      "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish_reason=" in proc.stderr


@pytest.mark.e2e
def test_client_reports_unknown_model(triton_server):
    proc = run_client("--url", triton_server.grpc_url, "--model", "no_such_model", "hello")
    assert proc.returncode == 2
    assert "no_such_model" in proc.stderr
