"""The sampler's cost per step with top-k, top-p and penalties, and sorting the vocabulary.

    python -m client.bench.sampling --json bench/results/<machine kind>/sampler_parameters.json

A [rows, vocab] batch of logits (SmolLM2's 49,152 by default) goes through the engine's
Sampler with each set of sampling parameters. Beside each, what sorting the vocabulary costs:
the top-p nucleus by `keep_nucleus_reference` (a sort per row) against the one the sampler
uses (`keep_nucleus_`: bucketed sums), and top-k's k-th largest by a sort against topk.
Medians of `--repeat` calls, in one process, alternating the two sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from backend.request import Request, SamplingParams
from backend.sampler import Sampler
from client.bench.records import git_commit, machine, write_report
from kernels import keep_nucleus_, keep_nucleus_reference

PARAMETER_SETS = {
    "temperature 1": dict(temperature=1.0),
    "top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "temperature 0.7, top_k 40, top_p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
    "min_p 0.05": dict(temperature=1.0, min_p=0.05),
    "repetition_penalty 1.1": dict(temperature=1.0, repetition_penalty=1.1),
    "presence_penalty 0.5, frequency_penalty 0.5": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5),
}


def _requests(rows: int, vocab: int, params: dict) -> list[Request]:
    """Requests 128 tokens into their prompts and 64 into their outputs (what penalties read)."""
    gen = torch.Generator().manual_seed(1)
    requests = []
    for i in range(rows):
        r = Request(request_id=f"r{i}", prompt_token_ids=torch.randint(vocab, (128,), generator=gen).tolist(),
                    params=SamplingParams(**params), max_tokens=256, arrival_time=0.0, arrival_seq=i,
                    eos_token_ids=frozenset())
        for token in torch.randint(vocab, (64,), generator=gen).tolist():
            r.append_output_token(token)
        requests.append(r)
    return requests


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--scale", type=float, default=2.0,
                        help="logits ~ N(0, scale^2): 2 spreads a 0.9 nucleus over ~10k tokens")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * args.scale
    sampler = Sampler()
    results: dict = {"sampler_ms": {}, "nucleus_ms": {}, "kth_largest_ms": {}}
    for name, params in PARAMETER_SETS.items():
        requests = _requests(args.rows, args.vocab, params)
        results["sampler_ms"][name] = _median_ms(lambda: sampler(logits, requests), args.repeat)

    probs = torch.softmax(logits, dim=-1)
    top_p = torch.full((args.rows,), 0.9, dtype=torch.float64)
    sorted_ms, buckets_ms = [], []
    for _ in range(args.repeat):
        sorted_ms.append(_median_ms(lambda: keep_nucleus_reference(probs.clone(), top_p), 1))
        buckets_ms.append(_median_ms(lambda: keep_nucleus_(probs.clone(), top_p), 1))
    results["nucleus_ms"] = {"sort (keep_nucleus_reference)": statistics.median(sorted_ms),
                             "bucketed sums (keep_nucleus_)": statistics.median(buckets_ms)}
    results["kth_largest_ms"] = {
        "sort": _median_ms(lambda: logits.sort(dim=-1, descending=True), args.repeat),
        "topk 50": _median_ms(lambda: logits.topk(50, dim=-1), args.repeat),
    }
    results["nucleus_speedup"] = (results["nucleus_ms"]["sort (keep_nucleus_reference)"]
                                  / results["nucleus_ms"]["bucketed sums (keep_nucleus_)"])
    report = {"command": "python -m client.bench.sampling " + " ".join(argv if argv is not None else sys.argv[1:]),
              "git_commit": git_commit(), "machine": machine(), "torch_threads": torch.get_num_threads(),
              "rows": args.rows, "vocab": args.vocab, "logit_scale": args.scale, "results": results}
    print(json.dumps(results, indent=2))
    if args.json:
        write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
