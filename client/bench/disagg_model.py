"""W10's crossover (docs/benchmarks.md): where disaggregated prefill and decode starts to pay,
modelled from measured step costs. `python -m client.bench.disagg_model`.

A 2-core machine cannot show W10's gain (docs/benchmarks.md, W10): one core of decode is too
slow for the TPOT goal at any load that keeps it busy. This models 4, 8 and 16 cores:

1. **Step costs, measured.** The engine's forward pass (the model's own, in process, over made-up
   sequences: `ModelRunner.synthetic_inputs`) for a grid of steps (a prefill chunk of P tokens
   at a context, beside B decodes at a context), on 1 and on 2 cores (each in a process pinned
   to them), plus the engine's own work per step (scheduling, sampling, update) from real steps.
   Each core count's times are fitted by least squares to
   `t = a + b * P + c * P * chunk_context + d * B + e * B * decode_context`.
2. **Cores, extrapolated.** Each coefficient's change from 1 to 2 cores gives its exponent
   (`coef(n) = coef(2) * (n / 2) ** -s`, s in [0, 1]): the prefill terms scale with the cores'
   arithmetic, the weights' read and the decode terms with the memory bandwidth the cores reach;
   the engine's Python work per step not at all. That extrapolation is the model's assumption;
   the 1- and 2-core points are measurements.
3. **The schedule, simulated.** W10's arrivals (client.bench.workloads.w10_disaggregated) with the
   load scaled by cores / 2 (chats at `chat_rate * cores / 2`, long prompts as often), through a
   simulation of the engine's FCFS scheduler (running decodes first, then prefill chunks of at
   most `long_prefill_token_threshold` tokens within `max_num_batched_tokens`, at most
   `max_num_seqs` running, which grows with the load): the aggregated instance on all the cores
   (chunks of 512, and capped),
   against a prefill instance and a decode instance on half each, the KV handed over at the
   measured transfer cost, which the decode instance's step pays.

The report gives, per core count and system, the chats' ITL p99, TPOT p99 and TTFT p99 and the
goodput at W10's SLO; the 2-core rows sit beside the measured W10 run's (`--measured`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from backend.paths import DEFAULT_CHECKPOINT
from client.bench.records import git_commit, machine, write_report
from client.bench.workloads import w10_disaggregated

W10_SLO = {"ttft_ms": 2000.0, "tpot_ms": 100.0}
TERMS = ("a", "b", "c", "d", "e")  # constant, chunk tokens, chunk tokens x context, decodes, decodes x context


# ---- 1. step costs ----------------------------------------------------------------------------

# (chunk tokens, chunk context after the chunk, decodes, decode context)
# The decodes' counts and contexts vary apart, so that their two terms separate in the fit.
GRID = [(p, ctx, b, dctx) for p, ctx in ((0, 0), (128, 128), (128, 1024), (512, 512), (512, 2000))
        for b, dctx in ((0, 0), (4, 64), (16, 64), (16, 1024), (32, 384)) if p or b]


def measure_costs(model: str, dtype: str, seconds: float) -> dict:
    """In this process (pinned by the caller): each GRID step's forward pass in seconds, and
    the engine's own seconds per step beside it (real decode steps minus their forward pass)."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams
    from client.bench.flops import seconds_per_call

    engine = LLMEngine(EngineConfig(model_path=model, dtype=dtype, max_num_seqs=32, max_model_len=2048,
                                    num_kv_blocks=32 * 2048 // 16 + 256))
    runner = engine.runner
    rows = []
    for p, ctx, b, dctx in GRID:
        q_lens = ([p] if p else []) + [1] * b
        seq_lens = ([ctx] if p else []) + [dctx] * b
        inputs = runner.synthetic_inputs(q_lens, seq_lens)
        rows.append({"chunk": p, "chunk_context": ctx, "decodes": b, "decode_context": dctx,
                     "seconds": seconds_per_call(lambda: runner.forward_logits(inputs), engine.device, seconds, 3)})
    # Real steps of 16 decodes: the scheduler, the sampler and the update beside the forward pass.
    for i in range(16):
        engine.add_request(f"o{i}", list(range(100 + i, 356 + i)), SamplingParams(temperature=0.0, max_tokens=40,
                                                                                ignore_eos=True))
    started: set[str] = set()
    while len(started) < 16:  # until each has its first token
        started.update(out.request_id for out in engine.step() if out.token_ids_delta)
    step_s = []
    for _ in range(24):
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    inputs = runner.synthetic_inputs([1] * 16, [280] * 16)
    forward = seconds_per_call(lambda: runner.forward_logits(inputs), engine.device, seconds, 3)
    return {"steps": rows, "engine_overhead_s": max(0.0, float(np.median(step_s)) - forward)}


def fit(costs: dict) -> dict[str, float]:
    """The least-squares coefficients of TERMS over the measured forward passes (`a` is mostly
    the weights' read), and the engine's own work per step as `overhead`."""
    rows = costs["steps"]
    x = np.array([[1.0, r["chunk"], r["chunk"] * r["chunk_context"] / 1000, r["decodes"],
                   r["decodes"] * r["decode_context"] / 1000] for r in rows])
    y = np.array([r["seconds"] for r in rows])
    # Relative errors: a decode step of 30 ms must fit as well as a 512-token chunk of 1.3 s.
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    fitted = dict(zip(TERMS, np.maximum(coef, 0.0).tolist()))
    fitted["overhead"] = costs["engine_overhead_s"]
    return fitted


def at_cores(one: dict[str, float], two: dict[str, float], cores: float) -> dict[str, float]:
    """The coefficients at `cores`: as measured at 1 and 2; past 2, each term's 2-core value
    scaled by (cores / 2) to the power that took it from one core to two, within [0, 1] (0: it
    does not scale, 1: it scales with the cores). The engine's own work per step (`overhead`, one
    Python thread) does not scale: the larger of its two measurements, each a difference of two
    timings."""
    out = {"overhead": max(one["overhead"], two["overhead"])}
    for term in TERMS:
        if cores <= 1 or cores == 2 or one[term] <= 0 or two[term] <= 0:
            out[term] = one[term] if cores <= 1 else two[term]
            continue
        s = float(np.clip(np.log2(one[term] / two[term]), 0.0, 1.0))
        out[term] = two[term] * (cores / 2) ** -s
    return out


def step_seconds(coef: dict[str, float], chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
    """A step of `chunks` (tokens, context after the chunk) beside decodes at `decode_contexts`."""
    if not chunks and not decode_contexts:
        return 0.0
    return (coef["overhead"] + coef["a"] + coef["b"] * sum(p for p, _ in chunks)
            + coef["c"] * sum(p * c for p, c in chunks) / 1000
            + coef["d"] * len(decode_contexts) + coef["e"] * sum(decode_contexts) / 1000)


# ---- 3. the schedule --------------------------------------------------------------------------

@dataclass
class SimRequest:
    arrival: float
    prompt: int
    output: int
    label: str
    computed: int = 0  # prompt tokens computed
    tokens: list[float] = field(default_factory=list)  # when each output token reached the client


@dataclass
class Engine:
    """One simulated engine: FCFS, running decodes first, then prefill chunks within the budget."""

    coef: dict[str, float]
    chunk_cap: int
    budget: int = 512
    max_num_seqs: int = 32
    hand_over: bool = False  # role prefill: a request leaves after its first token
    export_s_per_token: float = 0.0  # role prefill: what handing a request over adds to its step
    clock: float = 0.0
    waiting: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    import_s: float = 0.0  # transfer seconds the next step pays (role decode)

    def step(self) -> list[SimRequest]:
        """One step from `clock`; the requests that finished their prefill here when handing over."""
        while self.waiting and len(self.running) < self.max_num_seqs and self.waiting[0].arrival <= self.clock:
            self.running.append(self.waiting.pop(0))
        decodes = [r for r in self.running if r.computed >= r.prompt]
        left = self.budget - len(decodes)
        chunks = []
        for r in self.running:
            if r.computed < r.prompt and left > 0:
                n = min(r.prompt - r.computed, self.chunk_cap, left)
                chunks.append((r, n))
                left -= n
        if not decodes and not chunks:
            upcoming = [r.arrival for r in self.waiting[:1]]
            self.clock = max(self.clock, upcoming[0]) if upcoming else self.clock
            return []
        finishing = sum(r.prompt for r, n in chunks if r.computed + n == r.prompt) if self.hand_over else 0
        duration = (step_seconds(self.coef, [(n, r.computed + n) for r, n in chunks],
                                 [r.prompt + len(r.tokens) for r in decodes])
                    + self.import_s + self.export_s_per_token * finishing)
        self.import_s = 0.0
        self.clock += duration
        handed = []
        for r in decodes:
            r.tokens.append(self.clock)
        for r, n in chunks:
            r.computed += n
            if r.computed == r.prompt:
                if self.hand_over:
                    handed.append(r)
                else:
                    r.tokens.append(self.clock)
        self.running = [r for r in self.running if len(r.tokens) < r.output and r not in handed]
        return handed

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)


def simulate(requests: list[SimRequest], coef_all: dict, coef_half: dict, system: str, chunk_cap: int,
             transfer: tuple[float, float] = (0.0, 0.0), max_num_seqs: int = 32) -> list[SimRequest]:
    """Run `requests` (fresh copies) through `system`: "aggregated" (one engine on all the cores)
    or "disaggregated" (a prefill and a decode engine on half each, `transfer` the seconds per
    prompt token of the export and of the import; a handed-over request waits for a seat of the
    decode engine); their finished copies. Each engine runs at most `max_num_seqs`."""
    requests = [dataclasses.replace(r, tokens=[]) for r in requests]
    if system == "aggregated":
        engine = Engine(coef_all, chunk_cap, max_num_seqs=max_num_seqs, waiting=list(requests))
        while engine.busy:
            engine.step()
        return requests
    export_s, import_s = transfer
    prefill = Engine(coef_half, chunk_cap, max_num_seqs=max_num_seqs, hand_over=True, export_s_per_token=export_s,
                     waiting=list(requests))
    decode = Engine(coef_half, chunk_cap, max_num_seqs=max_num_seqs)
    in_flight: list[tuple[float, SimRequest]] = []  # (ready on the decode side, request)
    while prefill.busy or decode.busy or in_flight:
        # Step whichever engine is behind; the other's clock stands still meanwhile.
        if prefill.busy and (prefill.clock <= decode.clock or not (decode.busy or in_flight)):
            for r in prefill.step():
                in_flight.append((prefill.clock, r))
            continue
        seats = decode.max_num_seqs - len(decode.running)
        arrived = [(t, r) for t, r in in_flight if t <= decode.clock][:max(0, seats)]
        for t, r in arrived:
            in_flight.remove((t, r))
            r.tokens.append(decode.clock + import_s * r.prompt)  # its first token, after the import
            decode.import_s += import_s * r.prompt
            if len(r.tokens) < r.output:
                decode.running.append(r)
        if decode.running:
            decode.step()
        elif in_flight:  # nothing running, so a seat is free: wait for the next hand-over
            decode.clock = max(decode.clock, min(t for t, _ in in_flight))
        elif prefill.busy:
            decode.clock = max(decode.clock, prefill.clock)
    return requests


def _ttft_ms(r: SimRequest) -> float:
    return (r.tokens[0] - r.arrival) * 1e3


def _tpot_ms(r: SimRequest) -> float:
    """Mean gap after the first token; 0 for a request of one token."""
    return (r.tokens[-1] - r.tokens[0]) / (len(r.tokens) - 1) * 1e3 if len(r.tokens) > 1 else 0.0


def chat_metrics(requests: list[SimRequest], slo: dict) -> dict:
    """The chats' ITL, TPOT and TTFT percentiles, and every request's goodput at `slo` (requests
    a second, to the last token)."""
    chats = [r for r in requests if r.label == "chat"]
    gaps = np.concatenate([np.diff(r.tokens) for r in chats]) * 1e3
    tpot = np.array([_tpot_ms(r) for r in chats])
    ttft = np.array([_ttft_ms(r) for r in chats])
    good = sum(1 for r in requests if _ttft_ms(r) <= slo["ttft_ms"] and _tpot_ms(r) <= slo["tpot_ms"])
    end = max(r.tokens[-1] for r in requests)
    return {"chats": len(chats), "itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p99_ms": float(np.percentile(tpot, 99)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "goodput_rps": good / end}


def transfer_costs(measured: dict, model: str, dtype: str) -> tuple[float, float]:
    """(export, import) seconds per prompt token: the measured W10 run's transfer seconds per byte
    (its prefill and decode models' /metrics) times the model's KV bytes per token."""
    from backend.model_runner import DTYPES, kv_block_bytes
    from backend.models.loader import load_arch

    per_token = kv_block_bytes(load_arch(model)[0], 1, DTYPES[dtype])
    kv = next(r["kv_transfers"] for r in measured["results"] if r["system"].startswith("disaggregated"))
    return (kv["llm_prefill"]["seconds"] / kv["llm_prefill"]["bytes"] * per_token,
            kv["llm_decode"]["seconds"] / kv["llm_decode"]["bytes"] * per_token)


def _measure_pinned(cpus: str, model: str, dtype: str, seconds: float) -> dict:
    """measure_costs in a process of its own pinned to `cpus` (the engine takes one thread per CPU)."""
    code = ("import json, sys; from client.bench.disagg_model import measure_costs; "
            f"print('COSTS', json.dumps(measure_costs({model!r}, {dtype!r}, {seconds})))")
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = next(line for line in out.stdout.splitlines() if line.startswith("COSTS "))
    return json.loads(line[len("COSTS "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (W10 ran float32)")
    parser.add_argument("--cores", default="2,4,8,16", help="core counts to model")
    parser.add_argument("--duration", type=float, default=80.0)
    parser.add_argument("--chat-rate", type=float, default=0.4, help="chats per second at 2 cores")
    parser.add_argument("--long-every", type=float, default=20.0, help="seconds between long prompts at 2 cores")
    parser.add_argument("--caps", default="128", help="the capped aggregated systems' long_prefill_token_threshold")
    parser.add_argument("--prefill-cap", type=int, default=128, help="the prefill engine's long_prefill_token_threshold")
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="every engine's max_num_seqs at 2 cores, scaled with the load")
    parser.add_argument("--measured", required=True,
                        help="a W10 report (python -m client.bench.disaggregated) from this machine: its KV "
                             "transfers' seconds per byte, and its measured 2-core results beside the model's")
    parser.add_argument("--costs", help="reuse the step costs of an earlier report instead of measuring")
    parser.add_argument("--seconds", type=float, default=0.3, help="length of each timing window")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    with open(args.measured) as f:
        measured = json.load(f)
    if args.costs:
        costs = json.load(open(args.costs))["step_costs"]
    else:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("measuring needs 2 CPUs (1 and 2 cores)")
        costs = {"1": _measure_pinned(str(cpus[0]), args.model, args.dtype, args.seconds),
                 "2": _measure_pinned(f"{cpus[0]},{cpus[1]}", args.model, args.dtype, args.seconds)}
    one, two = fit(costs["1"]), fit(costs["2"])
    transfer = transfer_costs(measured, args.model, args.dtype)
    caps = [int(c) for c in args.caps.split(",") if c]
    rows = []
    for cores in [int(c) for c in args.cores.split(",")]:
        scale = cores / 2
        workload = w10_disaggregated(0, args.duration, args.chat_rate * scale, args.long_every / scale)
        base = [SimRequest(r.arrival_s, len(r.prompt_token_ids), r.max_tokens, r.label) for r in workload.requests]
        all_cores, half = at_cores(one, two, cores), at_cores(one, two, cores / 2)
        systems = [("aggregated", "aggregated", 512)] + [(f"aggregated-cap{c}", "aggregated", c) for c in caps]
        systems.append((f"disaggregated-cap{args.prefill_cap}", "disaggregated", args.prefill_cap))
        for name, kind, cap in systems:
            done = simulate(base, all_cores, half, kind, cap, transfer, max_num_seqs=round(args.max_num_seqs * scale))
            rows.append({"cores": cores, "system": name, **chat_metrics(done, W10_SLO)})
    by = {(r["cores"], r["system"]): r for r in rows}
    ratios = {}
    for cores in sorted({r["cores"] for r in rows}):
        agg, dis = by[(cores, "aggregated")], by[(cores, f"disaggregated-cap{args.prefill_cap}")]
        ratios[str(cores)] = {"itl_p99": dis["itl_p99_ms"] / agg["itl_p99_ms"],
                              "goodput": dis["goodput_rps"] / agg["goodput_rps"] if agg["goodput_rps"] else None}
    print(f"W10 crossover model: chats {args.chat_rate:g}/s and a long prompt every {args.long_every:g} s at 2 cores, "
          f"scaled with the cores; KV export/import {transfer[0] * 1e6:.0f}/{transfer[1] * 1e6:.0f} us per prompt token")
    print(f"{'cores':>5} {'system':<24} {'ITL p99':>9} {'TPOT p99':>9} {'TTFT p99':>9} {'goodput':>8}")
    for r in rows:
        print(f"{r['cores']:>5} {r['system']:<24} {r['itl_p99_ms']:>9.0f} {r['tpot_p99_ms']:>9.0f} "
              f"{r['ttft_p99_ms']:>9.0f} {r['goodput_rps']:>8.3f}")
    for cores, ratio in ratios.items():
        goodput = f"{ratio['goodput']:.2f}x" if ratio["goodput"] is not None else "-"
        print(f"{cores} cores: disaggregated/aggregated chats' ITL p99 {ratio['itl_p99']:.2f}x, goodput {goodput}")
    if args.json:
        write_report(args.json, {
            "benchmark": "W10 crossover model",
            "command": "python -m client.bench.disagg_model " + " ".join(sys.argv[1:] if argv is None else argv),
            "git_commit": git_commit(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(), "checkpoint": args.model, "dtype": args.dtype, "slo": W10_SLO,
            "step_costs": costs, "fitted": {"1": one, "2": two},
            "transfer_s_per_token": {"export": transfer[0], "import": transfer[1]},
            "results": rows, "ratios": ratios,
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
