"""kernels/cpu/gemm_quant.cpp and its use in kernels.linear and the fused decoder layer: int8 and
int4 weights packed once and de-quantized in registers give the float32 panel GEMM's bits on the
de-quantized weight (QuantizedWeight.dequantize(): scale * q then + min, never fused), for every
group layout, shape tail and row count; a row's bits never depend on its batch; the AVX2,
AVX-512 and plain C++ paths agree; and a decoder layer with quantized projections runs as one
C++ call with the bits of the same layer on the de-quantized weights.

With bfloat16 activations on vdpbf16ps (isa AVX512_BF16, CPUs with AVX512-BF16) or the AMX tiles,
the result is instead gemm.cpp's bf16 GEMM of that isa on the de-quantized weight rounded to
bfloat16, `dequantize().bfloat16()`: what a bf16 model of the de-quantized weights computes. The
tile tests run on AMX hardware, and under the software model of the tiles on any CPU
(test_the_quantized_tile_path_under_a_software_model).

int8 and int4 against bfloat16 activations on vdpbf16ps (QUANT_BF16_DOTS, the bf16 dots: a bf16
model's every call in the batch-invariant mode where there are no tiles, and its calls of a few rows
outside the mode) applies each group's scale and min to its sums of x times the integers: bits
of its own, within the roundings of its sums of the exact product, and a row's bits still its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from backend.paths import REPO_ROOT
from kernels import cpu_ext
from kernels.cpu_ext import QUANT_BF16_DOTS, Isa
from kernels.quantized import QuantizedWeight, quantize
from kernels.testing import bf16_dots_rounding_excess, make_random_quantized_weight

LINEAR = sys.modules["kernels.linear"]
MODULE = cpu_ext.load()


def needs(isa: Isa):
    return pytest.mark.skipif(MODULE is None or MODULE.quant_gemm_isa() < isa,
                              reason=f"this CPU (or build) has no {isa.name} path")


VECTOR_PATHS = [pytest.param(isa, marks=needs(isa), id=isa.name.lower()) for isa in (Isa.AVX2, Isa.AVX512)]
# vdpbf16ps: its paths built, and the CPU has it.
HAS_BF16 = MODULE is not None and MODULE.quant_bf16_built() and cpu_ext.isa() >= Isa.AVX512_BF16
# The tiles: built (on the hardware, or as the software model) and lent to this process.
HAS_TILES = MODULE is not None and MODULE.quant_gemm_isa() >= Isa.AMX and cpu_ext.isa() >= Isa.AMX
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="no vdpbf16ps paths in this build, or no vdpbf16ps on this CPU")
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="no AMX tiles in this build, or the kernel refused them")
needs_bf16_or_tiles = pytest.mark.skipif(not (HAS_BF16 or HAS_TILES),
                                         reason="neither vdpbf16ps paths nor AMX tiles in this build and on this CPU")
pytestmark = pytest.mark.skipif(MODULE is None, reason="the C++ kernels could not be built here")

# (bits, group_size or None for one group per output channel, mins, float16-exact scales)
LAYOUTS = {
    "int8_per_channel": (8, None, False, False),
    "int8_g32_q8_0": (8, 32, False, True),
    "int8_g64_mins": (8, 64, True, False),
    "int4_g32_mins": (4, 32, True, False),
    "int4_g32_q4_1": (4, 32, True, True),
    "int4_g64_mins": (4, 64, True, False),
    "int4_g128_mins": (4, 128, True, False),
    "int4_g32_symmetric": (4, 32, False, False),
    "int4_g128_symmetric": (4, 128, False, True),
    "int4_g33_odd_group": (4, 33, True, False),
    "int4_per_channel": (4, None, True, False),
}


def make_weight(out_features: int, in_features: int, layout: str, seed: int) -> QuantizedWeight:
    """Random integers and group values in `layout`; where float16-exact, values float16 holds
    (GGUF's), so that the packing keeps them as float16."""
    bits, group, mins, half = LAYOUTS[layout]
    return make_random_quantized_weight(out_features, in_features, bits, group, mins, half,
                                        torch.Generator().manual_seed(seed))


def float_panel_gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, isa: Isa) -> torch.Tensor:
    """The float32 panel GEMM (kernels/cpu/gemm.cpp) on the de-quantized weight."""
    float_isa = max(Isa.AVX2, min(isa, Isa.AVX512))
    return MODULE.panel_gemm(x, MODULE.pack_panels(weight.dequantize(), float_isa), bias, weight.shape[0], float_isa)


def quant_gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, isa: Isa) -> torch.Tensor:
    packed = MODULE.pack_quant_panels(weight.q, weight.scales, weight.mins, weight.bits, weight.group_size, isa)
    return MODULE.quant_panel_gemm(x, packed[0], packed[1], packed[2] if len(packed) > 2 else None, bias,
                                   weight.shape[0], weight.bits, weight.group_size, isa)


