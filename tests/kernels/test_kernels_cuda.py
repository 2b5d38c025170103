"""The OpenAI Triton kernels compiled and run on an NVIDIA GPU, in every dtype the engine
serves there (bfloat16 included, which the CPU interpreter of test_kernels.py cannot run).

Each kernel's CUDA output is checked against the naive float32 loops of kernels.testing (run
on CPU copies of the same inputs) or the float64 torch reference, with tolerances set by the
dtype's rounding; the kernels' exact operations (the KV store, the residual sum) must match
bit for bit. The shapes include the engine's real ones (Llama-3-8B attention, 2k contexts),
which a grid or an index that overflows only at size would fail.

Skipped where torch sees no CUDA device; its GPU runs are in bench/results/gpu/cuda_tests_*
with the commands that made them.
"""

import zlib

import pytest
import torch

import kernels
from kernels import (
    build_cos_sin_cache,
    lora_delta_triton,
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
from kernels.testing import PagedBatch, make_paged_batch, naive_paged_attention
from tests.kernels.test_kernels import HEADS, SCENARIOS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 attention runs its dots in IEEE fp32 (DOT_PRECISION); the 16-bit types round the
# probabilities to the value type before P.V, an error of about one unit in the last place
# (2^-8 for bf16, 2^-11 for fp16) of each output.
ATTENTION_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
                 torch.float16: dict(atol=4e-3, rtol=4e-3)}
# Elementwise kernels compute in float32 and round once to the output's dtype.
ELEMENTWISE_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
                   torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _on_cuda(batch: PagedBatch) -> PagedBatch:
    return PagedBatch(*(t.to(CUDA) for t in batch.args()[:6]), batch.scale)


def _assert_attention_matches_naive(batch: PagedBatch, **kw):
    """`batch` on CPU; the Triton kernel runs on a CUDA copy."""
    want = naive_paged_attention(*batch.args())          # float32 loops over float32 copies of the inputs
    gpu = _on_cuda(batch)
    out = paged_attention_triton(*gpu.args(), **kw)
    assert out.is_cuda and out.dtype == batch.query.dtype and out.shape == batch.query.shape
    out = out.float().cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, **ATTENTION_TOL[batch.query.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS), ids=list(SCENARIOS))
def test_paged_attention_grid_on_cuda(scenario, heads, head_dim, block_size, dtype):
    q_lens, seq_lens = SCENARIOS[scenario]
    seed = zlib.crc32(f"{scenario}/{heads}/{head_dim}/{block_size}".encode()) % 1000
    batch = make_paged_batch(q_lens, seq_lens, *HEADS[heads], head_dim, block_size, dtype=dtype, seed=seed)
    _assert_attention_matches_naive(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [80, 96])
def test_paged_attention_padded_head_dims_on_cuda(head_dim, dtype):
    batch = make_paged_batch([1, 12, 1], [30, 12, 5], 6, 2, head_dim, 16, dtype=dtype, seed=head_dim)
    _assert_attention_matches_naive(batch)


@pytest.mark.parametrize("max_seqlen_q", [None, 1, 64])
def test_paged_attention_tile_shapes_on_cuda(max_seqlen_q):
    batch = make_paged_batch([1, 20, 1, 3, 0], [9, 45, 33, 3, 7], 9, 3, 64, 16, dtype=torch.bfloat16, seed=3)
    _assert_attention_matches_naive(batch, max_seqlen_q=max_seqlen_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_attention_at_llama3_8b_size(dtype):
    """32 query heads on 8 KV heads of 128, 48 decodes of up to 2k context beside two
    prefill chunks of 300 and 700 tokens after cached prefixes: the engine's real step."""
    g = torch.Generator().manual_seed(8)
    decodes = torch.randint(1, 2048, (48,), generator=g).tolist()
    q_lens = [1] * 48 + [300, 700]
    seq_lens = decodes + [300 + 1200, 700 + 33]
    batch = make_paged_batch(q_lens, seq_lens, 32, 8, 128, 16, dtype=dtype, seed=9)
    gpu = _on_cuda(batch)
    out = paged_attention_triton(*gpu.args()).float()
    # The naive loops would take minutes here: the torch reference in float32 on the GPU.
    want = paged_attention_reference(gpu.query.float(), gpu.k_cache.float(), gpu.v_cache.float(),
                                     *gpu.args()[3:]).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, **ATTENTION_TOL[dtype])


