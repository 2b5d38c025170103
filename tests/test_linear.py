"""kernels.linear: prepacked CPU weights give F.linear's results, for every shape the
model feeds them, in every layout this machine can pack (our panels, oneDNN, MKL), and
packing is skipped where it does not apply."""

from __future__ import annotations

import sys

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import kernels
from backend.models.llama import Linear
from kernels import cpu_ext

# sys.modules: the package exports a function under the module's name `linear`.
LINEAR = sys.modules["kernels.linear"]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The panel kernel where this machine has it (an AVX2 CPU with the C++ kernels built), and
# oneDNN's layout, which every CPU build of torch has.
LAYOUTS = (["panels"] if LINEAR._panels_usable() else []) + ["onednn"]


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    """Pack into this layout, at any size (the oneDNN size rule would leave these small
    test weights as they are)."""
    monkeypatch.setattr(LINEAR, "_MIN_PACKED_ELEMENTS", 0)
    if request.param != "panels":
        monkeypatch.setattr(LINEAR, "_panels_usable", lambda: False)
    return request.param


@pytest.fixture
def pack_any_size(monkeypatch):
    monkeypatch.setattr(LINEAR, "_MIN_PACKED_ELEMENTS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(layout, dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    assert packed is not None, "this CPU build of torch packs float32 and bfloat16 (oneDNN)"
    if dtype == torch.float32 or packed.upcast:
        assert packed.kind == layout
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = kernels.linear(x, weight, b, packed)
    assert got.dtype == dtype and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_takes_batched_and_strided_inputs(layout, dtype):
    weight = torch.randn(48, 32).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    x3 = torch.randn(2, 5, 32).to(dtype)
    torch.testing.assert_close(kernels.linear(x3, weight, None, packed).float(),
                               F.linear(x3.float(), weight.float()), **TOLERANCE[dtype])
    strided = torch.randn(7, 64).to(dtype)[:, ::2]  # a column slice, as split() makes
    torch.testing.assert_close(kernels.linear(strided, weight, None, packed).float(),
                               F.linear(strided.float(), weight.float()), **TOLERANCE[dtype])


def test_packing_is_skipped_where_it_does_not_apply():
    assert kernels.pack_linear_weight(torch.randn(8, 4).half()) is None
    assert kernels.pack_linear_weight(torch.randn(8, 4, 2)) is None
    x, weight = torch.randn(3, 4).half(), torch.randn(8, 4).half()
    torch.testing.assert_close(kernels.linear(x, weight), F.linear(x, weight))


def test_which_weights_are_packed_and_how(monkeypatch):
    small, large = torch.randn(128, 512), torch.randn(512, 512)
    assert small.numel() < LINEAR._MIN_PACKED_ELEMENTS <= large.numel()
    # The panel kernel has no per-call setup to pay back: every float32 weight, any size.
    monkeypatch.setattr(LINEAR, "_panels_usable", lambda: True)
    monkeypatch.setattr(cpu_ext, "load", lambda: _AlwaysPanels())
    assert kernels.pack_linear_weight(small).kind == "panels"
    native = LINEAR._native_bf16()
    packed_bf16 = kernels.pack_linear_weight(small.bfloat16())
    assert (packed_bf16.kind, packed_bf16.upcast) == ("onednn" if native else "panels", not native)
    monkeypatch.undo()
    # Without it, oneDNN packs only weights large enough to pay for its per-call setup.
    monkeypatch.setattr(LINEAR, "_panels_usable", lambda: False)
    assert kernels.pack_linear_weight(small) is None
    assert kernels.pack_linear_weight(large).kind == "onednn"
    # Without native bf16 the float32 upcast is the fast path at any size.
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: False)
    assert kernels.pack_linear_weight(small.bfloat16()).upcast
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: True)
    monkeypatch.setattr(LINEAR, "_onednn_usable", lambda: True)
    assert kernels.pack_linear_weight(small.bfloat16()) is None


class _AlwaysPanels:
    """Stands in for the C++ module where only the packing decision is under test."""

    @staticmethod
    def pack_panels(weight):
        return weight


