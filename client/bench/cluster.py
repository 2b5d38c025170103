"""The cluster benchmarks of docs/benchmarks.md ("Cluster"), one run each, JSON under bench/results/<cpu kind>/:

- ``w3``:  W3 at concurrency 32 through haproxy with 2 replicas against 1 replica direct;
- ``itl``: the routers' added latency per token at concurrency 1 (haproxy gRPC and vllm-router
  against the replica's own gRPC and OpenAI ports), 3 interleaved runs after every replica is warm.
  Both run with prefix caching off on the replicas (see `main`);
- ``w4``:  W4 with several system prompts through vllm-router ``kv_aware`` (fed by the replicas'
  KV events), ``cache_aware`` and ``round_robin``: TTFT, and each replica's prefix-cache hit
  rate from its own metrics. Each policy gets fresh replicas, so no cache carries over.

The load itself is ``python -m client.bench`` against the started cluster (tools/scaleout.py).

    python -m client.bench.cluster --parts w3,itl,w4 --base-port 18610
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backend.paths import REPO_ROOT
from client.bench.records import git_commit, machine
from client.metrics import metric_sum, read_metrics
from tools import scaleout

W4_POLICIES = ("kv_aware", "cache_aware", "round_robin")


def bench(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "client.bench", *args, "--no-progress"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)


# What each replica's /metrics says about its prefix cache and load: key -> (family, labels).
REPLICA_METRICS = {"hit_rate": ("inflight_prefix_cache_hit_rate", {}),
                   "reused_blocks": ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "reused"}),
                   "requests": ("vllm:request_success_total", {}),
                   "prompt_tokens": ("vllm:prompt_tokens_total", {})}


def replica_prefix_stats(replica: scaleout.Replica) -> dict[str, float]:
    samples = read_metrics(replica.metrics_url)
    return {key: metric_sum(samples, family, **labels) for key, (family, labels) in REPLICA_METRICS.items()}


def cluster(args, policy: str = "round_robin", kv_events: bool = False,
            prefix_caching: bool = True) -> scaleout.Cluster:
    replicas = scaleout.local_replicas(args.replicas, args.base_port, kv_events=kv_events)
    return scaleout.Cluster(replicas, Path(args.model_repository), http_port=args.http_port, grpc_port=args.grpc_port,
                            openai_port=args.openai_port, router_policy=policy,
                            engine_parameters=None if prefix_caching else {"enable_prefix_caching": "false"},
                            log_dir=Path(tempfile.mkdtemp(prefix=f"bench-cluster-{policy}-")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="w3,itl,w4")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--http-port", type=int, default=8100)
    parser.add_argument("--grpc-port", type=int, default=8101)
    parser.add_argument("--openai-port", type=int, default=8180)
    parser.add_argument("--base-port", type=int, default=8200)
    parser.add_argument("--w3-requests", type=int, default=64)
    parser.add_argument("--w4-requests", type=int, default=64)
    parser.add_argument("--w4-prefixes", type=int, default=8)
    parser.add_argument("--w4-rate", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="folder (default bench/results/<cpu kind>)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    out = Path(args.out or REPO_ROOT / "bench" / "results" / machine()["cpu_kind"])
    out.mkdir(parents=True, exist_ok=True)

    if "w3" in parts or "itl" in parts:
        # These parts compare paths to the same replicas with the same prompts (targets one
        # after another, runs repeated): with prefix caching on, a later target or run would
        # find its prompts in a replica's cache and its TTFT would measure the cache, not the
        # path. W4 measures the cache.
        with cluster(args, prefix_caching=False) as c:
            r0 = c.replicas[0]
            if "w3" in parts:
                bench(["W3", "--concurrency", "32", "--num-requests", str(args.w3_requests),
                       "--target", f"routers-{args.replicas}-replicas=grpc://{c.grpc_url}",
                       "--target", f"1-replica-direct=grpc://{r0.grpc_url}",
                       "--json", str(out / "cluster_w3_c32.json")])
            if "itl" in parts:
                # Warm every replica first: haproxy spreads even c=1 over both, and a replica's
                # first requests (torch's first calls) would otherwise count as a router's TTFT.
                for replica in c.replicas:
                    bench(["W3", "--concurrency", "2", "--num-requests", "4", "--output-len", "8",
                           "--target", f"warm-up=grpc://{replica.grpc_url}"])
                bench(["W3", "--concurrency", "1", "--num-requests", "8", "--output-len", "64", "--repeat", "3",
                       "--target", f"haproxy-grpc=grpc://{c.grpc_url}", "--target", f"direct-grpc=grpc://{r0.grpc_url}",
                       "--target", f"vllm-router=openai://{c.openai_url.removeprefix('http://')}",
                       "--target", f"direct-openai=openai://{r0.openai_url.removeprefix('http://')}",
                       "--json", str(out / "cluster_router_itl_c1.json")])

    if "w4" in parts:
        runs = {}
        for policy in W4_POLICIES:
            with cluster(args, policy, kv_events=True) as c:
                path = Path(tempfile.mkdtemp()) / f"w4_{policy}.json"
                bench(["W4", "--num-requests", str(args.w4_requests), "--num-prefixes", str(args.w4_prefixes),
                       "--rate", str(args.w4_rate), "--target",
                       f"{policy}=openai://{c.openai_url.removeprefix('http://')}", "--json", str(path)])
                report = json.loads(path.read_text())
                runs[policy] = {"result": report["results"][0],
                                "replicas": {r.name: replica_prefix_stats(r) for r in c.replicas}}
        first = report
        combined = {
            "command": "python -m client.bench.cluster " + " ".join(sys.argv[1:] if argv is None else argv),
            "git_commit": git_commit(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(),
            "checkpoint": first["checkpoint"],
            "workload": first["workload"],
            "note": (f"{args.replicas} replicas and vllm-router on one machine sharing its cores; each policy "
                     "ran on fresh replicas. hit_rate: the replica's prompt tokens found in its prefix cache / "
                     "prompt tokens looked up, over the run (its warm-up request included)."),
            "policies": runs,
        }
        path = out / f"cluster_w4_routing_rate{args.w4_rate:g}.json"
        path.write_text(json.dumps(combined, indent=2))
        print(f"wrote {path}")
        for policy, run in runs.items():
            ttft = run["result"].get("ttft_ms", {})
            rates = {name: round(r.get("hit_rate", 0.0), 3) for name, r in run["replicas"].items()}
            print(f"{policy:12s} TTFT mean {ttft.get('mean')} p90 {ttft.get('p90')} ms; hit rate per replica {rates}; "
                  f"requests {[r.get('requests') for r in run['replicas'].values()]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
