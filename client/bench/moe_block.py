"""A mixture-of-experts layer's MLP on the CPU, one C++ call (kernels.cpu_moe_experts) against
the per-expert loop of the modules (SparseMoeBlock without it): `python -m client.bench.moe_block`.

For a MoE checkpoint (`--model`, e.g. `python -m tools.random_checkpoint .models/random-qwen3-moe-small
--family qwen3_moe --shape qwen3-moe-small`), the first MoE layer's block at each token count:
milliseconds a call of the C++ block and of the modules' loop (which must give the same bits;
checked first), the experts a call touches, and the weight bytes those experts hold. Timings:
the best of `--windows` windows of `--seconds`, after warm-up calls.

    python -m client.bench.moe_block --model .models/random-qwen3-moe-small \\
        --json bench/results/avx2/moe_block_qwen3_moe_small.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from backend.models.llama import SparseMoeBlock
from backend.models.loader import load_model
from client.bench.flops import seconds_per_call
from client.bench.records import git_commit, machine, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a mixture-of-experts checkpoint folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch/OpenMP threads (default: torch's); 1 on a machine other processes share")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(args.model, dtype, torch.device("cpu"), 64, quantization=args.quantization)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks:
        print(f"{args.model} has no mixture-of-experts layer", file=sys.stderr)
        return 1
    block = blocks[0]
    if block.cpu_block is None:
        print("the C++ MoE block is unavailable here (no C++ kernels, or weights not in the panel layout)",
              file=sys.stderr)
        return 1
    fused = block.cpu_block
    expert_bytes = block.experts[0].gate_up_proj.resident_bytes() + block.experts[0].down_proj.resident_bytes()
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'tokens':>7} {'experts':>8} {'C++ ms':>9} {'loop ms':>9} {'speedup':>8}")
    for tokens in args.tokens:
        x = torch.randn(tokens, model.arch.hidden_size, generator=gen).to(dtype)
        block.cpu_block = None
        loop_out = block(x)
        block.cpu_block = fused
        if not torch.equal(block(x), loop_out):
            print(f"the C++ block differs from the modules at {tokens} tokens: refusing to time it", file=sys.stderr)
            return 1
        touched = int(torch.topk(block.gate(x).float(), block.top_k, dim=-1).indices.unique().numel())
        cpp_s = seconds_per_call(lambda: block(x), "cpu", args.seconds, args.windows)
        block.cpu_block = None
        loop_s = seconds_per_call(lambda: block(x), "cpu", args.seconds, args.windows)
        block.cpu_block = fused
        rows.append(dict(tokens=tokens, experts_touched=touched, expert_weight_bytes=expert_bytes * touched,
                         cpp_ms=cpp_s * 1e3, loop_ms=loop_s * 1e3, speedup=loop_s / cpp_s))
        print(f"{tokens:>7} {touched:>8} {cpp_s * 1e3:>9.3f} {loop_s * 1e3:>9.3f} {loop_s / cpp_s:>7.2f}x")
    report = dict(
        benchmark="MoE block: one C++ call against the per-expert loop",
        command="python -m client.bench.moe_block " + " ".join(argv if argv is not None else sys.argv[1:]),
        git_commit=git_commit(), machine=machine(), checkpoint=args.model, dtype=args.dtype,
        quantization=args.quantization, threads=torch.get_num_threads(), num_experts=model.arch.num_experts,
        top_k=model.arch.num_experts_per_tok, moe_intermediate_size=model.arch.moe_intermediate_size,
        hidden_size=model.arch.hidden_size, results=rows,
    )
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
