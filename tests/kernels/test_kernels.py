"""Triton kernels, run on CPU by Triton's interpreter, against the torch references.

CPU launches always go through Triton's interpreter (`kernels.triton_utils.launch`), and
`test_kernels_run_in_the_interpreter` checks that every kernel really executes there.
On a machine without a GPU, TRITON_INTERPRET=1 is also set before triton is imported (the
documented switch; nothing here could run compiled kernels anyway). On a GPU machine it
is left alone: it would turn the GPU tests of this process, and any server started from
it, into interpreter runs.

Shapes stay small: the interpreter runs each program in Python. bfloat16 is left out here:
the interpreter stores it as raw uint16 and cannot do arithmetic on it (float16 exercises
the same 16-bit paths); `test_kernels_compile_for_gpu` compiles the bf16 variants.
"""

import os
import sys
import zlib

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import given, settings, strategies as st

import kernels
from backend.paths import REPO_ROOT
from kernels import (
    build_cos_sin_cache,
    paged_attention_reference,
    paged_attention_triton,
    rms_norm_reference,
    rms_norm_triton,
    rotary_embedding_reference,
    rotary_embedding_triton,
    silu_and_mul_reference,
    silu_and_mul_triton,
    store_kv_reference,
    store_kv_triton,
)
from kernels.testing import make_paged_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# (q_lens, seq_lens) per sequence; block sizes 16 and 32 are both exercised by every case.
SCENARIOS = {
    # 1-token decodes: context of 1, exactly one block of 16, one block of 32, across blocks
    "decodes": ([1, 1, 1, 1, 1], [1, 16, 32, 33, 70]),
    # a fresh prompt (empty cached context) that ends inside a block
    "prefill_from_empty": ([37], [37]),
    # chunks that start and end inside a block (cached 3 -> 11, cached 20 -> 27)
    "chunks_inside_block": ([8, 7], [11, 27]),
    # cached context of exactly one block (16 or 32), then a chunk
    "after_one_block": ([9, 5], [16 + 9, 32 + 5]),
    # the engine's usual step: decodes mixed with prefill chunks, ragged
    "mixed": ([1, 23, 1, 7, 1, 1], [40, 23, 1, 30, 65, 17]),
    # a longer prefill chunk after a cached prefix
    "long_prefill": ([90, 1], [120, 50]),
}
HEADS = {"gqa1": (2, 2), "gqa4": (8, 2), "gqa8": (8, 1)}   # (num_q_heads, num_kv_heads)


def _assert_attention_matches(batch, **kw):
    ref = paged_attention_reference(*batch.args(), **kw)
    out = paged_attention_triton(*batch.args(), **kw)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[batch.query.dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=list(SCENARIOS))
