"""kernels.linear: prepacked CPU weights give F.linear's results, for every shape the
model feeds them, and packing is skipped where it does not apply."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from backend.models.llama import Linear

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def pack_any_size(monkeypatch):
    """Packing of the small weights these tests use, which the size rule would leave as they are.
    (sys.modules: the package exports a function under the module's name `linear`.)"""
    monkeypatch.setattr(sys.modules["kernels.linear"], "_MIN_PACKED_ELEMENTS", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(pack_any_size, dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    packed = kernels.pack_linear_weight(weight)
    assert packed is not None, "this CPU build of torch packs float32 and bfloat16 (oneDNN)"
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = kernels.linear(x, weight, b, packed)
    assert got.dtype == dtype and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_takes_batched_and_strided_inputs(pack_any_size, dtype):
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


def test_small_float32_weights_stay_unpacked_large_ones_and_bf16_upcasts_are_packed(monkeypatch):
    module = sys.modules["kernels.linear"]
    small, large = torch.randn(128, 512), torch.randn(512, 512)
    assert small.numel() < module._MIN_PACKED_ELEMENTS <= large.numel()
    assert kernels.pack_linear_weight(small) is None
    assert kernels.pack_linear_weight(large) is not None
    # Without native bf16 the float32 upcast is the fast path at any size.
    monkeypatch.setattr(module, "_native_bf16", lambda: False)
    assert kernels.pack_linear_weight(small.bfloat16()).upcast
    monkeypatch.setattr(module, "_native_bf16", lambda: True)
    monkeypatch.setattr(module, "_onednn_usable", lambda: True)
    assert kernels.pack_linear_weight(small.bfloat16()) is None


def test_packed_module_drops_its_row_major_copy(pack_any_size):
    layer = Linear(64, 32, bias=True)
    x = torch.randn(5, 64)
    expected = layer(x)
    layer.pack()
    assert layer.packed is not None
    assert layer.weight.shape == (32, 64) and layer.weight.stride() == (0, 0)  # shape only, no data
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("library", ["onednn", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_without_native_bf16_packs_the_float32_upcast(monkeypatch, library, bias):
    # CPUs without AVX512-BF16 or AMX (AVX2-only EPYC, say): oneDNN refuses to pack bf16 there
    # and torch's bf16 GEMM is ~7x slower than float32, so the weight is packed as its exact
    # float32 upcast and the output rounded to bf16 once. (sys.modules: the package exports a
    # function under the module's name `linear`.)
    module = sys.modules["kernels.linear"]
    monkeypatch.setattr(module, "_native_bf16", lambda: False)
    monkeypatch.setattr(module, "_onednn_usable", lambda: library == "onednn")
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
    monkeypatch.setattr(sys.modules["kernels.linear"], "_onednn_usable", lambda: False)
    gen = torch.Generator().manual_seed(rows)
    weight, b, x = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 80, generator=gen)
    packed = kernels.pack_linear_weight(weight)
    assert (packed.kind, packed.upcast) == ("mkl", False)
    torch.testing.assert_close(kernels.linear(x, weight, b, packed), F.linear(x, weight, b), **TOLERANCE[torch.float32])


def test_packing_matches_the_cpu(pack_any_size):
    assert kernels.pack_linear_weight(torch.randn(8, 4)).kind == "onednn"
    packed = kernels.pack_linear_weight(torch.randn(8, 4).bfloat16())
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert (packed.kind, packed.upcast) == ("onednn", not native)
