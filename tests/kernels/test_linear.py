"""kernels.linear: prepacked CPU weights give F.linear's results, for every shape the
model feeds them, in every layout this machine can pack (each path of our panel GEMM that
the CPU has, oneDNN, MKL), packing is skipped where it does not apply, and the panel GEMM
gives every row the same bits whatever else is in the batch."""

from __future__ import annotations

import os
import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import kernels
from backend.models.llama import Linear
from backend.paths import REPO_ROOT
from kernels import cpu_ext
from kernels.cpu_ext import Isa

# sys.modules: the package exports a function under the module's name `linear`.
LINEAR = sys.modules["kernels.linear"]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
PANEL_PATHS = [Isa.AVX2, Isa.AVX512, Isa.AVX512_BF16, Isa.AMX]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())


def needs(isa: Isa):
    """The path runs only where the CPU has its instructions (and the C++ kernels built): what
    the build has, not what INFLIGHT_CPU_ISA lets the engine use."""
    return pytest.mark.skipif(cpu_ext.built_isa() < isa, reason=f"this CPU (or build) has no {isa.name} path")


PANELS = [pytest.param(isa, marks=needs(isa), id=isa.name.lower()) for isa in PANEL_PATHS]


@pytest.fixture(params=PANELS + ["onednn"])
def layout(request, monkeypatch):
    """Pack with this panel path, or into oneDNN's layout at any size (its size rule would
    leave these small test weights as they are)."""
    monkeypatch.setattr(LINEAR, "_MIN_PACKED_ELEMENTS", 0)
    isa = Isa.NONE if request.param == "onednn" else request.param
    monkeypatch.setattr(cpu_ext, "isa", lambda: isa)
    return request.param


@pytest.fixture
def pack_any_size(monkeypatch):
    monkeypatch.setattr(LINEAR, "_MIN_PACKED_ELEMENTS", 0)


def expected_kind(layout, dtype) -> tuple[str, Isa, bool]:
    """(kind, isa, upcast) a weight of `dtype` gets under `layout`."""
    if layout == "onednn":
        return "onednn", Isa.NONE, dtype == torch.bfloat16 and not LINEAR._native_bf16()
    if dtype == torch.bfloat16 and layout >= Isa.AVX512_BF16:
        return "panels", layout, False
    return "panels", min(layout, Isa.AVX512), dtype == torch.bfloat16


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
    assert (packed.kind, packed.isa, packed.upcast) == expected_kind(layout, dtype)
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
    # The panel GEMM has no per-call setup to pay back: every weight, any size, on every path.
    monkeypatch.setattr(cpu_ext, "load", lambda: _RecordingPanels())
    for isa in PANEL_PATHS:
        monkeypatch.setattr(cpu_ext, "isa", lambda isa=isa: isa)
        packed = kernels.pack_linear_weight(small)
        assert (packed.kind, packed.isa, packed.upcast, packed.data.dtype) == \
            ("panels", min(isa, Isa.AVX512), False, torch.float32)
        packed_bf16 = kernels.pack_linear_weight(small.bfloat16())
        native = isa >= Isa.AVX512_BF16
        assert (packed_bf16.kind, packed_bf16.isa, packed_bf16.upcast, packed_bf16.data.dtype) == \
            ("panels", isa if native else min(isa, Isa.AVX512), not native,
             torch.bfloat16 if native else torch.float32)
        # Outside the batch-invariant mode only a bf16 weight on the tiles has a path beside them.
        fast = kernels.pack_linear_weight(small.bfloat16(), batch_invariant=False)
        assert (fast.isa, fast.vector_rows, fast.vector_isa) == (
            (Isa.AMX, LINEAR.BF16_ROWS_BESIDE_TILES, Isa.AVX512_BF16) if isa == Isa.AMX else
            (packed_bf16.isa, 0, Isa.NONE))
        assert kernels.pack_linear_weight(small, batch_invariant=False).vector_rows == 0
        assert packed_bf16.vector_rows == 0
    # A build whose tiles are a software model on an AVX2 CPU: float32 on the AVX2 path, and no
    # vdpbf16ps beside the tiles.
    monkeypatch.setattr(cpu_ext, "load", lambda: _RecordingPanels(Isa.AVX2))
    monkeypatch.setattr(cpu_ext, "isa", lambda: Isa.AMX)
    assert kernels.pack_linear_weight(small).isa == Isa.AVX2
    assert kernels.pack_linear_weight(small.bfloat16()).isa == Isa.AMX
    assert kernels.pack_linear_weight(small.bfloat16(), batch_invariant=False).vector_rows == 0
    monkeypatch.undo()
    # Without the panel GEMM, oneDNN packs only weights large enough to pay for its per-call setup.
    monkeypatch.setattr(cpu_ext, "isa", lambda: Isa.NONE)
    assert kernels.pack_linear_weight(small) is None
    assert kernels.pack_linear_weight(large).kind == "onednn"
    # Without native bf16 the float32 upcast is the fast path at any size.
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: False)
    assert kernels.pack_linear_weight(small.bfloat16()).upcast
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: True)
    monkeypatch.setattr(LINEAR, "_onednn_usable", lambda: True)
    assert kernels.pack_linear_weight(small.bfloat16()) is None


