"""kv_cache_dtype int8: the KV store quantizes and every attention path de-quantizes.

Each path (the torch reference, the C++ CPU kernel at each vector width this machine has,
the CPU dispatcher with its SDPA branch, the Triton kernels in the interpreter) runs on a
`QuantizedKV` and is checked against naive float32 attention over the same cache
de-quantized in float32: de-quantizing is part of the kernel, quantizing is the store's.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels import (
    QuantizedKV,
    cpu_ext,
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_triton,
    store_kv_reference,
    store_kv_triton,
)
from kernels.kv_store import dequantize_kv_rows, kv_storage, quantize_kv_rows
from kernels.testing import make_paged_batch, naive_paged_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXACT = dict(atol=3e-6, rtol=3e-6)
CASES = {
    "decodes": ([1, 1, 1, 1, 1], [1, 16, 32, 33, 70]),
    "mixed": ([1, 23, 1, 7, 1, 1], [40, 23, 1, 30, 65, 17]),
    # a long chunk at a long context (paged_attention_cpu sends it to SDPA) beside decodes
    "long_context_chunk": ([1, 100, 3, 1], [40, 600, 5, 700]),
    "skewed_decodes": ([1] * 9, [1500, 5, 7, 1, 600, 30, 31, 2, 900]),
}
HEADS = {"gqa1": (2, 2), "gqa3": (9, 3), "gqa2_kv8": (16, 8)}


def quantized(cache: torch.Tensor) -> QuantizedKV:
    """A float cache's rows quantized into a QuantizedKV (NaN rows, the slots no sequence
    owns, get NaN scales: a kernel that reads them shows it)."""
    num_blocks, block_size, heads, head_dim = cache.shape
    out = QuantizedKV.zeros(num_blocks, block_size, heads, head_dim)
    q, scale = quantize_kv_rows(cache)
    out.data.copy_(q)
    out.scale.copy_(scale)
    return out


def quantized_batch(q_lens, seq_lens, heads, head_dim=64, block_size=16, seed=0, dtype=torch.float32):
    batch = make_paged_batch(q_lens, seq_lens, *heads, head_dim, block_size, seed=seed)
    k, v = quantized(batch.k_cache), quantized(batch.v_cache)
    query = batch.query.to(dtype)
    args = (query, k, v, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    expected = naive_paged_attention(query.float(), k.dequantize(), v.dequantize(), *args[3:])
    return args, expected


def _cpp(lanes):
    def attention(query, k, v, block_tables, seq_lens, cu_seqlens_q, scale):
        return cpu_ext.load().paged_attention(query, k.data, v.data, block_tables.to(torch.int32),
                                              seq_lens.to(torch.int32), cu_seqlens_q.to(torch.int32), scale, lanes,
                                              k.scale, v.scale)
    return attention


_BUILT = cpu_ext.load()
PATHS = {"reference": paged_attention_reference, "cpu": paged_attention_cpu,
         **{f"cpp_{lanes}_lanes": _cpp(lanes) for lanes in (8, 16)
            if _BUILT is not None and lanes <= _BUILT.attention_lanes()}}


def test_quantize_rows_round_trip():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[4, 1] = 0.0  # an all-zero row: scale 0, values 0
    q, scale = quantize_kv_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50, 3)
    assert int(q.abs().max()) == 127 and bool((scale[4, 1] == 0) & (q[4, 1] == 0).all())
    assert bool(((dequantize_kv_rows(q, scale) - x).abs() <= scale[..., None] / 2 + 1e-7).all())


def test_block_is_self_contained():
    """Moving a block's bytes moves its rows and its scales: what swap and copy-on-write do."""
    cache = quantized(torch.randn(4, 16, 2, 64, generator=torch.Generator().manual_seed(1)))
    before = cache.dequantize()
    kv_storage(cache)[3] = kv_storage(cache)[0]
    assert torch.equal(cache.dequantize()[3], before[0]) and torch.equal(cache.dequantize()[1:3], before[1:3])
    assert cache.blocks.shape == (4, QuantizedKV.block_bytes(16, 2, 64)) == (4, 16 * 2 * (64 + 4))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_dequantizes(case, heads, path):
    args, expected = quantized_batch(*CASES[case], HEADS[heads], seed=len(case))
    out = PATHS[path](*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **EXACT)


