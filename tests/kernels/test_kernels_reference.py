"""The torch references and the CPU production path against naive loops and against HF.

The references are what the engine runs on CPU (paged attention excepted: a C++
kernel, `paged_attention_cpu`, checked here the same way), and what the Triton
kernels are checked against, so they are checked here against implementations too simple
to be wrong, and against transformers' own Llama modules where those define the numerics
(bit-exact).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from backend.paths import REPO_ROOT
from kernels import (
    build_cos_sin_cache,
    cpu_ext,
    paged_attention_cpu,
    paged_attention_reference,
    rms_norm_cpu,
    rms_norm_reference,
    rotary_embedding_reference,
    rotary_store_kv_cpu,
    silu_and_mul_cpu,
    silu_and_mul_reference,
    store_kv_reference,
)
from kernels.testing import make_paged_batch, naive_paged_attention, naive_rms_norm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# float32: same math as straightforward attention, only summation order differs.
EXACT = dict(atol=3e-6, rtol=3e-6)
LOW = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}

CASES = {
    "decodes": ([1, 1, 1, 1, 1], [1, 16, 32, 33, 70]),
    "prefill_from_empty": ([37], [37]),
    "chunks_inside_block": ([8, 7], [11, 27]),
    "after_one_block": ([9, 5], [16 + 9, 32 + 5]),
    "mixed": ([1, 23, 1, 7, 1, 1], [40, 23, 1, 30, 65, 17]),
    "long_prefill": ([150, 1], [300, 50]),
    # a long chunk at a long context (paged_attention_cpu sends it to SDPA) beside decodes and a short chunk
    "long_context_chunk": ([1, 100, 3, 1], [40, 600, 5, 700]),
    # decode contexts so uneven that the reference splits them into several padded groups
    "skewed_decodes": ([1] * 9, [1500, 5, 7, 1, 600, 30, 31, 2, 900]),
    "many_decodes": ([1] * 40, [(i * 37) % 200 + 1 for i in range(40)]),
    "empty_sequence": ([0, 3, 1, 0], [5, 3, 9, 1]),   # sequences with no new tokens
    # contexts past 2048 positions, which the C++ kernel splits in parts (kPartPositions): at the
    # edges, several parts, and a chunk whose tokens straddle the first edge
    "split_contexts": ([1, 1, 1, 30, 1], [2048, 2049, 4100, 2070, 5000]),
}
# Up to 4 KV heads the decode path uses one block-diagonal matmul, beyond that one per KV head.
HEADS = {"gqa1": (2, 2), "gqa3": (9, 3), "gqa8": (8, 1), "gqa2_kv8": (16, 8)}


def _cpu_kernel_with_lanes(lanes: int):
    """The C++ kernel with vectors of `lanes` floats (8: AVX2, 16: AVX-512), whatever the
    machine's best: each path is checked where the CPU has it."""
    def attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, window=0, softcap=0.0):
        return cpu_ext.load().paged_attention(query, k_cache, v_cache, block_tables.to(torch.int32),
                                              seq_lens.to(torch.int32), cu_seqlens_q.to(torch.int32), scale, lanes,
                                              window=window, softcap=softcap)
    return attention


_BUILT = cpu_ext.load()
ATTENTION = {"reference": paged_attention_reference, "cpu": paged_attention_cpu,
             **{f"cpu_{lanes}_lanes": _cpu_kernel_with_lanes(lanes)
                for lanes in (8, 16) if _BUILT is not None and lanes <= _BUILT.attention_lanes()}}


def test_cpp_cpu_kernels_build_on_this_machine():
    """Else paged_attention_cpu silently is the reference, and the tests below test it twice."""
    assert cpu_ext.load() is not None, "kernels/cpu_ext.py could not build the C++ kernels (see its warning)"


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_reference_matches_naive(case, heads, block_size, impl):
    q_lens, seq_lens = CASES[case]
    batch = make_paged_batch(q_lens, seq_lens, *HEADS[heads], 64, block_size, seed=block_size)
    out = ATTENTION[impl](*batch.args())
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out, naive_paged_attention(*batch.args()), **EXACT)


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("window, softcap", [(5, 0.0), (16, 0.0), (0, 2.0), (16, 2.0)])
@pytest.mark.parametrize("case", ["decodes", "chunks_inside_block", "mixed", "long_context_chunk", "skewed_decodes",
                                  "split_contexts"])
