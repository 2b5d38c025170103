"""Quantized KV cache against llama.cpp's llama-server (docs/benchmarks.md, issue 49): long
prompts at concurrency 8, through each system's server, on the same model and requests.

    python -m client.bench.kv_serving --concurrency 8 --requests 16 --input-len 4000 --max-tokens 128

(the defaults: about 10 minutes on a quiet 2-core machine, most of it the prompts' prefill).

The requests: `--requests` stretches of `--input-len` tokens of the project's fixed text
(client/bench/perplexity.py's), each from a seeded random place (so no two share a prefix and
no server reuses one request's KV for another), sent as plain completions, greedy,
`--max-tokens` out, EOS ignored, `--concurrency` in flight (closed loop). Each setting starts
a fresh server, runs them through its OpenAI endpoint (client.bench.targets) and stops:

- `tritonserver`: model_repository/llm's config on the float checkpoint in `--dtype` behind
  the OpenAI frontend, with `kv_cache_dtype` each of `--kv-dtypes`, `kv_cache_memory_mb`
  `--kv-cache-mb` for every setting, prefix caching off;
- `llama-server`: the checkpoint converted to a GGUF in `--dtype` by llama.cpp's converter,
  with `--cache-type-k/v` each of `--llama-cache-types` (`model`: the weights' dtype; `q8_0`,
  `q4_0`: llama.cpp's quantized caches, which turn its flash attention on).

Both run on the first `--cores` CPUs with `--concurrency` sequences at once. The report
(bench/results/<cpu kind>/kv_vs_llama_server.json by default) holds every run, both servers'
versions, and the ratios: each engine setting over llama-server's q8_0 cache (issue 49's
target: ahead in output tokens/s) and over its own model-dtype cache, each quantized
llama-server cache over its own model-dtype one, and whether the engine's greedy texts with a
quantized cache are its `auto` text (recorded, not required: a quantized cache may change a
token).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from functools import partial

import numpy as np
from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from client.bench import llama_cpp, servers
from client.bench.perplexity import TEXT
from client.bench.records import machine, write_report
from client.bench.servers import first_cpus, llama_server, tritonserver
from client.bench.speculative_serving import text_difference
from client.bench.stats import safe_ratio, summarize
from client.bench.targets import parse_target, run_target
from client.bench.workloads import BenchRequest, Workload

BASE_MODEL = REPO_ROOT / "model_repository" / "llm"
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
LLAMA_CACHE_TYPES = ("model", "q8_0", "q4_0")
# The engine's quantized cache against llama-server's q8_0 (issue 49: ahead at concurrency 8).
TARGET_AGAINST = "q8_0"


def long_prompts(tokenizer, num_requests: int, input_len: int, max_tokens: int, seed: int = 0) -> Workload:
    """`num_requests` stretches of about `input_len` tokens of the fixed text, each from a random
    place; a request's ids are its text's encoding (what a server tokenizes)."""
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < input_len + 1:
        raise ValueError(f"--input-len {input_len}: the fixed text has {len(ids)} tokens")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        start = int(rng.integers(0, len(ids) - input_len))
        text = tokenizer.decode(ids[start : start + input_len])
        requests.append(BenchRequest(tokenizer.encode(text), max_tokens, prompt_text=text))
    return Workload("long-context", f"{num_requests} stretches of ~{input_len} tokens of the fixed text, greedy, "
                    f"{max_tokens} tokens out, EOS ignored", requests, prompt_source=f"text:{TEXT.name}")


def engine_parameters(kv_dtype: str, checkpoint: str, dtype: str, kv_cache_mb: int, max_model_len: int) -> dict:
    return {"model_path": checkpoint, "dtype": dtype, "kv_cache_dtype": kv_dtype,
            "kv_cache_memory_mb": str(kv_cache_mb), "max_model_len": str(max_model_len),
            "enable_prefix_caching": "false"}


def llama_flags(cache_type: str) -> list[str]:
    """Flags after llama_server_command's, whose cache is the weights' dtype (the later flag wins)."""
    return [] if cache_type == "model" else ["--cache-type-k", cache_type, "--cache-type-v", cache_type]


def parse_names(text: str, known, flag: str, base: str) -> list[str]:
    """Comma-separated names of `known`, `base` among them (every ratio needs it)."""
    names = [n for n in text.split(",") if n]
    if not names or any(n not in known for n in names) or base not in names:
        raise ValueError(f"{flag} {text!r}: comma-separated, {base} and any of {', '.join(k for k in known if k != base)}")
    return list(dict.fromkeys(names))


def _ratio(a: dict, b: dict) -> dict:
    return {"output_tokens_per_s": safe_ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "tpot_p50": safe_ratio(a["tpot_ms"]["p50"] or 0, b["tpot_ms"]["p50"] or 0),
            "ttft_p50": safe_ratio(a["ttft_ms"]["p50"] or 0, b["ttft_ms"]["p50"] or 0)}


def compare(results: list[dict]) -> dict:
    """Each engine setting over llama-server's q8_0 cache (with the target) and over its own
    `auto`; each llama-server cache over its own `model`."""
    engine = {r["setting"]: r for r in results if r["system"] == "tritonserver"}
    llama = {r["setting"]: r for r in results if r["system"] == "llama-server"}
    out: dict = {"tritonserver_over_its_auto": {s: _ratio(r, engine["auto"]) for s, r in engine.items() if s != "auto"}
                 if "auto" in engine else {},
                 "llama_server_over_its_model_dtype": {s: _ratio(r, llama["model"]) for s, r in llama.items()
                                                       if s != "model"} if "model" in llama else {}}
    if TARGET_AGAINST in llama:
        out[f"tritonserver_over_llama_server_{TARGET_AGAINST}"] = {
            s: {**_ratio(r, llama[TARGET_AGAINST]),
                "target": {"output_tokens_per_s": 1.0,
                           "met": r["output_tokens_per_s"] > llama[TARGET_AGAINST]["output_tokens_per_s"]}}
            for s, r in engine.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.kv_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=4000, help="prompt tokens, about")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(llama_cpp.GGUF_TYPE), default="bfloat16",
                        help="the weights' dtype on both systems (and the KV cache's, unquantized)")
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3", help=f"the engine's, of {', '.join(KV_DTYPES)}")
    parser.add_argument("--llama-cache-types", default="model,q8_0",
                        help=f"llama-server's, of {', '.join(LLAMA_CACHE_TYPES)}")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="the engine's kv_cache_memory_mb, every setting")
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="the float checkpoint (and tokenizer)")
    servers.add_llama_server_arguments(parser)
    servers.add_run_arguments(parser, "kv_vs_llama_server.json")
    args = parser.parse_args(argv)
    try:
        kv_dtypes = parse_names(args.kv_dtypes, KV_DTYPES, "--kv-dtypes", "auto")
        cache_types = parse_names(args.llama_cache_types, LLAMA_CACHE_TYPES, "--llama-cache-types", "model")
        cpus = first_cpus(args.cores)
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.concurrency, args.requests, args.input_len, args.max_tokens) < 1:
        parser.error("--concurrency, --requests, --input-len and --max-tokens must be at least 1")
    if not llama_cpp.LLAMA_SERVER.exists():
        parser.error(f"{llama_cpp.LLAMA_SERVER} is missing: run `make peers-llama-cpp`")

    info = machine()
    path = args.json or str(REPO_ROOT / "bench" / "results" / info["cpu_kind"] / "kv_vs_llama_server.json")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workload = long_prompts(tokenizer, args.requests, args.input_len, args.max_tokens, seed=args.seed)
    context = max(len(r.prompt_token_ids) for r in workload.requests) + args.max_tokens + 16
    gguf = llama_cpp.convert(args.model, args.dtype)
    print(f"long context vs llama-server: {args.requests} requests of ~{args.input_len} tokens, {args.max_tokens} out, "
          f"{args.concurrency} in flight, {args.dtype}, on CPUs {cpus} of {info['cpu']}", flush=True)

    results, versions, texts = [], {}, {}
    report = {
        **servers.report_header("Quantized KV cache against llama-server at long context (issue 49)",
                                "client.bench.kv_serving", argv, info, cpus, versions, args.model),
        "gguf": {"path": os.path.relpath(gguf, REPO_ROOT), "bytes": os.path.getsize(gguf)},
        "dtype": args.dtype,
        "engine_kv_cache_memory_mb": args.kv_cache_mb,
        "llama_server_ctx_per_slot": context,
        "llama_server_extra_args": args.llama_server_args,
        "workload": workload.summary(),
        **({"note": args.note} if args.note else {}),
        "results": results,
    }
    tmp = tempfile.mkdtemp(prefix="bench-kv-llama-")
    settings = [("tritonserver", k) for k in kv_dtypes] + [("llama-server", c) for c in cache_types]
    for system, setting in settings:
        start = (partial(tritonserver, BASE_MODEL,
                         engine_parameters(setting, args.model, args.dtype, args.kv_cache_mb, context), cpus,
                         args.concurrency) if system == "tritonserver" else
                 partial(llama_server, gguf, cpus, args.concurrency, extra=llama_flags(setting) + args.llama_server_args,
                         dtype=args.dtype, slot_context=context))
        with servers.started(f"{system} {setting}", system, start, tmp, versions) as address:
            run = run_target(parse_target(f"{system}=openai://{address}"), workload, args.concurrency,
                             not args.no_progress, args.request_timeout)
            texts[(system, setting)] = [r.text for r in run.records]
            result = {"setting": setting, **summarize(run, workload)}
            results.append(result)
            print(f"{system} {setting}: {result['num_completed']}/{result['num_requests']} completed, "
                  f"{result['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {result['ttft_ms']['p50'] or 0:.0f} ms, "
                  f"TPOT p50 {result['tpot_ms']['p50'] or 0:.1f} ms in {result['duration_s']:.1f} s", flush=True)
        report["ratios"] = compare(results)
        report["greedy_texts_against_auto"] = {
            s: text_difference(t, texts[("tritonserver", "auto")]) for (system, s), t in texts.items()
            if system == "tritonserver" and s != "auto" and ("tritonserver", "auto") in texts}
        write_report(path, report)
    shutil.rmtree(tmp)

    for name, entry in report["ratios"].items():
        for setting, ratio in entry.items():
            verdict = "" if "target" not in ratio else f" (ahead: {'yes' if ratio['target']['met'] else 'no'})"
            print(f"{name} {setting}: {ratio['output_tokens_per_s']:.2f}x output tok/s, "
                  f"TPOT p50 {ratio['tpot_p50']:.2f}x, TTFT p50 {ratio['ttft_p50']:.2f}x{verdict}")
    return 0 if all(r["num_failed"] == 0 and r["all_token_counts_right"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
