"""G2 kernels of docs/benchmarks.md: `python -m client.bench.attention`.

Paged decode attention in GB/s of K/V read, against the device's copy bandwidth
(`flops.copy_bandwidth_gbps`), and mixed prefill attention in TFLOP/s; each for the
engine's kernel (`kernels.paged_attention`: the Triton kernel on CUDA, the C++ kernel on
CPU), the torch reference (`kernels.paged_attention_reference`) and torch's SDPA.

    python -m client.bench.attention --json bench/results/gpu/g2_attention_h100.json

Decode: one query token per sequence, every sequence at the same context, for each batch x
context. GB/s counts the K and V bytes of those contexts only (queries, outputs and block
tables are noise beside them). SDPA runs on K/V already gathered out of the paged cache into
contiguous [batch, kv_heads, context, head_dim] tensors (GQA by `enable_gqa`): the gather is
not timed, so SDPA's row is dense attention over the same bytes, not a paged kernel.

Mixed prefill: `--prefill-seqs` chunks of `--chunk` tokens after `--prefill-context` cached
tokens, beside `--prefill-decodes` decodes at the context where the chunks end, in one call,
as the engine schedules a step. TFLOP/s counts the causal attention's q.k and p.v FLOPs
(`attention_flops`). SDPA covers the prefill chunks only, batched in one call with an
explicit boolean causal mask over [cached + chunk] keys (again on gathered K/V); it computes
the masked-out scores as well, but is credited with the causal FLOPs alone.

`--kv-cache-dtype` int8, fp8_e4m3 or fp8_e5m2 runs every implementation on the cache quantized
as the engine stores it (`kernels.QuantizedKV`: one byte a value and a float32 scale per row;
the reference and SDPA's gather de-quantize it); GB/s then counts those bytes, scales included.

Every shape is checked before it is timed: the engine kernel's and SDPA's outputs must match
the torch reference's (`check_matches`), so a wrong kernel is refused, never timed. Timings
are the best of `--windows` windows of `--seconds` each, after a few warm-up calls.

Batches are built on the CPU (`kernels.testing.make_paged_batch`, once per context at the
largest batch, whose first sequences serve the smaller batches) and then moved to the device.
The defaults (8B heads, batch 256 at context 2048, bfloat16) hold 2 GiB of K/V on the device;
building that batch took 9 s and 6.6 GB of host memory on a 2-core EPYC (float32 K/V before
the cast). Context 4096 doubles both.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import kernels
from backend.model_runner import resolve_device, resolve_dtype
from client.bench.flops import WARMUP_CALLS, copy_bandwidth_gbps, seconds_per_call
from client.bench.records import git_commit, machine, write_report
from kernels import QuantizedKV, cpu_ext
from kernels.kv_store import KV_QUANT_DTYPES, pool_zeros, quantize_kv_rows
from kernels.testing import PagedBatch, make_paged_batch

IMPLEMENTATIONS = ("engine", "reference", "sdpa")
# Largest error allowed against the reference, over the reference's largest output (at least
# 1): 16-bit kernels round scores, probabilities and outputs to 8 (bf16) or 11 (fp16) bits
# in places that differ from the reference's.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def attention_flops(q_lens: list[int], seq_lens: list[int], heads: int, head_dim: int) -> int:
    """FLOPs of causal attention over a ragged batch: 2 for q.k and 2 for p.v per query head,
    head dimension and key attended. Query i of a sequence with q_len new tokens and seq_len
    keys sits at position seq_len - q_len + i and attends that many keys plus one."""
    keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
    return 4 * heads * head_dim * keys


def check_matches(name: str, out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raises unless `out` is finite and within the dtype's tolerance of the reference's `want`."""
    tolerance = TOLERANCE[want.dtype]
    out, want = out.float(), want.float()
    scale = max(1.0, want.abs().max().item())
    error = (out - want).abs().max().item() / scale
    if not (torch.isfinite(out).all().item() and error <= tolerance):
        raise RuntimeError(f"{name} disagrees with the torch reference on {what}: largest error {error:.3g} "
                           f"(of {scale:.3g}) over the tolerance {tolerance:g} for {want.dtype}; refusing to time it")


