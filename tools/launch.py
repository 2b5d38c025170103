"""Launching the project's servers, each in a process group of its own: tritonserver on the
inflight backend, and the OpenAI frontend (client/openai/) in front of it. `make serve`
(tools/serve.py), the scale-out cluster (tools/scaleout.py), the soak run, the benchmarks and
the tests all start them here, so each runs one way everywhere.

tritonserver is the binary that ``tools.setup_triton`` laid out in ``.triton/``, run with the
environment the Python backend stub needs (see docs/architecture.md):

- the project venv's ``bin`` first on ``PATH``: the stub embeds the Python of the first
  venv it finds there and reads that venv's ``.pth`` files (the editable install makes
  the repository root importable that way; the stub ignores ``PYTHONPATH``);
- ``LD_LIBRARY_PATH`` = this interpreter's ``LIBDIR`` first (the stub links
  ``libpython3.11.so.1.0``; an older system copy breaks ``import ssl``), then the
  wheel's ``nvidia_pytriton.libs``.

API::

    http, grpc, metrics, openai = free_ports(4)
    triton = launch_tritonserver("model_repository", "127.0.0.1", http, grpc, metrics)
    wait_tritonserver(http, timeout=300, proc=triton, metrics_port=metrics)
    frontend = launch_frontend(f"127.0.0.1:{grpc}", "127.0.0.1", openai)
    wait_frontend(openai, proc=frontend)
    ...
    stop(frontend)
    stop(triton)

Either launcher takes ``netns``: the server then runs in that network namespace
(``ip netns exec``, tools/netns.py) and binds its address there.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Mapping, Sequence

from backend.paths import REPO_ROOT

# Where tools.setup_triton put the server; INFLIGHT_TRITON_DIR points elsewhere (e.g. an image).
TRITON_DIR = Path(os.environ.get("INFLIGHT_TRITON_DIR", REPO_ROOT / ".triton"))
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
EXIT_TIMEOUT_SECS = 15
# The gRPC server pings each connection every GRPC_KEEPALIVE_TIME_MS and drops one whose answer
# does not come within GRPC_KEEPALIVE_TIMEOUT_MS. A client (or a router's connection to this
# server) that vanished without a FIN, in a partition or with its host, is then found within
# ~15 s instead of TCP's ~15 min of retransmissions: its streams are cancelled, so the engine
# stops generating for nobody and the socket's unsent responses stop holding memory. A live
# peer answers a ping in a round trip (HTTP/2 requires it), so the pings cost nothing.
GRPC_KEEPALIVE_TIME_MS = 10_000
GRPC_KEEPALIVE_TIMEOUT_MS = 5_000
GROUP_EXIT_TIMEOUT_SECS = 10
# The Python backend's shared-memory region prefix, as tritonserver_command sets it and stop() reads it back.
SHM_PREFIX_FLAG = "--backend-config=python,shm-region-prefix-name="


def venv_dir() -> Path:
    """The venv whose Python the stub must embed: the running one, else the project's."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    return REPO_ROOT / ".venv"


def pytriton_libs_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        libs = Path(list(spec.submodule_search_locations)[0]).parent / "nvidia_pytriton.libs"
        if libs.is_dir():
            return libs
    found = sorted(venv_dir().glob("lib/python3*/site-packages/nvidia_pytriton.libs"))
    return found[0] if found else None


