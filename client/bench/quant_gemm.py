"""The quantized CPU GEMM (kernels/cpu/gemm_quant.cpp) against the float32 panel GEMM on the
same shapes: `python -m client.bench.quant_gemm`.

For each weight shape (SmolLM2-135M's projections and two of Llama-3.2-1B's) and row count,
GFLOP/s and the weight's GB/s (its packed bytes, read once a call) of: the float32 panel GEMM
(`float32`), int8 per output channel (`int8`), int8 in groups of 32 with float16 scales (as
GGUF's Q8_0, `q8_0`), int4 in groups of 32 with float16 scale and min (as Q4_1, `q4_1`), and
int4 in groups of 128 with float32 scale and min (AWQ/GPTQ-like, `int4_g128`). Each quantized
result is first checked to be the float32 panel GEMM's bits on the de-quantized weight (a wrong
kernel is refused, never timed). Also the machine's copy bandwidth, the bound a decode's weight
reads run against. Timings: the best of `--windows` windows of `--seconds`, after warm-up calls.

    python -m client.bench.quant_gemm --threads 1 --json bench/results/avx2/quant_gemm.json

`--bf16`: bfloat16 activations instead, as a bf16 model runs them: the bf16 panel GEMM (`bfloat16`,
the machine's best: the AMX tiles on a Xeon with them, else vdpbf16ps) against each format as the
engine packs it for bf16 (on the tiles or vdpbf16ps where the machine has them, each checked to be
that bf16 GEMM's bits on the weight rounded to bfloat16), and there the same format on the float32
vector path (`<format>_vector`: the input widened, as a machine without bf16 paths runs it); where the CPU has
AVX512-BF16, each int4 format on the bf16 dots too (`<format>_bf16_dots`, what a decode of a few
rows runs outside the batch-invariant mode; checked against x times the weight in float64 within
its roundings).

Each format also with int8 activations (`<format>_a8`, the engine's `activation_quantization`
int8: x quantized per row, integer dot products, kernels/cpu/gemm_int8_dots.cpp), checked to be
`int8_activation_linear`'s bits.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import kernels
from client.bench.flops import copy_bandwidth_gbps, seconds_per_call
from client.bench.records import git_commit, machine, write_report
from kernels import cpu_ext
from kernels.quantized import int8_activation_linear
from kernels.testing import bf16_dots_rounding_excess, make_random_quantized_weight

# (name, out_features, in_features)
SHAPES = [("smollm2_qkv", 960, 576), ("smollm2_o", 576, 576), ("smollm2_gate_up", 3072, 576),
          ("smollm2_down", 576, 1536), ("llama32_1b_gate_up", 8192, 2048), ("llama32_1b_down", 2048, 8192)]
# (name, bits, group_size or None (per output channel), mins, float16-exact group values)
FORMATS = [("int8", 8, None, False, False), ("q8_0", 8, 32, False, True), ("q4_1", 4, 32, True, True),
           ("int4_g128", 4, 128, True, False)]



def timed_row(calls: dict, name: str, n: int, k: int, rows: int, args) -> dict:
    """Times each of `calls` ({format: (call, weight bytes)}) and prints the shape's line."""
    row = {"shape": name, "out_features": n, "in_features": k, "rows": rows}
    for fmt, (call, nbytes) in calls.items():
        spent = seconds_per_call(call, "cpu", args.seconds, args.windows)
        row[fmt] = {"us": spent * 1e6, "gflop_per_s": 2 * rows * n * k / spent / 1e9,
                    "weight_gb_per_s": nbytes / spent / 1e9, "weight_bytes": nbytes}
    print(f"{name:20s} {n:5d}x{k:<5d} rows {rows:4d}: " + "  ".join(
        f"{fmt} {row[fmt]['gflop_per_s']:6.1f} GF/s {row[fmt]['weight_gb_per_s']:5.1f} GB/s" for fmt in calls),
        flush=True)
    return row


def path_name(isa: int) -> str:
    """A packed weight's path: an instruction set, or the bf16 dot products."""
    return "bf16_dots" if isa == cpu_ext.QUANT_BF16_DOTS else cpu_ext.Isa(isa).name.lower()


def check_int8_activations(packed, x: torch.Tensor, weight, what: str) -> None:
    if not torch.equal(kernels.linear(x, packed.shape_only, None, packed), int8_activation_linear(x, weight)):
        raise RuntimeError(f"{what}: not int8_activation_linear's bits; refusing to time it")