BF16_DOTS_LAYOUTS = ["int8_per_channel", "int8_g32_q8_0", "int8_g64_mins", "int4_g32_mins", "int4_g32_q4_1",
                     "int4_g64_mins", "int4_g128_mins", "int4_g32_symmetric", "int4_g128_symmetric", "int4_per_channel"]


def test_dequantize_is_two_roundings():
    """The oracle itself: QuantizedWeight.dequantize() rounds the product and then the sum,
    which a fused multiply-add would not (some of these weights differ from the fused value)."""
    weight = make_weight(64, 200, "int4_g32_mins", 0)
    scale = weight.scales.repeat_interleave(32, dim=1)[:, :200].double()
    low = weight.mins.repeat_interleave(32, dim=1)[:, :200].double()
    product = (scale * weight.q.double()).float().double()
    two_roundings = (product + low).float()
    fused = (scale * weight.q.double() + low).float()
    assert torch.equal(weight.dequantize(), two_roundings)
    assert not torch.equal(two_roundings, fused), "no weight here tells the two apart"


def test_quantize_keeps_group_values_float16_where_they_fit():
    """The load-time quantizer's groups store float16 scales and mins (half the bytes once packed)
    and choose the codes against those; a weight whose values float16 cannot hold keeps float32,
    and one scale per output channel stays float32 as computed."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 300, generator=gen) * 0.02
    w[5, :128] = 0.25  # a group of one value that float16 holds comes back exactly
    for bits, group in ((4, 128), (4, 32), (8, 32)):
        weight = quantize(w, bits, group)
        for values in (weight.scales, weight.mins):
            if values is not None:
                assert torch.equal(values.half().float(), values)
        step = weight.scales.repeat_interleave(group, dim=1)[:, :300]
        assert ((weight.dequantize() - w).abs() <= step * 0.5001 + 1e-7).all()
    assert torch.equal(quantize(w, 4, 128).dequantize()[5, :128], w[5, :128])
    huge = quantize(w * 1e8, 4, 32)
    assert not torch.equal(huge.scales.half().float(), huge.scales)
    per_channel = quantize(w, 8)
    assert torch.equal(per_channel.scales, (w.abs().amax(dim=1, keepdim=True) / 127.0))


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 5, 7, 33, 300])
def test_quant_gemm_gives_the_float_gemms_bits_on_the_dequantized_weight(isa, layout, rows):
    # 200 inputs: no multiple of 32, 64, 128 or 33 (a short last group), and odd halves for int4;
    # 70 outputs: a partial last panel.
    weight = make_weight(70, 200, layout, rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 200, generator=gen)
    bias = torch.randn(70, generator=gen)
    for b in (None, bias):
        got = quant_gemm(x, weight, b, isa)
        assert got.dtype == torch.float32 and got.shape == (rows, 70)
        assert torch.equal(got, float_panel_gemm(x, weight, b, isa)), (layout, rows, b is not None)


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("layout", ["int8_per_channel", "int4_g128_mins", "int4_g33_odd_group", "int4_g32_symmetric"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 20])
def test_quant_gemm_over_several_chunks_of_k(isa, layout, rows):
    # 601 inputs: past one buffer of 256 k's (the sums carried from chunk to chunk; groups of 33
    # straddle the chunks), odd; 1 to 4 rows de-quantize in registers (one or two panels a tile),
    # 20 through the buffer.
    weight = make_weight(100, 601, layout, rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 601, generator=gen), torch.randn(100, generator=gen)
    assert torch.equal(quant_gemm(x, weight, bias, isa), float_panel_gemm(x, weight, bias, isa))


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("layout", ["int8_g32_q8_0", "int4_g32_mins", "int4_g33_odd_group"])
@pytest.mark.parametrize("in_features", [1, 2, 31, 65])
def test_quant_gemm_short_and_odd_inputs(isa, layout, in_features):
    weight = make_weight(17, in_features, layout, in_features)
    x = torch.randn(3, in_features + 3)[:, :in_features]  # rows strided past their length
    assert torch.equal(quant_gemm(x, weight, None, isa), float_panel_gemm(x.contiguous(), weight, None, isa))


@pytest.mark.parametrize("layout", ["int8_per_channel", "int4_g32_mins", "int4_g33_odd_group", "int4_g128_symmetric"])
def test_the_plain_cpp_path_gives_the_same_bits(layout):
    weight = make_weight(40, 150, layout, 1)
    x, bias = torch.randn(9, 150), torch.randn(40)
    assert torch.equal(quant_gemm(x, weight, bias, Isa.NONE), float_panel_gemm(x, weight, bias, Isa.AVX2))


@needs(Isa.AVX512)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_avx2_and_avx512_paths_give_the_same_bits(layout):
    weight = make_weight(70, 333, layout, 4)
    x, bias = torch.randn(37, 333), torch.randn(70)
    assert torch.equal(quant_gemm(x, weight, bias, Isa.AVX2), quant_gemm(x, weight, bias, Isa.AVX512))


@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("layout", ["int8_per_channel", "int4_g32_mins"])
def test_a_row_has_the_same_bits_in_any_batch(isa, layout):
    """Batch invariance: a row's output is the same alone, in any batch around it, at any
    position, with one thread or two (large enough for the parallel path)."""
    weight = make_weight(1000, 576, layout, 3)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(300, 576, generator=gen), torch.randn(1000, generator=gen)
    packed = MODULE.pack_quant_panels(weight.q, weight.scales, weight.mins, weight.bits, weight.group_size, isa)
    mins = packed[2] if len(packed) > 2 else None

    def gemm(rows):
        return MODULE.quant_panel_gemm(rows, packed[0], packed[1], mins, bias, 1000, weight.bits, weight.group_size, isa)

    full = gemm(x)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for first, count in [(7, 1), (0, 5), (13, 31), (100, 200), (299, 1)]:
                assert torch.equal(gemm(x[first:first + count].clone()), full[first:first + count]), \
                    (num_threads, first, count)
    finally:
        torch.set_num_threads(threads)


def assert_a_row_keeps_its_bits(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor, isa: Isa,
                                slices: list[tuple[int, int]]) -> None:
    """Batch invariance: each slice of x's rows gives the rows' bits of the whole batch, with one
    thread or two."""
    full = quant_gemm(x, weight, bias, isa)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for first, count in slices:
                assert torch.equal(quant_gemm(x[first:first + count].clone(), weight, bias, isa),
                                   full[first:first + count]), (num_threads, first, count)
    finally:
        torch.set_num_threads(threads)


def bf16_panel_gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, isa: Isa) -> torch.Tensor:
    """gemm.cpp's bf16 GEMM of `isa` (vdpbf16ps or the tiles) on the de-quantized weight rounded to
    bfloat16."""
    panels = MODULE.pack_panels(weight.dequantize().bfloat16(), int(isa))
    return MODULE.panel_gemm(x, panels, bias, weight.shape[0], int(isa))


def bf16_isa() -> Isa:
    """The path a bf16 model's quantized weight takes here: the tiles where lent, else vdpbf16ps."""
    return min(cpu_ext.isa(), Isa(MODULE.quant_gemm_isa()))