def test_paged_attention_sliding_window_and_softcap_match_naive(case, window, softcap, impl):
    """Gemma's attention: each token sees its last `window` positions (contexts here cross the
    window), scores tanh-capped; decodes, chunks and the SDPA-sized chunk at a long context."""
    q_lens, seq_lens = CASES[case]
    batch = make_paged_batch(q_lens, seq_lens, 9, 3, 64, 16, seed=window + int(softcap))
    kw = dict(window=window, softcap=softcap)
    out = ATTENTION[impl](*batch.args(), **kw)
    expected = naive_paged_attention(*batch.args(), **kw)
    torch.testing.assert_close(out, expected, **EXACT)
    if window:   # the window really hides keys: full attention differs
        assert not torch.allclose(naive_paged_attention(*batch.args(), softcap=softcap), expected, **EXACT)


def test_paged_attention_cpu_sends_only_long_chunks_at_long_contexts_to_sdpa(monkeypatch):
    paged = sys.modules["kernels.paged_attention"]  # `kernels.paged_attention` is also the function's name

    chunks = []

    def counting_prefill(q, *args):
        chunks.append(q.shape[0])
        return prefill(q, *args)

    prefill = paged._prefill
    monkeypatch.setattr(paged, "_prefill", counting_prefill)
    q_lens, seq_lens = CASES["long_context_chunk"]
    batch = make_paged_batch(q_lens, seq_lens, 9, 3, 64, 16, seed=3)
    for max_seqlen_q in (None, max(q_lens)):
        out = paged_attention_cpu(*batch.args(), max_seqlen_q, max(seq_lens))
        torch.testing.assert_close(out, naive_paged_attention(*batch.args()), **EXACT)
    assert chunks == [100, 100]   # the 100-token chunk at context 600; decodes and the 3-token chunk: C++
    chunks.clear()
    paged_attention_cpu(*make_paged_batch([200, 1], [200, 900], 9, 3, 64, 16).args(), 200, 900)
    assert chunks == []   # 200 from empty: mean context 100, the C++ kernel's


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("head_dim", [20, 24, 32, 80, 96, 128, 256])  # 20: not a multiple of 8, the plain loops
def test_paged_attention_reference_head_dims(head_dim, impl):
    batch = make_paged_batch([1, 12, 1], [30, 12, 5], 6, 2, head_dim, 16, seed=head_dim)
    torch.testing.assert_close(ATTENTION[impl](*batch.args()),
                               naive_paged_attention(*batch.args()), **EXACT)


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (16, 8)])
def test_paged_attention_reference_low_precision(dtype, heads, impl):
    batch = make_paged_batch([1, 14, 1, 1], [40, 20, 17, 300], *heads, 64, 16, dtype=dtype, seed=1)
    out = ATTENTION[impl](*batch.args())
    assert out.dtype == dtype
    # float32 accumulation: as close to the float32 result as the output rounding allows
    torch.testing.assert_close(out.float(), naive_paged_attention(*batch.args()), **LOW[dtype])


def test_paged_attention_reference_is_plain_softmax_attention():
    """A contiguous (non-paged) single sequence equals F.softmax(q k^T * scale) v exactly enough."""
    g = torch.Generator().manual_seed(0)
    seq, heads, dim, bs = 48, 4, 64, 16
    q, k, v = (torch.randn(seq, heads, dim, generator=g) for _ in range(3))
    k_cache, v_cache = k.view(3, bs, heads, dim), v.view(3, bs, heads, dim)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    scale = dim ** -0.5
    for q_len in (1, 5, seq):
        out = paged_attention_reference(q[-q_len:], k_cache, v_cache, tables, torch.tensor([seq], dtype=torch.int32),
                                        torch.tensor([0, q_len], dtype=torch.int32), scale)
        scores = torch.einsum("qhd,khd->hqk", q[-q_len:], k) * scale
        causal = torch.arange(seq)[None, :] <= torch.arange(seq - q_len, seq)[:, None]
        expected = torch.einsum("hqk,khd->qhd", F.softmax(scores.masked_fill(~causal, float("-inf")), -1), v)
        torch.testing.assert_close(out, expected, **EXACT)


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_paged_attention_reference_empty_batch(impl):
    batch = make_paged_batch([1], [4], 4, 2, 64, 16)
    out = ATTENTION[impl](batch.query[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0],
                                    batch.seq_lens[:0], torch.zeros(1, dtype=torch.int32), batch.scale)
    assert out.shape == (0, 4, 64)