def test_paged_attention_grid(scenario, heads, head_dim, block_size):
    q_lens, seq_lens = SCENARIOS[scenario]
    num_q_heads, num_kv_heads = HEADS[heads]
    seed = zlib.crc32(f"{scenario}/{heads}/{head_dim}/{block_size}".encode()) % 1000
    batch = make_paged_batch(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, seed=seed)
    _assert_attention_matches(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, softcap", [(7, 0.0), (0, 3.0), (20, 3.0)])
@pytest.mark.parametrize("scenario", ["decodes", "mixed", "long_prefill"])
def test_paged_attention_sliding_window_and_softcap(scenario, window, softcap, dtype):
    """Gemma's windowed and soft-capped attention: tiles wholly before a query's window are
    skipped, tiles it sees only partly are masked (rows seeing none of a tile stay finite)."""
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_paged_batch(q_lens, seq_lens, 8, 2, 64, 16, dtype=dtype, seed=window)
    _assert_attention_matches(batch, window=window, softcap=softcap)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_paged_attention_padded_head_dims(head_dim):
    batch = make_paged_batch([1, 12, 1], [30, 12, 5], 6, 2, head_dim, 16, seed=head_dim)
    _assert_attention_matches(batch)


def test_paged_attention_sequences_without_new_tokens():
    # cu_seqlens_q may repeat (a sequence scheduled with no new tokens): nothing to do for it
    batch = make_paged_batch([0, 3, 1, 0, 2], [5, 3, 9, 1, 40], 8, 2, 64, 16, seed=11)
    _assert_attention_matches(batch)


@pytest.mark.parametrize("max_seqlen_q", [None, 1, 64])
def test_paged_attention_tile_shapes(max_seqlen_q):
    # The hint picks 16- or 64-row query tiles; both must give the same result.
    batch = make_paged_batch([1, 20, 1, 3], [9, 45, 33, 3], 9, 3, 64, 16, seed=3)
    _assert_attention_matches(batch, max_seqlen_q=max_seqlen_q)


def test_paged_attention_float16_and_odd_gqa():
    batch = make_paged_batch([1, 14, 1], [40, 20, 17], 9, 3, 64, 16, dtype=torch.float16, seed=5)
    _assert_attention_matches(batch)


def test_paged_attention_strided_query():
    # q as a view into a fused qkv projection output (token stride > heads * head_dim)
    batch = make_paged_batch([3, 1], [10, 20], 4, 2, 64, 16, seed=7)
    qkv = torch.randn(batch.query.shape[0], (4 + 2 * 2) * 64)
    qkv[:, :4 * 64] = batch.query.reshape(-1, 4 * 64)
    batch.query = qkv[:, :4 * 64].view(-1, 4, 64)
    assert not batch.query.is_contiguous()
    _assert_attention_matches(batch)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
    heads=st.sampled_from(list(HEADS.values())),
    block_size=st.sampled_from([16, 32]),
    decode_mask=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_paged_attention_property(seqs, heads, block_size, decode_mask):
    q_lens = [1 if decode_mask[i] else q for i, (_, q) in enumerate(seqs)]
    seq_lens = [cached + q for (cached, _), q in zip(seqs, q_lens)]
    batch = make_paged_batch(q_lens, seq_lens, heads[0], heads[1], 64, block_size, seed=len(seqs))
    _assert_attention_matches(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, tokens = 6, 3, 64, 20
    # key/value as views into a fused projection output, like the engine produces them
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 8, generator=g).to(dtype)
    key = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[0, 7, 19]] = -1
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    k_tri, v_tri = caches[0].clone(), caches[1].clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    assert not torch.equal(k_ref, caches[0])   # something was written ...
    written = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_ref.view(-1, kv_heads, head_dim)[untouched],
                       caches[0].view(-1, kv_heads, head_dim)[untouched])   # ... and nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(2, 3, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    residual = torch.randn(2, 3, hidden, generator=g).to(dtype) if with_residual else None
    ref = rms_norm_reference(x, weight, 1e-5, residual)
    out = rms_norm_triton(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(out[1], ref[1])   # the residual sum is bit-exact
        ref, out = ref[0], out[0]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 8, 1), (96, 4, 4)])
