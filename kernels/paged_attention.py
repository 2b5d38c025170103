"""Paged attention over a ragged batch that mixes prefill chunks and single decode tokens.

Inputs (shared by the Triton kernel and the torch reference):
  query         [num_tokens, num_q_heads, head_dim]: the new tokens of every sequence,
                concatenated; sequence s owns rows cu_seqlens_q[s] : cu_seqlens_q[s + 1].
  k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]: the paged KV cache,
                already holding the K/V of the new tokens (written by `store_kv`): tensors
                in the query's dtype, or `QuantizedKV` (int8 or fp8 rows and their
                scales, de-quantized to float32 as they are read).
  block_tables  int32 [num_seqs, max_blocks]: logical block i of sequence s lives in
                physical block block_tables[s, i]; entries past the end are arbitrary.
  seq_lens      int32 [num_seqs]: context length including the new tokens.
  cu_seqlens_q  int32 [num_seqs + 1].
Query i of sequence s sits at position seq_lens[s] - q_len_s + i and attends causally to
keys [0, that position], or with `window` > 0 (a sliding-window layer) to its last `window`
positions only: keys (position - window, position]. Query head h reads KV head
h // (num_q_heads // num_kv_heads).
out = softmax(cap(q k^T * scale)) v, accumulated in float32, returned in the query's dtype, where
cap(s) = tanh(s / softcap) * softcap when `softcap` > 0 (Gemma 2's attention logit soft-capping)
and s otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import cpu_ext
from .kv_store import QuantizedKV
from .triton_utils import dot_precision, launch, next_power_of_2

# ---------------------------------------------------------------------------------------
# torch reference, and the CPU production path (the C++ kernel; SDPA for long chunks at long contexts)
# ---------------------------------------------------------------------------------------

# Decode sequences are processed in padded groups; a new group (sorted by context length)
# costs roughly as much as this many padded key positions of wasted work.
_GROUP_OVERHEAD_KEYS = 2048
# Decode K is gathered this many bytes at a time (about half of a core's L2).
_CHUNK_BYTES = 1 << 20


def paged_attention_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, scale: float,
                              max_seqlen_q: int | None = None,
                              max_seqlen_k: int | None = None, window: int = 0,
                              softcap: float = 0.0) -> torch.Tensor:
    """Vectorised torch implementation (see module docstring for the contract).

    Sequences with one new token (decodes) are handled together, in a few groups of
    similar context length padded to the group's longest: K blocks are gathered a few
    sequences at a time and multiplied with all query heads at once (GQA by grouping query
    heads, no K/V repeat), softmax is masked by context length, and the V side is a
    weighted sum of cache rows read in place (`embedding_bag`), so V is never copied.
    Sequences with several new tokens (prefill chunks) go one by one through
    `scaled_dot_product_attention` with a causal mask offset by their cached context.
    Cost: one pass over the decodes' K/V (plus < 25% padding) and one SDPA call per
    prefill chunk; a few dozen torch ops per decode group, whatever the batch size.
    """
    return _ragged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window, softcap)


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, scale: float,
                        max_seqlen_q: int | None = None,
                        max_seqlen_k: int | None = None, batch_invariant: bool = False, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """The CPU production path: the C++ kernel (kernels/cpu/paged_attention.cpp) over the
    ragged batch, decodes and prefill chunks alike, cache rows read in place; unless
    `batch_invariant`, prefill chunks that are long and see long contexts go to SDPA
    (`_prefill`), whose GEMM-based flash attention is faster there (`_uses_sdpa`) but sums in
    an order that depends on the chunk. The C++ kernel computes each token alone, in an order
    set by its context length only. Where the C++ kernels could not be built, exactly the
    reference."""
    module = cpu_ext.load()
    if module is None:
        return paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                         window=window, softcap=softcap)

    lanes = 16 if cpu_ext.vector_isa() >= cpu_ext.Isa.AVX512 else 8

    if isinstance(k_cache, QuantizedKV):
        def kernel(q, tables, lens, cu):
            return module.paged_attention(q, k_cache.data, v_cache.data, tables.to(torch.int32), lens.to(torch.int32),
                                          cu.to(torch.int32), scale, lanes, k_cache.scale, v_cache.scale, window, softcap)
    else:
        def kernel(q, tables, lens, cu):
            return module.paged_attention(q.to(k_cache.dtype), k_cache, v_cache, tables.to(torch.int32),
                                          lens.to(torch.int32), cu.to(torch.int32), scale, lanes, None, None, window,
                                          softcap).to(query.dtype)

    if paged_attention_cpu_kernel_only(max_seqlen_q, max_seqlen_k, batch_invariant):
        return kernel(query, block_tables, seq_lens, cu_seqlens_q)  # the usual step: no host-side look at the batch
    cu = cu_seqlens_q.to(torch.int64)
    q_lens, ctx = cu[1:] - cu[:-1], seq_lens.to(torch.int64)
    sdpa = _uses_sdpa(q_lens, ctx)
    if not bool(sdpa.any()):
        return kernel(query, block_tables, seq_lens, cu_seqlens_q)
    out = torch.empty_like(query)
    rest = ~sdpa
    rows = torch.repeat_interleave(rest, q_lens)
    rest_cu = torch.zeros(int(rest.sum()) + 1, dtype=torch.int64)
    torch.cumsum(q_lens[rest], 0, out=rest_cu[1:])
    out[rows] = kernel(query[rows], block_tables[rest], ctx[rest], rest_cu)
    cu_l, ctx_l = cu.tolist(), ctx.tolist()
    for s in sdpa.nonzero().squeeze(1).tolist():
        out[cu_l[s]:cu_l[s + 1]] = _prefill(query[cu_l[s]:cu_l[s + 1]], k_cache, v_cache, block_tables[s], ctx_l[s],
                                            scale, window, softcap).to(query.dtype)
    return out


# The C++ kernel computes each query token on its own; SDPA shares each K/V load among a
# tile of queries but first gathers the context and pays per call. Measured on a 2-core
# AVX2 EPYC (SmolLM2 heads, one chunk, ms per layer, C++ / SDPA): 16 tokens at context
# 2048: 1.4 / 1.9; 512 from empty: 5.0 / 6.3; 64 at 1024: 2.5 / 2.2; 256 at 512: 4.5 / 3.9;
# 512 at 1024: 13.3 / 10.6; 128 at 4096: 18.1 / 13.0. SDPA wins from 64 tokens whose
# average context (the chunk's middle token's) reaches ~320 positions.
_SDPA_MIN_QUERY = 64
_SDPA_MIN_MEAN_CONTEXT = 320


def paged_attention_cpu_kernel_only(max_seqlen_q: int | None, max_seqlen_k: int | None, batch_invariant: bool) -> bool:
    """Whether `paged_attention_cpu` sends every token of a batch with these bounds to the C++
    kernel, known without looking at the batch (no chunk is long enough for SDPA)."""
    return (batch_invariant or (max_seqlen_q is not None and max_seqlen_q < _SDPA_MIN_QUERY)
            or (max_seqlen_k is not None and max_seqlen_k < _SDPA_MIN_MEAN_CONTEXT))


def _uses_sdpa(q_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    return (q_lens >= _SDPA_MIN_QUERY) & (seq_lens - q_lens // 2 >= _SDPA_MIN_MEAN_CONTEXT)


def _ragged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window=0,
                      softcap=0.0) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    cu = cu_seqlens_q.to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    ctx = seq_lens.to(torch.int64)
    num_seqs = ctx.shape[0]

    if num_tokens == num_seqs and bool((q_lens == 1).all()):
        out.copy_(_decode(query, k_cache, v_cache, block_tables[:num_seqs], ctx, scale, window, softcap))
        return out

    is_decode = q_lens == 1
    if bool(is_decode.any()):
        dec = is_decode.nonzero().squeeze(1)
        rows = cu[dec]
        out[rows] = _decode(query[rows], k_cache, v_cache, block_tables[dec], ctx[dec], scale, window,
                            softcap).to(out.dtype)
    multi = (q_lens > 1).nonzero().squeeze(1).tolist()
    if multi:
        cu_l, ctx_l = cu.tolist(), ctx.tolist()
        for s in multi:
            q0, q1 = cu_l[s], cu_l[s + 1]
            out[q0:q1] = _prefill(query[q0:q1], k_cache, v_cache, block_tables[s], ctx_l[s], scale, window, softcap)
    return out


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_table: torch.Tensor, seq_len: int, scale: float, window: int = 0,
             softcap: float = 0.0) -> torch.Tensor:
    """One sequence with q_len > 1 new tokens at positions [seq_len - q_len, seq_len)."""
    q_len = q.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_blocks = -(-seq_len // block_size)
    idx = block_table[:num_blocks]
    if isinstance(k_cache, QuantizedKV):
        k, v = k_cache.dequantize(idx), v_cache.dequantize(idx)
    else:
        k, v = k_cache.index_select(0, idx), v_cache.index_select(0, idx)
    k = k.view(-1, num_kv_heads, head_dim)[:seq_len]
    v = v.view(-1, num_kv_heads, head_dim)[:seq_len]
    if q.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    # [1, heads, tokens, head_dim] views, no copies; SDPA handles GQA natively.
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    cached = seq_len - q_len
    if softcap > 0:
        # SDPA cannot cap its scores: the scores, the cap, the mask and the softmax spelled out.
        group = q.shape[1] // num_kv_heads
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        scores = torch.matmul(qt, kt.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(~_visible(cached, seq_len, window, q.device), float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), vt)
    elif cached == 0 and not window:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = _visible(cached, seq_len, window, q.device)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _visible(cached: int, seq_len: int, window: int, device) -> torch.Tensor:
    """[q_len, seq_len] bool: which keys each new token (at positions cached..seq_len-1) sees."""
    keys = torch.arange(seq_len, device=device)[None, :]
    positions = torch.arange(cached, seq_len, device=device)[:, None]
    mask = keys <= positions
    if window:
        mask &= keys > positions - window
    return mask


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, ctx: torch.Tensor, scale: float, window: int = 0,
            softcap: float = 0.0) -> torch.Tensor:
    """B sequences with one new token each: q [B, Hq, D], ctx [B] int64 (>= 1)."""
    batch = q.shape[0]
    ctx_l = ctx.tolist()
    longest, total = max(ctx_l), sum(ctx_l)
    # One padded group unless padding to the longest context wastes more than a group costs.
    if batch * longest - total <= max(_GROUP_OVERHEAD_KEYS, total // 4):
        return _decode_group(q, k_cache, v_cache, block_tables, ctx, longest, scale, window, softcap)
    order = sorted(range(batch), key=ctx_l.__getitem__, reverse=True)
    out = q.new_empty(q.shape, dtype=torch.float32)
    start = 0
    while start < batch:
        head = ctx_l[order[start]]
        end = start + 1
        # Extend the group until padding would waste over a quarter of a row, and cutting
        # here saves more than a group costs (so groups shrink geometrically: few of them).
        while end < batch:
            c = ctx_l[order[end]]
            if c < 0.75 * head and (batch - end) * (head - c) > _GROUP_OVERHEAD_KEYS:
                break
            end += 1
        sel = torch.tensor(order[start:end], dtype=torch.int64, device=q.device)
        out[sel] = _decode_group(q[sel], k_cache, v_cache, block_tables[sel], ctx[sel], head, scale, window,
                                 softcap)
        start = end
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, ctx: torch.Tensor, longest: int,
                  scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention for B sequences padded to `longest` keys. Returns float32 [B, Hq, D].

    Memory traffic, not arithmetic, is the cost: K is read once from the cache into a
    small buffer (a few sequences at a time, so the matmul finds it in L2), V is read once
    straight from the cache; the padded scores/probabilities are B x Hq x L floats.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_blocks = -(-longest // block_size)
    padded = num_blocks * block_size
    # Entries past a sequence's last block are arbitrary: clamp them to some real block
    # (what it holds is masked out below).
    tables = block_tables[:, :num_blocks].clamp(0, k_cache.shape[0] - 1)
    if isinstance(k_cache, QuantizedKV):
        # The group's blocks de-quantized once into float32 caches of their own, which the
        # float path below reads through a table of their new places.
        idx = tables.reshape(-1).to(torch.int64)
        k_cache, v_cache = k_cache.dequantize(idx), v_cache.dequantize(idx)
        tables = torch.arange(idx.numel(), device=q.device).view(batch, num_blocks)
    # q.k runs in the cache's dtype (bfloat16 there is what HF's eager attention does, and
    # spares a float copy of K); scores and softmax are float32.
    q = q.to(k_cache.dtype)

    # scores[b, j, g, l] = q[b, j * group + g] . k[b, l, j]
    scores = torch.empty(batch, num_kv_heads, group, padded, dtype=torch.float32, device=q.device)
    same_dtype = k_cache.dtype == torch.float32
    block_diagonal = num_kv_heads <= 4
    if block_diagonal:
        # One batched matmul against the gathered rows [L, Hkv * D]: the query of head
        # (j, g) sits in the j-th D-slice of an otherwise zero row. Hkv times the (tiny)
        # flops, but K is read once, contiguously; the extra terms are exact zeros.
        qbd = q.new_zeros(batch, num_kv_heads, group, num_kv_heads, head_dim)
        qbd.diagonal(dim1=1, dim2=3).copy_(q.view(batch, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
        qbd = qbd.view(batch, num_q_heads, num_kv_heads * head_dim)
    else:
        qg = q.view(batch, num_kv_heads, group, head_dim)
    step = max(1, _CHUNK_BYTES // (padded * num_kv_heads * head_dim * k_cache.element_size()))
    buf = k_cache.new_empty(min(step, batch) * num_blocks, block_size, num_kv_heads, head_dim)
    for c0 in range(0, batch, step):
        c1 = min(batch, c0 + step)
        idx = tables[c0:c1].reshape(-1)
        k = torch.index_select(k_cache, 0, idx, out=buf[:idx.numel()])
        if block_diagonal:
            kt = k.view(c1 - c0, padded, num_kv_heads * head_dim).transpose(1, 2)
            target = scores[c0:c1].view(c1 - c0, num_q_heads, padded)
            if same_dtype:
                torch.bmm(qbd[c0:c1], kt, out=target)
            else:
                target.copy_(torch.bmm(qbd[c0:c1], kt))
        else:
            kv = k.view(c1 - c0, padded, num_kv_heads, head_dim)
            for j in range(num_kv_heads):
                part = torch.bmm(qg[c0:c1, j], kv[:, :, j].transpose(1, 2))
                scores[c0:c1, j].copy_(part)
    scores.mul_(scale)
    if softcap > 0:
        scores.div_(softcap).tanh_().mul_(softcap)
    key_pos = torch.arange(padded, device=q.device)[None, :]
    pad = key_pos >= ctx[:, None]   # [B, L]
    hidden = pad | (key_pos <= ctx[:, None] - 1 - window) if window else pad
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)                                  # [B, Hkv, G, L]

    # Padded positions read position 0's row of their own sequence (written, finite) and
    # carry probability exactly 0, so V needs no masking.
    slot = ((tables.to(torch.int64) * block_size)[:, :, None]
            + torch.arange(block_size, device=q.device)).view(batch, padded)
    slot = torch.where(pad, slot[:, :1], slot)
    if v_cache.dtype == torch.float32 and v_cache.is_contiguous():
        # out[b, h] = sum_l probs[b, h, l] * V[slot(b, l), h // group]: a weighted bag of
        # cache rows, read in place.
        head_of = torch.arange(num_q_heads, device=q.device) // group
        rows = (slot * num_kv_heads)[:, None, :] + head_of[None, :, None]  # [B, Hq, L]
        offsets = torch.arange(0, batch * num_q_heads * padded, padded, device=q.device)
        o = F.embedding_bag(rows.view(-1), v_cache.view(-1, head_dim), offsets, mode="sum",
                            per_sample_weights=probs.reshape(-1))
        return o.view(batch, num_q_heads, head_dim)
    # Reduced precision: probabilities rounded to the cache dtype (as HF's eager attention
    # rounds them) times V rows gathered by slot, float32 accumulation inside the matmul.
    v = v_cache.reshape(-1, num_kv_heads * head_dim).index_select(0, slot.view(-1))
    v = v.view(batch, padded, num_kv_heads * head_dim)
    p = probs.to(v.dtype)
    if block_diagonal:
        # Every query head against every KV head's slice in one matmul (Hkv times the tiny
        # flops, V read once and contiguously), then keep each head's own slice.
        full = torch.bmm(p.view(batch, num_q_heads, padded), v)            # [B, Hq, Hkv * D]
        o = full.view(batch, num_kv_heads, group, num_kv_heads, head_dim).diagonal(dim1=1, dim2=3)
        return o.permute(0, 3, 1, 2).reshape(batch, num_q_heads, head_dim).float()
    vt = v.view(batch, padded, num_kv_heads, head_dim).transpose(1, 2)    # [B, Hkv, L, D]
    return torch.matmul(p, vt).reshape(batch, num_q_heads, head_dim).float()


# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------

# The batch size and the block table's width change from step to step, and Triton compiles a
# variant for each kind of int it sees (1, a multiple of 16, other): specialised on them, a
# server would compile while requests wait (LLMEngine.warm_up compiles the rest at load).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    scale, num_seqs, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,   # query heads sharing one KV head
    BLOCK_SIZE: tl.constexpr,       # KV cache block size (any value; 16 and 32 in practice)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,         # next power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr,          # rows of the Q tile = BLOCK_Q tokens x QUERIES_PER_KV heads
    BLOCK_Q: tl.constexpr,          # query tokens per program
    TILE_N: tl.constexpr,           # keys per inner iteration
    DOT_PRECISION: tl.constexpr,    # "ieee" for float32 (exact), "tf32" otherwise (ignored for 16-bit)
    QUANTIZED: tl.constexpr,        # int8/fp8 K/V rows times their scales (kv_store.QuantizedKV)
    WINDOWED: tl.constexpr,         # each query sees its last `window` keys only
    SOFTCAP: tl.constexpr,          # scores become tanh(s / softcap) * softcap
):
    """One program = BLOCK_Q consecutive query tokens of one sequence x one KV head.

    The Q tile stacks the QUERIES_PER_KV query heads of that KV head for each token
    (row r = token r // QPK, head r % QPK), so each K/V tile is loaded once per head group.
    Keys are walked TILE_N at a time through the block table with an online softmax.
    Programs are numbered so that sequence s owns tiles [cu_q[s] // BLOCK_Q + s, ...): the
    grid size (num_tokens // BLOCK_Q + num_seqs) depends on shapes only, never on data.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Binary search for the sequence that owns this tile: the last s with start(s) <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q   # first query of the tile, in-sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = cached + q_idx                                     # absolute position of each row
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_DIM

    q_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Keys this tile needs: [0, cached + last query of the tile]. None if the tile is empty.
    kv_len = cached + tl.minimum(first_q + BLOCK_Q, q_len)
    num_tiles = tl.where(first_q < q_len, tl.cdiv(kv_len, TILE_N), 0)
    # With a window, the tiles before the first query's window are skipped.
    first_tile = 0
    if WINDOWED:
        first_tile = tl.maximum(cached + first_q - window + 1, 0) // TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    n = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(first_tile, num_tiles):
        k_pos = t * TILE_N + n
        k_valid = k_pos < kv_len
        blk = tl.load(table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        in_blk = k_pos % BLOCK_SIZE
        k_off = blk[None, :] * stride_kb + in_blk[None, :] * stride_ks + kv_head * stride_kh + d[:, None]
        kt = tl.load(k_cache_ptr + k_off, mask=d_valid[:, None] & k_valid[None, :], other=0.0)
        if QUANTIZED:
            k_scale = tl.load(k_scale_ptr + blk * stride_ksb + in_blk * stride_kss + kv_head, mask=k_valid, other=0.0)
            kt = (kt.to(tl.float32) * k_scale[None, :]).to(q.dtype)

        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale          # [BLOCK_M, TILE_N]
        if SOFTCAP:
            s = (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)) * softcap   # tanh(s / softcap) * softcap
        # Causal (which also bounds by kv_len for real rows). Without a window key 0 is
        # visible to every row, so the running max is finite from the first tile on.
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if WINDOWED:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if WINDOWED:
            # A row may have seen none of its keys yet: subtract 0 there, not -inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = blk[:, None] * stride_vb + in_blk[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        if QUANTIZED:
            v_scale = tl.load(v_scale_ptr + blk * stride_vsb + in_blk * stride_vss + kv_head, mask=k_valid, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)   # empty tiles store nothing; avoid 0/0 there
    acc = acc / l_i[:, None]
    o_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def attention_config(queries_per_kv: int, head_dim: int, element_size: int, max_seqlen_q: int) -> dict:
    """Tile shapes for `_paged_attention_kernel` (shape-only, so CUDA graphs can capture it).

    Decode-heavy batches get 16-row Q tiles (the minimum for tensor-core dots; a decode
    fills QUERIES_PER_KV rows), batches with long chunks 64-row tiles so each K/V tile is
    reused by more queries. 16-bit K/V tiles are 64 keys, float32 ones 32 (shared memory).
    """
    block_m = max(64 if max_seqlen_q > 16 else 16, next_power_of_2(queries_per_kv))
    head_pad = max(16, next_power_of_2(head_dim))
    return dict(
        QUERIES_PER_KV=queries_per_kv, HEAD_PAD=head_pad, BLOCK_M=block_m,
        BLOCK_Q=block_m // queries_per_kv,
        TILE_N=64 if element_size <= 2 and head_pad <= 128 else 32,
        DOT_PRECISION=dot_precision(element_size),
        num_warps=4,
    )


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, scale: float,
                           max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """Triton version of `paged_attention_reference`; launches one kernel, never syncs."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    assert kv_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized:
        k_scale, v_scale = k_cache.scale, v_cache.scale
        k_cache, v_cache = k_cache.data, v_cache.data
    else:
        assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
        k_scale = v_scale = k_cache  # not read
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpk = num_q_heads // num_kv_heads
    if max_seqlen_q is None:
        max_seqlen_q = 64 if num_tokens >= 4 * num_seqs else 1   # a guess from shapes; no sync
    config = attention_config(qpk, head_dim, query.element_size(), max_seqlen_q)
    grid = (num_tokens // config["BLOCK_Q"] + num_seqs, num_kv_heads)
    launch(
        _paged_attention_kernel, grid,
        query, k_cache, v_cache, k_scale, v_scale, out, block_tables, seq_lens, cu_seqlens_q,
        float(scale), num_seqs, int(window), float(softcap),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, QUANTIZED=quantized, WINDOWED=window > 0, SOFTCAP=softcap > 0,
        **config,
    )
    return out
