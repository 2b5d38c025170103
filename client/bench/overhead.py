"""Host overhead per iteration with a no-op model: `python -m client.bench.overhead`.

docs/benchmarks.md's target: scheduler plus input preparation at most 1 ms per iteration with
256 running requests, so that on a GPU the host never keeps the device waiting. The
engine runs as it serves (scheduler, KV manager, `ModelRunner.prepare`, sampler,
detokenizers, outputs); only the model's forward pass is replaced by one that returns
fixed logits, so what each phase costs is host time alone. Requests are all in decode
while iterations are measured, each scheduled one token per step, as in a full batch.

    python -m client.bench.overhead --running 32,64,128,256 --json bench/overhead/noop_model.json

Prints a table and writes JSON (per-phase mean, p50 and p99 in ms, the target, the
machine and the command).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models.random_checkpoint import SMALL_SHAPE, make_tiny_checkpoint
from backend.paths import MODELS_DIR
from backend.request import SamplingParams
from client.bench.records import git_commit, machine, write_report

SMALL_CHECKPOINT = str(MODELS_DIR / "random-llama-small")
PHASES = ("schedule", "prepare", "forward", "update")
TARGET_MS = 1.0  # schedule + prepare, per iteration


class NoOpModel(torch.nn.Module):
    """Stands in for the model: no forward work, logits that always choose `token_id`
    (an ordinary token, so no request stops early and detokenization does real work)."""

    def __init__(self, arch, max_rows: int, token_id: int):
        super().__init__()
        self.arch = arch
        self.logits = torch.zeros(max_rows, arch.vocab_size)
        self.logits[:, token_id] = 1.0

    def forward(self, input_ids, positions, kv_caches, meta, interrupt=None):
        return input_ids.new_zeros(len(input_ids), 1, dtype=torch.float32)

    def compute_logits(self, hidden):
        return self.logits[: len(hidden)]


def measure(model_path: str, running: int, prompt_len: int, iterations: int, warmup_iterations: int,
            progress: bool = True) -> dict:
    token_budget = max(2048, running)
    # Early requests decode while later ones still prefill (their decodes take part of each
    # step's budget): every request must outlive the measured iterations whatever its
    # place in the prefill order.
    prefill_steps = -(-running * prompt_len // (token_budget // 2))
    max_tokens = prefill_steps + warmup_iterations + iterations + 1
    blocks_per_request = -(-(prompt_len + max_tokens) // EngineConfig.block_size)
    config = EngineConfig(model_path=model_path, dtype="float32", device="cpu", max_num_seqs=running,
                          max_num_batched_tokens=token_budget, num_kv_blocks=running * blocks_per_request,
                          enable_prefix_caching=True)
    engine = LLMEngine(config)
    engine.runner.model = NoOpModel(engine.arch, running, token_id=engine.tokenizer.convert_tokens_to_ids("Ġthe"))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(running):
        engine.add_request(str(index), rng.integers(1000, 40000, prompt_len).tolist(), params)
    engine.step()  # prefill, not measured: until nothing waits and every request decodes
    while engine.stats.num_waiting or engine.stats.num_prefilling:
        engine.step()
    for _ in range(warmup_iterations):
        engine.step()
    samples = {phase: [] for phase in PHASES}
    batch_sizes = []
    for _ in tqdm(range(iterations), desc=f"{running} running", unit="it", disable=not progress, leave=False):
        engine.step()
        step = engine.stats.step
        batch_sizes.append(step.num_scheduled_tokens)
        for phase in PHASES:
            samples[phase].append(1e3 * getattr(step, f"{phase}_time_s"))
    samples["schedule+prepare"] = [a + b for a, b in zip(samples["schedule"], samples["prepare"])]
    assert set(batch_sizes) == {running}, f"expected {running} decode tokens per iteration, saw {sorted(set(batch_sizes))}"
    return {
        "running": running,
        "prompt_len": prompt_len,
        "iterations": iterations,
        "phases_ms": {
            phase: {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
                    "p99": float(np.percentile(values, 99))}
            for phase, values in samples.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="256", help="comma-separated running-request counts (default 256)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup-iterations", type=int, default=20)
    parser.add_argument("--model", default=SMALL_CHECKPOINT,
                        help="checkpoint for the tokenizer, shapes and KV layout (made when missing)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    if args.model == SMALL_CHECKPOINT:
        make_tiny_checkpoint(SMALL_CHECKPOINT, "llama", **SMALL_SHAPE)
    results = [measure(args.model, int(n), args.prompt_len, args.iterations, args.warmup_iterations,
                       progress=not args.no_progress) for n in args.running.split(",")]
    print(f"{'running':>8} " + " ".join(f"{p + ' p50/p99 ms':>24}" for p in (*PHASES, "schedule+prepare")))
    for result in results:
        cells = [f"{result['phases_ms'][p]['p50']:10.3f} / {result['phases_ms'][p]['p99']:8.3f}"
                 for p in (*PHASES, "schedule+prepare")]
        print(f"{result['running']:>8} " + " ".join(f"{c:>24}" for c in cells))
    report = {
        "benchmark": "host overhead per iteration, no-op model",
        "command": " ".join([os.path.basename(sys.executable), "-m", "client.bench.overhead", *(argv or sys.argv[1:])]),
        "commit": git_commit(),
        "machine": machine(),
        "python": platform.python_version(),
        "target_ms": {"schedule+prepare": TARGET_MS},
        "results": results,
        "meets_target": all(r["phases_ms"]["schedule+prepare"]["p50"] <= TARGET_MS for r in results),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
