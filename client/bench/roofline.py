"""G1 decode roofline (docs/benchmarks.md): `python -m client.bench.roofline`.

The time of one decode step of the engine's model (the forward pass and the output head)
at each batch x context, against its memory roofline: the bytes the step must read (every
layer weight and the output head once, each sequence's K/V) over the device's copy
bandwidth, measured in the same run. At these batch sizes a decode step's arithmetic is far
below the device's, so memory bounds it; the fraction says how close the engine comes.

    python -m client.bench.roofline --model /tmp/random-llama3-8b --batch 1,32,128,256 \\
        --context 512,2048 --json bench/results/gpu/g1.json

The sequences are made up (`ModelRunner.synthetic_inputs`: one new token each, at the given
context, over a zeroed KV pool); the sampler is not part of the time. Each sequence's blocks
follow one another in the pool unless `--scatter-blocks` shuffles them, as a served pool's
are once requests have come and gone. Runs on the CPU too
(`--device cpu`), where the same bound holds for the C++ kernels.

Several quantizations (`--quantization none,int4,int8`, one batch and one context): Q1's
comparison. The engines are loaded side by side; each round measures the copy bandwidth, then
runs their steps in turn, one step of each engine after another, for `--seconds` per engine. A
VM's memory bandwidth drifts by a third from minute to minute and by a fifth from one second to
the next, so ratios of runs minutes apart say as much about the drift as about the engines, and
so did windows of half a second one engine after another (one engine's window ran in a slow
second, the next one's in a fast one). Each round gives every engine's mean step time, its
fraction of the roofline of its own bytes, and the first quantization's time over each other's;
the report's figures are the medians over the rounds.

    python -m client.bench.roofline --model .models/random-llama3-1b --batch 1 --context 256 \
        --dtype bfloat16 --quantization none,int4,int8,int4+a8,int8+a8 --rounds 9 --batch-invariant false

Several KV dtypes (`--kv-cache-dtype auto,int8,fp8_e4m3`, one quantization) are compared the
same way: the KV-cache quantization's long-context step against the model's own dtype.

    python -m client.bench.roofline --dtype bfloat16 --kv-cache-dtype auto,int8,fp8_e4m3 --batch 32 \
        --context 8192 --rounds 5 --seconds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model_runner import kv_block_bytes
from backend.paths import DEFAULT_CHECKPOINT
from client.bench.flops import copy_bandwidth_gbps, seconds_per_call, synchronizer
from client.bench.records import git_commit, machine, write_report


def weight_bytes_read(arch, element_size: int) -> int:
    """Bytes of weights a decode step reads: every layer's projections and norms, the final
    norm and the output head (the embedding table is read only at the batch's rows, so it
    counts once, as the head, when the two are tied, and not at all when they are not).
    A mixture-of-experts model's step reads only the experts its batch routes to, which the
    architecture alone does not tell: refused."""
    if arch.num_experts:
        raise ValueError(f"{arch.architecture}: a step reads the experts its batch routes to, not a fixed set of "
                         "weights; the roofline is for dense models (client/bench/moe_block.py times MoE layers)")
    qkv = arch.head_dim * (arch.num_heads + 2 * arch.num_kv_heads)
    attention = arch.hidden_size * (qkv + arch.num_heads * arch.head_dim)
    attention += qkv * arch.attention_bias + arch.hidden_size * arch.o_proj_bias + 2 * arch.head_dim * arch.qk_norm
    mlp = 3 * arch.hidden_size * arch.intermediate_size + (2 * arch.intermediate_size + arch.hidden_size) * arch.mlp_bias
    per_layer = attention + mlp + 2 * arch.hidden_size
    return element_size * (arch.num_layers * per_layer + arch.hidden_size + arch.vocab_size * arch.hidden_size)


def step_bytes(engine: LLMEngine, batch: int, context: int) -> int:
    """What a decode step of `batch` sequences at `context` reads: its weights as packed (a quantized
    model's integers and scales) and the sequences' K/V."""
    element_size = torch.empty((), dtype=engine.dtype).element_size()
    weights = (engine.model.step_weight_bytes() if engine.model.is_quantized()
               else weight_bytes_read(engine.arch, element_size))
    return weights + batch * context * kv_block_bytes(engine.arch, 1, engine.dtype, engine.config.kv_cache_dtype)


def measure(engine: LLMEngine, batches: list[int], contexts: list[int], bandwidth_gbps: float,
            seconds: float, windows: int, scatter_seed: int | None = None) -> list[dict]:
    runner = engine.runner
    weights = step_bytes(engine, 0, 0)
    rows = []
    for batch in batches:
        for context in contexts:
            inputs = runner.synthetic_inputs([1] * batch, [context] * batch, scatter_seed=scatter_seed)
            step_ms = seconds_per_call(lambda: runner.forward_logits(inputs), engine.device, seconds, windows) * 1e3
            read = step_bytes(engine, batch, context)
            roofline_ms = read / (bandwidth_gbps * 1e9) * 1e3
            rows.append({"batch": batch, "context": context, "step_ms": step_ms, "bytes_read": read,
                         "weight_bytes": weights, "kv_bytes": read - weights, "roofline_ms": roofline_ms,
                         "achieved_gbps": read / step_ms / 1e6, "fraction_of_roofline": roofline_ms / step_ms})
    return rows


def alternating_steps_ms(steps: dict, device: torch.device | str, seconds: float) -> dict[str, float]:
    """Each of `steps` called in turn, one call of each after another, until every one has run
    `seconds` in all (after one warm-up call each): their mean times in ms."""
    sync = synchronizer(device)
    for step in steps.values():
        step()
    spent, calls = dict.fromkeys(steps, 0.0), dict.fromkeys(steps, 0)
    while min(spent.values()) < seconds:
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            spent[name] += time.perf_counter() - start
            calls[name] += 1
    return {name: spent[name] / calls[name] * 1e3 for name in steps}


def interleaved(engines: dict[str, LLMEngine], batch: int, context: int, seconds: float, rounds: int,
                scatter_seed: int | None = None) -> dict:
    """The module docstring's interleaved comparison: per round the copy bandwidth, then the
    engines' steps one after another until each has run `seconds`; medians over the rounds."""
    device = next(iter(engines.values())).device
    steps = {}
    for name, engine in engines.items():
        inputs = engine.runner.synthetic_inputs([1] * batch, [context] * batch, scatter_seed=scatter_seed)
        steps[name] = lambda runner=engine.runner, inputs=inputs: runner.forward_logits(inputs)
    reads = {name: step_bytes(engine, batch, context) for name, engine in engines.items()}
    first = next(iter(engines))
    per_round = []
    for _ in range(rounds):
        bandwidth = copy_bandwidth_gbps(device, windows=1)
        step_ms = alternating_steps_ms(steps, device, seconds)
        per_round.append({
            "copy_bandwidth_gbps": bandwidth, "step_ms": step_ms,
            "fraction_of_roofline": {n: reads[n] / (bandwidth * 1e9) * 1e3 / ms for n, ms in step_ms.items()},
            "speedup_over_" + first: {n: step_ms[first] / ms for n, ms in step_ms.items()}})
    return {"batch": batch, "context": context, "bytes_read": reads, "rounds": per_round,
            "median": {key: {n: statistics.median(r[key][n] for r in per_round) for n in engines}
                       for key in ("step_ms", "fraction_of_roofline", "speedup_over_" + first)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--batch", default="1,32,128,256", help="comma-separated batch sizes")
    parser.add_argument("--context", default="512,2048", help="comma-separated context lengths")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quantization", default="none",
                        help="the engine's quantization: none, int8, int4, and int8+a8, int4+a8 with int8 "
                             "activations; several, comma-separated: the interleaved comparison (the docstring's Q1)")
    parser.add_argument("--group-size", type=int, default=128, help="the engine's quantization_group_size")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype: auto, int8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--batch-invariant", choices=["auto", "true", "false"], default="auto",
                        help="the engine's batch_invariant (false: a bf16 model's quantized GEMMs of a few rows beside "
                             "the AMX tiles)")
    parser.add_argument("--scatter-blocks", action="store_true",
                        help="each sequence's KV blocks in a random order across the pool (seed 0), not one after another")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each timing window")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the interleaved comparison")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if "," in args.quantization or "," in args.kv_cache_dtype:
        return compare(args, argv)

    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    engine = LLMEngine(engine_config(args, args.quantization, args.kv_cache_dtype, max(batches), max(contexts)))
    bandwidth = copy_bandwidth_gbps(engine.device)
    rows = measure(engine, batches, contexts, bandwidth, args.seconds, args.windows, scatter_seed(args))

    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"G1 decode roofline: {os.path.basename(os.path.normpath(args.model))}, {dtype} (KV {args.kv_cache_dtype}) "
          f"on {engine.device}; "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'batch':>6} {'context':>8} {'step ms':>10} {'roofline ms':>12} {'GB/s':>9} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['step_ms']:>10.3f} {r['roofline_ms']:>12.3f} "
              f"{r['achieved_gbps']:>9.1f} {r['fraction_of_roofline']:>11.1%}")
    report = {
        **report_head("G1 decode roofline", args, argv, engine),
        "quantization": args.quantization if args.quantization != "none" else (
            "as stored" if engine.model.is_quantized() else "none"),
        "group_size": args.group_size if args.quantization.startswith("int4") else None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": engine.runner.batch_invariant,
        "copy_bandwidth_gbps": bandwidth,
        "results": rows,
    }
    if args.json:
        write_report(args.json, report)
    return 0


