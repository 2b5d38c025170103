"""Benchmark runner: `python -m client.bench W1 --json bench/results/w1.json`.

Runs a seeded workload (workloads.py) against several systems in one process and
one run, so ratios between them hold on a noisy shared machine: this engine with the
continuous policy, the same engine with the static policy (the seeds' baseline), other
engine settings (priority, prefix caching off), Hugging Face `generate()` in static
padded batches, and running servers (`--target`, targets.py: Triton gRPC or
HTTP streaming, any OpenAI-compatible server). Prints a table and writes JSON with the
command, commit, machine and every metric of docs/benchmarks.md.

Load: open loop by default (each request is sent at its workload arrival time, whatever
the others do); `--rates 0.5,1,2,4` runs the workload once per rate and system (a
latency-throughput curve, `--plot`); `--concurrency N` is closed loop instead (N requests
in flight, a new one as soon as one ends). `--repeat N` measures every system N times,
interleaved, run i with the workload of seed + i - 1 (a server's prefix cache would serve
a repeated run's prompts), and quotes each ratio as the median of the runs' ratios.

    python -m client.bench W3 --rates 0.5,1,2 --systems continuous --target grpc://127.0.0.1:8001 \
        --json bench/results/w3.json --plot
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import transformers
from transformers import AutoTokenizer

from backend.config import EngineConfig
from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from client.bench.flops import add_flop_bound, matmul_peak_gflops
from client.bench.plot import plot_path, plot_report
from client.bench.records import git_commit, machine, write_report
from client.bench.stats import DEFAULT_SLO, rate_label, ratios, summarize
from client.bench.systems import DEFAULT_SYSTEMS, SYSTEMS, RunContext, engine_device, engine_dtype_name, target_runner
from client.bench.table import print_table
from client.bench.targets import parse_target
from client.bench.workloads import BUILTIN_PROMPTS, WORKLOADS, TextPrompts, attach_text


def _parse_rates(text: str) -> list[float]:
    rates = []
    for item in text.split(","):
        rate = 0.0 if item.strip().lower() == "inf" else float(item)
        if rate < 0:
            raise ValueError(f"rate {item!r} is negative")
        rates.append(rate)
    return rates


def _load_tokenizer(model: str):
    # Quiet from here on, in this process and the peers it starts, unless the caller chose a
    # level. transformers reads the variable when it is imported, before this runs, hence the
    # explicit call beside it.
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        transformers.logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench", description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--systems", help="comma-separated: " + ", ".join(SYSTEMS)
                        + " (default: the workload's; none when --target is given)")
    parser.add_argument("--target", action="append", default=[], metavar="[NAME=]SCHEME://HOST:PORT",
                        help="a running server, repeatable: grpc:// (Triton gRPC streaming, system triton-grpc), "
                             "http:// (Triton generate_stream, triton-http), openai:// (/v1/completions, openai)")
    parser.add_argument("--model-name", default="llm", help="the model name servers know (default %(default)s)")
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="Hugging Face checkpoint folder (and the tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, help="override the workload's request count")
    parser.add_argument("--rate", type=float, help="Poisson arrival rate in requests/s (W3, W4, W5; W8a, W8b: the chats'); 0 = all at once")
    parser.add_argument("--rates", help="comma-separated rates (inf = all at once): one run per rate and system")
    parser.add_argument("--concurrency", type=int, help="closed loop: keep N requests in flight, ignoring arrivals")
    parser.add_argument("--input-len", type=int, help="prompt tokens (W3)")
    parser.add_argument("--output-len", type=int, help="output tokens (W3, W4; W8b: the long job's)")
    parser.add_argument("--num-prefixes", type=int, help="distinct shared system prompts (W4; default 1)")
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
    parser.add_argument("--note", help="free text kept in the report, e.g. how and why a run was scaled down")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    make_workload = WORKLOADS[args.workload]
    accepted = inspect.signature(make_workload).parameters
    kwargs = {"seed": args.seed}
    for flag, key in (("num_requests", "num_requests"), ("rate", "rate_per_s"), ("input_len", "input_len"),
                      ("output_len", "output_len"), ("num_prefixes", "num_prefixes")):
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

    try:
        targets = [parse_target(spec, args.model_name) for spec in args.target]
    except ValueError as exc:
        parser.error(str(exc))
    names = args.systems.split(",") if args.systems else ([] if targets else DEFAULT_SYSTEMS[args.workload])
    for name in names:
        if name not in SYSTEMS:
            parser.error(f"unknown system {name!r}")
    runners = [(name, SYSTEMS[name]) for name in names]
    runners += [(t.name, target_runner(t, args.request_timeout)) for t in targets]
    if len({name for name, _ in runners}) != len(runners):
        parser.error("two systems have one name: name targets apart, e.g. --target vllm=openai://HOST:PORT")

    engine_params = dict(item.split("=", 1) for item in args.engine)
    common = {}
    if engine_params:
        parsed = EngineConfig.from_parameters({**engine_params, "model_path": args.model}, str(REPO_ROOT))
        common = {k: getattr(parsed, k) for k in engine_params}
    try:
        device = engine_device(common)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = _load_tokenizer(args.model) if targets or args.text or args.text_prompts else None
    source = None
    if args.text_prompts:
        source = TextPrompts.from_file(args.text_prompts, tokenizer)
    elif args.text:
        source = TextPrompts(BUILTIN_PROMPTS, tokenizer)
    ctx = RunContext(args.model, common, args.concurrency, not args.no_progress)
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}

    # The FLOP bound's peak, measured while the machine is quiet: before the systems, not after a peer.
    matmul_peak = matmul_peak_gflops(engine_dtype_name(common), device=device)
    results = []
    workload = None
    for rate in rates:
        for repeat in range(1, args.repeat + 1):
            # Each run has prompts of its own (seed + run - 1), the same for every system: a
            # server keeps its prefix cache from one run to the next, and would serve a later
            # run's prompts from it.
            seed = args.seed + repeat - 1
            workload = make_workload(**{**kwargs, "seed": seed}, **({} if rate is None else {"rate_per_s": rate}),
                                     source=source)
            if targets or source is not None:
                # Text that encodes to exactly the prompt ids: servers get it, the engine the ids.
                attach_text(workload, tokenizer, source, seed)
            for name, runner in runners:
                try:
                    run = runner(workload, ctx)
                except (RuntimeError, ValueError) as exc:
                    print(f"error: {name}: {exc}", file=sys.stderr)
                    return 2
                result = summarize(run, workload, slo)
                # A line per run as it ends: a run cut short by a time limit keeps what finished.
                print(f"{name}: {result['num_completed']}/{result['num_requests']} completed, "
                      f"{result['output_tokens_per_s']:.1f} output tok/s in {result['duration_s']:.1f} s",
                      file=sys.stderr, flush=True)
                if args.repeat > 1:
                    result["run"], result["seed"] = repeat, seed
                results.append(result)
    summary = workload.summary()
    if args.rates:
        summary["rates_per_s"] = rates
        summary.pop("rate_per_s", None)
        summary["description"] += "; rates " + ", ".join(map(rate_label, rates))
    elif args.concurrency:
        summary["description"] += f"; closed loop, {args.concurrency} in flight"
    flop_bound = add_flop_bound(results, args.model, engine_dtype_name(common), matmul_peak, device)
    report = {
        "command": "python -m client.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "device": device.type,  # where the engine systems ran (and the peers with them)
        "checkpoint": os.path.relpath(args.model, REPO_ROOT) if args.model.startswith(str(REPO_ROOT)) else args.model,
        "workload": summary,
        **({"note": args.note} if args.note else {}),
        "concurrency": args.concurrency,  # None: open loop at the workload's arrival times
        "engine_parameters": common,
        "targets": {t.name: t.url for t in targets},
        "slo": slo,
        "flop_bound": flop_bound,
        "results": results,
        # The first target against every other: e.g. this backend's tritonserver against a peer's.
        "ratios": ratios(args.workload, results, [(targets[0].name, t.name) for t in targets[1:]]),
    }
    print_table(report)
    if args.json:
        write_report(args.json, report)
    if args.plot:
        path = plot_path(args.json, args.workload)
        plot_report(report, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
