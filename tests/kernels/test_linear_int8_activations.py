"""kernels/cpu/gemm_int8_dots.cpp and its use in kernels.linear: int8 activations against int8
and int4 weights (the engine's `activation_quantization` int8). x is quantized to int8 in blocks
of the weight's groups and each group's integer dot product is exact, so the result is `int8_activation_linear`'s
(kernels/quantized.py, in torch) to the bit, for every layout, shape tail, row count and input
dtype, on whichever instruction set the build has (AVX-512 VNNI, AVX2, plain C++: CI builds the
AVX2 one too) and, from 32 rows, on the AMX tiles (or their software model); a row's bits never depend on its batch; and the torch path (no C++ kernels) is the
same function."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

import kernels
from backend.paths import REPO_ROOT
from kernels import cpu_ext
from kernels.cpu_ext import QUANT_INT8_DOTS
from kernels.quantized import QuantizedWeight, int8_activation_linear, quantize, quantize_rows_int8
from kernels.testing import make_random_quantized_weight

MODULE = cpu_ext.load()
pytestmark = pytest.mark.skipif(MODULE is None, reason="the C++ kernels could not be built here")

# (bits, group_size or None for one group per output channel, mins, float16-exact scales)
LAYOUTS = {
    "int8_per_channel": (8, None, False, False),
    "int8_g32_q8_0": (8, 32, False, True),
    "int8_g16_q6_k": (8, 16, False, False),
    "int4_g32_q4_1": (4, 32, True, True),
    "int4_g32_mins": (4, 32, True, False),
    "int4_g128_mins": (4, 128, True, False),
    "int4_g32_symmetric": (4, 32, False, True),
    "int4_per_channel": (4, None, True, False),
}


def make_weight(out_features: int, in_features: int, layout: str, seed: int) -> QuantizedWeight:
    bits, group, mins, half = LAYOUTS[layout]
    return make_random_quantized_weight(out_features, in_features, bits, group, mins, half,
                                        torch.Generator().manual_seed(seed))


def kernel_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    packed = kernels.pack_linear_weight(weight, dtype=x.dtype, int8_activations=True)
    assert packed.kind == "quant_panels" and packed.isa == QUANT_INT8_DOTS
    return kernels.linear(x, packed.shape_only, bias, packed)


@pytest.mark.parametrize("block", [None, 32, 128])
def test_the_blocks_quantize_symmetric_to_127(block):
    """Each block (a row whole, or a weight group's inputs) on its own: its largest magnitude
    maps to 127, each value within half a step, a block of zeros stays zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 5.0, 1.0])[:, None]
    x[3] = 0.0
    x[4, 7] = -80.0  # the largest magnitude negative
    x[5, 200:] *= 1e3  # an outlier block, which per-block scales keep from the others
    q, scales = quantize_rows_int8(x, block)
    size = 300 if block is None else block
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.shape == (6, -(-300 // size))
    assert q.abs().max() <= 127 and torch.equal(q[3], torch.zeros_like(q[3])) and torch.equal(scales[3], torch.zeros(scales.shape[1]))
    assert q[4, 7] == -127
    per_input = scales.repeat_interleave(size, dim=1)[:, :300]
    for r in (0, 1, 2, 4, 5):
        for b in range(scales.shape[1]):
            assert q[r, b * size:(b + 1) * size].abs().max() == 127
        # Each value within half a step of the float one (and a few ulps of the scale's rounding).
        assert ((q[r].float() * per_input[r] - x[r]).abs() <= 0.5 * per_input[r] * (1 + 1e-5)).all()
    if block == 32:  # the outlier block's scale stays its own
        assert scales[5, 0] < 1e-2 * scales[5, -1]


def assert_reference_bits(layout: str, dtype: torch.dtype, row_counts: tuple[int, ...]) -> None:
    """Every shape tail: N past a panel's 16 columns (and an odd count of panels), K past a line of
    4 or 8 inputs, past a group and past a tile's 64."""
    for seed, (n, k) in enumerate([(16, 64), (40, 200), (300, 256), (33, 520)]):
        weight = make_weight(n, k, layout, seed)
        g = torch.Generator().manual_seed(100 + seed)
        bias = torch.randn(n, generator=g).to(dtype) if seed % 2 else None
        for rows in row_counts:
            x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
            out = kernel_linear(x, weight, bias)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert torch.equal(out, int8_activation_linear(x, weight, bias)), (layout, n, k, rows)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_vector_path_gives_the_reference_bits(layout, dtype):
    """1-4 rows (one tile of rows), 5 and 9 (tiles of 4 and a rest), 31 (below the AMX tiles)."""
    assert_reference_bits(layout, dtype, (1, 2, 3, 4, 5, 9, 31))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_tiles_give_the_reference_bits(layout):
    """From 32 rows, on an AMX Xeon (or the software model of the tiles): passes of 32 rows, a
    last one partly empty. Elsewhere the same calls run the vector path, to the same bits."""
    assert_reference_bits(layout, torch.bfloat16, (32, 45, 70))


@pytest.mark.skipif(os.environ.get("INFLIGHT_CPU_AMX_EMULATE") == "1", reason="already on the model")
def test_the_tiles_under_a_software_model_of_the_tiles():
    """On any CPU, the tile tests above on the software model of the tile instructions
    (INFLIGHT_CPU_AMX_EMULATE, kernels/cpu/amx.h), in a process of its own with that build."""
    env = {**os.environ, "INFLIGHT_CPU_AMX_EMULATE": "1"}
    env.pop("INFLIGHT_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__, "-k",
                          "test_the_tiles_give"], capture_output=True, text=True, timeout=1800, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and summary.startswith(f"{len(LAYOUTS)} passed"), summary


def test_the_reference_is_the_quantized_product():
    """int8_activation_linear is x's integers times the weight's, scaled: within float32's
    roundings of that product computed in float64."""
    weight = make_weight(48, 256, "int4_g32_q4_1", 7)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8))
    q, scales = quantize_rows_int8(x, weight.group_size)
    exact = (q.double() * scales.double().repeat_interleave(32, dim=1)) @ weight.dequantize().double().T
    out = int8_activation_linear(x, weight)
    assert (out.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # And close to the float product: int8 activations lose about 1/254 of each block's range.
    assert (out - x @ weight.dequantize().T).abs().max() <= 0.02 * (x @ weight.dequantize().T).abs().max()


def test_a_rows_bits_are_its_own_in_any_batch():
    weight = make_weight(96, 512, "int4_g32_mins", 3)
    g = torch.Generator().manual_seed(4)
    batch = torch.randn(23, 512, generator=g).to(torch.bfloat16)
    together = kernel_linear(batch, weight, None)
    for r in (0, 5, 22):
        assert torch.equal(kernel_linear(batch[r:r + 1], weight, None), together[r:r + 1])
        assert torch.equal(kernel_linear(batch[r:r + 4], weight, None)[0], together[r])


def test_a_weight_quantized_at_load_and_a_strided_input():
    weight = quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(5)), 4, 32)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(6))[:, ::2]
    assert torch.equal(kernel_linear(x, weight, None), int8_activation_linear(x.contiguous(), weight))


def test_without_the_cpp_kernels_torch_computes_the_same_numbers():
    weight = make_weight(40, 200, "int8_g32_q8_0", 9)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(10))
    with mock.patch.object(cpu_ext, "load", return_value=None):
        packed = kernels.pack_linear_weight(weight, int8_activations=True)
    assert packed.kind == "quant" and packed.isa == QUANT_INT8_DOTS
    assert torch.equal(kernels.linear(x, packed.shape_only, None, packed), kernel_linear(x, weight, None))


def test_groups_that_split_a_line_are_refused():
    weight = make_random_quantized_weight(16, 66, 4, 33, True, False, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="int8 activations take 4-bit groups of a multiple of 8 inputs, not 33"):
        kernels.pack_linear_weight(weight, int8_activations=True)


def test_the_path_built_is_named():
    flags = open("/proc/cpuinfo").read()
    expected = "avx512_vnni" if " avx512_vnni" in flags and cpu_ext.built_isa() >= cpu_ext.Isa.AVX512 else "avx2"
    if cpu_ext.built_isa() < cpu_ext.Isa.AVX2:
        expected = "plain"
    assert MODULE.int8_dots_path() == expected