# The bf16 GEMMs on the rounded weight; "tiles" in an id is what the software model's run selects.
BF16_PATHS = [pytest.param(Isa.AVX512_BF16, marks=needs_bf16, id="vdpbf16ps"),
              pytest.param(Isa.AMX, marks=needs_tiles, id="tiles")]


@pytest.mark.parametrize("isa", BF16_PATHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_bf16_paths_give_the_bf16_gemms_bits_on_the_rounded_weight(layout, isa):
    """Every layout, at 1-16 rows (one tile of x), 17-32 (two), 33 and more (several passes or
    tiles), with a partial last panel, an odd pair of panels, an odd K (its last pair half zeros)
    and short groups."""
    for n, k in [(70, 200), (33, 37), (16, 65)]:
        weight = make_weight(n, k, layout, n + k)
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen).bfloat16()
        for rows in (1, 7, 16, 17, 33, 70):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            for b in (None, bias):
                got = quant_gemm(x, weight, b, isa)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                assert torch.equal(got, bf16_panel_gemm(x, weight, b, isa)), (n, k, rows, b is not None)


@pytest.mark.parametrize("isa", BF16_PATHS)
@pytest.mark.parametrize("layout", ["int8_per_channel", "int4_g32_mins"])
def test_a_row_has_the_same_bits_in_any_batch_on_the_bf16_paths(layout, isa):
    """Batch invariance on vdpbf16ps and the tiles: alone (one tile of x), beside 30 rows (two),
    or in a batch of 300 at any position, with one thread or two."""
    weight = make_weight(160, 576, layout, 3)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(300, 576, generator=gen).bfloat16(), torch.randn(160, generator=gen).bfloat16()
    assert_a_row_keeps_its_bits(x, weight, bias, isa, [(7, 1), (0, 5), (13, 31), (100, 200), (299, 1)])


@needs_tiles
def test_linear_runs_bf16_activations_on_the_tiles_and_float32_on_the_vector_path():
    weight = make_weight(70, 200, "int4_g32_mins", 11)
    gen = torch.Generator().manual_seed(11)
    x, bias = torch.randn(2, 5, 200, generator=gen), torch.randn(70, generator=gen)
    tiles = kernels.pack_linear_weight(weight, dtype=torch.bfloat16)
    assert (tiles.kind, tiles.isa, tiles.upcast) == ("quant_panels", Isa.AMX, False)
    got = kernels.linear(x.bfloat16(), tiles.shape_only, bias.bfloat16(), tiles)
    expected = bf16_panel_gemm(x.bfloat16().reshape(10, 200), weight, bias.bfloat16(), Isa.AMX).view(2, 5, 70)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    vector = kernels.pack_linear_weight(weight, dtype=torch.float32)
    assert vector.isa == min(Isa.AVX512, Isa(MODULE.gemm_vector_isa())) and not vector.upcast
    assert torch.equal(kernels.linear(x, vector.shape_only, bias, vector),
                       float_panel_gemm(x.reshape(10, 200), weight, bias, vector.isa).view(2, 5, 70))
    with pytest.raises(RuntimeError, match="x \\[M, K\\] in BFloat16"):
        MODULE.quant_panel_gemm(x[0], tiles.data, tiles.scales, tiles.mins, None, 70, 4, 32, int(Isa.AMX))