def test_dispatch_runs_the_triton_kernels_on_cuda_tensors(monkeypatch):
    """`kernels.<op>` on CUDA tensors launches the Triton kernel, never the CPU path."""
    called = []
    for name in ("paged_attention_triton", "rms_norm_triton", "silu_and_mul_triton", "store_kv_triton",
                 "rotary_embedding_triton"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name, **k: called.append(_n) or _f(*a, **k))
    batch = _on_cuda(make_paged_batch([1, 5], [9, 5], 4, 2, 64, 16, dtype=torch.bfloat16, seed=1))
    kernels.paged_attention(*batch.args())
    x = torch.randn(3, 64, device=CUDA, dtype=torch.bfloat16)
    kernels.rms_norm(x, torch.ones(64, device=CUDA, dtype=torch.bfloat16), 1e-5)
    kernels.silu_and_mul(x)
    cache = build_cos_sin_cache(64, 64, 10000.0).to(CUDA)
    positions = torch.arange(3, device=CUDA)
    key = torch.randn(3, 2, 64, device=CUDA, dtype=torch.bfloat16)
    kernels.rotary_store_kv(positions, torch.randn(3, 4, 64, device=CUDA, dtype=torch.bfloat16), key, key.clone(),
                            cache, batch.k_cache, batch.v_cache, torch.arange(3, device=CUDA))
    assert called == ["paged_attention_triton", "rms_norm_triton", "silu_and_mul_triton",
                      "rotary_embedding_triton", "store_kv_triton"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_on_cuda(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, tokens = 40, 8, 128, 300
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 8, generator=g).to(dtype).to(CUDA)
    key = kv[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(CUDA)
    slots[[0, 7, 299]] = -1
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(CUDA) for _ in range(2)]
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    k_tri, v_tri = caches[0].clone(), caches[1].clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    assert not torch.equal(k_ref, caches[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1000, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_on_cuda(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(37, hidden, generator=g).to(dtype).to(CUDA)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(CUDA)
    residual = torch.randn(37, hidden, generator=g).to(dtype).to(CUDA) if with_residual else None
    out = rms_norm_triton(x, weight, 1e-5, residual)
    ref = rms_norm_reference(x.double(), weight.double(), 1e-5, None if residual is None else residual.double())
    if with_residual:
        assert torch.equal(out[1], x + residual)   # the residual sum is the dtype's own addition
        ref, out = ref[0], out[0]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 32, 8), (96, 4, 4)])
def test_rotary_embedding_on_cuda(dtype, is_neox, head_dim, q_heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim + q_heads)
    cache = build_cos_sin_cache(head_dim, 4096, 500000.0)
    positions = torch.randint(0, 4096, (70,), generator=g)
    query = torch.randn(70, q_heads * head_dim, generator=g).to(dtype)
    key = torch.randn(70, kv_heads, head_dim, generator=g).to(dtype)
    q_ref, k_ref = rotary_embedding_reference(positions, query.double(), key.double(), cache.double(), is_neox)
    q_out, k_out = rotary_embedding_triton(positions.to(CUDA), query.to(CUDA), key.to(CUDA), cache.to(CUDA), is_neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape and q_out.dtype == dtype
    torch.testing.assert_close(q_out.double().cpu(), q_ref, **ELEMENTWISE_TOL[dtype])
    torch.testing.assert_close(k_out.double().cpu(), k_ref, **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1536, 1000, 14336])
def test_silu_and_mul_on_cuda(dtype, inter):
    x = torch.randn(33, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype).to(CUDA)
    out = silu_and_mul_triton(x)
    assert out.shape == (33, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), silu_and_mul_reference(x.double()), **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lora_delta_on_cuda(dtype):
    """Three adapters of ranks 8, 16 and 64 over q/k/v slices, segments of 1 to 300 tokens,
    tokens of no adapter after them: the Triton SGMV against the float64 reference."""
    from kernels import lora_delta_reference

    g = torch.Generator().manual_seed(0)
    k, slice_sizes, max_rank = 512, (512, 128, 128), 64
    lens = [300, 1, 40, 1, 77]
    seg_adapter = torch.tensor([2, 0, 1, 2, 0], dtype=torch.int32)
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    num_tokens = int(indptr[-1]) + 5
    lora_a = torch.zeros(3, len(slice_sizes) * max_rank, k)
    lora_b = [torch.zeros(3, n, max_rank) for n in slice_sizes]
    for a, rank in enumerate((8, 16, 64)):
        for s, n in enumerate(slice_sizes):
            lora_a[a, s * max_rank:s * max_rank + rank] = torch.randn(rank, k, generator=g) / k**0.5
            lora_b[s][a, :, :rank] = torch.randn(n, rank, generator=g) / rank**0.5
    x = torch.randn(num_tokens, k, generator=g)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=g)
    offsets = [0, 512, 640]
    want = y.double().clone()
    lora_delta_reference(x.double(), want, lora_a.double(), [b.double() for b in lora_b], offsets, indptr, seg_adapter)
    out = y.to(dtype).to(CUDA)
    lora_delta_triton(x.to(dtype).to(CUDA), out, lora_a.to(dtype).to(CUDA), [b.to(dtype).to(CUDA) for b in lora_b],
                      offsets, indptr.to(CUDA), seg_adapter.to(CUDA), max_seg_len=max(lens))
    # float32 dots are IEEE; a 16-bit model's expand is TF32, below its output's rounding.
    tol = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=3e-2),
           torch.float16: dict(atol=1e-2, rtol=1e-2)}[dtype]
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    covered = int(indptr[-1])
    assert torch.equal(out[covered:].cpu(), y.to(dtype)[covered:])


