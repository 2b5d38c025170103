"""Q3 (docs/benchmarks.md): the same GGUF files served by tritonserver and by llama.cpp's llama-server.

    python -m client.bench.gguf_serving --types Q4_1,Q8_0 --concurrency 1,32

For each GGUF type (Q4_1: the shipped file; Q8_0, Q4_0 and Q4_K_M: made from the float
checkpoint by llama.cpp's own convert_hf_to_gguf.py and llama-quantize into .models/gguf/ when
absent) each system starts fresh on the file, runs W3 (128 in / 128 out, EOS ignored) closed
loop at each concurrency through its OpenAI endpoint, and stops:

- `tritonserver`: a model repository of one model, `llm`, model_repository/llm_q4's config
  with model_path the GGUF file, behind the OpenAI frontend (client/openai/);
- `llama-server`: client/bench/llama_cpp.py's settings (continuous batching, as many slots as
  the engine's max_num_seqs, KV in float32 as the engine's, no prompt cache reuse).

Both get the first `--cores` CPUs of this process: the engine's OpenMP threads bound one to
each (omp_threads_bind), llama-server confined to them with a thread on each. Each concurrency
has prompts of its own (seed + its index), the same for both systems, so neither server meets
a prompt it has cached. The report (bench/results/<cpu kind>/q3_gguf_vs_llama_server.json by
default) holds every run, the versions of both servers, and per type and concurrency
tritonserver's output tokens/s and TTFT over llama-server's, against issue 47's targets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from functools import partial

from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF, REPO_ROOT
from client.bench import llama_cpp, servers
from client.bench.records import machine, write_report
from client.bench.servers import first_cpus, llama_server, parse_concurrencies, tritonserver
from client.bench.stats import DEFAULT_SLO, format_ratio, ratios, summarize
from client.bench.targets import parse_target, run_target
from client.bench.workloads import attach_text, w3_online

SHIPPED_TYPE = "Q4_1"
TYPES = (SHIPPED_TYPE, *llama_cpp.QUANTIZED_TYPES)
SYSTEMS = ("tritonserver", "llama-server")
# Issue 47: tritonserver's output tokens/s over llama-server's, at least, by concurrency (and a lower TTFT).
TARGETS = {1: 1.0, 32: 1.3}
BASE_MODEL = REPO_ROOT / "model_repository" / "llm_q4"


def parse_types(text: str) -> list[str]:
    types = [t for t in text.split(",") if t]
    unknown = [t for t in types if t not in TYPES]
    if unknown or not types:
        raise ValueError(f"--types {text!r}: each of {', '.join(TYPES)}")
    return types


def requests_for(concurrency: int, num_requests: int | None) -> int:
    """`num_requests`, else three waves of the concurrency and at least 12. W3's requests are
    all of one length, so a closed loop's waves start and end together and each is as full
    as the next. Both types on both servers at concurrency 1 and 32 are then an estimated 8 to
    12 minutes on a quiet 2-core AVX2 machine (from the engine's W3 rates there)."""
    return num_requests if num_requests is not None else max(12, 3 * concurrency)


def gguf_file(gguf_type: str, checkpoint: str, shipped: str) -> str:
    return shipped if gguf_type == SHIPPED_TYPE else llama_cpp.make_quantized_gguf(checkpoint, gguf_type)


def compare(results: list[dict]) -> dict:
    """Per GGUF type and concurrency, tritonserver's output tokens/s and TTFT over
    llama-server's (stats.ratios), with the target of that concurrency, if it has one, and
    whether it is met (the TTFT's mean lower): {type: {"c=N": {...}}}."""
    out: dict[str, dict] = {}
    for gguf_type in dict.fromkeys(r["gguf_type"] for r in results):
        for concurrency in dict.fromkeys(r["concurrency"] for r in results if r["gguf_type"] == gguf_type):
            group = [r for r in results if r["gguf_type"] == gguf_type and r["concurrency"] == concurrency]
            pair = ratios("W3", group, [SYSTEMS]).get("/".join(SYSTEMS))
            if pair is None:
                continue
            if concurrency in TARGETS:
                target = TARGETS[concurrency]
                pair["target"] = {"output_tokens_per_s": target, "lower_ttft": True,
                                  "met": pair["output_tokens_per_s"] >= target and 0 < pair["ttft_mean"] < 1}
            out.setdefault(gguf_type, {})[f"c={concurrency}"] = pair
    return out


def engine_parameters(args) -> dict:
    """What tritonserver's `llm` takes beside llm_q4's config, the GGUF file aside."""
    return {"tokenizer": args.model, **({"activation_quantization": args.activation_quantization}
                                         if args.activation_quantization != "none" else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.gguf_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_1,Q8_0", help=f"comma-separated GGUF types, of {', '.join(TYPES)}")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated requests in flight (closed loop)")
    parser.add_argument("--num-requests", type=int,
                        help="requests per concurrency (default: 3 x the concurrency, at least 12)")
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT),
                        help="the float checkpoint the quantized files are made from, and the tokenizer")
    parser.add_argument("--gguf", default=str(DEFAULT_GGUF), help=f"the {SHIPPED_TYPE} file")
    parser.add_argument("--slots", type=int, default=32,
                        help="sequences at once: the engine's max_num_seqs and llama-server's --parallel")
    parser.add_argument("--activation-quantization", choices=("none", "int8"), default="none",
                        help="tritonserver's activation_quantization (int8: W4A8/W8A8, as llama.cpp's Q8 activations)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    servers.add_llama_server_arguments(parser)
    servers.add_run_arguments(parser, "q3_gguf_vs_llama_server.json")
    args = parser.parse_args(argv)

    try:
        types = parse_types(args.types)
        concurrencies = parse_concurrencies(args.concurrency)
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_requests is not None and args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.slots < 1:
        parser.error("--slots must be at least 1")
    try:
        cpus = first_cpus(args.cores)
    except ValueError as exc:
        parser.error(str(exc))
    for tool in (llama_cpp.LLAMA_SERVER, *([llama_cpp.LLAMA_QUANTIZE] if set(types) - {SHIPPED_TYPE} else [])):
        if not tool.exists():
            parser.error(f"{tool} is missing: run `make peers-llama-cpp`")

    info = machine()
    path = args.json or str(REPO_ROOT / "bench" / "results" / info["cpu_kind"] / "q3_gguf_vs_llama_server.json")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workloads = {}
    for index, concurrency in enumerate(concurrencies):
        workload = w3_online(seed=args.seed + index, num_requests=requests_for(concurrency, args.num_requests),
                             input_len=args.input_len, output_len=args.output_len, rate_per_s=0.0)
        workloads[concurrency] = attach_text(workload, tokenizer, None, args.seed + index)
    files = {t: gguf_file(t, args.model, args.gguf) for t in types}
    slo = dict(DEFAULT_SLO)
    print(f"Q3: W3 {args.input_len} in / {args.output_len} out at concurrency {concurrencies}, types {types}, "
          f"on CPUs {cpus} of {info['cpu']}", flush=True)

    results, versions = [], {}
    report = {
        **servers.report_header("Q3: GGUF files served by tritonserver and by llama-server (issue 47)",
                                "client.bench.gguf_serving", argv, info, cpus, versions, args.model),
        "gguf_files": {t: {"path": os.path.relpath(f, REPO_ROOT), "bytes": os.path.getsize(f)} for t, f in files.items()},
        "slots": args.slots,
        "tritonserver_parameters": engine_parameters(args),
        "llama_server_extra_args": args.llama_server_args,
        "workloads": {f"c={c}": w.summary() for c, w in workloads.items()},
        **({"note": args.note} if args.note else {}),
        "slo": slo,
        "results": results,
    }
    # A failure leaves the servers' logs in `tmp` (it says where); a run that ends removes them.
    tmp = tempfile.mkdtemp(prefix="bench-q3-")
    for gguf_type, gguf in files.items():
        for system in SYSTEMS:
            start = (partial(tritonserver, BASE_MODEL, {"model_path": gguf, **engine_parameters(args)}, cpus, args.slots)
                     if system == "tritonserver" else partial(llama_server, gguf, cpus, args.slots,
                                                              extra=args.llama_server_args))
            with servers.started(f"{gguf_type} {system}", system, start, tmp, versions) as address:
                target = parse_target(f"{system}=openai://{address}")
                for concurrency, workload in workloads.items():
                    run = run_target(target, workload, concurrency, not args.no_progress, args.request_timeout)
                    result = {"gguf_type": gguf_type, **summarize(run, workload, slo)}
                    results.append(result)
                    print(f"{gguf_type} {system} c={concurrency}: {result['num_completed']}/{result['num_requests']}"
                          f" completed, {result['output_tokens_per_s']:.1f} output tok/s, TTFT mean "
                          f"{result['ttft_ms']['mean'] or 0:.0f} ms in {result['duration_s']:.1f} s", flush=True)
            # Written after each server: a run stopped halfway keeps what it measured.
            report["ratios"] = compare(results)
            write_report(path, report)
    shutil.rmtree(tmp)

    for gguf_type, by_load in report["ratios"].items():
        for load, entry in by_load.items():
            target = entry.get("target")
            verdict = "" if target is None else (
                f" (target {target['output_tokens_per_s']}x and a lower TTFT: {'met' if target['met'] else 'not met'})")
            print(f"{gguf_type} {load}: tritonserver/llama-server {format_ratio(entry)}{verdict}")
    return 0 if all(r["num_failed"] == 0 and r["all_token_counts_right"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