class _RecordingPanels:
    """Stands in for the C++ module where only the packing decision is under test: a build
    with every vector path below the tiles (`vector`), as on an AMX Xeon."""

    def __init__(self, vector: Isa = Isa.AVX512_BF16):
        self.vector = vector

    @staticmethod
    def pack_panels(weight, isa):
        return weight

    def gemm_vector_isa(self):
        return self.vector


def test_packed_module_drops_its_row_major_copy(layout):
    layer = Linear(64, 32, bias=True)
    x = torch.randn(5, 64)
    expected = layer(x)
    layer.pack()
    assert layer.packed is not None
    assert layer.weight.shape == (32, 64) and layer.weight.stride() == (0, 0)  # shape only, no data
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("library", [p for p in PANELS if p.values[0] < Isa.AVX512_BF16] + ["onednn", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_without_native_bf16_packs_the_float32_upcast(monkeypatch, library, bias):
    # CPUs without AVX512-BF16 or AMX (AVX2-only EPYC, say): oneDNN refuses to pack bf16 there
    # and torch's bf16 GEMM is ~7x slower than float32, so the weight is packed as its exact
    # float32 upcast and the output rounded to bf16 once.
    isa = library if isinstance(library, Isa) else Isa.NONE
    monkeypatch.setattr(cpu_ext, "isa", lambda: isa)
    monkeypatch.setattr(LINEAR, "_native_bf16", lambda: False)
    monkeypatch.setattr(LINEAR, "_onednn_usable", lambda: library == "onednn")
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, 17, 80, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(weight)
    assert (packed.kind, packed.upcast, packed.shape_only.dtype) == \
        ("panels" if isa else library, True, torch.bfloat16)
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
    monkeypatch.setattr(cpu_ext, "isa", lambda: Isa.NONE)
    gen = torch.Generator().manual_seed(rows)
    weight, b, x = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 80, generator=gen)
    packed = kernels.pack_linear_weight(weight)
    assert (packed.kind, packed.upcast) == ("mkl", False)
    torch.testing.assert_close(kernels.linear(x, weight, b, packed), F.linear(x, weight, b), **TOLERANCE[torch.float32])


def test_the_gemm_path_matches_the_cpu():
    """The build takes the best path the CPU's flags allow: no capability left unused."""
    assert cpu_ext.load() is not None, "kernels/cpu_ext.py could not build the C++ kernels (see its warning)"
    if os.environ.get("INFLIGHT_CPU_MARCH", "native") != "native":
        pytest.skip("a build for another machine (INFLIGHT_CPU_MARCH) has that machine's paths, not this CPU's")
    flags = _cpu_flags()
    if {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= flags:
        expected = Isa.AMX
    elif {"avx512_bf16", "avx512bw"} <= flags:
        expected = Isa.AVX512_BF16
    elif "avx512f" in flags:
        expected = Isa.AVX512
    elif {"avx2", "fma"} <= flags:
        expected = Isa.AVX2
    else:
        expected = Isa.NONE
    assert cpu_ext.built_isa() == expected
    # The engine runs the best of them, the tiles included where Linux lends them
    # (tests/kernels/test_amx_default.py checks the fallback where it does not).
    if expected == Isa.AMX and not cpu_ext.amx_permission():
        expected = Isa.AVX512_BF16
    assert cpu_ext.isa() == expected or os.environ.get("INFLIGHT_CPU_ISA")


@pytest.mark.parametrize("cap", ["avx2", "AVX512", "none", "amx"])
def test_inflight_cpu_isa_caps_the_path(cap):
    # In a process of its own: cpu_ext.isa() is decided once per process.
    run = subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; print(cpu_ext.isa().name)"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "INFLIGHT_CPU_ISA": cap})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == min(Isa[cap.upper()], cpu_ext.built_isa()).name


def test_an_unknown_inflight_cpu_isa_is_refused():
    run = subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; cpu_ext.isa()"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "INFLIGHT_CPU_ISA": "sse9"})
    assert run.returncode != 0 and "INFLIGHT_CPU_ISA='sse9'" in run.stderr and "avx512_bf16" in run.stderr


# ---- the panel GEMM itself (kernels/cpu/gemm.cpp), against a float64 product ------------

def _gemm(x, weight, bias, isa):
    module = cpu_ext.load()
    return module.panel_gemm(x, module.pack_panels(weight, isa), bias, weight.shape[0], isa)


def _assert_matches_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: Isa) -> None:
    got = _gemm(x, weight, bias, isa)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == x.dtype and got.shape == exact.shape
    # Rounding error of a float32 sum of K products: about sqrt(K) roundings of the size of
    # the terms' magnitudes (4x margin), plus, in bfloat16, the output's one rounding (half
    # an ulp: 2^-8 of the value). A misplaced row, column or k is off by a term's size.
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    bound = 4 * max(1, x.shape[1]) ** 0.5 * 2.0**-24 * magnitudes + 1e-30
    if x.dtype == torch.bfloat16:
        bound += 2.0**-8 * exact.abs()
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"worst error {(error / bound).max().item():.2f}x the bound"


def _dtype(isa: Isa) -> torch.dtype:
    return torch.bfloat16 if isa >= Isa.AVX512_BF16 else torch.float32


@pytest.mark.parametrize("isa", PANELS)
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), out_features=st.integers(1, 70), in_features=st.integers(1, 90),
       bias=st.booleans(), row_padding=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_panel_gemm_matches_float64_for_any_shape(isa, rows, out_features, in_features, bias, row_padding, seed):
    # Row and column tails of every tile shape, odd K (bf16 pairs k's), and rows strided past
    # their length (a column slice of a wider tensor), which the kernel reads in place.
    gen = torch.Generator().manual_seed(seed)
    dtype = _dtype(isa)
    x = torch.randn(rows, in_features + row_padding, generator=gen).to(dtype)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    _assert_matches_float64(x, weight, torch.randn(out_features, generator=gen).to(dtype) if bias else None, isa)


