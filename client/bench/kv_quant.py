"""Greedy continuations with quantized KV (int8, fp8_e4m3, fp8_e5m2) against KV in the model's
dtype (issue 49): `python -m client.bench.kv_quant --kv-cache-dtype K`.

Prompts are consecutive stretches of the project's fixed text (client/bench/perplexity.py's),
each continued greedily for `--max-tokens` tokens by two engines that differ only in
`kv_cache_dtype`, all prompts in one continuous batch. Reported: the share of continuations
identical to `auto`'s, where the others first differ, and the largest difference of a chosen
token's logprob over the positions before a continuation first differs.

    python -m client.bench.kv_quant --json bench/results/avx2/kv_quant_greedy.json   # int8
    python -m client.bench.kv_quant --kv-cache-dtype fp8_e4m3 --json bench/results/avx2/kv_quant_greedy_fp8_e4m3.json
"""

from __future__ import annotations

import argparse
import sys
import time

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import SamplingParams
from client.bench.perplexity import TEXT
from client.bench.records import git_commit, machine, write_report


def continuations(model: str, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int,
                  dtype: str) -> tuple[list[list[int]], list[list[float]], float]:
    """Each prompt's greedy tokens and their logprobs, and the seconds the batch took."""
    engine = LLMEngine(EngineConfig(model_path=model, device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                    max_num_seqs=len(prompts), kv_cache_memory_mb=1024))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {f"p{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.token_ids_delta)
            logprobs[out.request_id].extend(next(iter(e.values()))["logprob"] for e in out.logprobs_delta or [])
    return list(tokens.values()), list(logprobs.values()), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", default="float32", help="the model's dtype (and the auto KV's)")
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    with open(TEXT, encoding="utf-8") as f:
        text_tokens = AutoTokenizer.from_pretrained(args.model)(f.read())["input_ids"]
    n = args.prompt_tokens
    if len(text_tokens) < args.prompts * n:
        raise SystemExit(f"the text has {len(text_tokens)} tokens, fewer than {args.prompts} x {n}")
    prompts = [text_tokens[i * n:(i + 1) * n] for i in range(args.prompts)]
    want, want_logprobs, auto_s = continuations(args.model, "auto", prompts, args.max_tokens, args.dtype)
    got, got_logprobs, quant_s = continuations(args.model, args.kv_cache_dtype, prompts, args.max_tokens, args.dtype)
    first_differences, largest = [], 0.0
    for a, b, la, lb in zip(want, got, want_logprobs, got_logprobs):
        differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first_differences.append(differ)
        same = len(a) if differ is None else differ + 1  # the first differing position's logprobs still compare
        largest = max([largest] + [abs(x - y) for x, y in zip(la[:same], lb[:same])])
    identical = sum(d is None for d in first_differences) / len(prompts)
    print(f"{args.kv_cache_dtype} KV vs auto ({args.dtype}): {identical:.1%} of {len(prompts)} greedy continuations of "
          f"{args.max_tokens} tokens identical; first differences at {first_differences}; largest logprob "
          f"difference before it {largest:.4g}")
    report = {
        "benchmark": "greedy continuations, quantized KV against auto (issue 49)",
        "command": "python -m client.bench.kv_quant " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "checkpoint": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "text": str(TEXT.relative_to(TEXT.parents[2])), "prompts": args.prompts, "prompt_tokens": n,
        "max_tokens": args.max_tokens,
        "identical_share": identical, "first_differences": first_differences,
        "largest_logprob_difference_while_identical": largest,
        "seconds": {"auto": auto_s, args.kv_cache_dtype: quant_s},
    }
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
