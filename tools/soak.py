"""Soak test CLI: a closed loop of streams against tritonserver for N minutes (client/soak.py).

    .venv/bin/python tools/soak.py --minutes 30 --json bench/results/avx512_bf16/soak_30min.json

Without --grpc-url it starts tritonserver on `--model-repository` (model_repository/ by
default) on the given ports, soaks it and stops it; with --grpc-url it soaks a running
server (give --metrics-url, and --server-pid for the RSS figures). Exit code 0 when every
criterion passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from client.soak import SoakConfig, run_soak


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="llm")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--note", default="", help="what else ran on the machine (recorded in the report)")
    parser.add_argument("--grpc-url", help="soak this running server instead of starting one")
    parser.add_argument("--metrics-url", help="its /metrics URL (with --grpc-url)")
    parser.add_argument("--server-pid", type=int, help="its tritonserver PID, for RSS (with --grpc-url)")
    parser.add_argument("--model-repository", default=None)
    parser.add_argument("--http-port", type=int, default=18400)
    parser.add_argument("--grpc-port", type=int, default=18401)
    parser.add_argument("--metrics-port", type=int, default=18402)
    args = parser.parse_args(argv)

    def soak(grpc_url: str, metrics_url: str, pid: int | None) -> int:
        config = SoakConfig(grpc_url=grpc_url, metrics_url=metrics_url, model=args.model, server_pid=pid,
                            minutes=args.minutes, streams=args.streams, seed=args.seed, note=args.note)
        report = run_soak(config, progress=lambda m: print(
            f"minute {m.index + 1}: {m.requests_done} done, {m.unexpected_errors} unexpected, "
            f"RSS {m.server_rss_mb} MB (anonymous {m.server_rss_anon_mb} MB), load {m.loadavg_1m}", flush=True))
        text = report.to_json()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text + "\n")
        print(f"totals {report.totals}; end state {report.end_state}")
        for name, criterion in report.criteria.items():
            print(f"  {name}: {criterion['value']} -> {criterion['passed']}")
        for problem in report.unexpected:
            print(f"  unexpected: {problem}")
        print("PASSED" if report.passed else "FAILED")
        return 0 if report.passed else 1

    if args.grpc_url:
        if not args.metrics_url:
            parser.error("--grpc-url needs --metrics-url")
        return soak(args.grpc_url, args.metrics_url, args.server_pid)

    from tools import launch

    repository = args.model_repository or str(launch.DEFAULT_MODEL_REPOSITORY)
    with tempfile.NamedTemporaryFile(prefix="soak-tritonserver-", suffix=".log", delete=False) as log:
        print(f"tritonserver log: {log.name}", flush=True)
        proc = launch.launch_tritonserver(repository, "127.0.0.1", args.http_port, args.grpc_port, args.metrics_port,
                                           stdout=log, stderr=log)
        try:
            launch.wait_tritonserver(args.http_port, proc=proc, metrics_port=args.metrics_port)
            return soak(f"127.0.0.1:{args.grpc_port}", f"http://127.0.0.1:{args.metrics_port}/metrics", proc.pid)
        finally:
            launch.stop(proc)


if __name__ == "__main__":
    sys.exit(main())