@needs_bf16
@pytest.mark.skipif(cpu_ext.isa() >= Isa.AMX, reason="the tiles serve the batch-invariant mode here")
@pytest.mark.parametrize("layout", ["int4_g128_mins", "int4_g32_q4_1", "int4_per_channel", "int4_g33_odd_group",
                                    "int8_per_channel", "int8_g32_q8_0"])
def test_on_vdpbf16ps_alone_the_batch_invariant_mode_runs_one_path_at_every_row_count(layout):
    """A bf16 model's weight packed in the batch-invariant mode on a CPU with vdpbf16ps and no
    tiles: groups of an even size (or one group) on the bf16 dots, others on the float32 path
    (widened, rounded once), at every row count; nothing beside."""
    weight = make_weight(70, 256, layout, 14)
    gen = torch.Generator().manual_seed(14)
    bias = torch.randn(70, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(weight, dtype=torch.bfloat16)
    dots = layout != "int4_g33_odd_group"
    vector_isa = min(Isa.AVX512, Isa(MODULE.gemm_vector_isa()))
    assert (packed.isa, packed.vector_rows, packed.upcast) == ((QUANT_BF16_DOTS, 0, False) if dots else
                                                               (vector_isa, 0, True))
    for rows in (1, 4, 40):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        got = kernels.linear(x, packed.shape_only, bias, packed)
        if dots:
            assert torch.equal(got, quant_gemm(x, weight, bias, QUANT_BF16_DOTS))
        else:
            assert torch.equal(got, float_panel_gemm(x.float(), weight, bias.float(), vector_isa).bfloat16())


@needs_bf16_or_tiles
@pytest.mark.parametrize("rows", [1, LINEAR.VECTOR_ROWS_BESIDE_TILES, LINEAR.VECTOR_ROWS_BESIDE_TILES + 1, 40])
def test_outside_batch_invariance_a_few_rows_beside_the_tiles_run_the_vector_path(rows):
    """Packed with the engine's batch-invariant mode off, a quantized weight the bf16 dots cannot
    take (groups of an odd size) for vdpbf16ps or the tiles runs a call of at most
    VECTOR_ROWS_BESIDE_TILES rows on the AVX-512 path, on the same panels (the bf16 input widened,
    the output rounded once, as `upcast`), and more rows on its bf16 path; packed in the mode,
    every call on the tiles or, without them, the AVX-512 path."""
    weight = make_weight(70, 200, "int4_g33_odd_group", 12)
    gen = torch.Generator().manual_seed(12)
    x, bias = torch.randn(rows, 200, generator=gen).bfloat16(), torch.randn(70, generator=gen).bfloat16()
    invariant = kernels.pack_linear_weight(weight, dtype=torch.bfloat16)
    fast = kernels.pack_linear_weight(weight, dtype=torch.bfloat16, batch_invariant=False)
    vector_isa = min(Isa.AVX512, Isa(MODULE.gemm_vector_isa()))
    tiles = bf16_isa() == Isa.AMX
    assert (invariant.isa, invariant.vector_rows) == (Isa.AMX if tiles else vector_isa, 0)
    assert (fast.isa, fast.vector_rows, fast.vector_isa) == (bf16_isa(), LINEAR.VECTOR_ROWS_BESIDE_TILES, vector_isa)
    assert torch.equal(fast.data, invariant.data) and torch.equal(fast.scales, invariant.scales)
    vector = float_panel_gemm(x.float(), weight, bias.float(), vector_isa).bfloat16()
    bf16 = bf16_panel_gemm(x, weight, bias, bf16_isa())
    assert torch.equal(kernels.linear(x, invariant.shape_only, bias, invariant), bf16 if tiles else vector)
    got = kernels.linear(x, fast.shape_only, bias, fast)
    assert torch.equal(got, vector if rows <= LINEAR.VECTOR_ROWS_BESIDE_TILES else bf16)
    # A float32 model's weight is on the vector path already: nothing beside it.
    assert kernels.pack_linear_weight(weight, dtype=torch.float32, batch_invariant=False).vector_rows == 0


@pytest.mark.slow
def test_the_quantized_tile_path_under_a_software_model_of_the_tiles():
    """On any CPU, this file's tile tests on the software model of the tile instructions
    (INFLIGHT_CPU_AMX_EMULATE, kernels/cpu/amx.h), which refuses the shapes the hardware refuses:
    the de-quantizing loop, the passes of rows (1-16 rows leave tile 1 out) and the few rows that
    run beside the tiles outside the batch-invariant mode, in a process of its own with that build.
    On an AMX Xeon the same tests also run on the hardware above."""
    env = {**os.environ, "INFLIGHT_CPU_AMX_EMULATE": "1"}
    env.pop("INFLIGHT_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__, "-k", "tiles",
                          "-m", "not slow"], capture_output=True, text=True, timeout=1800, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and summary.startswith("20 passed"), summary


@pytest.mark.parametrize("layout, bits_per_weight", [
    ("int4_g32_q4_1", 4 + 32 / 32), ("int8_g32_q8_0", 8 + 16 / 32), ("int4_g32_mins", 4 + 64 / 32),
    ("int4_g128_mins", 4 + 64 / 128),
])
def test_packed_bytes_per_weight(layout, bits_per_weight):
    """Scales and mins that float16 holds exactly are stored as float16 (GGUF's), others as float32."""
    weight = make_weight(64, 256, layout, 0)
    packed = kernels.pack_linear_weight(weight, isa=max(Isa.AVX2, MODULE.quant_gemm_isa()))
    assert packed.kind == "quant_panels"
    half = LAYOUTS[layout][3]
    assert packed.scales.dtype == (torch.float16 if half else torch.float32)
    assert packed.nbytes * 8 / weight.q.numel() == bits_per_weight


# ---- kernels.linear ---------------------------------------------------------------------------

@pytest.mark.parametrize("isa", VECTOR_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["int8_per_channel", "int4_g64_mins"])
def test_linear_dispatches_quant_panels(isa, dtype, layout):
    weight = make_weight(70, 200, layout, 9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 200, generator=gen).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    packed = kernels.pack_linear_weight(weight, isa=isa, dtype=dtype)
    assert (packed.kind, packed.isa, packed.upcast, packed.bits) == ("quant_panels", isa, dtype == torch.bfloat16,
                                                                     weight.bits)
    assert packed.shape_only.shape == (70, 200) and packed.shape_only.dtype == dtype
    got = kernels.linear(x, packed.shape_only, bias, packed)
    # A float32 GEMM on the widened input, rounded once to the input's dtype.
    expected = float_panel_gemm(x.reshape(10, 200).float(), weight, bias.float(), isa).to(dtype).view(2, 5, 70)
    assert got.dtype == dtype and torch.equal(got, expected)
    strided = torch.randn(7, 400, generator=gen).to(dtype)[:, ::2]
    assert torch.equal(kernels.linear(strided, packed.shape_only, bias, packed),
                       float_panel_gemm(strided.float(), weight, bias.float(), isa).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_without_the_cpp_kernels_dequantizes_per_call(monkeypatch, dtype):
    weight = make_weight(48, 100, "int4_g32_mins", 2)
    monkeypatch.setattr(cpu_ext, "isa", lambda: Isa.NONE)
    packed = kernels.pack_linear_weight(weight, dtype=dtype)
    assert packed.kind == "quant" and packed.data is None and packed.quantized is weight
    assert packed.nbytes == weight.nbytes  # no float copy resident
    x, bias = torch.randn(6, 100).to(dtype), torch.randn(48).to(dtype)
    got = kernels.linear(x, packed.shape_only, bias, packed)
    expected = F.linear(x.double(), weight.dequantize().double(), bias.double())
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                                          else dict(atol=1e-5, rtol=2 ** -8)))


