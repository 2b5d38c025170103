"""Quantized KV (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2): the KV store quantizes and every
attention path de-quantizes.

Each path (the torch reference, the C++ CPU kernel at each vector width this machine has,
the CPU dispatcher with its SDPA branch, the Triton kernels in the interpreter) runs on a
`QuantizedKV` of each kind and is checked against naive float32 attention over the same cache
de-quantized in float32: de-quantizing is part of the kernel, quantizing is the store's. The
fp8 encoders (the C++ store's bit manipulation, the Triton cast) are torch's cast to the bit
over every value of interest (each representable value, the ties between them and their float32
neighbours, subnormals, underflow), and the C++ decoders (F16C vectors and the table) give
torch's value of every code.
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
from kernels.kv_store import FP8_E4M3, FP8_E5M2, INT8, KV_QUANT_DTYPES, dequantize_kv_rows, kv_storage, quantize_kv_rows
from kernels.paged_attention import _uses_sdpa
from kernels.testing import int16_rounded_query, make_paged_batch, naive_paged_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXACT = dict(atol=3e-6, rtol=3e-6)
CASES = {
    "decodes": ([1, 1, 1, 1, 1], [1, 16, 32, 33, 70]),
    "mixed": ([1, 23, 1, 7, 1, 1], [40, 23, 1, 30, 65, 17]),
    # a long chunk at a long context (paged_attention_cpu sends it to SDPA) beside decodes
    "long_context_chunk": ([1, 100, 3, 1], [40, 600, 5, 700]),
    "skewed_decodes": ([1] * 9, [1500, 5, 7, 1, 600, 30, 31, 2, 900]),
    # contexts the C++ kernel splits in parts of 2048 positions, a chunk straddling the edge
    "split_contexts": ([1, 30, 1], [2049, 2070, 4100]),
}
HEADS = {"gqa1": (2, 2), "gqa3": (9, 3), "gqa2_kv8": (16, 8)}
KINDS = list(KV_QUANT_DTYPES)
FP8 = [FP8_E4M3.name, FP8_E5M2.name]


def quantized(cache: torch.Tensor, kind=INT8) -> QuantizedKV:
    """A float cache's rows quantized into a QuantizedKV (NaN rows, the slots no sequence
    owns, get NaN scales: a kernel that reads them shows it)."""
    num_blocks, block_size, heads, head_dim = cache.shape
    out = QuantizedKV.zeros(num_blocks, block_size, heads, head_dim, kind)
    q, scale = quantize_kv_rows(cache, kind)
    out.data.copy_(q)
    out.scale.copy_(scale)
    return out


def quantized_batch(q_lens, seq_lens, heads, head_dim=64, block_size=16, seed=0, dtype=torch.float32, kind=INT8):
    batch = make_paged_batch(q_lens, seq_lens, *heads, head_dim, block_size, seed=seed)
    k, v = quantized(batch.k_cache, kind), quantized(batch.v_cache, kind)
    query = batch.query.to(dtype)
    args = (query, k, v, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.scale)
    expected = naive_paged_attention(query.float(), k.dequantize(), v.dequantize(), *args[3:])
    return args, expected


def expected_of_path(path: str, args, expected: torch.Tensor) -> torch.Tensor:
    """What `path` computes on int8 KV: the C++ kernel scores int8 keys against the query
    rounded to int16 (int16_rounded_query), the reference and SDPA against the query itself;
    the CPU dispatcher sends long chunks at long contexts to SDPA."""
    query, k, v, tables, lens, cu, scale = args
    if k.kind is not INT8 or path == "reference":
        return expected
    rounded = naive_paged_attention(int16_rounded_query(query, scale), k.dequantize(), v.dequantize(), tables, lens,
                                    cu, 1.0)
    if path == "cpu":
        for s in _uses_sdpa(cu[1:] - cu[:-1], lens).nonzero().flatten().tolist():
            rounded[cu[s]:cu[s + 1]] = expected[cu[s]:cu[s + 1]]
    return rounded


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


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_round_trip(kind):
    kind = KV_QUANT_DTYPES[kind]
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[4, 1] = 0.0  # an all-zero row: scale 0, values 0
    q, scale = quantize_kv_rows(x, kind)
    assert q.dtype == kind.storage and scale.dtype == torch.float32 and scale.shape == (50, 3)
    assert float(q.float().abs().amax()) == kind.max and bool((scale[4, 1] == 0) & (q[4, 1].float() == 0).all())
    error = (dequantize_kv_rows(q, scale) - x).abs()
    if kind is INT8:
        assert bool((error <= scale[..., None] / 2 + 1e-7).all())
    else:  # half a step of the format's grid around each value: a relative step of 2^-mantissa bits
        mantissa = 3 if kind is FP8_E4M3 else 2
        assert bool((error <= x.abs() * 2.0 ** -(mantissa + 1) + scale[..., None] * 2.0 ** -9).all())


def interesting_values(kind) -> torch.Tensor:
    """Every finite value of the fp8 format, the ties halfway between neighbours and the float32
    values either side of each tie, subnormals, values that underflow to zero (those just above
    half the smallest subnormal round up), float32 subnormals and negative zero."""
    grid = torch.arange(256, dtype=torch.uint8).view(kind.storage).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    smallest = float(grid[grid > 0].min())
    tiny = torch.tensor([smallest / 2, smallest / 4, smallest * 0.75, smallest * 0.500001, 1e-30, 1e-40, -1e-40, -0.0])
    values = torch.cat([grid, ties, torch.nextafter(ties, torch.tensor(float("inf"))),
                        torch.nextafter(ties, torch.tensor(float("-inf"))), tiny, -tiny])
    return values[values.abs() <= kind.max]


@pytest.mark.parametrize("kind", FP8)
def test_fp8_encoding_is_torchs_cast(kind):
    """The reference encoder (what the Triton and C++ stores are checked against) is torch's cast,
    saturating past the format's largest value instead of becoming NaN or infinity."""
    kind = KV_QUANT_DTYPES[kind]
    values = interesting_values(kind)
    assert torch.equal(kind.encode(values).view(torch.uint8), values.to(kind.storage).view(torch.uint8))
    beyond = torch.tensor([kind.max * 1.01, kind.max * 1.5, 1e30, float("inf")])
    for sign in (1, -1):
        assert torch.equal(kind.encode(sign * beyond).float(), torch.full((4,), sign * kind.max))


