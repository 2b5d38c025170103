"""backend.readiness: finding tritonserver's HTTP endpoint and reading its model readiness.

The probe is asked of a real local HTTP server that answers like Triton's; the end-to-end
behaviour (shutdown and unload with live streams) is in test_e2e_triton.py.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading

import pytest

from backend.readiness import HttpReadinessProbe, http_endpoint, model_ready, parent_command_line, tritonserver_options

TRITON = "/opt/triton/bin/tritonserver"


def test_options_take_both_spellings_and_the_last_one_wins():
    argv = [TRITON, "--model-repository", "/m", "--http-port=9000", "--log-verbose=1", "--http-port", "9100"]
    assert tritonserver_options(argv) == {"model-repository": "/m", "http-port": "9100", "log-verbose": "1"}


def test_a_parent_that_is_not_tritonserver_has_no_options():
    assert tritonserver_options(["/usr/bin/python3", "--http-port=9000"]) is None
    assert tritonserver_options([]) is None


@pytest.mark.parametrize("options, endpoint", [
    ({}, ("127.0.0.1", 8000)),
    ({"http-port": "9000"}, ("127.0.0.1", 9000)),
    ({"http-address": "10.1.2.3", "http-port": "9000"}, ("10.1.2.3", 9000)),
    ({"http-address": "::"}, ("::1", 8000)),
    ({"allow-http": "false"}, None),
    ({"allow-http": "0"}, None),
    ({"allow-http": "true", "http-port": "8080"}, ("127.0.0.1", 8080)),
    ({"http-port": "eighty"}, None),
])
def test_http_endpoint(options, endpoint):
    assert http_endpoint(options) == endpoint


def test_the_probe_comes_from_the_parents_command_line():
    probe = HttpReadinessProbe.for_parent_server("llm", "1", argv=[TRITON, "--http-port=9000"])
    assert probe.url == "http://127.0.0.1:9000/v2/models/llm/versions/1/ready"
    assert HttpReadinessProbe.for_parent_server("llm", "1", argv=[TRITON, "--allow-http=false"]) is None
    assert HttpReadinessProbe.for_parent_server("llm", "1", argv=["/usr/bin/python3"]) is None
    # This test's own parent is no tritonserver.
    assert parent_command_line() and HttpReadinessProbe.for_parent_server("llm") is None


def test_names_are_quoted_into_the_path():
    probe = HttpReadinessProbe("::1", 8000, "my model/x")
    assert probe.url == "http://[::1]:8000/v2/models/my%20model%2Fx/ready"


class _Triton:
    """An HTTP server that answers the readiness path with a settable status."""

    def __init__(self):
        self.status = 200
        self.paths: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # http.server's name
                owner.paths.append(self.path)
                self.send_response(owner.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        """Close the listening socket, as tritonserver does with its HTTP endpoint on SIGTERM."""
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def triton():
    server = _Triton()
    yield server
    server.stop()


def test_ready_then_unloading(triton):
    probe = HttpReadinessProbe("127.0.0.1", triton.port, "llm", "1")
    assert probe() is True
    triton.status = 400
    assert probe() is False
    assert triton.paths == ["/v2/models/llm/versions/1/ready"] * 2


def test_a_400_before_any_ready_is_no_answer(triton):
    """A name the probe got wrong must not end every live request."""
    triton.status = 400
    assert HttpReadinessProbe("127.0.0.1", triton.port, "llm")() is None


def test_other_statuses_are_no_answer(triton):
    probe = HttpReadinessProbe("127.0.0.1", triton.port, "llm")
    assert probe() is True
    triton.status = 403  # a restricted health API
    assert probe() is None
    triton.status = 500
    assert probe() is None


def test_a_closed_endpoint_means_stopping_only_after_it_answered(triton):
    seen = HttpReadinessProbe("127.0.0.1", triton.port, "llm")
    never_seen = HttpReadinessProbe("127.0.0.1", triton.port, "llm")
    assert seen() is True
    triton.stop()
    assert seen() is False
    assert never_seen() is None


def test_a_server_that_does_not_answer_in_time_is_no_answer():
    with socket.socket() as listener:  # accepts connections (backlog) but never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        probe = HttpReadinessProbe("127.0.0.1", listener.getsockname()[1], "llm", timeout_s=0.2)
        probe.seen_ready = True
        assert probe() is None


def test_once_the_endpoint_has_answered_no_answer_never_falls_back_to_is_model_ready():
    """A stopping tritonserver's HTTP socket may accept and never reply. Asking
    pb_utils.is_model_ready then is the call whose error path crashes the stub."""
    asked = []

    def is_model_ready(**kwargs):
        asked.append(kwargs)
        raise RuntimeError("Server not ready")

    with socket.socket() as listener:  # accepts connections (backlog) but never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        never_seen = HttpReadinessProbe("127.0.0.1", port, "llm", timeout_s=0.2)
        assert model_ready(never_seen, is_model_ready, "llm", "1") is False  # nothing else to ask
        assert len(asked) == 1
        seen = HttpReadinessProbe("127.0.0.1", port, "llm", timeout_s=0.2, seen_ready=True)
        assert model_ready(seen, is_model_ready, "llm", "1") is None
        assert len(asked) == 1


def test_the_command_line_of_a_real_process():
    argv = [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(30)", "--http-port", "9000"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # past exec and interpreter start-up
        assert parent_command_line(child.pid) == argv
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert parent_command_line(child.pid) == []  # gone: nothing to read
