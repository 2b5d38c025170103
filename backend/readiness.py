"""Is this model still served? Asked of the tritonserver that runs this stub over HTTP.

Triton keeps a decoupled model loaded while any of its response senders is open, so on
shutdown (or an unload) the backend must notice by itself and end its live requests,
or the server waits out its exit timeout (see ``model.py``).

The obvious question, ``pb_utils.is_model_ready``, is unsafe exactly when it matters:
once the server is stopping Triton answers it with an error, and the Python backend of
tritonserver 2.51 frees that error string in the server process as soon as it has woken
the stub, while the stub's thread still has to read it. When the stub loses that race
(one shutdown in ten on a busy 2-core machine) it dies of a segfault, its requests are
never ended, and the server exits with "Exit timeout expired". The server's own HTTP
endpoint answers the same question without that hazard:

- ``GET /v2/models/<name>/versions/<v>/ready``: 200 while the model is READY, 400 once it
  is unloading (an explicit unload with ``--model-control-mode=explicit``);
- on SIGTERM tritonserver closes its HTTP endpoint first (connection refused), while the
  gRPC streams of live requests stay open for their last responses: a refusal after the
  endpoint has answered before means the server is stopping.

The endpoint is found on the server's command line (``/proc/<parent>/cmdline``: the stub
is tritonserver's child). Where there is none to ask (``--allow-http=false``, an
in-process server, a restricted ``health`` API) the probe answers "unknown" and the
caller falls back to ``is_model_ready``.
"""

from __future__ import annotations

import http.client
import os
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import quote

# Triton's defaults for the options below.
DEFAULT_HTTP_PORT = 8000
DEFAULT_HTTP_ADDRESS = "0.0.0.0"
_FALSE = {"false", "0", "off", "no"}
# Addresses a server listens on that a client cannot connect to: ask loopback instead.
_LOOPBACK_FOR = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def tritonserver_options(argv: Sequence[str]) -> dict[str, str] | None:
    """``--name=value`` and ``--name value`` options of a tritonserver command line (last wins).

    None when ``argv`` is not tritonserver's (the stub may run under an in-process server).
    """
    if not argv or os.path.basename(argv[0]) != "tritonserver":
        return None
    options: dict[str, str] = {}
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            continue
        name, has_value, value = arg[2:].partition("=")
        if not has_value and args and not args[0].startswith("--"):
            value = args.pop(0)
        options[name] = value
    return options


def http_endpoint(options: dict[str, str]) -> tuple[str, int] | None:
    """(host, port) a client on this machine reaches the server's HTTP endpoint at, if enabled."""
    if options.get("allow-http", "true").strip().lower() in _FALSE:
        return None
    address = options.get("http-address", DEFAULT_HTTP_ADDRESS).strip()
    try:
        port = int(options.get("http-port", DEFAULT_HTTP_PORT))
    except ValueError:
        return None
    return _LOOPBACK_FOR.get(address, address.strip("[]")), port


def parent_command_line(pid: int | None = None) -> list[str]:
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


@dataclass
class HttpReadinessProbe:
    """One model version's readiness on one tritonserver HTTP endpoint.

    Calling it answers True (READY), False (unloading, or the server is stopping) or None
    (no answer this time: let the caller ask another way).
    """

    host: str
    port: int
    model_name: str
    model_version: str = ""
    timeout_s: float = 1.0
    # Whether the endpoint has said READY before: only then does a refusal mean "stopping",
    # and a 400 "unloading" rather than a name this probe got wrong.
    seen_ready: bool = False

    @classmethod
    def for_parent_server(cls, model_name: str, model_version: str = "",
                          argv: Sequence[str] | None = None) -> HttpReadinessProbe | None:
        options = tritonserver_options(parent_command_line() if argv is None else argv)
        endpoint = http_endpoint(options) if options is not None else None
        if endpoint is None:
            return None
        return cls(endpoint[0], endpoint[1], model_name, model_version)

    @property
    def path(self) -> str:
        version = f"/versions/{quote(self.model_version, safe='')}" if self.model_version else ""
        return f"/v2/models/{quote(self.model_name, safe='')}{version}/ready"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    def __call__(self) -> bool | None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            connection.request("GET", self.path)
            status = connection.getresponse().status
        except ConnectionRefusedError:
            return False if self.seen_ready else None
        except (OSError, http.client.HTTPException):  # timeout, reset, garbled: no answer
            return None
        finally:
            connection.close()
        if status == 200:
            self.seen_ready = True
            return True
        if status == 400:  # Triton's "model version not ready"
            return False if self.seen_ready else None
        return None  # e.g. 403 from a restricted health API


def model_ready(http_probe: HttpReadinessProbe | None, is_model_ready: Callable[..., bool] | None,
                model_name: str, model_version: str) -> bool | None:
    """READY (True), unloading or server stopping (False), or no answer (None): the HTTP
    probe's answer, else `is_model_ready` (pb_utils.is_model_ready, None where the stub has
    none), which this module's docstring says can crash the stub once the server stops.

    Once the endpoint has answered READY it alone is asked. A stopping server's socket may
    still accept a connection that nobody serves, and a busy one may answer late: that is no
    answer this time, to be asked again, never a reason to take the crashing path exactly
    when the server is stopping."""
    if http_probe is not None:
        ready = http_probe()
        if ready is not None or http_probe.seen_ready:
            return ready
    if is_model_ready is None:
        return None
    try:
        return bool(is_model_ready(model_name=model_name, model_version=model_version))
    except Exception as exc:
        # Once shutdown has begun Triton answers "Server not ready"; anything else is
        # an unanswerable question, not a shutdown.
        return False if "not ready" in str(exc).lower() else None
