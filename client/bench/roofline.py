"""G1 decode roofline (docs/benchmarks.md): `python -m client.bench.roofline`.

The time of one decode step of the engine's model (the forward pass and the output head)
at each batch x context, against its memory roofline: the bytes the step must read (every
layer weight and the output head once, each sequence's K/V) over the device's copy
bandwidth, measured in the same run. At these batch sizes a decode step's arithmetic is far
below the device's, so memory bounds it; the fraction says how close the engine comes.

    python -m client.bench.roofline --model /tmp/random-llama3-8b --batch 1,32,128,256 \\
        --context 512,2048 --json bench/results/gpu/g1.json

The sequences are made up (`ModelRunner.synthetic_inputs`: one new token each, at the given
context, over a zeroed KV pool); the sampler is not part of the time. Runs on the CPU too
(`--device cpu`), where the same bound holds for the C++ kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model_runner import kv_block_bytes
from backend.paths import DEFAULT_CHECKPOINT
from client.bench.flops import copy_bandwidth_gbps, seconds_per_call
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


def measure(engine: LLMEngine, batches: list[int], contexts: list[int], bandwidth_gbps: float,
            seconds: float, windows: int) -> list[dict]:
    runner = engine.runner
    element_size = torch.empty((), dtype=engine.dtype).element_size()
    # A quantized model's bytes are its integers and scales as packed.
    weights = (engine.model.step_weight_bytes() if engine.model.is_quantized()
               else weight_bytes_read(engine.arch, element_size))
    kv_per_token = kv_block_bytes(engine.arch, 1, engine.dtype, engine.config.kv_cache_dtype)
    rows = []
    for batch in batches:
        for context in contexts:
            inputs = runner.synthetic_inputs([1] * batch, [context] * batch)
            step_ms = seconds_per_call(lambda: runner.forward_logits(inputs), engine.device, seconds, windows) * 1e3
            read = weights + batch * context * kv_per_token
            roofline_ms = read / (bandwidth_gbps * 1e9) * 1e3
            rows.append({"batch": batch, "context": context, "step_ms": step_ms, "bytes_read": read,
                         "weight_bytes": weights, "kv_bytes": read - weights, "roofline_ms": roofline_ms,
                         "achieved_gbps": read / step_ms / 1e6, "fraction_of_roofline": roofline_ms / step_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--batch", default="1,32,128,256", help="comma-separated batch sizes")
    parser.add_argument("--context", default="512,2048", help="comma-separated context lengths")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quantization", default="none", help="the engine's quantization: none, int8, int4")
    parser.add_argument("--group-size", type=int, default=128, help="the engine's quantization_group_size")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype: auto, int8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--batch-invariant", choices=["auto", "true", "false"], default="auto",
                        help="the engine's batch_invariant (false: a bf16 model's quantized GEMMs of a few rows beside "
                             "the AMX tiles)")
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each timing window")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    bs = args.block_size
    config = EngineConfig(model_path=args.model, device=args.device, dtype=args.dtype, block_size=bs,
                          max_num_seqs=max(batches), max_model_len=max(contexts),
                          num_kv_blocks=max(batches) * -(-max(contexts) // bs) + 1,
                          quantization=args.quantization, quantization_group_size=args.group_size,
                          kv_cache_dtype=args.kv_cache_dtype,
                          batch_invariant={"auto": None, "true": True, "false": False}[args.batch_invariant])
    engine = LLMEngine(config)
    bandwidth = copy_bandwidth_gbps(engine.device)
    rows = measure(engine, batches, contexts, bandwidth, args.seconds, args.windows)

    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"G1 decode roofline: {os.path.basename(os.path.normpath(args.model))}, {dtype} (KV {args.kv_cache_dtype}) "
          f"on {engine.device}; "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'batch':>6} {'context':>8} {'step ms':>10} {'roofline ms':>12} {'GB/s':>9} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['step_ms']:>10.3f} {r['roofline_ms']:>12.3f} "
              f"{r['achieved_gbps']:>9.1f} {r['fraction_of_roofline']:>11.1%}")
    report = {
        "benchmark": "G1 decode roofline",
        "command": "python -m client.bench.roofline " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "device": engine.device.type,
        "checkpoint": args.model,
        "dtype": dtype,
        "quantization": args.quantization if args.quantization != "none" else (
            "as stored" if engine.model.is_quantized() else "none"),
        "group_size": args.group_size if args.quantization == "int4" else None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": engine.runner.batch_invariant,
        "copy_bandwidth_gbps": bandwidth,
        "results": rows,
    }
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
