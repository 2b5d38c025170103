"""Does a request's result depend on what shares its batch? A bitwise check anyone can run.

One probe request (a prompt of `--probe-tokens` tokens, greedy, `logprobs` 0) runs alone,
then again among `--others` requests of 5-200 tokens, arriving `--arrival-step` steps late,
under each scheduling variant below; its per-token logprobs are compared bit for bit with
the run alone. Prints one line per variant and exits 1 if any logprob differed. The default
probe is long enough (700 tokens) that, with the mode off, some of its prefill chunks are long
chunks at long contexts, which go to SDPA, and the others are not.

    .venv/bin/python -m client.batch_invariance --dtype bfloat16 --batch-invariant false
    .venv/bin/python -m client.batch_invariance --dtype bfloat16 --batch-invariant true
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import SamplingParams

# The scheduling variants: engine parameters and when the probe arrives.
VARIANTS = {
    "in a batch of 32": ({}, 0),
    "arriving 5 steps late": ({}, 5),
    "16-token prefill chunks": ({"long_prefill_token_threshold": 16}, 0),
    "a 64-token step budget": ({"max_num_batched_tokens": 64}, 0),
}


@dataclass
class Comparison:
    variant: str
    num_tokens: int
    num_different: int
    max_difference: float
    same_tokens: bool


def probe_logprobs(engine: LLMEngine, probe: list[int], others: list[list[int]], max_tokens: int,
                   arrival_step: int) -> tuple[list[int], list[float]]:
    """The probe's tokens and sampled-token logprobs, with `others` in the batch from step 0."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(others):
        engine.add_request(f"other{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    logprobs: list[float] = []
    step = 0
    while engine.has_unfinished() or step <= arrival_step:
        if step == arrival_step:
            engine.add_request("probe", probe, greedy)
        for out in engine.step():
            if out.request_id == "probe":
                tokens.extend(out.token_ids_delta)
                logprobs.extend(next(iter(entry.values()))["logprob"] for entry in out.logprobs_delta or [])
        step += 1
    return tokens, logprobs


def compare(model: str, dtype: str, batch_invariant: bool, probe_tokens: int = 700, num_others: int = 31,
            max_tokens: int = 24, seed: int = 0) -> list[Comparison]:
    rng = random.Random(seed)
    engine_config = dict(model_path=model, dtype=dtype, device="cpu", batch_invariant=batch_invariant)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    probe = [rng.randrange(3, vocab) for _ in range(probe_tokens)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 200))] for _ in range(num_others)]
    alone_tokens, alone = probe_logprobs(LLMEngine(EngineConfig(**engine_config)), probe, [], max_tokens, 0)
    results = []
    for variant, (overrides, arrival_step) in VARIANTS.items():
        engine = LLMEngine(EngineConfig(**engine_config, **overrides))
        tokens, logprobs = probe_logprobs(engine, probe, others, max_tokens, arrival_step)
        different = [abs(a - b) for a, b in zip(alone, logprobs) if a != b]
        results.append(Comparison(variant, len(alone), len(different), max(different, default=0.0), tokens == alone_tokens))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-invariant", default="true", choices=["true", "false"])
    parser.add_argument("--probe-tokens", type=int, default=700)
    parser.add_argument("--others", type=int, default=31)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", help="also write the comparisons here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = compare(args.model, args.dtype, args.batch_invariant == "true", args.probe_tokens, args.others,
                      args.max_tokens)
    print(f"{args.dtype}, batch_invariant={args.batch_invariant}: the probe's {args.max_tokens} sampled-token logprobs "
          f"against the probe alone")
    for r in results:
        print(f"  {r.variant:<26} {r.num_different:>3} of {r.num_tokens} differ (max {r.max_difference:.3g})"
              f"{'' if r.same_tokens else ', tokens differ'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
    return 1 if any(r.num_different for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
