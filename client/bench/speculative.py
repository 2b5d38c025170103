"""W9 (docs/benchmarks.md): speculative decoding at low load, and under a full batch.

    python -m client.bench.speculative --json bench/results/<cpu kind>/w9_smollm2.json

W9a, grounded: the served instruct model asked to copy-edit passages of the project's fixed
text (bench/data), greedy, at concurrency 1 and 4; W9b, open chat: the project's built-in
chat prompts at concurrency 1; W1 at 32 in flight. Each with speculation off and with each
method (ngram, suffix, the served model int8 / int4 as its own draft), all in one run, in
process. Greedy output is the same tokens whatever the method (the engine tests check it),
so the systems do the same work; the report gives output tokens/s, TPOT p50, the acceptance
rate per draft position, drafts trimmed by the adaptive budget, and each method's ratio to
speculation off in the same workload and concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT
from client.bench.perplexity import TEXT
from client.bench.records import git_commit, machine, write_report
from client.bench.runners import run_engine
from client.bench.stats import safe_ratio, summarize
from client.bench.workloads import BUILTIN_PROMPTS, BenchRequest, Workload, w1_variance

METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_int8": {"method": "draft_model", "model": "", "quantization": "int8", "num_speculative_tokens": 3},
    "draft_int4": {"method": "draft_model", "model": "", "quantization": "int4", "num_speculative_tokens": 3},
    "draft_int8_a8": {"method": "draft_model", "model": "", "quantization": "int8", "activation_quantization": "int8",
                      "num_speculative_tokens": 3},
    "draft_int4_a8": {"method": "draft_model", "model": "", "quantization": "int4", "activation_quantization": "int8",
                      "num_speculative_tokens": 3},
}
EDIT_INSTRUCTION = "Copy the following text exactly, fixing only spelling mistakes:\n\n"


def _chat(tokenizer, text: str, max_tokens: int) -> BenchRequest:
    """`text` as the user's turn of a chat: the templated prompt's ids, and the prompt as text
    for servers (whose special tokens attach_text's decoding would drop)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    return BenchRequest(tokenizer.encode(prompt, add_special_tokens=False), max_tokens, prompt_text=prompt)


def w9a_grounded(tokenizer, num_requests: int, max_tokens: int, seed: int = 0) -> Workload:
    """Passages of 60-160 tokens of the fixed text, each inside a copy-edit instruction."""
    words = TEXT.read_text(encoding="utf-8").split()
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        start = int(rng.integers(0, len(words) - 200))
        passage = " ".join(words[start : start + int(rng.integers(50, 120))])
        requests.append(_chat(tokenizer, EDIT_INSTRUCTION + passage, max_tokens))
    return Workload("W9a", f"{num_requests} copy-edit requests of passages of the fixed text, greedy, "
                    f"{max_tokens} tokens out, EOS ignored", requests, prompt_source=f"text:{TEXT.name}")


def w9b_chat(tokenizer, num_requests: int, max_tokens: int) -> Workload:
    prompts = BUILTIN_PROMPTS[:num_requests]
    requests = [_chat(tokenizer, p, max_tokens) for p in prompts]
    return Workload("W9b", f"{len(requests)} chat prompts (built in), greedy, {max_tokens} tokens out, EOS ignored",
                    requests, prompt_source="text:builtin")


def _method_config(name: str, model: str, adaptive: bool = True) -> dict | None:
    config = METHODS[name]
    if config is not None and config["method"] == "draft_model":
        config = {**config, "model": model}
    if config is not None and not adaptive:
        config = {**config, "adaptive": False}
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--requests", type=int, default=8, help="W9a and W9b requests")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--w1-requests", type=int, default=64, help="W1 at 32 in flight; 0 skips it")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-adaptive", action="store_true",
                        help="verify every draft (each method on its own, without the draft budget)")
    parser.add_argument("--json", default=None, help="write the report here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    grounded = w9a_grounded(tokenizer, args.requests, args.max_tokens)
    chat = w9b_chat(tokenizer, args.requests, args.max_tokens)
    runs = [(grounded, 1), (grounded, 4), (chat, 1)]
    if args.w1_requests:
        runs.append((w1_variance(num_requests=args.w1_requests), 32))
    results = []
    for workload, concurrency in runs:
        base = None
        for name in args.methods:
            overrides = {"dtype": args.dtype, "max_num_seqs": max(concurrency, 4)}
            spec = _method_config(name, args.model, adaptive=not args.no_adaptive)
            if spec is not None:
                overrides["speculative_config"] = spec
            run = run_engine(workload, args.model, overrides, name, concurrency=concurrency)
            result = {"workload": workload.name, **summarize(run, workload)}
            result.pop("service_timeline", None)
            if name == "off":
                base = result
            elif base is not None:
                result["ratio_to_off"] = {
                    "output_tokens_per_s": safe_ratio(result["output_tokens_per_s"], base["output_tokens_per_s"]),
                    "tpot_p50": safe_ratio(result["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
                }
            results.append(result)
            print(f"{workload.name} c={concurrency} {name:>10}: {result['output_tokens_per_s']:8.1f} tok/s, "
                  f"TPOT p50 {result['tpot_ms']['p50']:7.1f} ms, accepted "
                  f"{result.get('spec_acceptance_rate', 0):.2f} {json.dumps(result.get('ratio_to_off', {}))}")
    report = {"benchmark": "W9 speculative decoding", "command": " ".join(["python -m client.bench.speculative", *argv]), "machine": machine(), "commit": git_commit(), "model": args.model,
              "dtype": args.dtype, "workloads": [w.summary() for w in (grounded, chat)], "results": results}
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
