"""W8A16 / W4A16 GEMM (kernels/linear_quant.py): the Triton kernel, run on CPU by Triton's
interpreter in float32, against the de-quantized weight's float64 product and the torch
reference; int8 per channel and in groups (16, 24, 32, 128), int4 in groups (32, 48, 64, 128)
with and without mins, K past the last whole group and odd, N and M off the block sizes,
decode (split-K) and prefill tilings, with and without bias."""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels.linear_quant import (
    linear_quant_config,
    linear_quant_reference,
    linear_quant_triton,
    pack_quant_weight_triton,
)
from kernels.quantized import QuantizedWeight, quantize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 96  # not a multiple of BLOCK_N (64 for decode, 128 for prefill)
ROWS = {"decode": 3, "prefill": 37}  # 37: not a multiple of BLOCK_M (64)


def _weight(bits: int, group_size: int | None, mins: bool, k: int, half_scales: bool = False, seed: int = 0):
    """A QuantizedWeight: quantize() of a random float weight (int8 symmetric, int4 with
    mins), or for int4 without mins raw codes 0..15 and random scales. `half_scales`: scales
    and mins that float16 holds exactly, as GGUF's Q8_0/Q4_0/Q4_1 have; else one float32 step
    above such values where quantize() gives them (its groups' float16 ones), which float16 does
    not hold."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4 and not mins:
        groups = -(-k // group_size)
        q = torch.randint(0, 16, (N, k), generator=g, dtype=torch.int8)
        qw = QuantizedWeight(q, torch.rand(N, groups, generator=g) * 0.02 + 1e-3, None, 4, group_size)
    else:
        qw = quantize(torch.randn(N, k, generator=g) * 0.05, bits, group_size)
        assert (qw.mins is not None) == mins
    if half_scales:
        qw = QuantizedWeight(qw.q, qw.scales.half().float(), None if qw.mins is None else qw.mins.half().float(),
                             qw.bits, qw.group_size)
    elif torch.equal(qw.scales.half().float(), qw.scales):
        up = lambda v: torch.nextafter(v, torch.full_like(v, float("inf")))
        qw = QuantizedWeight(qw.q, up(qw.scales), None if qw.mins is None else up(qw.mins), qw.bits, qw.group_size)
    return qw


CASES = {
    # id: (bits, group_size (None: per channel), mins, K)
    "int8-channel": (8, None, False, 200),
    "int8-g16": (8, 16, False, 200),          # Q6_K's groups: tiles of 16
    "int8-g24": (8, 24, False, 200),          # no power-of-two tile divides it: scale per weight
    "int8-g32": (8, 32, False, 200),
    "int8-g128": (8, 128, False, 200),        # last group 72 long
    "int4-g32-mins": (4, 32, True, 200),
    "int4-g32-odd-k": (4, 32, True, 201),     # a padding nibble in the last byte
    "int4-g48-mins": (4, 48, True, 200),      # no power-of-two tile divides it: scale per weight
    "int4-g64-mins": (4, 64, True, 200),
    "int4-g64": (4, 64, False, 200),
    "int4-g128-mins": (4, 128, True, 200),
    "int4-g128": (4, 128, False, 200),
}


@pytest.mark.parametrize("phase", list(ROWS))
@pytest.mark.parametrize("case", list(CASES))
def test_linear_quant_triton_matches_the_dequantized_product(case, phase):
    bits, group_size, mins, k = CASES[case]
    qw = _weight(bits, group_size, mins, k, seed=k + bits)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS[phase], k, generator=g)
    bias = torch.randn(N, generator=g) if "g64" in case or "channel" in case else None
    packed = pack_quant_weight_triton(qw)
    out = linear_quant_triton(x, packed, bias)
    assert out.shape == (ROWS[phase], N) and out.dtype == torch.float32
    want = x.double() @ qw.dequantize().double().T
    if bias is not None:
        want += bias.double()
    # IEEE float32 dots over 200 terms of ~|0.1|: a few float32 ulps of the sum.
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, linear_quant_reference(x, qw, bias), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("phase", list(ROWS))
@pytest.mark.parametrize("case", ["int8-g32", "int4-g64-mins"])
def test_linear_quant_triton_in_float16(case, phase):
    """The 16-bit path (float16 here, bfloat16 on the GPU only): the weight tile is rounded to
    float16 for the dot, the float32 sum to float16 once."""
    bits, group_size, mins, k = CASES[case]
    qw = _weight(bits, group_size, mins, k, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS[phase], k, generator=g).half()
    bias = torch.randn(N, generator=g).half()
    out = linear_quant_triton(x, pack_quant_weight_triton(qw), bias)
    assert out.dtype == torch.float16
    want = x.double() @ qw.dequantize().double().T + bias.double()
    torch.testing.assert_close(out.double(), want, atol=4e-3, rtol=2e-3)


@pytest.mark.parametrize("bits,mins", [(8, False), (4, True), (4, False)], ids=["int8", "int4-mins", "int4"])
def test_the_kernel_builds_dequantize_s_weight_to_the_bit(bits, mins):
    """Rows of the identity pick single weights: 1 * w plus exact zeros is w, so the output is
    the kernel's de-quantized weight itself, which must be dequantize()'s bits (two roundings,
    no FMA). float16-exact scales and mins take the float16 layout, the others float32."""
    k = 96
    for half in (False, True):
        qw = _weight(bits, 32, mins, k, half_scales=half, seed=7)
        packed = pack_quant_weight_triton(qw)
        expected = torch.float16 if half else torch.float32
        assert packed.scales.dtype == expected and packed.scales.shape == (3, N)
        assert packed.mins is None if not mins else packed.mins.dtype == expected
        rows = torch.tensor([0, 1, 31, 32, 33, 63, 64, 95, 50, 2, 17, 80])
        for picked in (rows[:2], rows):   # decode and prefill tilings
            out = linear_quant_triton(torch.eye(k)[picked], packed)
            assert torch.equal(out, qw.dequantize()[:, picked].T)


def test_int4_packs_two_weights_a_byte_along_k():
    qw = _weight(4, 32, True, 201, seed=3)
    packed = pack_quant_weight_triton(qw)
    assert packed.q.dtype == torch.uint8 and packed.q.shape == (N, 101)
    assert packed.shape == qw.shape and packed.bits == 4 and packed.group_size == 32
    low, high = (packed.q & 15).to(torch.int8), (packed.q >> 4).to(torch.int8)
    assert torch.equal(low, qw.q[:, 0::2]) and torch.equal(high[:, :100], qw.q[:, 1::2])
    assert torch.equal(high[:, 100], torch.zeros(N, dtype=torch.int8))
    assert packed.nbytes == N * 101 + 2 * 7 * N * 4
    int8 = pack_quant_weight_triton(_weight(8, None, False, 200))
    assert int8.q.dtype == torch.int8 and int8.q.shape == (N, 200) and int8.scales.shape == (1, N)


def test_decode_splits_k_and_prefill_does_not():
    """The test shapes above really run both tilings (and split-K's second kernel)."""
    from triton.runtime import interpreter

    decode = linear_quant_config(ROWS["decode"], N, 200, 8, 32)
    prefill = linear_quant_config(ROWS["prefill"], N, 200, 8, 32)
    assert decode["BLOCK_M"] == 16 and decode["split_k"] > 1
    assert prefill["BLOCK_M"] == 64 and prefill["split_k"] == 1
    assert linear_quant_config(ROWS["decode"], N, 200, 8, 32, batch_invariant=True) == prefill
    assert linear_quant_config(1, 4096, 4096, 4, 128, num_sms=132)["split_k"] > 1
    assert linear_quant_config(1, 128256, 4096, 4, 128, num_sms=132)["split_k"] == 1

    launches = []
    original = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    packed = pack_quant_weight_triton(_weight(8, 32, False, 200))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.GridExecutor, "__call__", counting)
        decode_out = linear_quant_triton(torch.ones(3, 200), packed, torch.ones(N))
        assert launches == ["_linear_quant_kernel", "_sum_splits_kernel"]
        launches.clear()
        invariant_out = linear_quant_triton(torch.ones(3, 200), packed, torch.ones(N), batch_invariant=True)
        assert launches == ["_linear_quant_kernel"]
    torch.testing.assert_close(decode_out, invariant_out, atol=2e-5, rtol=1e-5)


def test_leading_dims_and_a_wrong_input_size():
    qw = _weight(4, 64, True, 128)
    packed = pack_quant_weight_triton(qw)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(5))
    out = linear_quant_triton(x, packed)
    assert out.shape == (2, 3, N)
    torch.testing.assert_close(out, linear_quant_reference(x, qw), atol=2e-5, rtol=1e-5)
    assert linear_quant_triton(torch.empty(0, 128), packed).shape == (0, N)
    with pytest.raises(ValueError, match="127 input features, the weight 128"):
        linear_quant_triton(torch.randn(1, 127), packed)