def test_rotary_embedding(dtype, is_neox, head_dim, q_heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim + q_heads)
    cache = build_cos_sin_cache(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (7,), generator=g)
    query = torch.randn(7, q_heads * head_dim, generator=g).to(dtype)        # [T, Hq * D]
    key = torch.randn(7, kv_heads, head_dim, generator=g).to(dtype)          # [T, Hkv, D]
    q_ref, k_ref = rotary_embedding_reference(positions, query, key, cache, is_neox)
    q_out, k_out = rotary_embedding_triton(positions, query, key, cache, is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


def test_rotary_embedding_partial_rotary_dim():
    cache = build_cos_sin_cache(64, 64, 10000.0, {"partial_rotary_factor": 0.5})
    assert cache.shape == (64, 32)
    positions = torch.arange(5)
    query, key = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    q_ref, k_ref = rotary_embedding_reference(positions, query, key, cache)
    q_out, k_out = rotary_embedding_triton(positions, query, key, cache)
    torch.testing.assert_close(q_out, q_ref)
    torch.testing.assert_close(k_out, k_ref)
    assert torch.equal(q_out[..., 32:], query[..., 32:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [64, 1536, 1000])
def test_silu_and_mul(dtype, inter):
    x = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    ref = silu_and_mul_reference(x)
    out = silu_and_mul_triton(x)
    assert out.shape == (5, inter)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_kernels_run_in_the_interpreter(monkeypatch):
    """Every *_triton function launches exactly one program grid through the interpreter."""
    from triton.runtime import interpreter

    launches = []
    original = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting)
    batch = make_paged_batch([1, 4], [5, 4], 4, 2, 64, 16)
    paged_attention_triton(*batch.args())
    k = torch.randn(2, 2, 64)
    store_kv_triton(k, k, batch.k_cache.clone(), batch.v_cache.clone(), torch.tensor([0, -1]))
    rms_norm_triton(torch.randn(2, 64), torch.ones(64), 1e-6)
    rotary_embedding_triton(torch.arange(2), torch.randn(2, 4, 64), k, build_cos_sin_cache(64, 8, 1e4))
    silu_and_mul_triton(torch.randn(2, 128))
    assert launches == ["_paged_attention_kernel", "_store_kv_kernel", "_rms_norm_kernel",
                        "_rotary_kernel", "_silu_and_mul_kernel"]


def test_dispatch_runs_the_cpu_paths_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("Triton kernel called for CPU tensors")

    for name in ("store_kv", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul"):
        monkeypatch.setattr(kernels, f"{name}_triton", boom)
    batch = make_paged_batch([1, 3], [9, 3], 4, 2, 64, 16)
    # Paged attention's CPU path is its own (the C++ kernel).
    out = kernels.paged_attention(*batch.args())
    assert torch.equal(out, kernels.paged_attention_cpu(*batch.args()))
    torch.testing.assert_close(out, paged_attention_reference(*batch.args()), atol=3e-6, rtol=3e-6)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    # RMSNorm's CPU path is C++ too, equal to the reference to the bit.
    normed = kernels.rms_norm(x, torch.ones(64), 1e-6)
    assert torch.equal(normed, kernels.rms_norm_cpu(x, torch.ones(64), 1e-6))
    assert torch.equal(normed, rms_norm_reference(x, torch.ones(64), 1e-6))
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_reference(x))
    cache = build_cos_sin_cache(64, 16, 1e4)
    q, k = kernels.rotary_embedding(torch.arange(3), x, x, cache)
    assert torch.equal(q, rotary_embedding_reference(torch.arange(3), x, x, cache)[0])
    kc, vc = torch.zeros(2, 16, 1, 64), torch.zeros(2, 16, 1, 64)
    kernels.store_kv(x.view(3, 1, 64), x.view(3, 1, 64), kc, vc, torch.tensor([0, 17, -1]))
    assert torch.equal(kc[0, 0, 0], x[0]) and torch.equal(kc[1, 1, 0], x[1])
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    q2 = kernels.rotary_store_kv(torch.arange(3), x.view(3, 1, 64), x.view(3, 1, 64), x.view(3, 1, 64), cache, kc2, vc2,
                                 torch.tensor([0, 17, -1]))
    assert torch.equal(q2, q.view(3, 1, 64)) and torch.equal(kc2[1, 1, 0], q[1]) and torch.equal(vc2[0, 0, 0], x[0])


def test_kernels_compile_for_gpu(tmp_path):
    """The interpreter is lenient: compile every kernel for sm_90 too (Triton ships ptxas,
    no GPU needed), in a clean process because TRITON_INTERPRET=1 is set in this one."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = str(REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--quick"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mma=0 " not in proc.stdout.split("paged_attention", 1)[1]   # tensor cores are used