@pytest.mark.parametrize("isa", PANELS)
@pytest.mark.parametrize("rows,in_features", [(300, 128), (97, 4096), (1, 49152 // 16)])
def test_panel_gemm_splits_rows_into_blocks_and_work_over_threads(isa, rows, in_features):
    # Large enough for the parallel path; 4096 columns make a row block one tile high, so 97
    # rows are several blocks with a short last one.
    gen = torch.Generator().manual_seed(rows)
    dtype = _dtype(isa)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(200, in_features, generator=gen).to(dtype)
    _assert_matches_float64(x, weight, torch.randn(200, generator=gen).to(dtype), isa)


@pytest.mark.parametrize("isa", PANELS)
def test_panel_gemm_gives_a_row_the_same_bits_in_any_batch(isa):
    """Batch invariance: a row's output is the same alone, in any batch around it, at any
    position, with one thread or two."""
    gen = torch.Generator().manual_seed(3)
    dtype = _dtype(isa)
    weight = torch.randn(1000, 576, generator=gen).to(dtype)  # large enough for the parallel path
    bias = torch.randn(1000, generator=gen).to(dtype)
    module = cpu_ext.load()
    packed = module.pack_panels(weight, isa)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    full = module.panel_gemm(x, packed, bias, 1000, isa)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for first, count in [(7, 1), (0, 5), (13, 31), (100, 200), (299, 1)]:
                part = module.panel_gemm(x[first:first + count].clone(), packed, bias, 1000, isa)
                assert torch.equal(part, full[first:first + count]), (num_threads, first, count)
    finally:
        torch.set_num_threads(threads)


@needs(Isa.AVX512)
def test_avx2_and_avx512_float32_paths_give_the_same_bits():
    gen = torch.Generator().manual_seed(4)
    x, weight, bias = torch.randn(37, 333, generator=gen), torch.randn(70, 333, generator=gen), torch.randn(70, generator=gen)
    assert torch.equal(_gemm(x, weight, bias, Isa.AVX2), _gemm(x, weight, bias, Isa.AVX512))


@pytest.mark.parametrize("isa", PANELS)
def test_panel_gemm_refuses_mismatched_shapes(isa):
    module = cpu_ext.load()
    dtype = _dtype(isa)
    panels = module.pack_panels(torch.randn(40, 8).to(dtype), isa)
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        module.panel_gemm(torch.randn(2, 9).to(dtype), panels, None, 40, isa)
    with pytest.raises(RuntimeError, match="n does not match"):
        module.panel_gemm(torch.randn(2, 8).to(dtype), panels, None, 60, isa)
    with pytest.raises(RuntimeError, match="bias"):
        module.panel_gemm(torch.randn(2, 8).to(dtype), panels, torch.randn(39).to(dtype), 40, isa)
    with pytest.raises(RuntimeError, match="x"):
        module.panel_gemm(torch.randn(2, 8).to(torch.float16), panels, None, 40, isa)


def test_panel_gemm_refuses_a_path_this_machine_lacks():
    module = cpu_ext.load()
    with pytest.raises(RuntimeError, match="instruction set 5 is not built"):
        module.pack_panels(torch.randn(4, 4), 5)
    if cpu_ext.built_isa() < Isa.AMX:
        with pytest.raises(RuntimeError, match="instruction set 4 is not built"):
            module.pack_panels(torch.randn(16, 4).bfloat16(), Isa.AMX)
        # The path is checked before the panels are looked at, so that any tensor stands in for
        # them (a build without AVX512-BF16 packs no bf16 panels at all).
        with pytest.raises(RuntimeError, match="instruction set 4 is not built"):
            module.panel_gemm(torch.randn(2, 4).bfloat16(), torch.zeros(1, 2, 16, 2).bfloat16(), None, 16, Isa.AMX)


def _pytest_in_a_process_of_its_own(args: list[str], env: dict[str, str]) -> str:
    """Runs pytest on `args` with `env` (a kernel build of its own), asserts that it passed,
    and returns its summary line."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                         capture_output=True, text=True, timeout=1800, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(cpu_ext.isa() < Isa.AMX or cpu_ext.built_isa() < Isa.AMX, reason="no AMX tiles lent here")
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 40])
def test_outside_batch_invariance_a_bf16_weights_few_rows_run_beside_the_tiles(rows):
    """Packed with the engine's mode off, a bf16 weight's calls of at most BF16_ROWS_BESIDE_TILES rows
    run vdpbf16ps on the same panels, more rows the tiles; in the mode, every call the tiles. The
    weight and input are ones where the two paths' sums round apart, so the check tells them apart."""
    gen = torch.Generator().manual_seed(21)
    weight, bias = torch.randn(2048, 4096, generator=gen).bfloat16(), torch.randn(2048, generator=gen).bfloat16()
    x = torch.randn(rows, 4096, generator=gen).bfloat16()
    module = cpu_ext.load()
    fast = kernels.pack_linear_weight(weight, batch_invariant=False)
    invariant = kernels.pack_linear_weight(weight)
    assert torch.equal(fast.data, invariant.data)
    dots = module.panel_gemm(x, invariant.data, bias, 2048, int(Isa.AVX512_BF16))
    tiles = module.panel_gemm(x, invariant.data, bias, 2048, int(Isa.AMX))
    assert not torch.equal(dots, tiles)
    assert torch.equal(kernels.linear(x, invariant.shape_only, bias, invariant), tiles)
    expected = dots if rows <= LINEAR.BF16_ROWS_BESIDE_TILES else tiles
    assert torch.equal(kernels.linear(x, fast.shape_only, bias, fast), expected)
    # The fused decoder layer's projections follow the same rule.
    projection = kernels.decoder_layer._projection(module, fast, bias)
    assert (projection.vector_rows, projection.vector_isa) == (LINEAR.BF16_ROWS_BESIDE_TILES, int(Isa.AVX512_BF16))


@pytest.mark.slow
def test_the_tile_path_under_a_software_model_of_the_tiles():
    """On any CPU, the tile kernel runs on a software model of the tile instructions
    (INFLIGHT_CPU_AMX_EMULATE, kernels/cpu/amx.h), which refuses the shapes the hardware
    refuses: this file's panel GEMM tests of the AMX path (any shape, row blocks over threads,
    a row's bits in any batch, bad shapes refused), in a process of its own with that build.
    What the model cannot check is the instructions themselves; on an AMX CPU every AMX test
    here, the linear layers' included, runs on the hardware (`needs(Isa.AMX)` above)."""
    summary = _pytest_in_a_process_of_its_own([__file__, "-k", "panel_gemm and amx"],
                                              {**os.environ, "INFLIGHT_CPU_AMX_EMULATE": "1"})
    assert "skipped" not in summary and summary.startswith("6 passed"), summary


@pytest.mark.slow
def test_the_kernels_of_an_avx2_only_machine_pass_every_kernel_test():
    """What an AVX2-only CPU (the 2-core EPYC this project also runs on) builds and runs,
    checked on whatever CPU this is: the kernels compiled for any AVX2 CPU
    (INFLIGHT_CPU_MARCH=x86-64-v3: no AVX-512, so the code under `#if !__AVX512F__` compiles and
    runs) and torch on its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), against every test in
    tests/kernels, in a process of its own with that build (but the Triton kernels' compile for
    sm_90, which no CPU flag touches).

    On an AVX2-only CPU this run of tests/kernels already is that run (the native build has no
    AVX-512 and torch picks avx2), so the test checks that and does not run the suite twice."""
    if "avx512f" not in _cpu_flags():
        assert cpu_ext.built_isa() == Isa.AVX2 and torch.backends.cpu.get_cpu_capability() == "AVX2"
        return
    env = {**os.environ, "INFLIGHT_CPU_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop("INFLIGHT_CPU_ISA", None)
    probe = subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; print(cpu_ext.isa().name)"],
                           capture_output=True, text=True, timeout=1800, env=env, cwd=REPO_ROOT)
    assert probe.stdout.strip() == "AVX2", probe.stdout + probe.stderr[-2000:]
    summary = _pytest_in_a_process_of_its_own(
        [os.path.dirname(__file__), "-k", "not avx2_only_machine and not tile_path_under and not compile_for_gpu"], env)
    assert "passed" in summary and "failed" not in summary, summary