def test_store_kv_reference_matches_loop():
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    slots = torch.tensor([5, -1, 0, 31, 16, -1, 7, 8, 30, 1])
    k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    store_kv_reference(key, value, k_cache, v_cache, slots)
    k_loop, v_loop = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_loop[slot // 16, slot % 16] = key[t]
            v_loop[slot // 16, slot % 16] = value[t]
    assert torch.equal(k_cache, k_loop) and torch.equal(v_cache, v_loop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 576, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    residual = torch.randn(4, 5, 576, generator=g).to(dtype)
    out = rms_norm_reference(x, weight, 1e-5)
    torch.testing.assert_close(out.double(), naive_rms_norm(x, weight, 1e-5),
                               **(EXACT if dtype == torch.float32 else LOW[dtype]))
    out2, r = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(r, x + residual)
    assert torch.equal(out2, rms_norm_reference(x + residual, weight, 1e-5))

    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        assert torch.equal(out, hf(x))   # bit-exact


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_cpu_matches_the_reference(dtype, threads):
    """The C++ pass rounds where the reference rounds and adds up a row's squares in torch's
    own order: equal to the bit, at hidden sizes shorter than one vector, with leftover
    vectors and elements, and long enough for torch's second and third summation levels."""
    g = torch.Generator().manual_seed(2)
    torch.set_num_threads(threads)  # the fixture restores it
    for width in (576, 5, 100, 2049, 16384, 70000):
        x = (3 * torch.randn(37, width, generator=g)).to(dtype)
        weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
        residual = torch.randn(37, width, generator=g).to(dtype)
        out = rms_norm_cpu(x, weight, 1e-5)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out, rms_norm_reference(x, weight, 1e-5)), width
        out2, summed = rms_norm_cpu(x, weight, 1e-5, residual)
        ref2, ref_summed = rms_norm_reference(x, weight, 1e-5, residual)
        assert torch.equal(summed, ref_summed) and torch.equal(out2, ref2), width
    # a 3-D input and a mismatched weight dtype (the reference then) still work
    x, weight = x[:, :576], weight[:576].float()
    assert torch.equal(rms_norm_cpu(x.reshape(1, 37, 576), weight.to(dtype), 1e-5),
                       rms_norm_reference(x, weight.to(dtype), 1e-5).view(1, 37, 576))
    assert torch.equal(rms_norm_cpu(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_store_kv_cpu_is_the_reference_bit_for_bit(dtype, is_neox, rotary_dim, threads):
    """RoPE then the cache store, on views of a fused qkv output as the model passes them,
    with padding slots (-1) and partial rotary dimensions: the same bits as the reference."""
    g = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, head_dim, block_size, num_blocks = 21, 9, 3, 64, 16, 6
    cache = build_cos_sin_cache(rotary_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = (2 * torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[2, 7, 8]] = -1
    torch.set_num_threads(threads)
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    q_ours = rotary_store_kv_cpu(positions, q, k, v, cache, caches[0], caches[1], slots, is_neox)
    q_ref, k_ref = rotary_embedding_reference(positions, q, k, cache, is_neox)
    store_kv_reference(k_ref, v, caches[2], caches[3], slots)
    assert q_ours.shape == q.shape and q_ours.dtype == dtype
    assert torch.equal(q_ours, q_ref)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))  # unwritten slots stay NaN in both
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


def test_silu_and_mul_reference():
    x = torch.randn(3, 2 * 7, generator=torch.Generator().manual_seed(0))
    out = silu_and_mul_reference(x)
    expected = torch.empty(3, 7)
    for t in range(3):
        for i in range(7):
            gate, up = float(x[t, i]), float(x[t, 7 + i])
            expected[t, i] = gate / (1 + torch.exp(torch.tensor(-gate)).item()) * up
    torch.testing.assert_close(out, expected, **EXACT)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(144, 2 * 1536), (1, 2 * 1536), (5, 2 * 37), (2, 3, 2 * 64), (1, 2 * 8192),
                                   (3, 2 * 5003)],
                         ids=["w1_mixed_step", "one_row", "odd_width", "3d", "one_row_in_slices",
                              "rows_in_slices_odd_width"])
def test_silu_and_mul_cpu_is_bit_identical_to_the_reference(dtype, shape):
    """The engine's greedy tokens must equal HF's: the C++ path (SLEEF's expf, torch's order
    of roundings) gives exactly torch's values, not values within an ulp of them."""
    x = (4 * torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))).to(dtype)
    out = silu_and_mul_cpu(x)
    assert out.shape == shape[:-1] + (shape[-1] // 2,) and out.dtype == dtype
    assert torch.equal(out, silu_and_mul_reference(x))

# The C++ kernels match torch to the bit by doing what torch runs on this machine, which is
# not what its CPU capability says (kernels/cpu/layer_ops.cpp and activation.cpp ask torch).
# Each capability this CPU has, forced with ATEN_CPU_CAPABILITY in a process of its own. torch
# does not clamp the variable to the CPU: forcing avx512 on an AVX2-only CPU runs torch's own
# AVX-512 kernels and dies of SIGILL, so a capability above the CPU's is not a case here.
BIT_IDENTICAL = "rms_norm_cpu_matches or silu_and_mul_cpu_is_bit or rotary_store_kv_cpu_is"
CPU_CAPABILITIES = ["default"] + ["avx2"] * torch.cpu._is_avx2_supported() + ["avx512"] * torch.cpu._is_avx512_supported()


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
def test_the_bit_identical_kernels_follow_torch_under_every_capability(capability):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", BIT_IDENTICAL],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "deselected" in run.stdout


ROPE = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    # Qwen2.5's long-context setting, its pretraining context shrunk so the ramp falls inside the head.
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale-untruncated": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2, "truncate": False,
                                "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("rope", list(ROPE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf_llama(rope, dtype):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = ROPE[rope]
    head_dim, max_pos, tokens = 64, 16384, 40
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=dict(params))
    hf = LlamaRotaryEmbedding(config)
    cache = build_cos_sin_cache(head_dim, max_pos, params["rope_theta"], params)
    assert cache.dtype == torch.float32 and cache.shape == (max_pos, head_dim)

    g = torch.Generator().manual_seed(1)
    positions = torch.cat([torch.tensor([0, 1, max_pos - 1]), torch.randint(0, max_pos, (tokens - 3,), generator=g)])
    cos, sin = hf(torch.zeros(1, dtype=dtype), positions[None])
    assert torch.equal(cos[0, :, :head_dim // 2], cache[positions, :head_dim // 2].to(dtype))
    assert torch.equal(sin[0, :, :head_dim // 2], cache[positions, head_dim // 2:].to(dtype))

    q = torch.randn(1, 9, tokens, head_dim, generator=g).to(dtype)
    k = torch.randn(1, 3, tokens, head_dim, generator=g).to(dtype)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_ours, k_ours = rotary_embedding_reference(positions, q[0].transpose(0, 1).reshape(tokens, -1),
                                                k[0].transpose(0, 1), cache)
    assert torch.equal(q_ours.view(tokens, 9, head_dim), q_hf[0].transpose(0, 1))   # bit-exact
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_rotary_gptj_style_matches_loop():
    cache = build_cos_sin_cache(8, 16, 10000.0)
    positions = torch.tensor([3, 0, 15])
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    q, _ = rotary_embedding_reference(positions, x, x, cache, is_neox=False)
    for t, p in enumerate(positions.tolist()):
        for h in range(2):
            for i in range(4):
                c, s = cache[p, i], cache[p, 4 + i]
                a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                torch.testing.assert_close(q[t, h, 2 * i], a * c - b * s)
                torch.testing.assert_close(q[t, h, 2 * i + 1], b * c + a * s)


def test_rope_scaling_rejects_unknown_type():
    with pytest.raises(NotImplementedError):
        build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


# ---- batch invariance: a token's or a row's result alone equals its result in any batch -----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 16), ((6, 2), 20)])  # 20: the plain loops
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_cpu_gives_a_token_the_same_bits_in_any_batch_and_chunk(dtype, heads, head_dim, threads):
    """With `batch_invariant`, a token's attention is the same bits whether it is decoded
    alone, or is one of a prefill chunk of any length among other sequences: the C++ kernel
    reduces over a token's context in an order that depends on that length only, long
    chunks at long contexts included (no SDPA)."""
    torch.set_num_threads(threads)  # the fixture restores it
    batch = make_paged_batch([1, 150, 7, 1, 100], [40, 600, 33, 700, 420], *heads, head_dim, 16, dtype=dtype, seed=5)
    full = paged_attention_cpu(*batch.args(), max_seqlen_q=150, max_seqlen_k=700, batch_invariant=True)
    assert_each_token_alone_gets_its_bits(batch, full)


def assert_each_token_alone_gets_its_bits(batch, full: torch.Tensor, window: int = 0) -> None:
    """Each token of `batch`, decoded alone over its own prefix, gets the bits `full` has for it."""
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    for s in range(len(lens)):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            token = cu[s] + i
            alone = paged_attention_cpu(batch.query[token:token + 1], batch.k_cache, batch.v_cache,
                                        batch.block_tables[s:s + 1], torch.tensor([lens[s] - q_len + i + 1], dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), batch.scale, batch_invariant=True,
                                        window=window)
            assert torch.equal(alone[0], full[token]), (s, i)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_split_contexts_give_a_token_the_same_bits_in_any_batch_and_chunk(threads, window):
    """Past 2048 positions the C++ kernel splits a token's context in parts, tasks of their own,
    merged in order: where it splits depends on the token's length alone, so a token decoded
    alone (its KV heads then each a task, its parts too) has the bits it has in a busy batch, or
    as one of a chunk straddling a part's edge. With a window of 300 every part but the last
    lies wholly before some tokens' windows."""
    torch.set_num_threads(threads)  # the fixture restores it
    batch = make_paged_batch([1, 60, 1, 2, 1], [40, 2100, 4500, 2049, 700], 9, 3, 64, 16, dtype=torch.bfloat16, seed=9)
    full = paged_attention_cpu(*batch.args(), max_seqlen_q=60, max_seqlen_k=4500, batch_invariant=True, window=window)
    torch.testing.assert_close(full.float(), naive_paged_attention(*batch.args(), window=window).float(),
                               **LOW[torch.bfloat16])
    assert_each_token_alone_gets_its_bits(batch, full, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_gives_a_row_the_same_bits_in_any_batch(dtype):
    g = torch.Generator().manual_seed(8)
    x, residual = (torch.randn(45, 576, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    out, summed = rms_norm_cpu(x, weight, 1e-5, residual)
    for row in (0, 7, 44):
        alone, alone_summed = rms_norm_cpu(x[row:row + 1], weight, 1e-5, residual[row:row + 1])
        assert torch.equal(alone[0], out[row]) and torch.equal(alone_summed[0], summed[row])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_longrope_within_the_pretraining_context_matches_hf_phi3(dtype):
    """Phi-3's LongRoPE at positions within original_max_position_embeddings (where transformers
    keeps the short factors, and the loader keeps max_model_len): cos and sin to the bit,
    the extended context's attention factor included."""
    pytest.importorskip("transformers")
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    head_dim, original = 64, 4096
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
              "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)], "long_factor": [8.0] * (head_dim // 2)}
    config = Phi3Config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=131072,
                        original_max_position_embeddings=original, rope_parameters=dict(params))
    hf = Phi3RotaryEmbedding(config)
    cache = build_cos_sin_cache(head_dim, original, params["rope_theta"], {**params, "factor": 131072 / original})
    positions = torch.cat([torch.tensor([0, 1, original - 1]),
                           torch.randint(0, original, (37,), generator=torch.Generator().manual_seed(2))])
    cos, sin = hf(torch.zeros(1, dtype=dtype), positions[None])
    assert torch.equal(cos[0, :, :head_dim // 2], cache[positions, :head_dim // 2].to(dtype))
    assert torch.equal(sin[0, :, :head_dim // 2], cache[positions, head_dim // 2:].to(dtype))
    assert not torch.equal(cache, build_cos_sin_cache(head_dim, original, params["rope_theta"]))