def test_round_to_nearest_quantization_packs_and_runs():
    """kernels.quantize's own int8 and int4 weights, through the packed path."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 160, generator=gen), torch.randn(4, 160, generator=gen)
    for weight in (quantize(w, 8), quantize(w, 4, 32), quantize(w, 4, 64)):
        packed = kernels.pack_linear_weight(weight)
        got = kernels.linear(x, packed.shape_only, None, packed)
        torch.testing.assert_close(got, F.linear(x, weight.dequantize()), atol=1e-4, rtol=1e-4)


def test_bad_packing_is_refused():
    weight = make_weight(16, 32, "int4_g32_mins", 0)
    with pytest.raises(RuntimeError, match="4-bit q must hold 0..15"):
        MODULE.pack_quant_panels(weight.q - 1, weight.scales, weight.mins, 4, 32, Isa.AVX2)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        MODULE.pack_quant_panels(weight.q, weight.scales[:, :0], weight.mins, 4, 32, Isa.AVX2)
    packed = MODULE.pack_quant_panels(weight.q, weight.scales, weight.mins, 4, 32, Isa.AVX2)
    with pytest.raises(RuntimeError, match="x has 30 columns"):
        MODULE.quant_panel_gemm(torch.randn(2, 30), *packed, None, 16, 4, 32, Isa.AVX2)
    with pytest.raises(RuntimeError, match="n does not match"):
        MODULE.quant_panel_gemm(torch.randn(2, 32), *packed, None, 40, 4, 32, Isa.AVX2)
    with pytest.raises(RuntimeError, match="instruction set 7 has no quantized path"):
        MODULE.quant_panel_gemm(torch.randn(2, 32), *packed, None, 16, 4, 32, 7)
    with pytest.raises(RuntimeError, match="int8_dot_gemm: q panels from pack_int8_dot_panels"):  # isa 5's own layout
        MODULE.quant_panel_gemm(torch.randn(2, 32), *packed, None, 16, 4, 32, 5)
    if not MODULE.quant_bf16_built():
        for isa in (3, QUANT_BF16_DOTS):
            with pytest.raises(RuntimeError, match=f"instruction set {isa} has no quantized path"):
                MODULE.quant_panel_gemm(torch.randn(2, 32).bfloat16(), *packed, None, 16, 4, 32, isa)


# ---- the fused decoder layer --------------------------------------------------------------------

@pytest.mark.parametrize("isa", VECTOR_PATHS + BF16_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoder_layer_with_quantized_projections(isa, dtype):
    """A layer whose four projections are quantized (int4 g32 with mins, int8 per channel,
    int4 g64 symmetric, int8 g32), with a float LoRA adapter on q|k|v, runs as one C++ call, and
    gives the bits of the same layer on the de-quantized weights' float32 panels (that layer's
    bits are the modules' own: tests/engine/test_model_families.py), hidden state and KV writes
    alike, over a batch of a prefill chunk and decodes. On vdpbf16ps and the tiles, bf16
    activations: the same layer on the de-quantized weights rounded to bf16, in that path's bf16
    panels."""
    hidden_size, heads, kv_heads, head_dim, inter, rank = 64, 4, 2, 16, 96, 4
    qkv_size = (heads + 2 * kv_heads) * head_dim
    weights = {"qkv": make_weight(qkv_size, hidden_size, "int4_g32_mins", 1),
               "o": make_weight(hidden_size, heads * head_dim, "int8_per_channel", 2),
               "gate_up": make_weight(2 * inter, hidden_size, "int4_g128_symmetric", 3),
               "down": make_weight(hidden_size, inter, "int8_g32_q8_0", 4)}
    gen = torch.Generator().manual_seed(5)
    qkv_bias = (torch.randn(qkv_size, generator=gen) * 0.1).to(dtype)
    upcast = dtype != torch.float32
    float_isa = min(isa, Isa.AVX512, Isa(MODULE.gemm_vector_isa()))
    bf16_panels = isa >= Isa.AVX512_BF16 and dtype == torch.bfloat16

    def float_projection(weight: torch.Tensor, bias=None):
        return MODULE.Projection(MODULE.pack_panels(weight, float_isa), None if bias is None else bias.float(),
                                 weight.shape[0], int(float_isa), upcast)

    lora_a = torch.randn(3 * rank, hidden_size, generator=gen) * 0.1
    slices = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    lora_b = [torch.randn(n, rank, generator=gen) * 0.1 for n in slices]
    lora = MODULE.LoraProjection([float_projection(lora_a)], [[float_projection(b) for b in lora_b]],
                                 [0, slices[0], slices[0] + slices[1]], rank)
    norms = [(1 + 0.1 * torch.randn(hidden_size, generator=gen)).to(dtype) for _ in range(2)]

    def layer(quantized: bool):
        projections = []
        for name, weight in weights.items():
            bias = qkv_bias if name == "qkv" else None
            if quantized:
                # Without tiles, vdpbf16ps on the de-quantized panels runs outside the batch-invariant
                # mode, for calls of more than VECTOR_ROWS_BESIDE_TILES rows (this batch has 8).
                packed = kernels.pack_linear_weight(weight, isa=isa, dtype=dtype,
                                                    batch_invariant=isa != Isa.AVX512_BF16)
                assert packed.kind == "quant_panels"
                projections.append(kernels.decoder_layer._projection(MODULE, packed, bias))
            elif bf16_panels:
                panels = MODULE.pack_panels(weight.dequantize().bfloat16(), int(isa))
                projections.append(MODULE.Projection(panels, bias, weight.shape[0], int(isa), False))
            else:
                projections.append(float_projection(weight.dequantize(), bias))
        return MODULE.DecoderLayer(*norms, 1e-5, *projections, heads, kv_heads, head_dim, head_dim ** -0.5, None,
                                   None, True, 8, [lora, None, None, None])

    block, new_tokens, cached = 16, [6, 1, 1], [3, 20, 9]
    seq_lens = [n + c for n, c in zip(new_tokens, cached)]
    tables = torch.arange(len(seq_lens) * 2, dtype=torch.int32).view(len(seq_lens), 2)
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new_tokens, cached)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(new_tokens))
    slots = tables[seq_of, positions // block].to(torch.int64) * block + positions % block
    meta = kernels.cpu_step_meta(positions, kernels.build_cos_sin_cache(head_dim, 64, 10000.0), slots, tables,
                                 torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32),
                                 torch.tensor([0, 6, 8]), torch.tensor([0, 0]))
    shape = (tables.numel(), block, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
    hidden = torch.randn(len(positions), hidden_size, generator=gen).to(dtype)
    residual = torch.randn(len(positions), hidden_size, generator=gen).to(dtype)

    def forward(quantized: bool):
        kv = tuple(c.clone() for c in cache)
        return layer(quantized).forward(hidden, residual, *kv, meta), kv

    (got, got_kv), (expected, expected_kv) = forward(True), forward(False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, expected_kv))
    assert not torch.equal(got[0], hidden)


@needs_bf16
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_decode_step_of_the_decoder_layer_follows_the_projections_path(batch_invariant):
    """One token through the fused layer with bf16 activations and quantized projections (int8 and
    int4, groups of an even size): in the batch-invariant mode each projection on the tiles (the
    layer of bf16 tile panels of the rounded weights), else on the bf16 dots, which are the path of
    every row count without tiles in the mode and of a few rows outside it."""
    hidden_size, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 96
    weights = [make_weight((heads + 2 * kv_heads) * head_dim, hidden_size, "int4_g32_mins", 1),
               make_weight(hidden_size, heads * head_dim, "int8_per_channel", 2),
               make_weight(2 * inter, hidden_size, "int4_g128_symmetric", 3),
               make_weight(hidden_size, inter, "int8_g32_q8_0", 4)]
    gen = torch.Generator().manual_seed(6)
    qkv_bias = (torch.randn(weights[0].shape[0], generator=gen) * 0.1).bfloat16()
    norms = [(1 + 0.1 * torch.randn(hidden_size, generator=gen)).bfloat16() for _ in range(2)]

    def layer(projection):
        projections = [projection(w, qkv_bias if i == 0 else None) for i, w in enumerate(weights)]
        return MODULE.DecoderLayer(*norms, 1e-5, *projections, heads, kv_heads, head_dim, head_dim ** -0.5, None,
                                   None, True, 8, [None] * 4)

    def quantized(weight, bias):
        packed = kernels.pack_linear_weight(weight, dtype=torch.bfloat16, batch_invariant=batch_invariant)
        return kernels.decoder_layer._projection(MODULE, packed, bias)

    def reference(weight, bias):
        if batch_invariant and bf16_isa() == Isa.AMX:
            panels = MODULE.pack_panels(weight.dequantize().bfloat16(), int(Isa.AMX))
            return MODULE.Projection(panels, bias, weight.shape[0], int(Isa.AMX), False)
        q, scales, *mins = MODULE.pack_quant_panels(weight.q, weight.scales, weight.mins, weight.bits,
                                                    weight.group_size, QUANT_BF16_DOTS)
        return MODULE.Projection.quantized(q, scales, mins[0] if mins else None, weight.bits, weight.group_size, bias,
                                           weight.shape[0], QUANT_BF16_DOTS, False)

    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    meta = kernels.cpu_step_meta(torch.tensor([20]), kernels.build_cos_sin_cache(head_dim, 64, 10000.0),
                                 torch.tensor([20]), tables, torch.tensor([21], dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32))
    shape = (2, 16, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
    hidden, residual = (torch.randn(1, hidden_size, generator=gen).bfloat16() for _ in range(2))

    def forward(projection):
        kv = tuple(c.clone() for c in cache)
        return layer(projection).forward(hidden, residual, *kv, meta), kv

    (got, got_kv), (expected, expected_kv) = forward(quantized), forward(reference)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, expected_kv))


def test_cpu_decoder_layer_takes_quantized_projections():
    """kernels.cpu_decoder_layer (what the model builds its layers with) accepts quant panels."""
    weights = [make_weight(n, k, "int4_g32_mins", i) for i, (n, k) in enumerate([(128, 64), (64, 64), (192, 64),
                                                                                 (64, 96)])]
    packed = [(kernels.pack_linear_weight(w), None, None) for w in weights]
    layer = kernels.cpu_decoder_layer(torch.ones(64), torch.ones(64), 1e-5, *packed, 4, 2, 16, 0.25)
    assert layer is not None


@needs_bf16
@pytest.mark.parametrize("layout", BF16_DOTS_LAYOUTS)
def test_the_bf16_dots_compute_x_times_the_dequantized_weight(layout):
    """Every layout of an even group size (or one group), at one row (four panels a tile), 2-12
    (one row tile), more (tiles of equal height: 13 as 7 + 6, 40 as four of 10) and, at K 4096,
    two row blocks; with a partial last panel, a group of panels short of four, a short last
    group, an odd K (its last pair half zeros), K of 1, and a bias or none."""
    for n, k, row_counts in [(70, 256, (1, 2, 3, 4, 5, 9, 12, 13, 40)), (33, 64, (1, 3, 13)), (130, 37, (1, 4, 40)),
                             (16, 2, (1, 2, 13)), (20, 1, (1, 5)), (33, 4096, (1, 70))]:
        weight = make_weight(n, k, layout, n + k)
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen).bfloat16()
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            for b in (None, bias):
                got = quant_gemm(x, weight, b, QUANT_BF16_DOTS)
                assert got.shape == (rows, n)
                assert got.dtype == torch.bfloat16 and bf16_dots_rounding_excess(got, x, weight, b) <= 0


@needs_bf16
@pytest.mark.parametrize("layout", ["int8_per_channel", "int8_g64_mins", "int4_g32_mins", "int4_g128_symmetric",
                                    "int4_per_channel"])
def test_a_row_has_the_same_bits_in_any_batch_on_the_bf16_dots(layout):
    """Without tiles the batch-invariant mode runs the bf16 dots at every row count: one row's four
    panels a tile, a few rows' two, tall tiles of up to 12 rows, several row blocks (K 2048)."""
    weight = make_weight(200, 2048, layout, 5)
    gen = torch.Generator().manual_seed(5)
    x, bias = torch.randn(300, 2048, generator=gen).bfloat16(), torch.randn(200, generator=gen).bfloat16()
    assert_a_row_keeps_its_bits(x, weight, bias, QUANT_BF16_DOTS,
                                [(0, 1), (3, 2), (5, 3), (7, 4), (2, 9), (13, 31), (100, 200), (299, 1)])