def engine_kernel_name(device: torch.device, batch_invariant: bool) -> str:
    if device.type == "cuda":
        return "triton"
    if cpu_ext.load() is None:
        return "torch reference (the C++ kernels could not be built)"
    if batch_invariant:
        return "c++ (batch-invariant: every token, long prefill chunks too)"
    return "c++ (long prefill chunks at long contexts: SDPA per chunk, as paged_attention_cpu chooses)"


def on_device(batch: PagedBatch, device: torch.device, kv_cache_dtype: str = "auto") -> PagedBatch:
    """The batch on `device`, its caches in memory allocated as the engine allocates its pool
    (`pool_zeros`: on the CPU, huge pages) and quantized as the engine stores them where
    `kv_cache_dtype` is not auto."""
    if kv_cache_dtype == "auto":
        def stored(cache: torch.Tensor) -> torch.Tensor:
            return pool_zeros(tuple(cache.shape), cache.dtype, device).copy_(cache)
    else:
        kind = KV_QUANT_DTYPES[kv_cache_dtype]

        def stored(cache: torch.Tensor) -> QuantizedKV:
            out = QuantizedKV.zeros(*cache.shape, kind, device=device)
            codes, scales = quantize_kv_rows(cache.to(device).float(), kind)
            out.data.copy_(codes)
            out.scale.copy_(scales)
            return out

    return PagedBatch(batch.query.to(device), stored(batch.k_cache), stored(batch.v_cache),
                      *(t.to(device) for t in batch.args()[3:6]), batch.scale)


def kv_row_bytes(cache: torch.Tensor | QuantizedKV) -> int:
    """Bytes of one position's K (or V) row of one KV head, as stored (a quantized row's scale included)."""
    head_dim = cache.shape[-1]
    return head_dim + 4 if isinstance(cache, QuantizedKV) else head_dim * cache.element_size()


def first_sequences(batch: PagedBatch, count: int) -> PagedBatch:
    """The batch cut to its first `count` sequences (their queries, tables and lengths; the
    whole cache, which the kernels read only through the tables)."""
    end = int(batch.cu_seqlens_q[count])
    return PagedBatch(batch.query[:end], batch.k_cache, batch.v_cache, batch.block_tables[:count],
                      batch.seq_lens[:count], batch.cu_seqlens_q[:count + 1], batch.scale)