# W8A16 / W4A16 (kernels/linear_quant.py): (bits, group size (None: per channel), mins). The
# int4 ones are AWQ/GPTQ's g128 (with mins) and GGUF's Q4_0 (symmetric here: raw codes) and
# Q4_1/Q4_K's g32 with mins; int8 per channel, Q8_0's g32 and Q6_K's g16.
QUANT_CASES = {"int8-channel": (8, None, False), "int8-g32": (8, 32, False), "int8-g16": (8, 16, False),
               "int4-g128-mins": (4, 128, True), "int4-g128": (4, 128, False), "int4-g32-mins": (4, 32, True)}
# The kernel rounds the de-quantized weight to the activations' dtype before the tensor-core
# dot (2^-9 relative for bf16, 2^-12 for fp16), then the float32 sum to the output's; float32
# runs IEEE dots. Outputs here are ~3 in size (K = 4096 terms of N(0,1) x ~0.05).
QUANT_TOL = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
             torch.float16: dict(atol=1e-2, rtol=5e-3)}


def _quant_weight(bits, group_size, mins, n, k, seed):
    from kernels.quantized import QuantizedWeight, quantize

    g = torch.Generator().manual_seed(seed)
    if bits == 4 and not mins:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, -(-k // group_size), generator=g) * 0.006 + 5e-4
        return QuantizedWeight(q, scales, None, 4, group_size)
    return quantize(torch.randn(n, k, generator=g) * 0.05, bits, group_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_linear_quant_on_cuda(case, rows, dtype):
    """Llama-3-8B's fused q|k|v (4096 -> 6144) plus 40 rows, so N is off every block size:
    decode (split-K) and prefill tilings, with a bias, against the float64 product of the
    de-quantized weight and against the torch reference."""
    from kernels.linear_quant import linear_quant_reference, linear_quant_triton, pack_quant_weight_triton

    n, k = 6144 + 40, 4096
    qw = _quant_weight(*QUANT_CASES[case], n, k, seed=rows)
    g = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, k, generator=g).to(dtype).to(CUDA)
    bias = torch.randn(n, generator=g).to(dtype).to(CUDA)
    packed = pack_quant_weight_triton(qw, CUDA)
    out = linear_quant_triton(x, packed, bias)
    assert out.shape == (rows, n) and out.dtype == dtype and out.is_cuda
    w = qw.dequantize().to(CUDA)
    want = x.double() @ w.double().T + bias.double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, **QUANT_TOL[dtype])
    torch.testing.assert_close(out, linear_quant_reference(x, qw, bias), **QUANT_TOL[dtype])


@pytest.mark.parametrize("case", ["int8-g32", "int4-g128-mins", "int4-g32-mins"])
def test_linear_quant_builds_dequantize_s_weight_to_the_bit_on_cuda(case):
    """float32 rows of the identity through IEEE dots return the kernel's de-quantized weight,
    which must be dequantize()'s bits: the kernel is compiled without FMA contraction."""
    from kernels.linear_quant import linear_quant_triton, pack_quant_weight_triton

    n, k = 520, 1024
    qw = _quant_weight(*QUANT_CASES[case], n, k, seed=5)
    picked = torch.tensor([0, 1, 31, 32, 127, 128, 500, 1023] + list(range(600, 700)))
    packed = pack_quant_weight_triton(qw, CUDA)
    for rows in (picked[:3], picked):
        out = linear_quant_triton(torch.eye(k)[rows].to(CUDA), packed)
        assert torch.equal(out.cpu(), qw.dequantize()[:, rows].T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_linear_quant_batch_invariant_on_cuda(dtype):
    """With batch_invariant, a row's output is the same bits alone as among 300 rows."""
    from kernels.linear_quant import linear_quant_triton, pack_quant_weight_triton

    qw = _quant_weight(4, 128, True, 2048, 4096, seed=11)
    packed = pack_quant_weight_triton(qw, CUDA)
    x = torch.randn(300, 4096, generator=torch.Generator().manual_seed(12)).to(dtype).to(CUDA)
    whole = linear_quant_triton(x, packed, batch_invariant=True)
    for t in (0, 5, 131, 299):
        alone = linear_quant_triton(x[t:t + 1], packed, batch_invariant=True)
        assert torch.equal(alone[0], whole[t])


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_moe_kernel_on_the_gpu(dtype):
    """kernels/moe.py on the GPU: the per-expert float32 reference within the dtype's rounding,
    and every token's result the same bits alone and in a busy, skewed batch."""
    from kernels.moe import moe_experts_reference, moe_experts_triton

    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, top_k = 8, 256, 192, 300, 2
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.05).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 1] += 3.0
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    want = moe_experts_reference(x.float(), chosen, weights.float(), gate_up.float(), down.float())
    got = moe_experts_triton(x.to(CUDA), chosen.to(CUDA), weights.to(CUDA), gate_up.to(CUDA), down.to(CUDA))
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tolerance)
    for t in (0, 151, tokens - 1):
        alone = moe_experts_triton(x[t:t + 1].to(CUDA), chosen[t:t + 1].to(CUDA), weights[t:t + 1].to(CUDA),
                                   gate_up.to(CUDA), down.to(CUDA))
        assert torch.equal(alone[0], got[t])
