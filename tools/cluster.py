"""``make cluster``: replicas behind haproxy (Triton HTTP/gRPC) and vllm-router (OpenAI API)
on 127.0.0.1, until Ctrl-C. The logic is tools/scaleout.py's.

CLI: ``python -m tools.cluster [--replicas N] [--http-port N] [--grpc-port N] [--openai-port N]
[--base-port N] [--router-policy P] [--kv-events] [--model-repository DIR]``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from tools import scaleout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model-repository", default=str(scaleout.REPO_ROOT / "model_repository"))
    parser.add_argument("--http-port", type=int, default=8100)
    parser.add_argument("--grpc-port", type=int, default=8101)
    parser.add_argument("--openai-port", type=int, default=8180)
    parser.add_argument("--router-metrics-port", type=int, default=None, help="vllm-router's own metrics (OPENAI+1)")
    parser.add_argument("--base-port", type=int, default=8200,
                        help="replica i listens on BASE+10i: +0 HTTP, +1 gRPC, +2 metrics, +3 OpenAI, +4/+5 KV events")
    parser.add_argument("--router-policy", default="round_robin", choices=scaleout.ROUTER_POLICIES)
    parser.add_argument("--router-bin", default=str(scaleout.ROUTER_BIN))
    parser.add_argument("--kv-events", action="store_true",
                        help="replicas publish KV events (on with --router-policy kv_aware)")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    replicas = scaleout.local_replicas(args.replicas, args.base_port,
                                       kv_events=args.kv_events or args.router_policy == "kv_aware")
    cluster = scaleout.Cluster(replicas, Path(args.model_repository), http_port=args.http_port,
                               grpc_port=args.grpc_port, openai_port=args.openai_port,
                               router_metrics_port=args.router_metrics_port,
                               router_policy=args.router_policy, router_bin=Path(args.router_bin),
                               log_dir=Path(args.log_dir) if args.log_dir else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[cluster] starting {args.replicas} replica(s); logs in {cluster.log_dir}", flush=True)
    try:
        cluster.start()
        print(f"[cluster] ready: Triton HTTP {cluster.http_url}, gRPC {cluster.grpc_url} (haproxy), "
              f"OpenAI {cluster.openai_url} (vllm-router, {args.router_policy})", flush=True)
        for r in replicas:
            print(f"[cluster]   {r.name}: HTTP {r.http_url} gRPC {r.grpc_url} metrics {r.metrics_url} "
                  f"OpenAI {r.openai_url}", flush=True)
        stop.wait()
    finally:
        print("[cluster] stopping", flush=True)
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
