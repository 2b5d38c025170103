"""The launcher of the local tritonserver: used by ``make serve``, the tests and benchmarks.

It runs the tritonserver binary that ``tools.setup_triton`` laid out in ``.triton/`` with
the environment the Python backend stub needs (see DESIGN.md, "Known pitfalls"):

- the project venv's ``bin`` first on ``PATH``: the stub embeds the Python of the first
  venv it finds there and reads that venv's ``.pth`` files (the editable install makes
  the repository root importable that way; the stub ignores ``PYTHONPATH``);
- ``LD_LIBRARY_PATH`` = this interpreter's ``LIBDIR`` first (the stub links
  ``libpython3.11.so.1.0``; an older system copy breaks ``import ssl``), then the
  wheel's ``nvidia_pytriton.libs``.

API::

    proc = launch("model_repository", "127.0.0.1", 8000, 8001, 8002)
    wait_ready(8000, timeout=300, proc=proc)
    ...
    stop(proc)

CLI: ``python -m tools.serve [--model-repository DIR] [--host H] [--http-port N]
[--grpc-port N] [--metrics-port N] [--log-verbose N] [--set KEY=VALUE ...] [-- extra
tritonserver args]``. ``--set`` serves a temporary copy of the repository with those
config.pbtxt parameters set in every model, e.g. another checkpoint or an engine switch.
Ctrl-C (or SIGTERM) is forwarded to tritonserver, which shuts down gracefully; a second
Ctrl-C kills it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
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


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
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


def build_command(
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
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
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


def repository_with_parameters(src: Path, dst: Path, parameters: Mapping[str, str]) -> Path:
    """A copy of model repository ``src`` at ``dst``, each model's config.pbtxt with
    ``parameters`` set and a relative ``model_path`` made absolute (the copy lives elsewhere)."""
    shutil.copytree(src, dst)
    for config_path in dst.glob("*/config.pbtxt"):
        text = config_path.read_text()
        version_dir = (src / config_path.parent.name / "1").resolve()
        match = re.search(r'key:\s*"model_path"\s*,\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
        values = dict(parameters)
        if "model_path" not in values and match and match.group(1) and not os.path.isabs(match.group(1)):
            values["model_path"] = os.path.normpath(version_dir / match.group(1))
        config_path.write_text(set_parameters(text, values))
    return dst


def _die_with_parent() -> None:
    """Child side of fork: SIGTERM tritonserver when the launcher dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def check_setup(triton_dir: Path | None = None) -> None:
    triton_dir = Path(triton_dir or TRITON_DIR)
    binary = triton_dir / "bin" / "tritonserver"
    stub = triton_dir / "backends" / "python" / "triton_python_backend_stub"
    backend = triton_dir / "backends" / "inflight" / "model.py"
    for path in (binary, stub, backend):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `make setup`")


def launch(
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
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start tritonserver in its own process group; returns at once (see ``wait_ready``)."""
    check_setup()
    if not Path(model_repository).is_dir():
        raise FileNotFoundError(f"model repository {model_repository} is not a directory")
    cmd = build_command(model_repository, host, http_port, grpc_port, metrics_port, log_verbose, extra_args)
    return subprocess.Popen(
        cmd,
        env=server_env(env),
        cwd=str(REPO_ROOT),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which forwards it once
        preexec_fn=_die_with_parent,
    )


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


def is_ready(http_port: int, host: str = "127.0.0.1") -> bool:
    return _answers_200(host, http_port, "/v2/health/ready")


def _answers_200(host: str, port: int, path: str) -> bool:
    h = _probe_host(host)
    h = f"[{h}]" if ":" in h else h
    try:
        with urllib.request.urlopen(f"http://{h}:{port}{path}", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_ready(
    http_port: int,
    timeout: float = 300.0,
    host: str = "127.0.0.1",
    proc: subprocess.Popen | None = None,
    metrics_port: int | None = None,
) -> None:
    """Block until ``/v2/health/ready`` answers 200, and ``/metrics`` too when ``metrics_port``
    is given; raise if ``proc`` exits or time runs out.

    tritonserver starts its metrics service after the HTTP service, so on a loaded machine a
    scrape right after "ready" can be refused."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode} before it was ready")
        if is_ready(http_port, host) and (metrics_port is None or _answers_200(host, metrics_port, "/metrics")):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tritonserver not ready on port {http_port} after {timeout:.0f}s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = EXIT_TIMEOUT_SECS + 15) -> int:
    """Graceful stop by PID: SIGTERM, wait, then SIGKILL. Returns the exit code.

    Then whatever is left of the server's process group (it leads one, `launch`) is
    killed: Python backend stubs outlive a tritonserver that was killed, or that timed out
    unloading a model, and would hold a core and gigabytes with no parent to reap them."""
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
    return code