def gathered_kv(batch: PagedBatch, seqs: slice, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of sequences `seqs` (all `seq_len` long), contiguous [seqs, kv_heads, seq_len, head_dim]."""
    block_size, num_kv_heads, head_dim = batch.k_cache.shape[1:]
    num_blocks = -(-seq_len // block_size)
    index = batch.block_tables[seqs, :num_blocks].reshape(-1).long()

    def gather(cache: torch.Tensor | QuantizedKV) -> torch.Tensor:
        blocks = cache.dequantize(index).to(batch.query.dtype) if isinstance(cache, QuantizedKV) else cache[index]
        rows = blocks.view(-1, num_blocks * block_size, num_kv_heads, head_dim)[:, :seq_len]
        return rows.transpose(1, 2).contiguous()

    return gather(batch.k_cache), gather(batch.v_cache)


def engine_call(batch: PagedBatch, max_seqlen_q: int, max_seqlen_k: int, batch_invariant: bool = False):
    # The bounds the engine passes with a step: they pick the Triton kernel's tile shape, and
    # spare the CPU path a look at the batch where no chunk is long enough for SDPA.
    return lambda: kernels.paged_attention(*batch.args(), max_seqlen_q, max_seqlen_k, batch_invariant)


def measure_decode(batch: PagedBatch, context: int, device: torch.device, seconds: float,
                   windows: int, copy_gbps: float, batch_invariant: bool = False) -> dict:
    num_seqs = batch.seq_lens.shape[0]
    _, num_kv_heads, head_dim = batch.k_cache.shape[1:]
    want = kernels.paged_attention_reference(*batch.args())
    engine = engine_call(batch, 1, context, batch_invariant)
    check_matches("the engine kernel", engine(), want, f"decode batch {num_seqs} at context {context}")
    keys, values = gathered_kv(batch, slice(0, num_seqs), context)
    query = batch.query[:, :, None, :]                                   # [batch, heads, 1, head_dim]

    def sdpa():
        return F.scaled_dot_product_attention(query, keys, values, scale=batch.scale, enable_gqa=True)

    check_matches("SDPA", sdpa()[:, :, 0], want, f"decode batch {num_seqs} at context {context}")
    calls = {"engine": engine, "reference": lambda: kernels.paged_attention_reference(*batch.args()), "sdpa": sdpa}
    kv_bytes = num_seqs * context * num_kv_heads * 2 * kv_row_bytes(batch.k_cache)
    row = {"batch": num_seqs, "context": context, "kv_bytes": kv_bytes}
    for name in IMPLEMENTATIONS:
        spent = seconds_per_call(calls[name], device, seconds, windows)
        gbps = kv_bytes / spent / 1e9
        row[name] = {"ms": spent * 1e3, "gb_per_s": gbps, "fraction_of_copy_bandwidth": gbps / copy_gbps}
    return row


def measure_prefill(args, dtype: torch.dtype, device: torch.device) -> dict:
    chunk, cached, seqs, decodes = args.chunk, args.prefill_context, args.prefill_seqs, args.prefill_decodes
    seq_len = cached + chunk
    # Decodes first, then the chunks: the scheduler lists running requests before admitted ones.
    q_lens, seq_lens = [1] * decodes + [chunk] * seqs, [seq_len] * (decodes + seqs)
    batch = on_device(make_paged_batch(q_lens, seq_lens, args.heads, args.kv_heads, args.head_dim, args.block_size,
                                       dtype=dtype, seed=1, unwritten=0.0), device, args.kv_cache_dtype)
    what = f"{seqs} chunks of {chunk} after {cached} cached beside {decodes} decodes"
    want = kernels.paged_attention_reference(*batch.args())
    engine = engine_call(batch, chunk, seq_len, args.batch_invariant)
    check_matches("the engine kernel", engine(), want, what)

    keys, values = gathered_kv(batch, slice(decodes, decodes + seqs), seq_len)
    query = batch.query[decodes:].view(seqs, chunk, args.heads, args.head_dim).transpose(1, 2)
    causal = (torch.arange(seq_len, device=device)[None, :]
              <= torch.arange(cached, seq_len, device=device)[:, None])   # [chunk, cached + chunk]

    def sdpa():
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal, scale=batch.scale,
                                              enable_gqa=True)

    check_matches("SDPA", sdpa().transpose(1, 2).reshape(-1, args.heads, args.head_dim), want[decodes:], what)
    flops = attention_flops(q_lens, seq_lens, args.heads, args.head_dim)
    sdpa_flops = attention_flops([chunk] * seqs, [seq_len] * seqs, args.heads, args.head_dim)
    calls = {"engine": engine, "reference": lambda: kernels.paged_attention_reference(*batch.args()), "sdpa": sdpa}
    covered = {"engine": flops, "reference": flops, "sdpa": sdpa_flops}
    row = {"prefill_seqs": seqs, "chunk": chunk, "prefill_context": cached, "decodes": decodes,
           "decode_context": seq_len, "flops": flops, "sdpa_flops": sdpa_flops,
           "sdpa_covers": f"the {seqs} prefill chunks only, with an explicit causal mask over {seq_len} keys; not the decodes"}
    for name in IMPLEMENTATIONS:
        spent = seconds_per_call(calls[name], device, args.seconds, args.windows)
        row[name] = {"ms": spent * 1e3, "tflop_per_s": covered[name] / spent / 1e12}
    return row


def print_tables(report: dict) -> None:
    shape = report["shape"]
    print(f"G2 paged attention on {report['device_name']} ({report['device']}), {report['dtype']}, "
          f"KV {report['kv_cache_dtype']}, "
          f"{shape['heads']} query / {shape['kv_heads']} KV heads x {shape['head_dim']}, block {shape['block_size']}; "
          f"engine kernel: {report['engine_kernel']}")
    print(f"decode, GB/s of K/V read; copy bandwidth {report['copy_bandwidth_gbps']:.1f} GB/s")
    print(f"{'batch':>6} {'context':>8} {'KV MiB':>9} " + " ".join(f"{name + ' ms / GB/s / %copy':>30}"
                                                                  for name in IMPLEMENTATIONS))
    for row in report["decode"]:
        cells = [f"{row[n]['ms']:10.3f} / {row[n]['gb_per_s']:8.1f} / {100 * row[n]['fraction_of_copy_bandwidth']:5.1f}"
                 for n in IMPLEMENTATIONS]
        print(f"{row['batch']:>6} {row['context']:>8} {row['kv_bytes'] / 2**20:>9.1f} "
              + " ".join(f"{c:>30}" for c in cells))
    row = report["prefill"]
    print(f"mixed prefill: {row['prefill_seqs']} chunks of {row['chunk']} after {row['prefill_context']} cached, "
          f"beside {row['decodes']} decodes at {row['decode_context']}: {row['flops'] / 1e12:.4g} TFLOP of attention; "
          f"SDPA covers {row['sdpa_covers']}: {row['sdpa_flops'] / 1e12:.4g} TFLOP")
    print(f"{'':>10} {'ms':>10} {'TFLOP/s':>10}")
    for name in IMPLEMENTATIONS:
        print(f"{name:>10} {row[name]['ms']:10.3f} {row[name]['tflop_per_s']:10.4g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda where torch sees one, else cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: as the engine's (float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3-8B's)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_QUANT_DTYPES),
                        help="auto: the cache in --dtype; else quantized as the engine stores it")
    parser.add_argument("--batch", default="1,32,128,256", help="comma-separated decode batch sizes")
    parser.add_argument("--context", default="512,2048", help="comma-separated decode context lengths")
    parser.add_argument("--chunk", type=int, default=512, help="new tokens per prefill chunk")
    parser.add_argument("--prefill-seqs", type=int, default=4, help="prefill chunks in the mixed batch")
    parser.add_argument("--prefill-context", type=int, default=1536, help="cached tokens before each chunk")
    parser.add_argument("--prefill-decodes", type=int, default=32,
                        help="decodes in the mixed batch, at the context where the chunks end")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's default on the CPU: every token through the C++ kernel, long chunks too")
    parser.add_argument("--seconds", type=float, default=0.25, help="length of one timing window")
    parser.add_argument("--windows", type=int, default=4, help="timing windows; the best counts")
    parser.add_argument("--copy-megabytes", type=int, default=1024,
                        help="size of the copy that measures the bandwidth (well above the caches)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    dtype = resolve_dtype(args.dtype, device)
    batches = sorted(int(n) for n in args.batch.split(","))
    contexts = sorted(int(n) for n in args.context.split(","))
    copy_gbps = copy_bandwidth_gbps(device, args.copy_megabytes, args.seconds, args.windows)
    decode = []
    for context in contexts:
        largest = on_device(make_paged_batch([1] * batches[-1], [context] * batches[-1], args.heads, args.kv_heads,
                                             args.head_dim, args.block_size, dtype=dtype, seed=context,
                                             unwritten=0.0), device, args.kv_cache_dtype)
        for batch in batches:
            decode.append(measure_decode(first_sequences(largest, batch), context, device, args.seconds, args.windows,
                                         copy_gbps, args.batch_invariant))
        del largest  # before the next context's cache is built beside it
    decode.sort(key=lambda row: (row["batch"], row["context"]))
    host = machine()
    report = {
        "benchmark": "G2 kernels: paged attention",
        "command": "python -m client.bench.attention " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": host,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else host["cpu"],
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": args.kv_cache_dtype,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "block_size": args.block_size},
        "engine_kernel": engine_kernel_name(device, args.batch_invariant),
        "batch_invariant": args.batch_invariant,
        "timing": {"seconds_per_window": args.seconds, "windows": args.windows, "warmup_calls": WARMUP_CALLS},
        "copy_bandwidth_gbps": copy_gbps,
        "decode": decode,
        "prefill": measure_prefill(args, dtype, device),
    }
    print_tables(report)
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
