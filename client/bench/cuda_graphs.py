"""G4 CUDA graphs (docs/benchmarks.md): `python -m client.bench.cuda_graphs`.

The engine's decode step with its CUDA graphs (the default) against the same engine with
`enforce_eager`, at each batch size: `batch` requests of `context` prompt tokens each are
prefilled, then the next `steps` calls of `engine.step()` are decode steps of the whole batch,
each timed from the call to its outputs (scheduling, metadata, forward pass, sampling and the update; the
sampler's copy of the tokens to the host waits for the device). Greedy, so the two engines'
tokens must be the same: the report says whether they were, request by request.

    python -m client.bench.cuda_graphs --model /tmp/random-llama3-1b --dtype bfloat16 \\
        --batch 1,32,256 --json bench/results/gpu/g4.json

Without CUDA (a rehearsal on a CPU) the graphs' static buffers and padding run eagerly, and
the report says so: only a GPU run's times mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import SamplingParams
from client.bench.records import git_commit, machine, write_report


def prefill_steps(batch: int, context: int, budget: int) -> int:
    """At most how many steps the prompts of `batch` requests take, in which the first requests
    prefilled already decode."""
    return -(-batch * context // budget) + 1


def decode_steps(engine: LLMEngine, batch: int, context: int, steps: int, seed: int) -> tuple[list[float], dict]:
    """The seconds of each of `steps` decode steps of `batch` requests at about `context` tokens,
    and every request's greedy tokens. Each request may run long enough that none ends before
    the last timed step; all are aborted after it."""
    rng = np.random.default_rng(seed)
    max_tokens = prefill_steps(batch, context, engine.config.max_num_batched_tokens) + steps + 1
    ids = [f"s{seed}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = rng.integers(3, engine.vocab_size, size=context).tolist()
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids_delta)

    while any(not t for t in tokens.values()):  # prefill, until every request has its first token
        step()
    times = []
    for _ in range(steps):
        assert engine.num_running == batch, "a request ended before the timed steps did"
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        step()
    return times, tokens


def measure(config: EngineConfig, batches: list[int], context: int, steps: int) -> tuple[dict, dict, str]:
    """Per batch size, the step times and every request's tokens; the engine's device type."""
    engine = LLMEngine(config)
    if not config.enforce_eager and engine.runner.graphs is None:
        if engine.device.type == "cuda":
            raise SystemExit(f"the engine recorded no graphs: {engine.runner.decode_graphs_possible()}")
        engine.runner.capture_decode_graphs(engine.max_model_len, capture=False)
    rows, tokens = {}, {}
    decode_steps(engine, 1, 16, 4, seed=0)  # the sampler's and allocator's first use
    for batch in batches:
        times, tokens[batch] = decode_steps(engine, batch, context, steps, seed=1000 + batch)
        rows[batch] = {"step_ms_median": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
                       "steps": len(times)}
    return rows, tokens, engine.device.type


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--batch", default="1,32,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed at each batch size")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    batches = [int(b) for b in args.batch.split(",")]
    results, tokens = {}, {}
    budget = max(2048, args.context)
    max_model_len = args.context + prefill_steps(max(batches), args.context, budget) + args.steps + 8
    for mode, eager in (("graphs", False), ("eager", True)):
        config = EngineConfig(model_path=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(batches),
                              max_model_len=max_model_len, enforce_eager=eager, max_num_batched_tokens=budget,
                              num_kv_blocks=max(batches) * -(-max_model_len // 16) + 64)
        results[mode], tokens[mode], device = measure(config, batches, args.context, args.steps)
    rows = []
    for batch in batches:
        graphs, eager = results["graphs"][batch], results["eager"][batch]
        same = sum(tokens["graphs"][batch][rid] == tokens["eager"][batch][rid] for rid in tokens["eager"][batch])
        rows.append({"batch": batch, "context": args.context, "graphs_step_ms": graphs["step_ms_median"],
                     "eager_step_ms": eager["step_ms_median"], "graphs_step_ms_min": graphs["step_ms_min"],
                     "eager_step_ms_min": eager["step_ms_min"], "steps": graphs["steps"],
                     "speedup": eager["step_ms_median"] / graphs["step_ms_median"],
                     "step_time_cut": 1 - graphs["step_ms_median"] / eager["step_ms_median"],
                     "requests_with_identical_tokens": same, "requests": batch})
    on_cuda = device == "cuda"
    print(f"G4 CUDA graphs: {args.model}, {args.dtype}, context {args.context}, median of {args.steps} decode steps"
          + ("" if on_cuda else " (no CUDA: static buffers run eagerly, times mean nothing)"))
    print(f"{'batch':>6} {'eager ms':>10} {'graphs ms':>10} {'speedup':>8} {'identical tokens':>17}")
    for r in rows:
        print(f"{r['batch']:>6} {r['eager_step_ms']:>10.3f} {r['graphs_step_ms']:>10.3f} {r['speedup']:>7.2f}x "
              f"{r['requests_with_identical_tokens']:>8}/{r['requests']}")
    if args.json:
        write_report(args.json, {
            "benchmark": "G4 CUDA graphs",
            "command": "python -m client.bench.cuda_graphs " + " ".join(sys.argv[1:] if argv is None else argv),
            "git_commit": git_commit(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(),
            "device": device,
            "graphs": "recorded" if on_cuda else "static buffers run eagerly (no CUDA)",
            "checkpoint": args.model,
            "dtype": args.dtype,
            "results": rows,
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
