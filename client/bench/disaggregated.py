"""W10 (docs/benchmarks.md): disaggregated prefill and decode against aggregated instances.

    python -m client.bench.disaggregated --json bench/results/<cpu kind>/w10_smollm2.json

Long prompts arrive at a steady interval among Poisson chats (client.bench.workloads.W10),
sent over gRPC streams to three kinds of tritonserver, one after another, each on the same
cores (`--cores`, the first of this process's CPUs):

- `disaggregated`: model_repository_disaggregated/, the BLS `llm` in front of `llm_prefill` on
  the first half of the cores and `llm_decode` on the second half (`disaggregated-cap<N>` with
  `--prefill-cap N`: the prefill engine's chunks capped at N tokens, so that a chat's prompt
  waits less behind a long one's chunk);
- `aggregated`: model_repository/'s `llm` on all of them, as shipped;
- `aggregated-cap<N>` for each `--caps` N: the same with `long_prefill_token_threshold` N, so a
  long prompt's prefill is cut into chunks of N tokens that stretch each decode step less.

The report gives, for each system and request class, TTFT, TPOT, ITL and goodput (at TTFT <=
2 s and TPOT <= 100 ms by default), the disaggregated system's KV transfers (count, bytes,
seconds) from its /metrics, and the ratios of the chats' ITL p99, TPOT p99 and goodput to the
aggregated instance's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from client.bench.records import git_commit, machine, write_report
from client.bench.stats import summarize
from client.bench.targets import parse_target, run_target
from client.bench.workloads import attach_text, w10_disaggregated
from client.metrics import metric_sum, read_metrics
from tools.launch import (
    free_ports,
    launch_tritonserver,
    repository_with_parameters,
    set_parameters,
    stop,
    wait_tritonserver,
)

W10_SLO = {"ttft_ms": 2000.0, "tpot_ms": 100.0}


@dataclass
class ServerSystem:
    name: str
    repository: Path
    # The models of the repository to serve (the rest are left out of the copy).
    models: list[str]
    # OpenMP threads of each engine, and each engine model's own parameters.
    threads: int
    model_parameters: dict[str, dict[str, str]] = field(default_factory=dict)


def systems(cores: list[int], caps: list[int], prefill_cap: int | None = None,
            kv_transfer: str = "shm") -> list[ServerSystem]:
    """The W10 systems on `cores`: `caps` are the capped aggregated systems' chunk caps,
    `prefill_cap` the disaggregated prefill engine's (None: the repository's), and `kv_transfer`
    how its KV reaches the decode engine (shared memory, or TCP as across hosts)."""
    half = len(cores) // 2
    if half < 1:
        raise ValueError(f"--cores {len(cores)}: the disaggregated system needs at least 2 cores, one per role")
    cpu_list = ",".join(map(str, cores))
    aggregated = {"llm": {"omp_threads_bind": cpu_list}}
    prefill = {"omp_threads_bind": ",".join(map(str, cores[:half])), "kv_transfer": kv_transfer}
    if prefill_cap is not None:
        prefill["long_prefill_token_threshold"] = str(prefill_cap)
    found = [
        ServerSystem("disaggregated" + ("" if prefill_cap is None else f"-cap{prefill_cap}")
                     + ("" if kv_transfer == "shm" else f"-{kv_transfer}"),
                     REPO_ROOT / "model_repository_disaggregated", ["llm", "llm_prefill", "llm_decode"], half,
                     {"llm_prefill": prefill, "llm_decode": {"omp_threads_bind": ",".join(map(str, cores[half: 2 * half]))}}),
        ServerSystem("aggregated", REPO_ROOT / "model_repository", ["llm"], len(cores), aggregated),
    ]
    for cap in caps:
        found.append(ServerSystem(f"aggregated-cap{cap}", REPO_ROOT / "model_repository", ["llm"], len(cores),
                                  {"llm": {**aggregated["llm"], "long_prefill_token_threshold": str(cap)}}))
    return found


def prepare_repository(system: ServerSystem, dst: Path, parameters: dict[str, str]) -> Path:
    """A copy of the system's repository with only its models, `parameters` set on each engine
    model (not on a BLS model, which has none of them) and each model's own on top."""
    repository_with_parameters(system.repository, dst, {})
    for entry in dst.iterdir():
        if entry.is_dir() and entry.name not in system.models:
            shutil.rmtree(entry)
    for name in system.models:
        config = dst / name / "config.pbtxt"
        text = config.read_text()
        if 'backend: "inflight"' in text:
            text = set_parameters(text, {**parameters, **system.model_parameters.get(name, {})})
        config.write_text(text)
    return dst


TRANSFER_METRICS = {"transfers": "inflight_kv_transfers_total", "bytes": "inflight_kv_transfer_bytes_total",
                    "seconds": "inflight_kv_transfer_seconds_sum"}