@needs_bf16
def test_the_bf16_dots_refuse_what_they_do_not_compute():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 66, generator=gen).bfloat16()
    with pytest.raises(RuntimeError, match="even size"):
        quant_gemm(x, make_weight(20, 66, "int4_g33_odd_group", 9), None, QUANT_BF16_DOTS)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] in BFloat16"):
        quant_gemm(x.float(), make_weight(20, 66, "int4_g32_mins", 9), None, QUANT_BF16_DOTS)


@needs_bf16
@pytest.mark.parametrize("layout, dots", [("int4_g128_mins", True), ("int4_g32_q4_1", True), ("int8_per_channel", True),
                                          ("int8_g32_q8_0", True), ("int4_g33_odd_group", False)])
@pytest.mark.parametrize("rows", [1, LINEAR.VECTOR_ROWS_BESIDE_TILES, LINEAR.VECTOR_ROWS_BESIDE_TILES + 1])
def test_outside_batch_invariance_a_few_rows_run_the_bf16_dots(layout, dots, rows):
    """A bf16 model's int8 or int4 weight of even groups, packed with the engine's batch-invariant
    mode off, runs calls of at most VECTOR_ROWS_BESIDE_TILES rows on the bf16 dots, the input as it
    is and the bias in bfloat16, and more rows on its main path (vdpbf16ps or the tiles, on the
    rounded weight). Groups of an odd size never run them."""
    weight = make_weight(70, 256, layout, 13)
    gen = torch.Generator().manual_seed(13)
    x, bias = torch.randn(rows, 256, generator=gen).bfloat16(), torch.randn(70, generator=gen).bfloat16()
    fast = kernels.pack_linear_weight(weight, dtype=torch.bfloat16, batch_invariant=False)
    main = kernels.pack_linear_weight(weight, dtype=torch.bfloat16)
    assert main.vector_rows == 0
    if not dots:
        assert QUANT_BF16_DOTS not in (fast.isa, fast.vector_isa)
        return
    assert (fast.isa, fast.vector_rows, fast.vector_isa) == (bf16_isa(), LINEAR.VECTOR_ROWS_BESIDE_TILES,
                                                             QUANT_BF16_DOTS)
    on_dots = rows <= LINEAR.VECTOR_ROWS_BESIDE_TILES
    got = kernels.linear(x, fast.shape_only, bias, fast)
    if on_dots:
        assert torch.equal(got, quant_gemm(x, weight, bias, QUANT_BF16_DOTS))
    else:
        assert torch.equal(got, bf16_panel_gemm(x, weight, bias, bf16_isa()))
    # Which path ran, told apart where the results cannot round to the same bits.
    telling = weight_telling_the_paths_apart(70, 256, weight.group_size)
    fast = kernels.pack_linear_weight(telling, dtype=torch.bfloat16, batch_invariant=False)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    x[:, 0], x[:, 1] = 1, -1
    assert torch.equal(kernels.linear(x, fast.shape_only, None, fast),
                       torch.full((rows, 70), 1.0 if on_dots else 0.0).bfloat16())


def weight_telling_the_paths_apart(out_features: int, in_features: int, group_size: int) -> QuantizedWeight:
    """int4 weights 2^24 + 1 (q 1) and 2^24 (q 0), with scale 1 and min 2^24 in every group: against
    x = (1, -1, 0, ...) the bf16 dots, which never round a weight, give exactly 1; the float32 and
    tile paths multiply the weight rounded (float32 cannot hold 2^24 + 1) and give 0."""
    groups = -(-in_features // group_size)
    q = torch.zeros(out_features, in_features, dtype=torch.int8)
    q[:, 0] = 1
    return QuantizedWeight(q, torch.ones(out_features, groups), torch.full((out_features, groups), 2.0 ** 24), 4,
                           group_size)
