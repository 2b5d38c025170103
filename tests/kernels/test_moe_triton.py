"""The grouped mixture-of-experts kernel (kernels/moe.py), run on CPU by Triton's interpreter in
float32: against the per-expert torch reference, for batches that leave experts empty, give one
expert many tiles, and route one token twice over the same tile edge; a token's result the
same bits alone and in a busy batch where its rows keep their place in a tile; the alignment's
bookkeeping."""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels.moe import BLOCK_M, _align, moe_experts_reference, moe_experts_triton

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I = 6, 40, 24  # H, I off the block sizes


def _experts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


def _routing(tokens: int, top_k: int, seed: int, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    if skew:
        logits[:, 2] += 4.0  # expert 2 gets nearly every token: several tiles of one expert
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return chosen, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("tokens, top_k, skew", [(1, 2, False), (5, 2, False), (37, 2, True), (23, 3, False)])
def test_grouped_kernel_matches_the_per_expert_reference(tokens, top_k, skew):
    gate_up, down = _experts()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    chosen, weights = _routing(tokens, top_k, seed=2, skew=skew)
    got = moe_experts_triton(x, chosen, weights, gate_up, down)
    want = moe_experts_reference(x, chosen, weights, gate_up, down)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_tokens_rows_get_the_same_bits_wherever_they_sort():
    """A token's assignments land in other tiles and other rows of them in a busy batch than
    alone; each of its rows still reduces over K in the same BLOCK_K order. (Here tl.dot is
    numpy's float32 matmul, whose bits may depend on a row's place in the tile, so the check is
    where the place is the same; on a GPU, test_kernels_cuda.py checks whole tokens.)"""
    gate_up, down = _experts(3)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    chosen, weights = _routing(40, 2, seed=5, skew=True)
    busy = moe_experts_triton(x, chosen, weights, gate_up, down)
    _, _, position = _align(chosen, E)
    same_place = [t for t in range(40) if all(int(position[t, s]) % BLOCK_M == 0 for s in range(2))]
    assert same_place  # the first row of their experts' tiles, as a token alone is
    for t in same_place:
        alone = moe_experts_triton(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], busy[t])


def test_align_sorts_by_expert_into_whole_tiles():
    chosen = torch.tensor([[3, 0], [0, 5], [3, 5], [0, 3]])
    rows, tile_expert, position = _align(chosen, E)
    assert rows.numel() % BLOCK_M == 0 and rows.numel() == BLOCK_M * tile_expert.numel()
    assert tile_expert.tolist() == [0, 3, 5]  # empty experts get no tile
    for t in range(4):
        for s in range(2):
            r = int(position[t, s])
            assert int(rows[r]) == t and int(tile_expert[r // BLOCK_M]) == int(chosen[t, s])
    assert int((rows >= 0).sum()) == chosen.numel()