def run_system(system: ServerSystem, workload, parameters: dict[str, str], workdir: Path, progress: bool,
               timeout_s: float) -> tuple[object, dict]:
    """The workload against a fresh tritonserver of `system`; the run and each engine model's
    KV-transfer totals."""
    repository = prepare_repository(system, workdir / system.name, parameters)
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "OMP_NUM_THREADS": str(system.threads)}
    log_path = workdir / f"{system.name}.log"
    with open(log_path, "w") as log:
        server = launch_tritonserver(repository, "127.0.0.1", http, grpc, metrics, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
    try:
        wait_tritonserver(http, timeout=600, proc=server, metrics_port=metrics)
        target = parse_target(f"{system.name}=grpc://127.0.0.1:{grpc}")
        run = run_target(target, workload, None, progress, timeout_s)
        samples = read_metrics(f"http://127.0.0.1:{metrics}/metrics")
        # Each transfer is counted by both roles, the prefill model exporting and the decode model importing.
        transfers = {model: {key: metric_sum(samples, family, model=model) for key, family in TRANSFER_METRICS.items()}
                     for model in system.model_parameters}
    except Exception:
        print(f"{system.name}: tritonserver's log is {log_path}", file=sys.stderr)
        raise
    finally:
        stop(server)
    return run, transfers


def chat_ratios(results: list[dict], baseline: str = "aggregated") -> dict:
    """Each other system's chats' ITL p99, TPOT p99 and goodput, and all requests' goodput, over
    the baseline's (None where the baseline's is 0 or missing)."""
    by_name = {r["system"]: r for r in results}
    base = by_name.get(baseline)
    if base is None:
        return {}
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    ratios = {}
    for name, result in by_name.items():
        if name == baseline:
            continue
        mine, theirs = result["by_class"].get("chat", {}), base["by_class"].get("chat", {})
        ratios[f"{name}/{baseline}"] = {
            "chat_itl_p99": ratio(mine.get("itl_ms", {}).get("p99"), theirs.get("itl_ms", {}).get("p99")),
            "chat_tpot_p99": ratio(mine.get("tpot_ms", {}).get("p99"), theirs.get("tpot_ms", {}).get("p99")),
            "chat_goodput": ratio(mine.get("goodput_requests_per_s"), theirs.get("goodput_requests_per_s")),
            "goodput": ratio(result["goodput_requests_per_s"], base["goodput_requests_per_s"]),
            "output_tokens_per_s": ratio(result["output_tokens_per_s"], base["output_tokens_per_s"]),
        }
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.disaggregated", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", default="auto", help="the engines' dtype parameter")
    parser.add_argument("--cores", type=int, default=2, help="how many of this process's CPUs the servers use")
    parser.add_argument("--caps", default="128", help="long_prefill_token_threshold of each capped aggregated system")
    parser.add_argument("--kv-transfer", choices=["shm", "tcp"], default="shm",
                        help="the disaggregated system's KV transfer")
    parser.add_argument("--prefill-cap", type=int, help="long_prefill_token_threshold of the disaggregated prefill "
                        "engine (default: the repository's)")
    parser.add_argument("--systems", default="", help="comma-separated subset of the systems, by name")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals")
    parser.add_argument("--chat-rate", type=float, default=1.0, help="chats per second (Poisson)")
    parser.add_argument("--long-every", type=float, default=15.0, help="seconds between long prompts")
    parser.add_argument("--long-input", type=int, default=2000)
    parser.add_argument("--chat-output", type=int, default=256)
    parser.add_argument("--slo-ttft-ms", type=float, default=W10_SLO["ttft_ms"])
    parser.add_argument("--slo-tpot-ms", type=float, default=W10_SLO["tpot_ms"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    available = sorted(os.sched_getaffinity(0))
    if args.cores > len(available):
        parser.error(f"--cores {args.cores}: this process may use {len(available)} CPUs")
    try:
        chosen = systems(available[: args.cores], [int(c) for c in args.caps.split(",") if c], args.prefill_cap,
                         args.kv_transfer)
    except ValueError as exc:
        parser.error(str(exc))
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(set(wanted) - {s.name for s in chosen})
        if unknown:
            parser.error(f"--systems: unknown {unknown}; the systems are {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in wanted]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workload = w10_disaggregated(seed=args.seed, duration_s=args.duration, chat_rate_per_s=args.chat_rate,
                                 long_every_s=args.long_every, long_input=args.long_input,
                                 chat_output=args.chat_output)
    attach_text(workload, tokenizer, None, args.seed)
    parameters = {"model_path": str(Path(args.model).resolve()), "dtype": args.dtype}
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    print(f"W10: {workload.description}; systems {[s.name for s in chosen]} on {args.cores} cores")

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-w10-") as tmp:
        for system in chosen:
            run, transfers = run_system(system, workload, parameters, Path(tmp), not args.no_progress,
                                        args.request_timeout)
            result = summarize(run, workload, slo)
            result["kv_transfers"] = transfers
            result["threads_per_engine"] = system.threads
            results.append(result)
            chat = result["by_class"].get("chat", {})
            print(f"{system.name:>22}: chats ITL p99 {chat.get('itl_ms', {}).get('p99') or 0:8.1f} ms, "
                  f"TPOT p99 {chat.get('tpot_ms', {}).get('p99') or 0:7.1f} ms, goodput "
                  f"{result['goodput_requests_per_s']:.3f} req/s, {result['output_tokens_per_s']:.1f} tok/s, "
                  f"{result['num_failed']} failed", flush=True)
    report = {
        "benchmark": "W10 disaggregated prefill/decode",
        "command": "python -m client.bench.disaggregated " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "machine": machine(),
        "checkpoint": args.model,
        "dtype": args.dtype,
        "cores": args.cores,
        "workload": workload.summary(),
        "results": results,
        "ratios": chat_ratios(results),
    }
    for name, ratio in report["ratios"].items():
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v is not None))
    if args.json:
        write_report(args.json, report)
    return 0 if all(r["num_failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