def tritonserver_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python backend stub."""
    env = dict(os.environ if base is None else base)
    venv = venv_dir()
    env["VIRTUAL_ENV"] = str(venv)
    path = [str(venv / "bin")] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != str(venv / "bin")]
    env["PATH"] = os.pathsep.join(path)

    libs: list[str] = []
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        libs.append(libdir)
    pytriton_libs = pytriton_libs_dir()
    if pytriton_libs is not None:
        libs.append(str(pytriton_libs))
    libs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in libs]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)

    env.pop("PYTHONHOME", None)  # would point the embedded interpreter elsewhere
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def tritonserver_command(
    model_repository: str | os.PathLike,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    log_verbose: int = 0,
    extra_args: Sequence[str] = (),
    triton_dir: Path | None = None,
) -> list[str]:
    """The tritonserver command line (paths absolute, so the working directory does not matter)."""
    triton_dir = Path(triton_dir or TRITON_DIR).resolve()
    binary = triton_dir / "bin" / "tritonserver"
    # The Python backend names its shared-memory regions with this prefix: make it unique
    # per server so that several servers on one machine (tests, `make serve`) never collide.
    shm_prefix = f"inflight_{os.getpid()}_{http_port}_"
    return [
        str(binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={triton_dir / 'backends'}",
        f"--cache-directory={triton_dir / 'caches'}",
        f"{SHM_PREFIX_FLAG}{shm_prefix}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--grpc-keepalive-time={GRPC_KEEPALIVE_TIME_MS}",
        f"--grpc-keepalive-timeout={GRPC_KEEPALIVE_TIMEOUT_MS}",
        "--allow-metrics=true",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--model-control-mode=none",
        "--strict-readiness=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_SECS}",
        f"--log-verbose={int(log_verbose)}",
        *extra_args,
    ]


def set_parameters(config_text: str, parameters: Mapping[str, str]) -> str:
    """Replace (or add) `parameters` entries of a config.pbtxt. A value may hold quotes (JSON,
    e.g. tenant_weights): they are escaped as protobuf text wants them."""
    for key, value in parameters.items():
        quoted = str(value).replace("\\", "\\\\").replace('"', '\\"')
        entry = f'{{ key: "{key}", value: {{ string_value: "{quoted}" }} }}'
        pattern = re.compile(r'\{\s*key:\s*"' + re.escape(key) + r'"\s*,\s*value:\s*\{\s*string_value:\s*"(?:[^"\\]|\\.)*"\s*\}\s*\}')
        if pattern.search(config_text):
            config_text = pattern.sub(lambda _m: entry, config_text)
        else:
            config_text += f"\nparameters [ {entry} ]\n"
    return config_text


# The engine parameters that are paths, relative to the model's version folder when not absolute.
PATH_PARAMETERS = ("model_path", "tokenizer")


def repository_with_parameters(src: Path, dst: Path, parameters: Mapping[str, str]) -> Path:
    """A copy of model repository ``src`` at ``dst``, each model's config.pbtxt with
    ``parameters`` set and its relative paths (``model_path``, ``tokenizer``) made absolute
    (the copy lives elsewhere)."""
    shutil.copytree(src, dst)
    for config_path in dst.glob("*/config.pbtxt"):
        text = config_path.read_text()
        version_dir = (src / config_path.parent.name / "1").resolve()
        values = dict(parameters)
        for name in PATH_PARAMETERS:
            match = re.search(rf'key:\s*"{name}"\s*,\s*value:\s*\{{\s*string_value:\s*"([^"]*)"', text)
            if name not in values and match and match.group(1) and not os.path.isabs(match.group(1)):
                values[name] = os.path.normpath(version_dir / match.group(1))
        config_path.write_text(set_parameters(text, values))
    return dst


def _die_with_parent() -> None:
    """Child side of fork: SIGTERM the server when the launcher dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _in_netns(cmd: Sequence[str], netns: str | None) -> list[str]:
    # `ip netns exec` execs the command, so the pid (and the process group) stays the server's.
    return ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)


def _popen(cmd: Sequence[str], env: Mapping[str, str], stdout: int | IO | None,
           stderr: int | IO | None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        env=dict(env),
        cwd=str(REPO_ROOT),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which forwards it once
        preexec_fn=_die_with_parent,
    )


def check_setup(triton_dir: Path | None = None) -> None:
    triton_dir = Path(triton_dir or TRITON_DIR)
    binary = triton_dir / "bin" / "tritonserver"
    stub = triton_dir / "backends" / "python" / "triton_python_backend_stub"
    backend = triton_dir / "backends" / "inflight" / "model.py"
    for path in (binary, stub, backend):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `make setup`")


def launch_tritonserver(
    model_repository: str | os.PathLike,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    log_verbose: int = 0,
    extra_args: Sequence[str] = (),
    *,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    env: Mapping[str, str] | None = None,
    netns: str | None = None,
) -> subprocess.Popen:
    """Start tritonserver in its own process group; returns at once (see ``wait_tritonserver``).
    ``env`` replaces this process's environment, under the stub's own settings."""
    check_setup()
    if not Path(model_repository).is_dir():
        raise FileNotFoundError(f"model repository {model_repository} is not a directory")
    cmd = tritonserver_command(model_repository, host, http_port, grpc_port, metrics_port, log_verbose, extra_args)
    return _popen(_in_netns(cmd, netns), tritonserver_env(None if env is None else dict(env)), stdout, stderr)


