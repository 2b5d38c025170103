"""``make serve``: the local tritonserver on a model repository, until Ctrl-C. The launching
itself is tools/launch.py's.

CLI: ``python -m tools.serve [--model-repository DIR] [--host H] [--http-port N]
[--grpc-port N] [--metrics-port N] [--log-verbose N] [--set KEY=VALUE ...] [-- extra
tritonserver args]``. ``--set`` serves a temporary copy of the repository with those
config.pbtxt parameters set in every model, e.g. another checkpoint or an engine switch.
Ctrl-C (or SIGTERM) is forwarded to tritonserver, which shuts down gracefully; a second
Ctrl-C kills it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from tools.launch import (
    DEFAULT_MODEL_REPOSITORY,
    launch_tritonserver,
    model_names,
    repository_with_parameters,
    wait_tritonserver,
)


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
        proc = launch_tritonserver(
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
        wait_tritonserver(args.http_port, args.ready_timeout, args.host, proc, metrics_port)
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
