"""Benchmark runner: `python -m client.bench W1 --json bench/results/w1.json`.

Runs a seeded workload (client/workloads.py) against several systems in one process and
one run, so ratios between them hold on a noisy shared machine: this engine with the
continuous policy, the same engine with the static policy (the seeds' baseline), other
engine settings (priority, prefix caching off), and Hugging Face `generate()` in static
padded batches. Prints a table and writes JSON with the command, commit, machine and
every metric of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from client.workloads import WORKLOADS, BenchRequest, Workload

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO_ROOT, ".models", "SmolLM2-135M-Instruct")

# System name -> engine overrides. Every engine system shares the workload's overrides.
ENGINE_SYSTEMS = {
    "continuous": {"scheduling_policy": "fcfs"},
    "static": {"scheduling_policy": "static"},
    "priority": {"scheduling_policy": "priority"},
    "fcfs": {"scheduling_policy": "fcfs"},
    "prefix-cache": {"enable_prefix_caching": True},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "swap": {"preemption_mode": "swap"},
}
DEFAULT_SYSTEMS = {
    "W1": ["continuous", "static"],
    "W2": ["continuous", "static"],
    "W4": ["prefix-cache", "no-prefix-cache"],
    "W5": ["priority", "fcfs"],
    "W6": ["continuous"],
}
# (numerator, denominator) pairs whose ratio each workload reports.
RATIOS = {
    "W1": [("continuous", "static"), ("continuous", "hf-static")],
    "W2": [("continuous", "static"), ("continuous", "hf-static")],
    "W4": [("prefix-cache", "no-prefix-cache")],
    "W5": [("priority", "fcfs")],
}


@dataclass
class RequestRecord:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    expected_output_tokens: int = 0
    queue_time: float | None = None
    finish_reason: str | None = None
    label: str = ""


@dataclass
class SystemRun:
    system: str
    records: list[RequestRecord]
    duration_s: float
    engine_kpis: dict = field(default_factory=dict)


# ---- systems --------------------------------------------------------------------------


def run_engine(workload: Workload, model_path: str, overrides: dict, system: str, progress: bool = True) -> SystemRun:
    import torch

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    config = EngineConfig(model_path=model_path, **{**workload.engine_overrides, **overrides})
    engine = LLMEngine(config)
    _warm_up(engine)
    requests = sorted(enumerate(workload.requests), key=lambda item: item[1].arrival_s)
    records = [RequestRecord(arrival=0.0, expected_output_tokens=r.max_tokens, label=r.label) for r in workload.requests]
    steps_before = engine.counters.steps
    counters_before = dict(vars(engine.counters))
    pool_queries_before = engine.kv.num_prefix_queries
    pool_hits_before = engine.kv.num_prefix_hits
    next_index = 0
    start = time.perf_counter()
    bar = tqdm(total=len(requests), desc=f"{workload.name} {system}", unit="req", disable=not progress, leave=False)
    seeded = 0
    while next_index < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_index < len(requests) and requests[next_index][1].arrival_s <= now:
            index, spec = requests[next_index]
            seeded += 1
            params = SamplingParams(
                temperature=spec.temperature, max_tokens=spec.max_tokens, ignore_eos=True,
                priority=spec.priority, seed=seeded if spec.temperature > 0 else None,
            )
            engine.add_request(str(index), spec.prompt_token_ids, params)
            records[index].arrival = time.perf_counter()
            next_index += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, requests[next_index][1].arrival_s - now)))
            continue
        outputs = engine.step()
        now_abs = time.perf_counter()
        for out in outputs:
            record = records[int(out.request_id)]
            if out.token_ids_delta:
                record.token_times.extend([now_abs] * len(out.token_ids_delta))
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                record.finish_reason = out.finish_reason
                if out.first_scheduled_time is not None:
                    record.queue_time = out.first_scheduled_time - out.arrival_time
                bar.update(1)
    duration = time.perf_counter() - start
    bar.close()
    c = engine.counters
    steps = c.steps - steps_before
    kpis = {
        "iterations": steps,
        "slot_occupancy": (c.sum_running - counters_before["sum_running"]) / max(1, steps) / config.max_num_seqs,
        "tokens_per_iteration": (c.sum_scheduled_tokens - counters_before["sum_scheduled_tokens"]) / max(1, steps),
        "scheduler_ms_per_iteration": 1e3 * (c.sum_schedule_time_s - counters_before["sum_schedule_time_s"]) / max(1, steps),
        "preemptions": c.preemptions - counters_before["preemptions"],
        "prefix_hit_rate": _ratio(engine.kv.num_prefix_hits - pool_hits_before, engine.kv.num_prefix_queries - pool_queries_before),
        "num_kv_blocks": engine.num_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
    }
    del engine
    return SystemRun(system, records, duration, kpis)


def _warm_up(engine) -> None:
    """One short request first: the first forward pass pays for allocator and kernel setup."""
    from backend.request import SamplingParams

    engine.add_request("warmup", list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.kv.pool.reset_prefix_cache()
    engine.kv.num_prefix_queries = engine.kv.num_prefix_hits = 0


def run_hf_static(workload: Workload, model_path: str, batch_size: int, progress: bool = True) -> SystemRun:
    """Hugging Face `generate()` in static padded batches of `batch_size`, arrival order.

    A batch runs until its longest member is done; shorter members' extra tokens are
    waste and are not counted. All of a batch's tokens arrive when the batch ends, so
    TTFT is the batch's end (generate() streams nothing).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    records = [RequestRecord(arrival=0.0, expected_output_tokens=r.max_tokens, label=r.label) for r in workload.requests]
    order = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s)
    start = time.perf_counter()
    for i in order:
        records[i].arrival = start + workload.requests[i].arrival_s
    bar = tqdm(total=len(order), desc=f"{workload.name} hf-static", unit="req", disable=not progress, leave=False)
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = order[b : b + batch_size]
            specs = [workload.requests[i] for i in batch]
            wait = max(s.arrival_s for s in specs) - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            longest = max(len(s.prompt_token_ids) for s in specs)
            ids = torch.zeros((len(specs), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, s in enumerate(specs):  # left padding, as generate() expects
                ids[row, longest - len(s.prompt_token_ids):] = torch.tensor(s.prompt_token_ids)
                mask[row, longest - len(s.prompt_token_ids):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(s.max_tokens for s in specs),
                           min_new_tokens=max(s.max_tokens for s in specs), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
            done = time.perf_counter()
            for i, s in zip(batch, specs):
                records[i].token_times = [done] * s.max_tokens
                records[i].num_output_tokens = s.max_tokens
                records[i].finish_reason = "length"
                records[i].queue_time = 0.0
            bar.update(len(batch))
    bar.close()
    return SystemRun("hf-static", records, time.perf_counter() - start, {"batch_size": batch_size})


# ---- metrics --------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(run: SystemRun, workload: Workload) -> dict:
    records = run.records
    completed = [r for r in records if r.finish_reason is not None]
    output_tokens = sum(r.num_output_tokens for r in completed)
    prompt_tokens = sum(len(workload.requests[i].prompt_token_ids) for i, r in enumerate(records) if r.finish_reason)
    ttft = [r.token_times[0] - r.arrival for r in completed if r.token_times]
    e2el = [r.token_times[-1] - r.arrival for r in completed if r.token_times]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in completed if len(r.token_times) > 1]
    itl = [b - a for r in completed for a, b in zip(r.token_times, r.token_times[1:])]
    result = {
        "system": run.system,
        "num_requests": len(records),
        "num_completed": len(completed),
        "all_token_counts_right": all(r.num_output_tokens == r.expected_output_tokens for r in records),
        "duration_s": run.duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / run.duration_s,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / run.duration_s,
        "requests_per_s": len(completed) / run.duration_s,
        "ttft_ms": _stats_ms(ttft),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms(itl),
        "e2el_ms": _stats_ms(e2el),
        "queue_time_ms": _stats_ms([r.queue_time for r in completed if r.queue_time is not None]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **run.engine_kpis,
    }
    if "preemptions" in result:
        result["preemptions_per_1000_requests"] = 1000 * result["preemptions"] / max(1, len(records))
    labels = sorted({r.label for r in records if r.label})
    if labels:
        result["by_class"] = {
            label: {"ttft_ms": _stats_ms([r.token_times[0] - r.arrival for r in completed if r.label == label and r.token_times])}
            for label in labels
        }
    return result


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ratios(workload: str, results: list[dict]) -> dict:
    by_name = {r["system"]: r for r in results}
    out = {}
    for a, b in RATIOS.get(workload, []):
        if a in by_name and b in by_name:
            ra, rb = by_name[a], by_name[b]
            out[f"{a}/{b}"] = {
                "output_tokens_per_s": _ratio(ra["output_tokens_per_s"], rb["output_tokens_per_s"]),
                "ttft_mean": _ratio(ra["ttft_ms"]["mean"] or 0, rb["ttft_ms"]["mean"] or 0),
                "ttft_p99": _ratio(ra["ttft_ms"]["p99"] or 0, rb["ttft_ms"]["p99"] or 0),
            }
            if "by_class" in ra and "by_class" in rb:
                out[f"{a}/{b}"]["ttft_p99_by_class"] = {
                    label: _ratio(ra["by_class"][label]["ttft_ms"]["p99"] or 0, rb["by_class"][label]["ttft_ms"]["p99"] or 0)
                    for label in ra["by_class"]
                }
    return out


def print_table(report: dict) -> None:
    columns = ["system", "done", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "occupancy", "preempt", "prefix hit"]
    rows = []
    for r in report["results"]:
        def fmt(value, spec=".1f"):
            return "-" if value is None else format(value, spec)

        rows.append([
            r["system"], f"{r['num_completed']}/{r['num_requests']}", fmt(r["output_tokens_per_s"]),
            fmt(r["ttft_ms"]["mean"], ".0f"), fmt(r["ttft_ms"]["p99"], ".0f"),
            fmt(r["tpot_ms"]["mean"], ".1f"), fmt(r["tpot_ms"]["p99"], ".1f"),
            fmt(r.get("slot_occupancy"), ".2f"), str(r.get("preemptions", "-")), fmt(r.get("prefix_hit_rate"), ".2f"),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
    print(f"\n{report['workload']['name']}: {report['workload']['description']}  ({report['machine']['cpu']}, {report['machine']['cores']} cores)")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    for name, ratio in report["ratios"].items():
        print(f"ratio {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if isinstance(v, float)))
    print("(TTFT/TPOT in ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--systems", help="comma-separated: " + ", ".join([*ENGINE_SYSTEMS, "hf-static"]))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face checkpoint folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, help="override the workload's request count")
    parser.add_argument("--rate", type=float, help="Poisson arrival rate in requests/s (W4, W5); 0 = all at once")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="engine parameter for every engine system (as in config.pbtxt), repeatable")
    parser.add_argument("--json", help="write the report here (e.g. bench/results/w1.json)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    kwargs = {"seed": args.seed}
    if args.num_requests:
        kwargs["num_requests"] = args.num_requests
    if args.rate is not None:
        kwargs["rate_per_s"] = args.rate
    workload = WORKLOADS[args.workload](**kwargs)
    from backend.config import EngineConfig

    engine_params = dict(item.split("=", 1) for item in args.engine)
    common = {}
    if engine_params:
        parsed = EngineConfig.from_parameters({**engine_params, "model_path": args.model}, REPO_ROOT)
        common = {k: getattr(parsed, k) for k in engine_params}
    systems = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS[args.workload]
    results = []
    for system in systems:
        if system == "hf-static":
            batch = workload.engine_overrides.get("max_num_seqs", 32)
            run = run_hf_static(workload, args.model, batch, progress=not args.no_progress)
        elif system in ENGINE_SYSTEMS:
            run = run_engine(workload, args.model, {**common, **ENGINE_SYSTEMS[system]}, system, progress=not args.no_progress)
        else:
            parser.error(f"unknown system {system!r}")
        results.append(summarize(run, workload))
    report = {
        "command": "python -m client.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "checkpoint": os.path.relpath(args.model, REPO_ROOT) if args.model.startswith(REPO_ROOT) else args.model,
        "workload": workload.summary(),
        "engine_parameters": common,
        "results": results,
        "ratios": ratios(args.workload, results),
    }
    print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
