"""The sampler's running sums and top-p nucleus (kernels/sampling.py, kernels/cpu/sampling.cpp).
The sums are torch.cumsum's bits, which the inverse-CDF draw's token depends on."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kernels import cpu_ext, cumsum_rows, cumsum_rows_cpu, keep_nucleus_cpu, keep_nucleus_reference
from kernels.cpu_ext import Isa

needs_avx512 = pytest.mark.skipif(cpu_ext.load() is None or cpu_ext.isa() < Isa.AVX512,
                                  reason="the C++ running sums need AVX-512 (elsewhere torch.cumsum runs)")


def _rows(rows: int, n: int, seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "probs":  # what the sampler sums: a softmax, with masked tokens at zero
        x = torch.softmax(torch.randn(rows, n, generator=gen) * 4, -1)
        return x * (torch.rand(rows, n, generator=gen) > 0.3)
    if kind == "wide":  # magnitudes 2^-40..2^40: float32 partial sums round differently from double's
        return torch.rand(rows, n, generator=gen) * 2.0 ** torch.randint(-40, 41, (rows, n), generator=gen).float()
    return torch.full((rows, n), 1e-42)  # subnormal


@needs_avx512
@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 35), n=st.integers(1, 70), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["probs", "wide", "subnormal"]))
def test_cpu_running_sums_are_torch_cumsum_bit_for_bit(rows, n, seed, kind):
    # Every tail: rows past a group of 8, columns past a tile of 8, a row or a column alone.
    x = _rows(rows, n, seed, kind)
    out = torch.full_like(x, float("nan"))
    assert cumsum_rows_cpu(x, out) is out
    assert torch.equal(out, torch.cumsum(x, -1))


@needs_avx512
def test_a_vocabulary_wide_batch_sums_as_torch_does():
    x = _rows(33, 49157, 0, "probs")
    assert torch.equal(cumsum_rows(x, torch.empty_like(x)), torch.cumsum(x, -1))
    # A float32 accumulator would be off by now: the kernel must sum in double, as torch does.
    assert not torch.equal(torch.cumsum(x, -1), torch.from_numpy(x.numpy().cumsum(-1)))


def test_what_the_kernel_cannot_take_goes_to_torch():
    x = _rows(9, 40, 1, "probs")
    for strided in (x.t().contiguous().t(), x[:, ::2]):
        out = torch.empty(strided.shape)
        assert torch.equal(cumsum_rows(strided, out), torch.cumsum(strided, -1))
    doubles = x.double()
    assert torch.equal(cumsum_rows(doubles, torch.empty_like(doubles)), torch.cumsum(doubles, -1))


def test_capped_below_avx512_the_sums_are_torch_own():
    # In a process of its own: cpu_ext.isa() is decided once per process.
    code = ("import torch\nfrom unittest import mock\nfrom kernels import cpu_ext, cumsum_rows\n"
            "x = torch.rand(16, 64)\n"
            "module = cpu_ext.load()\n"
            "with mock.patch.object(cpu_ext, 'load', return_value=mock.Mock(wraps=module)) as load:\n"
            "    out = cumsum_rows(x, torch.empty_like(x))\n"
            "    assert not load.return_value.cumsum_rows.called\n"
            "assert torch.equal(out, torch.cumsum(x, -1))\n"
            "print(cpu_ext.isa().name)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "INFLIGHT_CPU_ISA": "avx2"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in ("AVX2", "NONE")


# --- top-p's nucleus (keep_nucleus_): bucketed sums in C++, a sort in the reference ---

needs_module = pytest.mark.skipif(cpu_ext.load() is None, reason="the C++ kernels could not be built here")


def _nucleus_rows(rows: int, n: int, seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "peaked":  # a model sure of itself: a few tokens hold most of the mass
        return torch.softmax(torch.randn(rows, n, generator=gen) * 8, -1)
    if kind == "flat":  # a random prompt at temperature 1: the nucleus is thousands of tokens
        return torch.softmax(torch.randn(rows, n, generator=gen), -1)
    if kind == "masked":  # top-k or a grammar left zeros
        keep = torch.rand(rows, n, generator=gen) > 0.5
        keep[:, 0] = True  # as top-k and grammars always leave a token
        x = torch.softmax(torch.randn(rows, n, generator=gen) * 3, -1) * keep
        return x / x.sum(-1, keepdim=True)
    # Ties: powers of two, whose sums are exact in any order.
    return 2.0 ** -torch.randint(1, 6, (rows, n), generator=gen).float()


@needs_module
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 3000), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["peaked", "flat", "masked", "ties"]),
       top_p=st.sampled_from([0.0, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999999, 1.0]))
def test_cpu_nucleus_is_the_reference_nucleus(rows, n, seed, kind, top_p):
    # The C++ path sorts only the bucket where the cut falls (split again past 256 members);
    # n up to 3000 puts thousands of flat probabilities into one bucket.
    probs = _nucleus_rows(rows, n, seed, kind)
    p = torch.full((rows,), top_p, dtype=torch.float64)
    expected = keep_nucleus_reference(probs.clone(), p)
    got = probs.clone()
    assert keep_nucleus_cpu(got, p).data_ptr() == got.data_ptr()  # in place
    assert torch.equal(got, expected)


@needs_module
def test_nucleus_of_a_vocabulary_wide_batch():
    probs = _nucleus_rows(32, 49152, 7, "flat")
    p = torch.linspace(0.05, 1.0, 32, dtype=torch.float64)
    got = keep_nucleus_cpu(probs.clone(), p)
    assert torch.equal(got, keep_nucleus_reference(probs.clone(), p))
    kept = (got > 0).sum(-1)
    assert kept[-1] == 49152 and bool((kept[:-1] < 49152).all()) and bool((kept.diff() >= 0).all())


def test_the_nucleus_is_the_smallest_set_whose_mass_reaches_top_p():
    probs = torch.tensor([[0.5, 0.125, 0.125, 0.25, 0.0]] * 6)
    p = torch.tensor([0.3, 0.5, 0.6, 0.75, 0.8, 1.0], dtype=torch.float64)
    for keep in (keep_nucleus_reference, keep_nucleus_cpu):
        got = keep(probs.clone(), p)
        assert got.tolist() == [
            [0.5, 0, 0, 0, 0],               # 0.5 alone reaches 0.3
            [0.5, 0, 0, 0, 0],               # and 0.5
            [0.5, 0, 0, 0.25, 0],            # 0.6 needs the 0.25
            [0.5, 0, 0, 0.25, 0],            # 0.75 is reached before the tied 0.125s
            [0.5, 0.125, 0.125, 0.25, 0],    # 0.8 takes both tied 0.125s, never one of them
            [0.5, 0.125, 0.125, 0.25, 0.0],  # 1: no top-p
        ], keep


def test_without_the_module_the_nucleus_is_the_reference():
    # In a process of its own: cpu_ext.isa() is decided once per process.
    code = ("import torch\nfrom unittest import mock\n"
            "from kernels import keep_nucleus_cpu, keep_nucleus_reference, cpu_ext\n"
            "assert cpu_ext.isa() == cpu_ext.Isa.NONE\n"
            "x = torch.softmax(torch.randn(4, 1000), -1); p = torch.full((4,), 0.9, dtype=torch.float64)\n"
            "module = cpu_ext.load()\n"
            "with mock.patch.object(cpu_ext, 'load', return_value=mock.Mock(wraps=module)) as load:\n"
            "    got = keep_nucleus_cpu(x.clone(), p)\n"
            "    assert not load.return_value.keep_nucleus_.called\n"
            "assert torch.equal(got, keep_nucleus_reference(x.clone(), p))")
    env = dict(os.environ, INFLIGHT_CPU_ISA="none")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
