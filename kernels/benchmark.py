"""CPU microbenchmark of the torch reference kernels (the engine's CPU production path).

    python -m kernels.benchmark [--threads N] [--repeat R]

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, block size
16, float32). Each line is one layer call: the median over R timed runs, with the spread.
For scale, "floor" is the time to copy the K and V blocks that the batch's decodes have to
read (into preallocated buffers): attention can hardly beat one pass over them, and on
this kind of machine memory bandwidth, not arithmetic, sets the pace. On a shared machine,
compare a line with its own floor rather than with yesterday's numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .paged_attention import paged_attention_reference

HQ, HKV, D, BS = 9, 3, 64, 16


def _batch(q_lens: list[int], seq_lens: list[int], generator: torch.Generator):
    num_seqs = len(q_lens)
    blocks_per_seq = [-(-s // BS) for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 64
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=generator)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=generator)
    perm = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    query = torch.randn(sum(q_lens), HQ, D, generator=generator)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), cu


def _time(fn, repeat: int) -> tuple[float, float, float]:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs), min(runs), max(runs)


def _per_sequence_sdpa(query, k_cache, v_cache, block_tables, seq_lens, cu, scale):
    """Baseline: one SDPA call per sequence (what a straightforward port would do)."""
    out = torch.empty_like(query)
    for s, (q0, q1, n) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), seq_lens.tolist())):
        nb = -(-n // BS)
        k = k_cache[block_tables[s, :nb].long()].view(-1, HKV, D)[:n].transpose(0, 1)[None]
        v = v_cache[block_tables[s, :nb].long()].view(-1, HKV, D)[:n].transpose(0, 1)[None]
        q = query[q0:q1].transpose(0, 1)[None]
        mask = torch.arange(n)[None, :] <= torch.arange(n - (q1 - q0), n)[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                    enable_gqa=True)[0].transpose(0, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--baseline", action="store_true", help="also time one SDPA call per sequence")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rand = lambda lo, hi, n: torch.randint(lo, hi + 1, (n,), generator=g).tolist()  # noqa: E731
    cases = {
        "decode 32 x ctx 256": ([1] * 32, [256] * 32),
        "decode 32 x ctx 64..512": ([1] * 32, rand(64, 512, 32)),
        "decode 128 x ctx 256": ([1] * 128, [256] * 128),
        "decode 256 x ctx 32..1024": ([1] * 256, rand(32, 1024, 256)),
        "mixed: 2 prefill chunks (256 new; 256 new after 512) + 30 decodes ctx 100..400":
            ([256, 256] + [1] * 30, [256, 768] + rand(100, 400, 30)),
        "prefill 1 x 512": ([512], [512]),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"Hq={HQ} Hkv={HKV} D={D} block={BS} float32; ms per layer call, median [min-max]")
    scale = D ** -0.5
    for name, (q_lens, seq_lens) in cases.items():
        batch = _batch(q_lens, seq_lens, g)
        med, lo, hi = _time(lambda: paged_attention_reference(*batch, scale), args.repeat)
        line = f"{name:<82} {med:7.3f} [{lo:.3f}-{hi:.3f}]"
        decodes = [(s, n) for s, (q, n) in enumerate(zip(q_lens, seq_lens)) if q == 1]
        if decodes:
            _, k_cache, v_cache, block_tables = batch[:4]
            idx = torch.cat([block_tables[s, :-(-n // BS)] for s, n in decodes])
            k_buf = k_cache.new_empty(idx.numel(), BS, HKV, D)
            v_buf = v_cache.new_empty(idx.numel(), BS, HKV, D)
            floor, _, _ = _time(lambda: (torch.index_select(k_cache, 0, idx, out=k_buf),
                                         torch.index_select(v_cache, 0, idx, out=v_buf)), args.repeat)
            line += f"   floor (gather decode K+V, {2 * idx.numel() * BS * HKV * D * 4 / 1e6:.1f} MB) {floor:.3f}"
        if args.baseline:
            base, _, _ = _time(lambda: _per_sequence_sdpa(*batch, scale), max(5, args.repeat // 5))
            line += f"   per-sequence SDPA {base:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