def model_names(http_port: int, host: str = "127.0.0.1") -> list[str]:
    h = _probe_host(host)
    h = f"[{h}]" if ":" in h else h
    req = urllib.request.Request(f"http://{h}:{http_port}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return [m["name"] for m in json.load(resp) if m.get("state", "READY") == "READY"]
    except (urllib.error.URLError, OSError, ValueError):
        return []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m tools.serve",
        description="Serve a model repository with the local tritonserver (args after -- go to tritonserver).",
    )
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    parser.add_argument("--host", default="127.0.0.1", help="address HTTP, gRPC and metrics bind to")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="serve a copy of the repository with this config.pbtxt parameter set in every model "
                             "(repeatable; a model_path is taken from the working directory)")
    args = parser.parse_args(argv)
    try:
        parameters = parse_settings(args.set)
    except ValueError as exc:
        parser.error(str(exc))

    model_repository = args.model_repository
    if parameters:
        if not Path(model_repository).is_dir():
            print(f"serve: model repository {model_repository} is not a directory", file=sys.stderr)
            return 2
        copy_dir = Path(tempfile.mkdtemp(prefix="inflight-serve-"))
        model_repository = str(repository_with_parameters(Path(model_repository), copy_dir / "model_repository",
                                                          parameters))
    try:
        return _serve(args, model_repository, extra)
    finally:
        if parameters:
            shutil.rmtree(copy_dir, ignore_errors=True)


def parse_settings(settings: Sequence[str]) -> dict[str, str]:
    """`--set KEY=VALUE` arguments as config.pbtxt parameters (a relative model_path made absolute)."""
    parameters = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {setting!r}: expected KEY=VALUE")
        parameters[key.strip()] = value
    if "model_path" in parameters:
        parameters["model_path"] = os.path.abspath(parameters["model_path"])
    return parameters


def _serve(args: argparse.Namespace, model_repository: str, extra: Sequence[str]) -> int:
    try:
        proc = launch(
            model_repository, args.host, args.http_port, args.grpc_port, args.metrics_port,
            args.log_verbose, extra,
        )
    except FileNotFoundError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2

    interrupts = 0

    def forward(signum: int, _frame) -> None:
        nonlocal interrupts
        interrupts += 1
        if proc.poll() is not None:
            return
        if interrupts == 1:
            print("\nserve: stopping tritonserver (Ctrl-C again to kill it) ...", file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGTERM)
        else:
            proc.kill()

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    print(f"serve: starting tritonserver (pid {proc.pid}) on {Path(model_repository).resolve()} ...", flush=True)
    try:
        metrics_port = None if "--allow-metrics=false" in extra else args.metrics_port
        wait_ready(args.http_port, args.ready_timeout, args.host, proc, metrics_port)
    except TimeoutError as exc:
        print(f"serve: {exc}; still waiting (Ctrl-C stops it)", file=sys.stderr, flush=True)
    except RuntimeError:
        pass  # exited before it was ready: its log above says why; the exit code is below
    else:
        host = args.host if ":" not in args.host else f"[{args.host}]"
        models = ", ".join(model_names(args.http_port, args.host)) or "?"
        print(
            f"serve: ready, models: {models}\n"
            f"serve:   HTTP    http://{host}:{args.http_port}  (e.g. /v2/models/llm/generate_stream)\n"
            f"serve:   gRPC    {host}:{args.grpc_port}\n"
            f"serve:   metrics http://{host}:{args.metrics_port}/metrics\n"
            f"serve: Ctrl-C stops it",
            flush=True,
        )
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover - the handler above takes SIGINT
            continue
    print(f"serve: tritonserver exited with code {code}", file=sys.stderr, flush=True)
    return 0 if interrupts and code in (0, -signal.SIGTERM) else (code if code >= 0 else 128 - code)


if __name__ == "__main__":
    sys.exit(main())
