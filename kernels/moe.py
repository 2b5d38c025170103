"""Mixture-of-experts MLP on GPUs: the experts' GEMMs grouped by expert over the whole ragged
batch, two Triton launches (gate|up, then down) whatever the number of experts.

The step's (token, slot) assignments are sorted by expert, each expert's run padded to a
multiple of BLOCK_M rows (`_align`), so that every row tile belongs to one expert; a tile
gathers its tokens' rows of x, multiplies them by its expert's weight, and writes its rows of
the sorted output. SiLU-and-mul runs on the sorted rows between the two GEMMs; each token's
outputs are then scaled by its routing weights and summed in ascending expert order, as the
CPU path and transformers sum them.

    moe_experts_reference(x, chosen, weights, gate_up, down)   per expert, torch matmuls
    moe_experts_triton(x, chosen, weights, gate_up, down)      the grouped kernel

    x        [T, H]           the layer's normed hidden states
    chosen   int64 [T, k]     each token's experts (the router's top-k)
    weights  [T, k]           their routing weights (float32, or x's dtype)
    gate_up  [E, 2I, H]       every expert's fused gate|up weight
    down     [E, H, I]        every expert's down weight

Every row of a tile reduces over K in the same BLOCK_K order whatever tile it lands in, so a
token's result does not depend on what else the batch routes to its experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_reference, silu_and_mul_triton
from .triton_utils import dot_precision, launch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def moe_experts_reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in torch.unique(chosen).tolist():
        tokens, slot = torch.where(chosen == expert)
        y = silu_and_mul_reference(x[tokens] @ gate_up[expert].T) @ down[expert].T
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, N, K,
                         stride_xm, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """out[r] = x[rows[r]] @ w[expert of r's tile].T for the tile's rows r; rows < 0 are padding."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + r)
    row_ok = rows >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(xs, w, input_precision=DOT_PRECISION)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _align(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, tile_expert, position): the assignments sorted by expert (stable), each expert's
    run padded to whole tiles. rows[r] is the token of sorted row r (-1: padding); tile_expert[t]
    the expert of tile t; position[token, slot] the sorted row of that assignment."""
    tokens, top_k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - first[sorted_experts]
    sorted_row = starts[sorted_experts] + rank
    total = int(padded.sum())
    rows = torch.full((total,), -1, dtype=torch.int64, device=flat.device)
    rows[sorted_row] = order // top_k
    position = torch.empty_like(flat)
    position[order] = sorted_row
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // BLOCK_M)
    return rows, tile_expert.to(torch.int32), position.view(tokens, top_k)


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, tile_expert: torch.Tensor) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((rows.numel(), n), dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    launch(_grouped_gemm_kernel, grid, x, w, out, rows, tile_expert, n, k, x.stride(0), w.stride(0), w.stride(1),
           out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
           DOT_PRECISION=dot_precision(x.element_size()), num_warps=4)
    return out


def moe_experts_triton(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    rows, tile_expert, position = _align(chosen, gate_up.shape[0])
    hidden = silu_and_mul_triton(_grouped_gemm(x, gate_up, rows, tile_expert))
    # The down GEMM reads the sorted rows themselves (padding rows stay padding).
    sorted_rows = torch.where(rows >= 0, torch.arange(rows.numel(), device=rows.device), rows)
    y = _grouped_gemm(hidden, down, sorted_rows, tile_expert)
    # Per token, its slots in ascending expert order: the same sum as the per-expert loop.
    by_expert = torch.sort(chosen, dim=-1, stable=True)
    scaled = y[position.gather(1, by_expert.indices)] * weights.gather(1, by_expert.indices)[..., None]
    out = torch.zeros_like(x)
    for slot in range(chosen.shape[1]):
        out += scaled[:, slot].to(x.dtype)
    return out