@pytest.mark.parametrize("kind", KINDS)
def test_block_is_self_contained(kind):
    """Moving a block's bytes moves its rows and its scales: what swap and copy-on-write do."""
    cache = quantized(torch.randn(4, 16, 2, 64, generator=torch.Generator().manual_seed(1)), KV_QUANT_DTYPES[kind])
    before = cache.dequantize()
    kv_storage(cache)[3] = kv_storage(cache)[0]
    assert torch.equal(cache.dequantize()[3], before[0]) and torch.equal(cache.dequantize()[1:3], before[1:3])
    assert cache.blocks.shape == (4, QuantizedKV.block_bytes(16, 2, 64)) == (4, 16 * 2 * (64 + 4))
    assert cache.kind is KV_QUANT_DTYPES[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_dequantizes(case, heads, path, kind):
    args, expected = quantized_batch(*CASES[case], HEADS[heads], seed=len(case), kind=KV_QUANT_DTYPES[kind])
    out = PATHS[path](*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected_of_path(path, args, expected), **EXACT)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize("head_dim", [80, 36])
def test_attention_dequantizes_other_head_dims(head_dim, path, kind):
    """80: the 8-lane kernel of 10 vectors; 36: the plain loops."""
    args, expected = quantized_batch([1, 12, 1], [30, 12, 5], (6, 2), head_dim=head_dim, seed=head_dim,
                                     kind=KV_QUANT_DTYPES[kind])
    torch.testing.assert_close(PATHS[path](*args), expected_of_path(path, args, expected), **EXACT)


@pytest.mark.parametrize("kind", FP8)
@pytest.mark.parametrize("head_dim", [64, 36])
def test_every_fp8_code_decodes_to_torchs_value(head_dim, kind):
    """A sequence of one position attends to it alone (probability exactly 1), so the output is
    that position's value row de-quantized: with scale 1, each code's value. Every finite code
    goes through each attention path; at head size 64 the C++ kernel's vectors decode them, at 36
    its plain loops, whose rows end in the table's scalar tail."""
    kind = KV_QUANT_DTYPES[kind]
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(kind.storage).float())]
    codes = torch.cat([codes, codes[:(-len(codes)) % head_dim]])
    seqs = len(codes) // head_dim
    k, v = (QuantizedKV.zeros(seqs, 16, 1, head_dim, kind) for _ in range(2))
    v.data.view(torch.uint8)[:, 0, 0] = codes.view(seqs, head_dim)
    for cache in (k, v):
        cache.scale.fill_(1.0)
    query = torch.randn(seqs, 2, head_dim, generator=torch.Generator().manual_seed(2))
    tables = torch.arange(seqs, dtype=torch.int32)[:, None]
    lens, cu = torch.ones(seqs, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32)
    want = codes.view(kind.storage).float().view(seqs, 1, head_dim).expand(seqs, 2, head_dim)
    for name, path in PATHS.items():
        assert torch.equal(path(query, k, v, tables, lens, cu, 0.125), want), name
    assert torch.equal(paged_attention_triton(query, k, v, tables, lens, cu, 0.125), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", [p for p in PATHS if p.startswith("cpp_")])
def test_a_chunks_tokens_get_the_bits_each_gets_as_a_decode(path, kind):
    """The C++ kernel widens an fp8 block to bfloat16 once when a task has several tokens to
    read it, and in registers for a decode: the same floats, so each token of a chunk gets the
    bits it gets as a decode over the same prefix (what the engine's batch invariance needs,
    since the batch decides how a prompt is chunked)."""
    chunk, context = 40, 300
    (query, k, v, tables, lens, cu, scale), _ = quantized_batch([chunk], [context], HEADS["gqa3"], seed=11,
                                                                kind=KV_QUANT_DTYPES[kind])
    together = PATHS[path](query, k, v, tables, lens, cu, scale)
    as_decodes = PATHS[path](query, k, v, tables.expand(chunk, -1).contiguous(),
                             torch.arange(context - chunk + 1, context + 1, dtype=torch.int32),
                             torch.arange(chunk + 1, dtype=torch.int32), scale)
    assert torch.equal(together, as_decodes)


@pytest.mark.skipif(_BUILT is None or _BUILT.attention_lanes() < 16, reason="needs the 16-lane kernel (AVX-512)")
def test_int8_keys_score_exactly_at_every_vector_width():
    """The int8 keys' dot products are integers, summed exactly whatever the order: the 8- and
    16-lane kernels, whose float32 sums fold their lanes differently, give the same bits."""
    for case in CASES:
        args, _ = quantized_batch(*CASES[case], HEADS["gqa3"], seed=len(case), kind=INT8)
        assert torch.equal(PATHS["cpp_8_lanes"](*args), PATHS["cpp_16_lanes"](*args)), case


@pytest.mark.parametrize("kind", KINDS)
def test_attention_dequantizes_bfloat16_query(kind):
    """A bf16 model's query over quantized KV: rows de-quantized to float32 all the same."""
    args, _ = quantized_batch([1, 9, 1], [40, 20, 300], (9, 3), seed=5, dtype=torch.bfloat16,
                              kind=KV_QUANT_DTYPES[kind])
    expected = naive_paged_attention(args[0].float(), args[1].dequantize(), args[2].dequantize(), *args[3:])
    for path in PATHS.values():
        out = path(*args)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_attention_dequantizes(kind):
    for case in ("decodes", "mixed"):
        for heads in ("gqa1", "gqa3"):
            args, expected = quantized_batch(*CASES[case], HEADS[heads], seed=7, kind=KV_QUANT_DTYPES[kind])
            torch.testing.assert_close(paged_attention_triton(*args), expected, atol=2e-5, rtol=1e-5)


def _store_inputs(dtype=torch.float32, block_size=16, kind=INT8):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, tokens = 6, 3, 64, 20
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 8, generator=g).to(dtype)
    key = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[0, 7, 19]] = -1
    fresh = [QuantizedKV.zeros(num_blocks, block_size, kv_heads, head_dim, kind) for _ in range(2)]
    return key, value, slots, fresh