def test_packed_module_drops_its_row_major_copy(layout):
    layer = Linear(64, 32, bias=True)
    x = torch.randn(5, 64)
    expected = layer(x)
    layer.pack()
    assert layer.packed is not None
    assert layer.weight.shape == (32, 64) and layer.weight.stride() == (0, 0)  # shape only, no data
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("library", LAYOUTS + ["mkl"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_without_native_bf16_packs_the_float32_upcast(monkeypatch, library, bias):
    # CPUs without AVX512-BF16 or AMX (AVX2-only EPYC, say): oneDNN refuses to pack bf16 there
    # and torch's bf16 GEMM is ~7x slower than float32, so the weight is packed as its exact
    # float32 upcast and the output rounded to bf16 once.
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: False)
    monkeypatch.setattr(LINEAR, "_onednn_usable", lambda: library == "onednn")
    if library != "panels":
        monkeypatch.setattr(LINEAR, "_panels_usable", lambda: False)
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, 17, 80, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(weight)
    assert (packed.kind, packed.upcast, packed.shape_only.dtype) == (library, True, torch.bfloat16)
    bias64 = None if b is None else b.double()

    def assert_rounded_once(got: torch.Tensor, rows: torch.Tensor) -> None:
        # One rounding to bf16 moves a value by at most half an ulp, 2^-8 of it; float32
        # accumulation adds ~1e-6 on top. (Against F.linear's float32 result rounded to bf16
        # the two can sit one ulp apart: their sums' order differs, and a sum that lands
        # beside a rounding boundary can round either way.)
        exact = F.linear(rows.double(), weight.double(), bias64)
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=2 ** -8)

    assert_rounded_once(kernels.linear(x, weight, b, packed), x)
    strided = torch.randn(7, 160, generator=gen).bfloat16()[:, ::2]
    assert_rounded_once(kernels.linear(strided, weight, b, packed), strided)


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_float32_falls_back_to_mkl_without_onednn(pack_any_size, monkeypatch, rows):
    monkeypatch.setattr(LINEAR, "_onednn_usable", lambda: False)
    monkeypatch.setattr(LINEAR, "_panels_usable", lambda: False)
    gen = torch.Generator().manual_seed(rows)
    weight, b, x = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 80, generator=gen)
    packed = kernels.pack_linear_weight(weight)
    assert (packed.kind, packed.upcast) == ("mkl", False)
    torch.testing.assert_close(kernels.linear(x, weight, b, packed), F.linear(x, weight, b), **TOLERANCE[torch.float32])


def test_packing_matches_the_cpu(pack_any_size):
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    module = cpu_ext.load()
    panels = avx2 and module is not None and module.panel_gemm_supported()
    if avx2 and module is not None:
        assert panels, "an AVX2 machine builds the panel kernel"
    assert kernels.pack_linear_weight(torch.randn(8, 4)).kind == ("panels" if panels else "onednn")
    packed = kernels.pack_linear_weight(torch.randn(8, 4).bfloat16())
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert (packed.kind, packed.upcast) == ("panels" if panels and not native else "onednn", not native)


# ---- the panel kernel itself (kernels/cpu/gemm.cpp), against a float64 product ----------

needs_panels = pytest.mark.skipif(not LINEAR._panels_usable(), reason="the panel kernel needs AVX2 and FMA")


def _assert_matches_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    module = cpu_ext.load()
    got = module.panel_gemm(x, module.pack_panels(weight), bias, weight.shape[0])
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == exact.shape
    # Rounding error of a float32 sum of K products: about sqrt(K) roundings of the size of
    # the terms' magnitudes (4x margin). A misplaced row, column or k is off by a term's size.
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    bound = 4 * max(1, x.shape[1]) ** 0.5 * 2.0**-24 * magnitudes + 1e-30
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"worst error {(error / bound).max().item():.2f}x the bound"


@needs_panels
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), out_features=st.integers(1, 70), in_features=st.integers(1, 90),
       bias=st.booleans(), row_padding=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_panel_gemm_matches_float64_for_any_shape(rows, out_features, in_features, bias, row_padding, seed):
    # Row and column tails of the 6 x 16 micro-tile, and rows strided past their length
    # (a column slice of a wider tensor), which the kernel reads in place.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features + row_padding, generator=gen)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen)
    _assert_matches_float64(x, weight, torch.randn(out_features, generator=gen) if bias else None)


@needs_panels
@pytest.mark.parametrize("rows,in_features", [(300, 128), (97, 4096), (1, 49152 // 16)])
def test_panel_gemm_splits_rows_into_blocks_and_work_over_threads(rows, in_features):
    # Large enough for the parallel path; 4096 columns make a row block 16 rows, so 97 rows
    # are seven blocks with a short last one.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(200, in_features, generator=gen)
    _assert_matches_float64(x, weight, torch.randn(200, generator=gen))


@needs_panels
def test_panel_gemm_refuses_mismatched_shapes():
    module = cpu_ext.load()
    panels = module.pack_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        module.panel_gemm(torch.randn(2, 9), panels, None, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        module.panel_gemm(torch.randn(2, 8), panels, None, 60)
    with pytest.raises(RuntimeError, match="float32 bias"):
        module.panel_gemm(torch.randn(2, 8), panels, torch.randn(39), 40)