@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize("head_dim", [80, 36])
def test_attention_dequantizes_other_head_dims(head_dim, path):
    """80: the 8-lane kernel of 10 vectors; 36: the plain loops."""
    args, expected = quantized_batch([1, 12, 1], [30, 12, 5], (6, 2), head_dim=head_dim, seed=head_dim)
    torch.testing.assert_close(PATHS[path](*args), expected, **EXACT)


def test_attention_dequantizes_bfloat16_query():
    """A bf16 model's query over int8 KV: rows de-quantized to float32 all the same."""
    args, _ = quantized_batch([1, 9, 1], [40, 20, 300], (9, 3), seed=5, dtype=torch.bfloat16)
    expected = naive_paged_attention(args[0].float(), args[1].dequantize(), args[2].dequantize(), *args[3:])
    for path in PATHS.values():
        out = path(*args)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_triton_attention_dequantizes():
    for case in ("decodes", "mixed"):
        for heads in ("gqa1", "gqa3"):
            args, expected = quantized_batch(*CASES[case], HEADS[heads], seed=7)
            torch.testing.assert_close(paged_attention_triton(*args), expected, atol=2e-5, rtol=1e-5)


def _store_inputs(dtype=torch.float32, block_size=16):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, tokens = 6, 3, 64, 20
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 8, generator=g).to(dtype)
    key = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[0, 7, 19]] = -1
    fresh = [QuantizedKV.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(2)]
    return key, value, slots, fresh


def _assert_stored(key, value, slots, k, v):
    """Every written row is the float32 quantization of its input (to one step of rounding:
    the kernels may divide in another order), and nothing else was written."""
    keep = slots >= 0
    bs = k.shape[1]
    blocks, offsets = slots[keep] // bs, slots[keep] % bs
    for x, cache in ((key[keep], k), (value[keep], v)):
        q, scale = quantize_kv_rows(x)
        torch.testing.assert_close(cache.scale[blocks, offsets], scale, atol=0, rtol=1e-6)
        assert int((cache.data[blocks, offsets].int() - q.int()).abs().max()) <= 1
        untouched = torch.ones(cache.shape[0] * bs, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert not cache.data.reshape(-1, *cache.shape[2:])[untouched].any()
        assert not cache.scale.reshape(-1, cache.shape[2])[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_quantizes(dtype):
    key, value, slots, (k, v) = _store_inputs(dtype)
    store_kv_reference(key, value, k, v, slots)
    _assert_stored(key, value, slots, k, v)
    key, value, slots, (kt, vt) = _store_inputs(dtype)
    store_kv_triton(key, value, kt, vt, slots)
    _assert_stored(key, value, slots, kt, vt)
    # The interpreter's round half to even is torch.round's: the same bytes.
    assert torch.equal(kt.blocks, k.blocks) and torch.equal(vt.blocks, v.blocks)


@pytest.mark.skipif(_BUILT is None, reason="the C++ kernels are not built on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_store_quantizes(dtype):
    """The C++ RoPE-and-store writes the rotated key and the value quantized."""
    from kernels import build_cos_sin_cache, rotary_embedding_reference, rotary_store_kv_cpu

    key, value, slots, (k, v) = _store_inputs(dtype)
    tokens, kv_heads, head_dim = key.shape
    g = torch.Generator().manual_seed(3)
    query = torch.randn(tokens, 2 * kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0)
    q_out = rotary_store_kv_cpu(positions, query, key, value, cos_sin, k, v, slots)
    q_ref, k_ref = rotary_embedding_reference(positions, query, key, cos_sin)
    assert torch.equal(q_out, q_ref)
    _assert_stored(k_ref, value, slots, k, v)
