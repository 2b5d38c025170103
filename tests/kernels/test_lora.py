"""Multi-LoRA SGMV (kernels/lora.py): the reference, the CPU path and the Triton kernel (run by
Triton's interpreter on CPU) against a naive per-token loop, on mixed segments of several
adapters, ranks 8/16/64, and tokens of no adapter between them."""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import kernels
from kernels import lora_delta_cpu, lora_delta_reference, lora_delta_triton, pack_linear_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}
# (first token, last token + 1, adapter): gaps between segments are tokens of no adapter;
# adapter 1 has two segments, and one segment is a single token (a decode).
SEGMENTS = [(3, 10, 1), (10, 11, 0), (15, 40, 2), (40, 41, 1), (44, 45, 2)]
NUM_TOKENS = 47


def _problem(ranks, slice_sizes, k=96, dtype=torch.float32, seed=0):
    """Per adapter weights of its own rank, and the same zero-padded into the stacked layout."""
    g = torch.Generator().manual_seed(seed)
    max_rank, num_slices = max(ranks), len(slice_sizes)
    lora_a = torch.zeros(len(ranks), num_slices * max_rank, k)
    lora_b = [torch.zeros(len(ranks), n, max_rank) for n in slice_sizes]
    own = []  # per adapter, per slice: (A [r, k], B [n, r])
    for a, r in enumerate(ranks):
        per_slice = []
        for s, n in enumerate(slice_sizes):
            wa = torch.randn(r, k, generator=g) / k**0.5
            wb = torch.randn(n, r, generator=g) / r**0.5
            lora_a[a, s * max_rank:s * max_rank + r] = wa
            lora_b[s][a, :, :r] = wb
            per_slice.append((wa.to(dtype), wb.to(dtype)))
        own.append(per_slice)
    x = torch.randn(NUM_TOKENS, k, generator=g).to(dtype)
    y = torch.randn(NUM_TOKENS, sum(slice_sizes), generator=g).to(dtype)
    bounds = [(start, end) for start, end, _ in SEGMENTS]
    seg_adapter = [a for _, _, a in SEGMENTS]
    return x, y, lora_a.to(dtype), [b.to(dtype) for b in lora_b], own, bounds, seg_adapter


def _naive(x, y, own, slice_sizes, bounds, seg_adapter):
    out = y.clone().double()
    offsets = [sum(slice_sizes[:s]) for s in range(len(slice_sizes))]
    for (start, end), a in zip(bounds, seg_adapter):
        for t in range(start, end):
            for s, (wa, wb) in enumerate(own[a]):
                out[t, offsets[s]:offsets[s] + slice_sizes[s]] += wb.double() @ (wa.double() @ x[t].double())
    return out


def _segments(x, bounds, seg_adapter):
    """Lay the segments out as the engine does: contiguous, in one CSR. Tokens outside every
    segment are moved to the end, where no segment covers them."""
    order = [t for start, end in bounds for t in range(start, end)]
    rest = [t for t in range(x.shape[0]) if t not in set(order)]
    perm = torch.tensor(order + rest)
    indptr = [0]
    for start, end in bounds:
        indptr.append(indptr[-1] + end - start)
    return perm, torch.tensor(indptr, dtype=torch.int32), torch.tensor(seg_adapter, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ranks", [(8, 8, 8), (16, 8, 16), (64, 16, 8)], ids=["r8", "r16", "r64"])
@pytest.mark.parametrize("slice_sizes", [(64, 32, 32), (80,)], ids=["qkv", "single"])
def test_lora_delta_matches_a_naive_loop(dtype, ranks, slice_sizes):
    x, y, lora_a, lora_b, own, bounds, seg_adapter = _problem(ranks, slice_sizes, dtype=dtype)
    perm, indptr, adapters = _segments(x, bounds, seg_adapter)
    x, y = x[perm].contiguous(), y[perm].contiguous()
    want = _naive(x, y, own, slice_sizes, [(int(indptr[i]), int(indptr[i + 1])) for i in range(len(bounds))],
                  seg_adapter)
    offsets = [sum(slice_sizes[:s]) for s in range(len(slice_sizes))]
    covered = int(indptr[-1])
    fns = {"triton": lora_delta_triton}
    if dtype == torch.float32:  # the CPU paths run the engine's float types; fp16 only on the GPU
        fns.update(reference=lora_delta_reference, cpu=lora_delta_cpu)
    for name, fn in fns.items():
        out = y.clone()
        fn(x, out, lora_a, lora_b, offsets, indptr, adapters)
        torch.testing.assert_close(out.double(), want, **TOL[dtype], msg=lambda m: f"{name}: {m}")
        assert torch.equal(out[covered:], y[covered:]), f"{name} changed tokens of no adapter"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lora_delta_cpu_packed_is_batch_invariant(dtype):
    """Through the panel GEMM (the default path for the dtype), a token's delta is the same
    bits whatever segment it is in."""
    ranks, slice_sizes = (16, 8, 64), (64, 32, 32)
    x, y, lora_a, lora_b, _, bounds, seg_adapter = _problem(ranks, slice_sizes, dtype=dtype)
    offsets = [0, 64, 96]
    rank = lora_a.shape[1] // 3
    packed = [(pack_linear_weight(lora_a[a]), [pack_linear_weight(b[a]) for b in lora_b]) for a in range(3)]
    if packed[0][0] is None:
        pytest.skip("no packed CPU GEMM on this machine")
    whole = y.clone()
    kernels.lora_delta(x, whole, lora_a, lora_b, offsets, torch.tensor([0, 30], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32), packed)
    for t in (0, 7, 29):
        alone = y[t:t + 1].clone()
        kernels.lora_delta(x[t:t + 1], alone, lora_a, lora_b, offsets, torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([2], dtype=torch.int32), packed)
        assert torch.equal(alone[0], whole[t])
    plain = y.clone()
    lora_delta_reference(x, plain, lora_a, lora_b, offsets, torch.tensor([0, 30], dtype=torch.int32),
                         torch.tensor([2], dtype=torch.int32))
    torch.testing.assert_close(whole, plain, **TOL[dtype])
    assert rank == 64


def test_lora_delta_triton_runs_in_the_interpreter(monkeypatch):
    from triton.runtime import interpreter

    launches = []
    original = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting)
    x, y, lora_a, lora_b, _, bounds, seg_adapter = _problem((8, 8, 8), (64, 32, 32))
    lora_delta_triton(x, y, lora_a, lora_b, [0, 64, 96], torch.tensor([0, 4, 9], dtype=torch.int32),
                      torch.tensor([1, 0], dtype=torch.int32))
    assert launches == ["_lora_shrink_kernel"] + ["_lora_expand_kernel"] * 3
