"""Multi-LoRA deltas over a ragged batch: SGMV (segmented gather matrix-vector), shrink then expand.

The tokens of one step are cut into segments, each a run of consecutive tokens that share
one adapter; tokens of no adapter are in no segment and get no delta. For a projection whose
output is a concatenation of slices (the fused q|k|v and gate|up projections), slice s of
the output columns, at `slice_offsets[s]`, gets its own adapter weights:

    buf = x[seg] @ lora_a[a].T                          shrink: [m, K] -> [m, S * R]
    y[seg, off_s : off_s + n_s] += buf[:, s*R:(s+1)*R] @ lora_b[s][a].T     expand, per slice

    lora_a      [num_adapters, S * R, K]  slice s's down-projection in rows s*R..(s+1)*R
    lora_b      S tensors [num_adapters, n_s, R], each with its scaling (alpha / r) folded in
    seg_indptr  int32 [G + 1]: segment g is tokens seg_indptr[g] .. seg_indptr[g + 1]
    seg_adapter int32 [G]: the adapter of each segment

R is the largest rank among the adapters; a smaller adapter's rows and columns past its
rank are zero, which adds exact zeros. `y` is updated in place.

    lora_delta_reference   per token: gather each token's adapter weights, batched matmul
    lora_delta_cpu         per segment: two matmuls, through the panel GEMM when packed
                           (kernels/linear.py), whose rows never depend on the segment's size
    lora_delta_triton      one shrink launch over all segments, one expand launch per slice
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .linear import PackedWeight, linear
from .triton_utils import dot_precision, launch, next_power_of_2


def lora_delta_reference(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                         slice_offsets: Sequence[int], seg_indptr: torch.Tensor, seg_adapter: torch.Tensor) -> None:
    bounds = seg_indptr.tolist()
    lengths = torch.tensor([e - s for s, e in zip(bounds, bounds[1:])], dtype=torch.int64)
    if not len(lengths) or int(lengths.sum()) == 0:
        return
    tokens = torch.cat([torch.arange(s, e) for s, e in zip(bounds, bounds[1:])]).to(x.device)
    adapter = torch.repeat_interleave(seg_adapter.to(torch.int64).cpu(), lengths).to(x.device)
    rank = lora_a.shape[1] // len(lora_b)
    buf = torch.bmm(lora_a[adapter], x[tokens].unsqueeze(-1)).squeeze(-1)  # [t, S * R]
    for s, (b, offset) in enumerate(zip(lora_b, slice_offsets)):
        delta = torch.bmm(b[adapter], buf[:, s * rank:(s + 1) * rank].unsqueeze(-1)).squeeze(-1)
        y[tokens, offset:offset + b.shape[1]] += delta


def lora_delta_cpu(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                   slice_offsets: Sequence[int], seg_indptr: torch.Tensor, seg_adapter: torch.Tensor,
                   packed: Sequence[tuple[PackedWeight | None, Sequence[PackedWeight | None]]] | None = None) -> None:
    """`packed[a]`: adapter a's (lora_a, [lora_b per slice]) packed by `pack_linear_weight`,
    or None: plain matmuls."""
    bounds = seg_indptr.tolist()
    rank = lora_a.shape[1] // len(lora_b)
    for start, end, a in zip(bounds, bounds[1:], seg_adapter.tolist()):
        if start == end:
            continue
        packed_a, packed_b = packed[a] if packed is not None else (None, [None] * len(lora_b))
        buf = linear(x[start:end], lora_a[a], None, packed_a)
        for s, (b, offset) in enumerate(zip(lora_b, slice_offsets)):
            y[start:end, offset:offset + b.shape[1]] += linear(buf[:, s * rank:(s + 1) * rank], b[a], None, packed_b[s])


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, buf_ptr, indptr_ptr, adapter_ptr, K, R,
                        stride_xm, stride_al, stride_ar, stride_bm,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    adapter = tl.load(adapter_ptr + seg).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < end
    col_ok = cols < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(a_ptr + adapter * stride_al + cols[None, :] * stride_ar + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(xs, w, input_precision=DOT_PRECISION)
    tl.store(buf_ptr + rows[:, None].to(tl.int64) * stride_bm + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _lora_expand_kernel(buf_ptr, b_ptr, y_ptr, indptr_ptr, adapter_ptr, N, R, buf_col, y_col,
                        stride_bm, stride_bl, stride_bn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    adapter = tl.load(adapter_ptr + seg).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_ok = rows < end
    col_ok = cols < N
    r_ok = rs < R
    buf = tl.load(buf_ptr + rows[:, None].to(tl.int64) * stride_bm + buf_col + rs[None, :],
                  mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    w = tl.load(b_ptr + adapter * stride_bl + cols[None, :] * stride_bn + rs[:, None],
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    delta = tl.dot(buf, w.to(tl.float32), input_precision=DOT_PRECISION)
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + y_col + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_delta_triton(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                      slice_offsets: Sequence[int], seg_indptr: torch.Tensor, seg_adapter: torch.Tensor,
                      max_seg_len: int | None = None) -> None:
    """Triton version of `lora_delta_reference`; the shrink accumulates in float32 into a
    float32 buffer, the expand adds to y in float32 and rounds once. `max_seg_len`: the
    longest segment (read from seg_indptr when not given). A float32 model's dots are IEEE
    float32, as its cuBLAS GEMMs and its attention; a 16-bit model's expand, whose operands
    are float32, takes TF32 (10 mantissa bits, more than the bfloat16 output keeps)."""
    num_segments = seg_adapter.shape[0]
    if num_segments == 0:
        return
    if max_seg_len is None:
        max_seg_len = int((seg_indptr[1:] - seg_indptr[:-1]).max())
    if max_seg_len == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and lora_a.stride(-1) == 1
    num_tokens, k = x.shape
    total_rank = lora_a.shape[1]
    rank = total_rank // len(lora_b)
    buf = torch.zeros((num_tokens, total_rank), dtype=torch.float32, device=x.device)
    block_m = 16
    block_r = max(16, min(64, next_power_of_2(total_rank)))
    precision = dot_precision(x.element_size())
    launch(_lora_shrink_kernel, (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(total_rank, block_r)),
           x, lora_a, buf, seg_indptr, seg_adapter, k, total_rank,
           x.stride(0), lora_a.stride(0), lora_a.stride(1), buf.stride(0),
           BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, DOT_PRECISION=precision, num_warps=4)
    block_rank = max(16, next_power_of_2(rank))
    for s, (b, offset) in enumerate(zip(lora_b, slice_offsets)):
        assert b.stride(-1) == 1
        n = b.shape[1]
        block_n = 64
        launch(_lora_expand_kernel, (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n)),
               buf, b, y, seg_indptr, seg_adapter, n, rank, s * rank, offset,
               buf.stride(0), b.stride(0), b.stride(1), y.stride(0),
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_rank, DOT_PRECISION=precision, num_warps=4)