def bf16_rows(module, name: str, n: int, k: int, args, gen: torch.Generator) -> list[dict]:
    """`--bf16`'s rows for one shape: the bf16 panel GEMM, each format as packed for bf16, and on a
    machine with the tiles each format on the vector path too."""
    packed = {}
    for fmt, bits, group, mins, half in FORMATS:
        weight = make_random_quantized_weight(n, k, bits, group, mins, half, gen)
        packed[fmt] = (weight, kernels.pack_linear_weight(weight, dtype=torch.bfloat16))
        if packed[fmt][1].isa >= cpu_ext.Isa.AVX512_BF16:
            vector_isa = min(cpu_ext.Isa.AVX512, cpu_ext.Isa(module.gemm_vector_isa()))
            packed[fmt + "_vector"] = (weight, kernels.pack_linear_weight(weight, isa=vector_isa, dtype=torch.bfloat16))
        beside = kernels.pack_linear_weight(weight, dtype=torch.bfloat16, batch_invariant=False)
        if beside.vector_isa == cpu_ext.QUANT_BF16_DOTS:
            packed[fmt + "_bf16_dots"] = (weight, beside)
        packed[fmt + "_a8"] = (weight, kernels.pack_linear_weight(weight, dtype=torch.bfloat16, int8_activations=True))
    bf16 = kernels.pack_linear_weight(packed["int8"][0].dequantize().bfloat16())
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        calls = {"bfloat16": (lambda: kernels.linear(x, bf16.shape_only, None, bf16), n * k * 2)}
        for fmt, (weight, p) in packed.items():
            if fmt.endswith("_bf16_dots"):  # at every row count, not only the few linear() gives them
                call = lambda p=p, weight=weight: module.quant_panel_gemm(
                    x, p.data, p.scales, p.mins, None, n, weight.bits, weight.group_size, int(p.vector_isa))
                if bf16_dots_rounding_excess(call(), x, weight) > 0:
                    raise RuntimeError(f"{fmt} {name} at {rows} rows: off x times the weight; refusing to time it")
                calls[fmt] = (call, p.nbytes)
                continue
            if fmt.endswith("_a8"):
                check_int8_activations(p, x, weight, f"{fmt} {name} at {rows} rows")
            elif p.isa == cpu_ext.QUANT_BF16_DOTS:  # the batch-invariant mode's one path, without tiles
                if bf16_dots_rounding_excess(kernels.linear(x, p.shape_only, None, p), x, weight) > 0:
                    raise RuntimeError(f"{fmt} {name} at {rows} rows: off x times the weight; refusing to time it")
            elif p.isa >= cpu_ext.Isa.AVX512_BF16:
                panels = module.pack_panels(weight.dequantize().bfloat16(), int(p.isa))
                want = module.panel_gemm(x, panels, None, n, int(p.isa))
                if not torch.equal(kernels.linear(x, p.shape_only, None, p), want):
                    raise RuntimeError(f"{fmt} {name} at {rows} rows: not the bf16 GEMM's bits; refusing to time it")
            calls[fmt] = (lambda p=p: kernels.linear(x, p.shape_only, None, p), p.nbytes)
        rows_out.append(timed_row(calls, name, n, k, rows, args))
    return rows_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch/OpenMP threads (default: torch's); 1 on a machine other processes share, "
                             "where a core taken away stalls every parallel call")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 activations (see above)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    module = cpu_ext.load()
    if module is None or cpu_ext.isa() < cpu_ext.Isa.AVX2:
        print("the quantized panel GEMM needs the C++ kernels with AVX2 and FMA", file=sys.stderr)
        return 1
    float_isa = min(cpu_ext.isa(), cpu_ext.Isa.AVX512, cpu_ext.Isa(module.gemm_vector_isa()))
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        if args.bf16:
            results.extend(bf16_rows(module, name, n, k, args, gen))
            continue
        float_packed = None
        packed = {}
        for fmt, bits, group, mins, half in FORMATS:
            weight = make_random_quantized_weight(n, k, bits, group, mins, half, gen)
            packed[fmt] = (weight, kernels.pack_linear_weight(weight))
            packed[fmt + "_a8"] = (weight, kernels.pack_linear_weight(weight, int8_activations=True))
        dequantized = packed["int8"][0].dequantize()
        float_packed = kernels.pack_linear_weight(dequantized, isa=float_isa)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            calls = {"float32": (lambda: kernels.linear(x, float_packed.shape_only, None, float_packed),
                                 n * k * 4)}
            for fmt, (weight, p) in packed.items():
                if fmt.endswith("_a8"):
                    check_int8_activations(p, x, weight, f"{fmt} {name} at {rows} rows")
                    calls[fmt] = (lambda p=p: kernels.linear(x, p.shape_only, None, p), p.nbytes)
                    continue
                got = kernels.linear(x, p.shape_only, None, p)
                want = module.panel_gemm(x, module.pack_panels(weight.dequantize(), float_isa), None, n, float_isa)
                if not torch.equal(got, want):
                    raise RuntimeError(f"{fmt} {name} at {rows} rows: not the float GEMM's bits; refusing to time it")
                calls[fmt] = (lambda p=p: kernels.linear(x, p.shape_only, None, p), p.nbytes)
            results.append(timed_row(calls, name, n, k, rows, args))
    report = {"benchmark": "quant_gemm_bf16" if args.bf16 else "quant_gemm", "command": " ".join(["python -m client.bench.quant_gemm"] + sys.argv[1:]),
              "machine": machine(), "git_commit": git_commit(), "threads": torch.get_num_threads(),
              "float_isa": float_isa.name.lower(), "quant_isa": min(cpu_ext.isa(), cpu_ext.Isa.AVX512).name.lower(),
              "bf16_activations": args.bf16,
              "bf16_quant_isa": path_name(kernels.pack_linear_weight(make_random_quantized_weight(
                  16, 32, 8, None, False, False, gen), dtype=torch.bfloat16).isa),
              "formats": {fmt: {"bits": bits, "group_size": group, "mins": mins, "float16_group_values": half}
                          for fmt, bits, group, mins, half in FORMATS},
              "copy_bandwidth_gb_per_s": copy_bandwidth_gbps("cpu"),
              # Other processes' load skews the figures on a shared machine: said, not hidden.
              "load_average_1_5_15_min": list(os.getloadavg()), "results": results}
    print(f"copy bandwidth {report['copy_bandwidth_gb_per_s']:.1f} GB/s")
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