def _assert_stored(key, value, slots, k, v):
    """Every written row is the float32 quantization of its input (int8: to one step of
    rounding, the kernels may divide in another order; fp8: to the bit), and nothing else was
    written."""
    keep = slots >= 0
    bs = k.shape[1]
    blocks, offsets = slots[keep] // bs, slots[keep] % bs
    for x, cache in ((key[keep], k), (value[keep], v)):
        q, scale = quantize_kv_rows(x, cache.kind)
        torch.testing.assert_close(cache.scale[blocks, offsets], scale, atol=0, rtol=1e-6)
        if cache.kind is INT8:
            assert int((cache.data[blocks, offsets].int() - q.int()).abs().max()) <= 1
        else:
            assert torch.equal(cache.data[blocks, offsets].view(torch.uint8), q.view(torch.uint8))
        untouched = torch.ones(cache.shape[0] * bs, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert not cache.data.view(torch.uint8).reshape(-1, *cache.shape[2:])[untouched].any()
        assert not cache.scale.reshape(-1, cache.shape[2])[untouched].any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_quantizes(dtype, kind):
    kind = KV_QUANT_DTYPES[kind]
    key, value, slots, (k, v) = _store_inputs(dtype, kind=kind)
    store_kv_reference(key, value, k, v, slots)
    _assert_stored(key, value, slots, k, v)
    key, value, slots, (kt, vt) = _store_inputs(dtype, kind=kind)
    store_kv_triton(key, value, kt, vt, slots)
    _assert_stored(key, value, slots, kt, vt)
    # The interpreter's round half to even is torch.round's: the same bytes.
    assert torch.equal(kt.blocks, k.blocks) and torch.equal(vt.blocks, v.blocks)


@pytest.mark.skipif(_BUILT is None, reason="the C++ kernels are not built on this machine")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rotary_store_quantizes(dtype, kind):
    """The C++ RoPE-and-store writes the rotated key and the value quantized."""
    from kernels import build_cos_sin_cache, rotary_embedding_reference, rotary_store_kv_cpu

    key, value, slots, (k, v) = _store_inputs(dtype, kind=KV_QUANT_DTYPES[kind])
    tokens, kv_heads, head_dim = key.shape
    g = torch.Generator().manual_seed(3)
    query = torch.randn(tokens, 2 * kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0)
    q_out = rotary_store_kv_cpu(positions, query, key, value, cos_sin, k, v, slots)
    q_ref, k_ref = rotary_embedding_reference(positions, query, key, cos_sin)
    assert torch.equal(q_out, q_ref)
    _assert_stored(k_ref, value, slots, k, v)


@pytest.mark.parametrize("path", ["cpp", "triton"])
@pytest.mark.parametrize("kind", FP8)
def test_fp8_stores_encode_as_torchs_cast(kind, path):
    """Rows whose largest value is the format's largest have scale 1, so every other value of
    the row is encoded as it is: the C++ store's bit manipulation and the Triton store's cast
    give torch's cast of each value of interest, to the bit."""
    from kernels import build_cos_sin_cache, rotary_store_kv_cpu

    if path == "cpp" and _BUILT is None:
        pytest.skip("the C++ kernels are not built on this machine")
    kind = KV_QUANT_DTYPES[kind]
    head_dim = 64
    values = interesting_values(kind)
    values = torch.cat([values, values[:(-len(values)) % (head_dim - 1)]]).view(-1, 1, head_dim - 1)
    rows = torch.cat([torch.full((values.shape[0], 1, 1), kind.max), values], dim=2)
    tokens = rows.shape[0]
    k, v = (QuantizedKV.zeros(-(-tokens // 16), 16, 1, head_dim, kind) for _ in range(2))
    slots = torch.arange(tokens)
    if path == "cpp":
        positions = torch.zeros(tokens, dtype=torch.int64)  # position 0: RoPE leaves the key as it is
        rotary_store_kv_cpu(positions, rows.clone(), rows, rows, build_cos_sin_cache(head_dim, 4, 10000.0), k, v,
                            slots)
    else:
        store_kv_triton(rows, rows, k, v, slots)
    stored = v.data.reshape(-1, head_dim)[:tokens]
    assert bool((v.scale.reshape(-1)[:tokens] == 1.0).all())
    assert torch.equal(stored.view(torch.uint8), rows.view(tokens, head_dim).to(kind.storage).view(torch.uint8))
