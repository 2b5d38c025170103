"""Compile every Triton kernel for an NVIDIA GPU, on a machine without one.

    python -m kernels.compile_check [--arch 90] [--quick]

Triton's wheel ships ptxas, so the whole pipeline (Triton IR -> LLVM -> PTX -> cubin) runs
on a CPU-only machine. The interpreter used by the CPU tests is lenient about types and
shapes; this catches what only the compiler rejects, and reports per variant whether the
attention kernel uses tensor-core MMA and whether anything spills to local memory.
Run with TRITON_INTERPRET unset (the tests start it in a clean subprocess).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

# Triton's pointer type for each quantized KV dtype's storage (kernels/kv_store.py's KVQuantDtype).
KV_POINTERS = {"int8": "*i8", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}


def _compile(fn, types: dict[str, str], constexprs: dict, arch: int, options: dict):
    """`options`: the launch's compile options (num_warps; num_stages, enable_fp_fusion where
    the launch sets them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32"))
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": True, **options})


def _stats(kernel) -> str:
    ptx = kernel.asm["ptx"]
    mma = len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)", ptx))
    spills = "ld.local" in ptx or "st.local" in ptx
    return f"mma={mma} spills={'yes' if spills else 'no'} smem={kernel.metadata.shared}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    parser.add_argument("--quick", action="store_true", help="one variant per kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2

    from .activation import _silu_and_mul_kernel
    from .kv_store import KV_QUANT_DTYPES, _store_kv_kernel, store_kv_quant_constants
    from .linear_quant import _linear_quant_kernel, _sum_splits_kernel, linear_quant_config
    from .lora import _lora_expand_kernel, _lora_shrink_kernel
    from .moe import BLOCK_K as MOE_BLOCK_K, BLOCK_M as MOE_BLOCK_M, BLOCK_N as MOE_BLOCK_N, _grouped_gemm_kernel
    from .paged_attention import _paged_attention_kernel, attention_config
    from .rms_norm import _rms_norm_kernel
    from .rotary import _rotary_kernel
    from .triton_utils import dot_precision

    dtypes = ["bf16"] if args.quick else ["bf16", "fp16", "fp32"]
    # (head_dim, queries per kv head, block size, max_seqlen_q: 1 = decode tiles, 64 = prefill tiles)
    attention = [(128, 4, 16, 1), (64, 3, 16, 64)] if args.quick else [
        (hd, qpk, bs, q) for hd in (64, 80, 128) for qpk in (1, 4, 8) for bs in (16, 32) for q in (1, 64)]
    failures = 0
    for dt in dtypes:
        p = "*" + dt
        element_size = 4 if dt == "fp32" else 2
        jobs = [
            *((f"store_kv{' ' + kind.name if kind else ''}", _store_kv_kernel,
               {"key_ptr": p, "value_ptr": p, "k_cache_ptr": KV_POINTERS[kind.name] if kind else p,
                "v_cache_ptr": KV_POINTERS[kind.name] if kind else p, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                "slot_ptr": "*i64"},
               dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, **store_kv_quant_constants(kind)))
              for kind in (None, *KV_QUANT_DTYPES.values())),
            ("rms_norm+residual", _rms_norm_kernel,
             {"x_ptr": p, "residual_ptr": p, "weight_ptr": p, "out_ptr": p, "residual_out_ptr": p, "eps": "fp32"},
             dict(HAS_RESIDUAL=True, BLOCK_N=4096)),
            ("rotary", _rotary_kernel,
             {"pos_ptr": "*i64", "q_ptr": p, "k_ptr": p, "q_out_ptr": p, "k_out_ptr": p, "cos_sin_ptr": "*fp32"},
             dict(HALF=64, HALF_PAD=64, BLOCK_HQ=32, BLOCK_HK=8, IS_NEOX=True)),
            ("silu_and_mul", _silu_and_mul_kernel, {"x_ptr": p, "out_ptr": p}, dict(BLOCK=1024)),
            ("lora_shrink", _lora_shrink_kernel,
             {"x_ptr": p, "a_ptr": p, "buf_ptr": "*fp32", "indptr_ptr": "*i32", "adapter_ptr": "*i32"},
             dict(BLOCK_M=16, BLOCK_R=64, BLOCK_K=64, DOT_PRECISION=dot_precision(element_size))),
            ("lora_expand", _lora_expand_kernel,
             {"buf_ptr": "*fp32", "b_ptr": p, "y_ptr": p, "indptr_ptr": "*i32", "adapter_ptr": "*i32"},
             dict(BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, DOT_PRECISION=dot_precision(element_size))),
        ]
        jobs.append(("moe grouped_gemm", _grouped_gemm_kernel,
                     {"x_ptr": p, "w_ptr": p, "out_ptr": p, "rows_ptr": "*i64", "tile_expert_ptr": "*i32"},
                     dict(BLOCK_M=MOE_BLOCK_M, BLOCK_N=MOE_BLOCK_N, BLOCK_K=MOE_BLOCK_K,
                          DOT_PRECISION=dot_precision(element_size))))
        jobs = [job + ({"num_warps": 4},) for job in jobs]
        # (bits, group size, mins, rows): decode and prefill tiles, a group per tile or per weight
        quant = [(4, 128, True, 1), (8, 4096, False, 512)] if args.quick else [
            (bits, group, mins, m) for bits, group, mins in
            ((8, 4096, False), (8, 32, False), (8, 16, False), (4, 32, True), (4, 128, True), (4, 128, False),
             (4, 48, True)) for m in (1, 64, 512)]
        for bits, group, mins, m in quant:
            config = linear_quant_config(m, 4096, 4096, bits, group)
            options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages"),
                       "enable_fp_fusion": False}   # as linear_quant_triton launches it
            for key in ("split_k", "tiles_per_split"):
                config.pop(key)
            jobs.append((f"linear_quant w{bits} g{group}{' mins' if mins else ''} block_m={config['BLOCK_M']}"
                         f"{'' if config['ONE_GROUP_PER_TILE'] else ' scale/weight'}",
                         _linear_quant_kernel,
                         {"x_ptr": p, "q_ptr": "*u8" if bits == 4 else "*i8", "scales_ptr": "*fp32",
                          "mins_ptr": "*fp16", "bias_ptr": p, "out_ptr": "*fp32" if m == 1 else p},
                         dict(BITS=bits, HAS_MINS=mins, HAS_BIAS=m > 1, DOT_PRECISION=dot_precision(element_size),
                              **config), options))
        jobs.append(("linear_quant sum_splits", _sum_splits_kernel,
                     {"part_ptr": "*fp32", "bias_ptr": p, "out_ptr": p}, dict(HAS_BIAS=True, BLOCK=1024), {"num_warps": 4}))
        # Quantized KV (every kv_cache_dtype but auto): the decode and the prefill tiles of the first head size
        quantized_kv = [a for a in attention if a[0] == attention[0][0] and a[1] == attention[0][1]]
        for (hd, qpk, bs, max_q), kind in ([(a, None) for a in attention]
                                           + [(a, kind) for a in quantized_kv for kind in KV_QUANT_DTYPES.values()]):
            config = attention_config(qpk, hd, element_size, max_q)
            num_warps = config.pop("num_warps")
            kv = KV_POINTERS[kind.name] if kind else p
            jobs.append((f"paged_attention hd={hd} qpk={qpk} bs={bs} block_m={config['BLOCK_M']}"
                         f"{' ' + kind.name + ' KV' if kind else ''}",
                         _paged_attention_kernel,
                         {"q_ptr": p, "k_cache_ptr": kv, "v_cache_ptr": kv, "k_scale_ptr": "*fp32",
                          "v_scale_ptr": "*fp32", "out_ptr": p, "block_tables_ptr": "*i32",
                          "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "scale": "fp32", "softcap": "fp32"},
                         dict(BLOCK_SIZE=bs, HEAD_DIM=hd, QUANTIZED=kind is not None, WINDOWED=False, SOFTCAP=False,
                              **config), {"num_warps": num_warps}))
        # Gemma 2's sliding-window, soft-capped layers: the decode and the prefill tiles of the first head size
        for hd, qpk, bs, max_q in quantized_kv:
            config = attention_config(qpk, hd, element_size, max_q)
            num_warps = config.pop("num_warps")
            jobs.append((f"paged_attention hd={hd} qpk={qpk} bs={bs} block_m={config['BLOCK_M']} window softcap",
                         _paged_attention_kernel,
                         {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "k_scale_ptr": "*fp32",
                          "v_scale_ptr": "*fp32", "out_ptr": p, "block_tables_ptr": "*i32",
                          "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "scale": "fp32", "window": "i32",
                          "softcap": "fp32"},
                         dict(BLOCK_SIZE=bs, HEAD_DIM=hd, QUANTIZED=False, WINDOWED=True, SOFTCAP=True, **config),
                         {"num_warps": num_warps}))
        for name, fn, types, constexprs, options in jobs:
            t0 = time.perf_counter()
            try:
                kernel = _compile(fn, types, constexprs, args.arch, options)
            except Exception as exc:  # report every failure, not just the first
                failures += 1
                print(f"FAIL {dt:<4} {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(f"ok   {dt:<4} {name:<52} {time.perf_counter() - t0:5.1f}s  {_stats(kernel)}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
