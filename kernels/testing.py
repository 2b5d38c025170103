"""Test helpers: random paged batches and naive loop implementations to check against.

Used by tests/kernels/test_kernels*.py; handy for engine tests that need a filled KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor          # [num_tokens, Hq, D]
    k_cache: torch.Tensor        # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor       # int32 [num_seqs]
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    scale: float

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, self.scale)


def make_paged_batch(q_lens: list[int], seq_lens: list[int], num_q_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                     seed: int = 0, unwritten: float = float("nan"),
                     spare_blocks: int = 3) -> PagedBatch:
    """A ragged batch whose caches hold K/V for positions [0, seq_len) of every sequence.

    Physical blocks are a random permutation; cache slots that no sequence owns hold
    `unwritten` (NaN by default, so kernels that read past a sequence's context show it),
    and block-table entries past a sequence's last block are garbage (-1, 0 or huge).
    K/V go in through `store_kv_reference` with a slot mapping that has -1 padding entries.
    """
    from .kv_store import store_kv_reference

    assert len(q_lens) == len(seq_lens)
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens)) and all(s >= 1 for s in seq_lens)
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks) + 2
    num_blocks = sum(blocks) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), unwritten, dtype=dtype)
    v_cache = torch.full_like(k_cache, unwritten)
    perm = torch.randperm(num_blocks, generator=g)
    garbage = torch.tensor([-1, 0, 1 << 30], dtype=torch.int32)
    block_tables = garbage[torch.randint(0, 3, (num_seqs, max_blocks), generator=g)]
    slots, used = [], 0
    for s, nb in enumerate(blocks):
        block_tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(seq_lens[s])
        slots.append(block_tables[s, pos // block_size].to(torch.int64) * block_size + pos % block_size)
        slots.append(torch.full((2,), -1, dtype=torch.int64))   # padding entries are skipped
    slot_mapping = torch.cat(slots)
    n = slot_mapping.shape[0]
    keys = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    values = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    store_kv_reference(keys, values, k_cache, v_cache, slot_mapping)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
                      cu, head_dim ** -0.5)


def naive_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                          compute_dtype: torch.dtype = torch.float32, window: int = 0,
                          softcap: float = 0.0) -> torch.Tensor:
    """Token by token over a dense copy of each sequence's K/V (GQA by repeating K/V heads):
    out = softmax(cap(q . k^T * scale)) v over positions [0, pos] (with `window`: the last
    `window` of them), cap(s) = tanh(s / softcap) * softcap when softcap > 0."""
    block_size = k_cache.shape[1]
    num_q_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=compute_dtype)
    for s in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[s])
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        # Dense K/V of the sequence, block by block through the block table.
        num_blocks = -(-seq_len // block_size)
        keys = torch.cat([k_cache[int(block_tables[s, b])] for b in range(num_blocks)])[:seq_len]
        values = torch.cat([v_cache[int(block_tables[s, b])] for b in range(num_blocks)])[:seq_len]
        keys = keys.to(compute_dtype).repeat_interleave(group, dim=1)       # [seq_len, Hq, D]
        values = values.to(compute_dtype).repeat_interleave(group, dim=1)
        for i in range(q1 - q0):
            pos = seq_len - (q1 - q0) + i
            q = query[q0 + i].to(compute_dtype)                               # [Hq, D]
            first = max(0, pos + 1 - window) if window else 0
            scores = (keys[first:pos + 1] * q).sum(-1) * scale                # [keys, Hq]
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            weights = torch.exp(scores - scores.max(0).values)
            weights = weights / weights.sum(0)
            out[q0 + i] = (weights[:, :, None] * values[first:pos + 1]).sum(0)
    return out


def int16_rounded_query(query: torch.Tensor, scale: float) -> torch.Tensor:
    """The query (times `scale`) that the C++ kernel scores int8 keys against
    (kernels/cpu/paged_attention.cpp's round_query_to_int16), as float32 values: each head's row
    rounded to integers against a power-of-two step, peak / step in [16384, 32768)."""
    query = query.float() * scale
    peak = query.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(peak)
    step = torch.ldexp(torch.ones_like(peak), exponent - 15)
    return torch.round(query / step).clamp(-32767, 32767) * step


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row, in float64."""
    rows = x.reshape(-1, x.shape[-1]).double()
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        out[r] = rows[r] / torch.sqrt((rows[r] ** 2).mean() + eps) * weight.double()
    return out.view(x.shape)


def make_random_quantized_weight(out_features: int, in_features: int, bits: int, group: int | None, mins: bool,
                                 half: bool, gen: torch.Generator):
    """Random integers and group values of a QuantizedWeight (`group` None: one group per row);
    with `half`, values float16 holds exactly (as GGUF's), which the CPU packing keeps in float16."""
    from .quantized import QuantizedWeight

    group = group or in_features
    groups = -(-in_features // group)
    low, high = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(low, high, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3
    lows = -torch.rand(out_features, groups, generator=gen) * 0.1 if mins else None
    if half:
        scales, lows = scales.half().float(), None if lows is None else lows.half().float()
    return QuantizedWeight(q, scales, lows, bits, group)


def bf16_dots_rounding_excess(got: torch.Tensor, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> float:
    """How far the bf16 dots' result `got` (bfloat16) strays past their roundings from x times the
    de-quantized weight (+ bias) in float64: half a unit in the last place of the bfloat16 output
    and a few units of 2^-24 of the products' magnitudes for the float32 sums. At most 0 when right."""
    dequantized = weight.dequantize().double()
    exact = x.double() @ dequantized.T
    magnitude = x.double().abs() @ dequantized.abs().T
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    allowed = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -18
    return ((got.double() - exact).abs() - allowed).max().item()