def frontend_command(triton_url: str, host: str = "127.0.0.1", port: int = 9000,
                     model_repository: str | os.PathLike | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """``python -m client.openai`` in front of the tritonserver at ``triton_url`` (gRPC, HOST:PORT)."""
    cmd = [sys.executable, "-m", "client.openai", "--triton-url", triton_url, "--host", host, "--port", str(port)]
    if model_repository is not None:
        cmd += ["--model-repository", str(model_repository)]
    return cmd + list(extra_args)


def launch_frontend(
    triton_url: str,
    host: str = "127.0.0.1",
    port: int = 9000,
    *,
    model_repository: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    env: Mapping[str, str] | None = None,
    netns: str | None = None,
) -> subprocess.Popen:
    """Start the OpenAI frontend in its own process group; returns at once (see ``wait_frontend``).
    ``env`` replaces this process's environment."""
    cmd = frontend_command(triton_url, host, port, model_repository, extra_args)
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    return _popen(_in_netns(cmd, netns), env, stdout, stderr)


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


def http_status(host: str, port: int, path: str) -> int | None:
    """The status of a GET of ``path``, or None when nothing answers."""
    h = _probe_host(host)
    h = f"[{h}]" if ":" in h else h
    try:
        with urllib.request.urlopen(f"http://{h}:{port}{path}", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def tritonserver_ready(http_port: int, host: str = "127.0.0.1") -> bool:
    return http_status(host, http_port, "/v2/health/ready") == 200


def _wait(answers, what: str, timeout: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        if answers():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.5)


def wait_tritonserver(
    http_port: int,
    timeout: float = 300.0,
    host: str = "127.0.0.1",
    proc: subprocess.Popen | None = None,
    metrics_port: int | None = None,
) -> None:
    """Block until ``/v2/health/ready`` answers 200, and ``/metrics`` too when ``metrics_port``
    is given; raise RuntimeError if ``proc`` exits, TimeoutError when time runs out.

    tritonserver starts its metrics service after the HTTP service, so on a loaded machine a
    scrape right after "ready" can be refused."""
    _wait(lambda: tritonserver_ready(http_port, host)
          and (metrics_port is None or http_status(host, metrics_port, "/metrics") == 200),
          f"tritonserver on port {http_port}", timeout, proc)


def wait_frontend(port: int, timeout: float = 120.0, host: str = "127.0.0.1", proc: subprocess.Popen | None = None,
                  healthy: bool = True) -> None:
    """Block until the frontend's ``/health`` answers 200 (it asks Triton), or answers at all
    when ``healthy`` is false; raise as ``wait_tritonserver`` does."""
    def answers() -> bool:
        status = http_status(host, port, "/health")
        return status == 200 or (not healthy and status is not None)

    _wait(answers, f"OpenAI frontend on port {port}", timeout, proc)


def stop(proc: subprocess.Popen, timeout: float = EXIT_TIMEOUT_SECS + 15) -> int:
    """Graceful stop of a server this module launched: SIGTERM, wait, then SIGKILL. Returns the
    exit code.

    Then whatever is left of the server's process group (it leads one) is killed: Python
    backend stubs outlive a tritonserver that was killed, or that timed out unloading a
    model, and would hold a core and gigabytes with no parent to reap them."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    code = proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone: nothing was left behind
    else:
        _wait_until_group_exits(proc.pid, GROUP_EXIT_TIMEOUT_SECS)
    _remove_shared_memory_regions(proc.args)
    return code


def _wait_until_group_exits(pgid: int, timeout: float) -> None:
    """SIGKILL is asynchronous: a relaunch on the same ports must not race the stubs' exit
    while they still hold gigabytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _remove_shared_memory_regions(args) -> None:
    """A killed tritonserver never unlinks its Python backend stubs' shared-memory regions,
    and /dev/shm is memory: remove what is left under the prefix this module gave it."""
    prefixes = [a[len(SHM_PREFIX_FLAG):] for a in (args if isinstance(args, (list, tuple)) else [])
                if str(a).startswith(SHM_PREFIX_FLAG)]
    for prefix in prefixes:
        for region in Path("/dev/shm").glob(f"{prefix}*"):
            region.unlink(missing_ok=True)


def model_names(http_port: int, host: str = "127.0.0.1") -> list[str]:
    h = _probe_host(host)
    h = f"[{h}]" if ":" in h else h
    req = urllib.request.Request(f"http://{h}:{http_port}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return [m["name"] for m in json.load(resp) if m.get("state", "READY") == "READY"]
    except (urllib.error.URLError, OSError, ValueError):
        return []


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 that were free a moment ago (bound together, then
    released); with ``consecutive``, ``n`` neighbours (e.g. a replica's block of ports)."""
    for _ in range(50):
        socks: list[socket.socket] = []
        try:
            first = _bind(socks, 0)
            if not consecutive:
                for _ in range(n - 1):
                    _bind(socks, 0)
                return [s.getsockname()[1] for s in socks]
            if first + n <= 65536 and all(_bind(socks, port) for port in range(first + 1, first + n)):
                return list(range(first, first + n))
        except OSError:
            pass  # a neighbour is taken: try another first port
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports found" + (" in a row" if consecutive else ""))


def _bind(socks: list[socket.socket], port: int) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    socks.append(s)
    s.bind(("127.0.0.1", port))
    return s.getsockname()[1]