def scatter_seed(args) -> int | None:
    return 0 if args.scatter_blocks else None


def report_head(benchmark: str, args, argv: list[str] | None, engine: LLMEngine) -> dict:
    """What every report of this command starts with: the run, the machine, the model."""
    return {"benchmark": benchmark,
            "command": "python -m client.bench.roofline " + " ".join(sys.argv[1:] if argv is None else argv),
            "git_commit": git_commit(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(), "device": engine.device.type, "checkpoint": args.model,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "kv_blocks": "scattered" if args.scatter_blocks else "consecutive"}


def engine_config(args, quantization: str, kv_cache_dtype: str, batch: int, context: int) -> EngineConfig:
    """`quantization`: the engine's quantization, with "+a8" for int8 activations (int4+a8)."""
    bs = args.block_size
    weights, _, activations = quantization.partition("+")
    if activations not in ("", "a8"):
        raise SystemExit(f"roofline: {quantization!r}: the activations' suffix is +a8 (int8 activations) or none")
    return EngineConfig(model_path=args.model, device=args.device, dtype=args.dtype, block_size=bs,
                        max_num_seqs=batch, max_model_len=context, num_kv_blocks=batch * -(-context // bs) + 1,
                        quantization=weights, quantization_group_size=args.group_size,
                        activation_quantization="int8" if activations else "none",
                        kv_cache_dtype=kv_cache_dtype,
                        batch_invariant={"auto": None, "true": True, "false": False}[args.batch_invariant])


def compare(args, argv: list[str] | None) -> int:
    """The interleaved comparison of several quantizations or of several KV dtypes (the module
    docstring)."""
    by_kv = "," in args.kv_cache_dtype
    if by_kv and "," in args.quantization:
        raise SystemExit("roofline: compare several quantizations or several KV dtypes, not both at once")
    names = (args.kv_cache_dtype if by_kv else args.quantization).split(",")
    if "," in args.batch or "," in args.context:
        raise SystemExit("roofline: several quantizations or KV dtypes take one --batch and one --context")
    batch, context = int(args.batch), int(args.context)
    engines = {name: LLMEngine(engine_config(args, args.quantization if by_kv else name,
                                             name if by_kv else args.kv_cache_dtype, batch, context))
               for name in names}
    result = interleaved(engines, batch, context, args.seconds, args.rounds, scatter_seed(args))
    first = names[0]
    print(f"{'KV dtypes' if by_kv else 'Q1'} interleaved: {os.path.basename(os.path.normpath(args.model))} "
          f"batch {batch} context {context}, {args.rounds} rounds (medians)")
    for name in names:
        print(f"{name:>6}: step {result['median']['step_ms'][name]:8.2f} ms, "
              f"{result['median']['fraction_of_roofline'][name]:6.1%} of its roofline, "
              f"{result['median']['speedup_over_' + first][name]:5.2f}x {first}")
    engine = engines[first]
    report = {
        **report_head("decode step by KV dtype, interleaved" if by_kv else "Q1 quantized decode step, interleaved",
                      args, argv, engine),
        "quantizations": [args.quantization] if by_kv else names,
        "group_size": args.group_size,
        "kv_cache_dtypes": names if by_kv else [args.kv_cache_dtype],
        "batch_invariant": engine.runner.batch_invariant,
        "seconds_per_window": args.seconds,
        **result,
    }
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
