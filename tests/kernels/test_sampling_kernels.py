"""The sampler's running sums (kernels/sampling.py, kernels/cpu/sampling.cpp): torch.cumsum's
bits, which the inverse-CDF draw's token depends on."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kernels import cpu_ext, cumsum_rows, cumsum_rows_cpu
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
