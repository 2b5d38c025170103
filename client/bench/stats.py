"""A run's metrics and the ratios between systems (docs/benchmarks.md).

`summarize` turns a `SystemRun` into every metric of a result; `ratios` compares the
results of one report pair by pair; `format_ratio` and the labels print them the same way
in the console table, the markdown tables and client/bench/loadtest.py.
"""

from __future__ import annotations

import resource
from typing import Sequence

import numpy as np

from client.bench.records import RequestRecord, SystemRun
from client.bench.workloads import Workload

# (numerator, denominator) pairs whose ratio each workload reports.
RATIOS = {
    "W1": [("continuous", "static"), ("continuous", "hf-static"), ("continuous", "hf-continuous"),
           ("continuous", "vllm-offline"), ("batch-invariant", "not-batch-invariant"), ("lora-mixed", "continuous")],
    "W2": [("continuous", "static"), ("continuous", "hf-static"), ("continuous", "hf-continuous"),
           ("continuous", "vllm-offline"), ("batch-invariant", "not-batch-invariant"),
           ("structured-half", "continuous")],
    "G3": [("continuous", "static"), ("continuous", "hf-continuous")],
    "G5": [("continuous", "static"), ("continuous", "hf-static")],
    "W4": [("prefix-cache", "no-prefix-cache")],
    "W5": [("priority", "fcfs")],
    "W7": [("continuous", "separate-no-prefix-cache")],
    "W8a": [("fair", "fcfs")],
    "W8b": [("fair", "fcfs"), ("priority", "fcfs")],
}
# Every workload: what serving through Triton (or a frontend) costs against the engine in-process.
SERVER_RATIOS = [("triton-grpc", "continuous"), ("triton-http", "continuous"), ("openai", "continuous")]
# Goodput's service-level objective (docs/benchmarks.md, on CPU).
DEFAULT_SLO = {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def safe_ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def _ttft(r: RequestRecord) -> float:
    return r.token_times[0] - r.arrival


def _e2el(r: RequestRecord) -> float:
    return (r.end_time if r.end_time is not None else r.token_times[-1]) - r.arrival


def _tpot(r: RequestRecord) -> float | None:
    """(E2EL - TTFT) / (n - 1), as vLLM and genai-perf define it; None for a single token."""
    if r.num_output_tokens < 2:
        return None
    return (_e2el(r) - _ttft(r)) / (r.num_output_tokens - 1)


def _meets(r: RequestRecord, slo: dict) -> bool:
    return _ttft(r) * 1e3 <= slo["ttft_ms"] and (_tpot(r) is None or _tpot(r) * 1e3 <= slo["tpot_ms"])


def _latencies(completed: list[RequestRecord]) -> dict:
    """TTFT, TPOT, ITL and E2EL of completed requests (those that streamed a token)."""
    streamed = [r for r in completed if r.token_times]
    return {
        "ttft_ms": _stats_ms([_ttft(r) for r in streamed]),
        "tpot_ms": _stats_ms([t for t in map(_tpot, streamed) if t is not None]),
        "itl_ms": _stats_ms([b - a for r in completed for a, b in zip(r.token_times, r.token_times[1:])]),
        "e2el_ms": _stats_ms([_e2el(r) for r in streamed]),
    }


def summarize(run: SystemRun, workload: Workload, slo: dict | None = None) -> dict:
    """Every metric of docs/benchmarks.md for one run; goodput against `slo` (DEFAULT_SLO's keys, in ms).

    A request meets the SLO when it completed with TTFT <= slo ttft_ms and TPOT <= slo
    tpot_ms (a one-token request has no TPOT and meets that half).
    """
    slo = {**DEFAULT_SLO, **(slo or {})}
    records = run.records
    completed = [r for r in records if r.finish_reason is not None]
    streamed = [r for r in completed if r.token_times]
    output_tokens = sum(r.num_output_tokens for r in completed)
    prompt_tokens = sum(len(workload.requests[i].prompt_token_ids) for i, r in enumerate(records) if r.finish_reason)
    good = [r for r in streamed if _meets(r, slo)]
    errors = [r.error for r in records if r.error]
    result = {
        "system": run.system,
        # Load: the workload's arrival rate (0 = all at once) unless closed loop.
        "rate_per_s": None if run.concurrency else workload.params.get("rate_per_s"),
        "concurrency": run.concurrency,
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_failed": len(errors),
        "all_token_counts_right": all(r.num_output_tokens == r.expected_output_tokens for r in records),
        "duration_s": run.duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / run.duration_s,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / run.duration_s,
        "requests_per_s": len(completed) / run.duration_s,
        "goodput_requests_per_s": len(good) / run.duration_s,
        "slo": slo,
        "slo_met": len(good),
        **_latencies(completed),
        "queue_time_ms": _stats_ms([r.queue_time for r in completed if r.queue_time is not None]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **run.engine_kpis,
    }
    if errors:
        result["errors"] = sorted(set(errors))[:5]
    if "preemptions" in result:
        result["preemptions_per_1000_requests"] = 1000 * result["preemptions"] / max(1, len(records))
    labels = sorted({r.label for r in records if r.label})
    if labels:
        result["by_class"] = {}
        for label in labels:
            mine = [r for r in completed if r.label == label]
            tokens = sum(r.num_output_tokens for r in mine)
            result["by_class"][label] = {
                **_latencies(mine), "output_tokens": tokens, "output_token_share": safe_ratio(tokens, output_tokens),
                "num_completed": len(mine),
                "goodput_requests_per_s": sum(1 for r in mine if r.token_times and _meets(r, slo)) / run.duration_s,
            }
    return result

def rate_label(rate: float | None) -> str:
    return "inf" if rate == 0 else f"{rate:g}/s"


def load_label(result: dict) -> str:
    """The load a result ran under: 'c=N' closed loop, a rate ('inf' = all at once), or ''."""
    if result.get("concurrency"):
        return f"c={result['concurrency']}"
    return "" if result.get("rate_per_s") is None else rate_label(result["rate_per_s"])


def run_label(result: dict) -> str:
    """'run K' for a result of a repeated measurement (--repeat), else ''."""
    return f"run {result['run']}" if result.get("run") else ""


def _pair_ratios(a: dict, b: dict) -> dict:
    entry = {
        "output_tokens_per_s": safe_ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
        "ttft_mean": safe_ratio(a["ttft_ms"]["mean"] or 0, b["ttft_ms"]["mean"] or 0),
        "ttft_p99": safe_ratio(a["ttft_ms"]["p99"] or 0, b["ttft_ms"]["p99"] or 0),
    }
    if "by_class" in a and "by_class" in b:
        entry["ttft_p99_by_class"] = {
            label: safe_ratio(a["by_class"][label]["ttft_ms"]["p99"] or 0, b["by_class"][label]["ttft_ms"]["p99"] or 0)
            for label in a["by_class"]
        }
        entry["e2el_p99_by_class"] = {
            label: safe_ratio(a["by_class"][label]["e2el_ms"]["p99"] or 0, b["by_class"][label]["e2el_ms"]["p99"] or 0)
            for label in a["by_class"]
        }
    return entry


def ratios(workload: str, results: list[dict], pairs: Sequence[tuple[str, str]] = ()) -> dict:
    """Each pair's ratios (the workload's, the server ones and `pairs`), per load when the
    report holds several (keys 'a/b @ 2/s').

    Ratios are taken within one run, never across runs. With repeated runs (--repeat)
    each ratio is the median of the runs' ratios, and `runs` lists every run's output
    tokens/s ratio: on a shared machine both systems' speed drifts between runs, so one
    run's ratio is one draw."""
    loads: dict[str, dict[int, list[dict]]] = {}
    for r in results:
        loads.setdefault(load_label(r), {}).setdefault(r.get("run", 0), []).append(r)
    out = {}
    for load, runs in loads.items():
        suffix = f" @ {load}" if len(loads) > 1 else ""
        for a, b in RATIOS.get(workload, []) + SERVER_RATIOS + list(pairs):
            per_run = []
            for group in runs.values():
                by_name = {r["system"]: r for r in group}
                if a in by_name and b in by_name:
                    per_run.append(_pair_ratios(by_name[a], by_name[b]))
            if per_run:
                out[f"{a}/{b}{suffix}"] = median_of_runs(per_run)
    return out


def median_of_runs(per_run: list[dict]) -> dict:
    """One pair's ratio entries, one per run, as one entry: each ratio's median over the
    runs (per class for the by-class ratios), and with several runs `runs`, every run's
    output tokens/s ratio."""
    by_class = ("ttft_p99_by_class", "e2el_p99_by_class")
    entry = {key: float(np.median([e[key] for e in per_run])) for key in per_run[0] if key not in by_class}
    for key in by_class:
        if key in per_run[0]:
            entry[key] = {label: float(np.median([e[key][label] for e in per_run])) for label in per_run[0][key]}
    if len(per_run) > 1:
        entry["runs"] = [e["output_tokens_per_s"] for e in per_run]
    return entry


def format_ratio(values: dict) -> str:
    """One ratio entry as text: its ratios (medians over runs), then each run's output tokens/s ratio."""
    parts = [f"{k.replace('_', ' ')} {v:.2f}x" for k, v in values.items() if isinstance(v, float)]
    parts += [f"TTFT p99 of class {label} {v:.2f}x" for label, v in values.get("ttft_p99_by_class", {}).items()]
    parts += [f"E2E p99 of class {label} {v:.2f}x" for label, v in values.get("e2el_p99_by_class", {}).items()]
    if "runs" in values:
        parts.append("per run " + ", ".join(f"{v:.2f}x" for v in values["runs"]))
    return ", ".join(parts)

