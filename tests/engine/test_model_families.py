"""Model families from local Hugging Face checkpoints, against `transformers` as the oracle.

Every supported family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, the MoE families, Gemma 2/3) in tiny random-weight
checkpoints made here: the engine's greedy output on a batch of prompts is token-identical
to `transformers` `generate()`, and its logits match a `transformers` forward pass. Then
loading: sharded checkpoints, checkpoint and configured dtypes, and load errors that name
what is wrong (missing / extra / misshapen tensors, unsupported architectures and config
fields, pickle-only weights). Then EOS ids from generation_config.json. One non-Llama
checkpoint served through tritonserver is tests/e2e/test_e2e_model_families.py's.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import kernels
from backend.config import EngineConfig, resolve_max_model_len
from backend.engine import LLMEngine
from backend.lora import LoRAError
from backend.models.llama import AttentionMetadata, SparseMoeBlock
from backend.models.loader import CheckpointError, checkpoint_dtype, load_arch, load_model
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import SamplingParams
from kernels import cpu_ext
from kernels.cpu_ext import Isa
from tests.checkpoints import hf_greedy, make_random_adapter, make_tiny_checkpoint
from tests.engine.test_engine_equivalence import probe_logprobs

PROMPTS = [
    "The capital of France is",
    # Longer than one KV block (16 tokens), so prefill spans blocks and chunks.
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old "
    "clockmaker who had never once been late",
    "def fibonacci(n):",
    "Hi",
]
MAX_TOKENS = 20  # decode crosses block boundaries too
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    # Far below max_position_embeddings, so the scaling changes even the short prompts here.
    original_max_position_embeddings=64,
)

# id -> (family, config overrides, engine overrides). Tied and untied embeddings, GQA and
# MHA, head sizes 16, 32, 64 and 128 (all but 16 with num_heads * head_dim != hidden_size),
# every optional bias. hidden_size stays 64: the 49152-token lm_head is most of the cost.
CASES = {
    "llama2-tied-gqa-hd16": ("llama", {}, {}),
    "llama-untied-mha-hd64-biases": (
        "llama",
        dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
             attention_bias=True, mlp_bias=True),
        dict(max_num_batched_tokens=24),  # chunked prefill mixed with decodes
    ),
    "llama3-rope-scaling-hd128": (
        "llama", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_parameters=LLAMA3_ROPE), {},
    ),
    "llama2-linear-rope-untied-gqa4": (
        "llama", dict(num_key_value_heads=1, tie_word_embeddings=False,
                      rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)), {},
    ),
    "mistral-untied-gqa-hd32": ("mistral", dict(head_dim=32, sliding_window=4096), {}),
    "qwen2-untied-qkv-bias-gqa": ("qwen2", {}, dict(max_num_batched_tokens=24)),
    # Qwen2.5's long-context YaRN, its pretraining context shrunk so that the ramp and the
    # attention factor change even the short prompts here.
    "qwen2-yarn-rope-scaling": ("qwen2", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                                                   original_max_position_embeddings=64)), {}),
    "qwen2-tied-mha-hd64": ("qwen2", dict(tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=2,
                                          head_dim=64), {}),
    # Phi-3/Phi-4: q|k|v and gate|up stored fused; a sliding window as Phi-3-mini's (2047).
    "phi3-fused-untied-gqa": ("phi3", dict(sliding_window=2047), dict(max_num_batched_tokens=24)),
    # Phi-3-mini-128k's LongRoPE (short factors within the pretraining context, the extended
    # context's attention factor), its pretraining context shrunk to max_model_len.
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=256, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], long_factor=[4.0] * 8)), {}),
    "phi3-tied-mha-hd32": ("phi3", dict(tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=2,
                                        head_dim=32), {}),
    "qwen3-tied-qk-norm-hd16": ("qwen3", {}, {}),
    # Mixture of experts: top-2 of 4 (Mixtral, renormalised) and of 8 (Qwen3-MoE, with and
    # without renormalising; a dense first layer beside expert layers).
    "mixtral-top2-of-4": ("mixtral", {}, dict(max_num_batched_tokens=24)),
    "qwen3-moe-top2-of-8": ("qwen3_moe", {}, {}),
    # Qwen2-MoE: a gated shared expert beside top-2 of 8, q/k/v biases, chunked prefill.
    "qwen2-moe-shared-expert": ("qwen2_moe", {}, dict(max_num_batched_tokens=24)),
    # OLMoE: top-2 of 8, unnormalised, q and k normed over all their heads.
    "olmoe-top2-of-8-gqa": ("olmoe", {}, {}),
    "qwen3-moe-dense-layer0-unnormalised": ("qwen3_moe", dict(mlp_only_layers=[0], norm_topk_prob=False,
                                                              tie_word_embeddings=True), {}),
    "qwen3-untied-bias-hd64-gqa4": ("qwen3", dict(head_dim=64, num_key_value_heads=1, attention_bias=True,
                                                  tie_word_embeddings=False), {}),
    # Gemma 2: a 16-position window on layer 0 (the longest prompt and its continuation cross
    # it), attention and final logits soft-capped (caps small enough to bite here), chunked prefill.
    "gemma2-window16-softcap": ("gemma2", dict(attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
                                dict(max_num_batched_tokens=24)),
    # Gemma 3: two windowed layers and a global one, each kind with its RoPE (global: linear scaling).
    "gemma3-local-global-two-ropes": ("gemma3", {}, {}),
    # Sliding windows of 16 positions, which the longest prompt and its continuation cross:
    # Mistral's and Phi-3's on every layer, Qwen2's past max_window_layers (layer 0 full),
    # Qwen3-MoE's on every layer once use_sliding_window is on.
    "mistral-window16": ("mistral", dict(sliding_window=16), dict(max_num_batched_tokens=24)),
    "phi3-window16": ("phi3", dict(sliding_window=16), {}),
    "qwen2-window16-past-layer0": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
                                   dict(max_num_batched_tokens=24)),
    "qwen3-moe-window16": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), {}),
}


def make_engine(path: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model_path": path, "num_kv_blocks": 64, "max_model_len": 256, **overrides}))


def prompt_ids(path: str) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(p) for p in PROMPTS]


def engine_greedy(engine: LLMEngine, prompts=PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.output_token_ids for r in engine.generate(list(prompts), params)]


def our_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence through our model (prefill, contiguous blocks)."""
    arch, n, block = model.arch, len(ids), 16
    num_blocks = -(-n // block)
    dtype = model.embed_tokens.weight.dtype
    shape = (num_blocks, block, arch.num_kv_heads, arch.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        max_seqlen_q=n, max_seqlen_k=n,
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def hf_logits(path: str, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def case_checkpoint(root, case: str) -> str:
    family, overrides, _ = CASES[case]
    return make_tiny_checkpoint(str(root / case), family=family, **overrides)


# ---- every family, token-identical ------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_family_greedy_matches_transformers(ckpt_root, case):
    _, _, engine_overrides = CASES[case]
    path = case_checkpoint(ckpt_root, case)
    ids = prompt_ids(path)
    expected = hf_greedy(path, ids, MAX_TOKENS)
    engine = make_engine(path, **engine_overrides)
    arch = engine.arch
    assert arch.architecture == transformers.AutoConfig.from_pretrained(path).architectures[0]

    # Logits of the longest prompt plus its continuation, all positions at once.
    sequence = ids[1] + expected[1]
    ours = our_logits(engine.model, sequence)
    theirs = hf_logits(path, sequence)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)

    got = engine_greedy(engine)
    assert got == expected, f"{case}: engine output differs from transformers"
    # Random weights can collapse to one repeated token, which would prove little.
    assert len({t for out in expected for t in out}) > MAX_TOKENS // 2


# One C++ call per layer where the CPU has the C++ kernels, the modules' kernels one by one otherwise.
GEMM_PATHS = [pytest.param(isa, marks=pytest.mark.skipif(cpu_ext.isa() < isa, reason=f"no {isa.name} path here"),
                           id=isa.name.lower()) for isa in (Isa.AVX2, Isa.AVX512, Isa.AVX512_BF16)]


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GEMMA_FAMILIES = ("gemma2", "gemma3")  # their layers run as modules (tests/engine/test_gemma.py)
DENSE_CASES = [case for case, (family, _, _) in CASES.items() if family not in MOE_FAMILIES + GEMMA_FAMILIES]
MOE_CASES = [case for case, (family, _, _) in CASES.items() if family in MOE_FAMILIES]
# MoE families whose layers run as one C++ call each, the routed experts included (qwen2_moe's
# shared expert and OLMoE's q/k norms over all heads run as modules).
FUSED_MOE_FAMILIES = ("mixtral", "qwen3_moe")
FUSED_CASES = DENSE_CASES + [case for case, (family, _, _) in CASES.items() if family in FUSED_MOE_FAMILIES]


@pytest.mark.parametrize("isa", GEMM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_cpu_decoder_layers_give_the_modules_bits(ckpt_root, monkeypatch, case, dtype, isa):
    """Each layer as one C++ call (kernels.cpu_decoder_layer) runs the modules' kernels in their
    order, so hidden states and KV writes are the same bits: every family whose layers fuse (the
    routed experts' C++ block inside a MoE layer), both dtypes, every
    GEMM path here (bf16 below AVX512-BF16 is the float32 upcast), on a batch that mixes a
    prefill chunk over cached context, a fresh prompt and decodes."""
    monkeypatch.setattr(cpu_ext, "isa", lambda: isa)
    model, _ = load_model(case_checkpoint(ckpt_root, case), dtype, torch.device("cpu"), 256)
    assert model.cpu_layers is not None and len(model.cpu_layers) == model.arch.num_layers
    arch, block = model.arch, 16
    new_tokens, cached = [7, 5, 1, 1], [9, 0, 20, 33]
    seq_lens = [n + c for n, c in zip(new_tokens, cached)]
    blocks_per_seq = -(-max(seq_lens) // block)
    tables = torch.randperm(len(seq_lens) * blocks_per_seq, generator=torch.Generator().manual_seed(1))
    tables = tables.to(torch.int32).view(len(seq_lens), blocks_per_seq)
    positions = torch.cat([torch.arange(c, c + n) for n, c in zip(new_tokens, cached)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(new_tokens))
    slots = tables[seq_of, positions // block].to(torch.int64) * block + positions % block
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32),
        max_seqlen_q=max(new_tokens), max_seqlen_k=max(seq_lens), batch_invariant=True,
    )
    gen = torch.Generator().manual_seed(2)
    shape = (tables.numel(), block, arch.num_kv_heads, arch.head_dim)
    cache = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
             for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (len(positions),), generator=gen)

    def forward(fused: bool):
        kv = [(k.clone(), v.clone()) for k, v in cache]
        layers, model.cpu_layers = model.cpu_layers, (model.cpu_layers if fused else None)
        try:
            with torch.inference_mode():
                return model(ids, positions, kv, meta), kv
        finally:
            model.cpu_layers = layers

    (fused, fused_kv), (modules, modules_kv) = forward(True), forward(False)
    assert torch.equal(fused, modules)
    assert all(torch.equal(a, b) for pair, other in zip(fused_kv, modules_kv) for a, b in zip(pair, other))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MOE_CASES)
def test_the_cpu_moe_block_gives_the_modules_bits(ckpt_root, case, dtype, quantization, threads):
    """The experts as one C++ call (kernels.cpu_moe_experts) run the modules' kernels in their
    order: the same bits, float and int4 experts, for a batch where experts get 0 to many rows.
    On two threads the call runs the experts side by side, one core each, where a few tokens
    spread over many experts, and one after another where one expert holds most of them."""
    model, _ = load_model(case_checkpoint(ckpt_root, case), dtype, torch.device("cpu"), 64,
                          quantization=quantization, quantization_group_size=32)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(block.cpu_block is not None for block in blocks)
    gen = torch.Generator().manual_seed(3)
    spread = torch.randn(37, model.arch.hidden_size, generator=gen)
    crowded = spread[:1].repeat(29, 1) + 1e-3 * torch.randn(29, model.arch.hidden_size, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in (spread.to(dtype), crowded.to(dtype), spread[:1].to(dtype)):
            for block in blocks:
                fused = block(x)
                block.cpu_block, cpu_block = None, block.cpu_block
                try:
                    modules = block(x)
                finally:
                    block.cpu_block = cpu_block
                assert torch.equal(fused, modules)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("case", MOE_CASES)
def test_the_grouped_triton_moe_kernel_in_the_block(ckpt_root, case):
    """The GPU's path through SparseMoeBlock (experts stacked once, kernels.moe_experts' grouped
    Triton kernel), run in Triton's interpreter: the per-expert loop's result in float32, with
    the experts' own weights views of the stacked ones."""
    model, _ = load_model(case_checkpoint(ckpt_root, case), torch.float32, torch.device("cpu"), 64,
                          pack_weights=False)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    x = torch.randn(21, model.arch.hidden_size, generator=torch.Generator().manual_seed(6))
    loop = block(x)
    block.stack_experts()
    gate_up, _ = block.stacked
    assert block.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
    with kernels.triton_kernels_on_cpu():
        grouped = block(x)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_logprobs_are_the_same_bits_alone_and_in_a_busy_batch(ckpt_root, case, dtype):
    """Routed experts batch their tokens per expert, so which rows an expert's GEMM sees depends
    on the batch: with batch_invariant a probe's logprobs must still be bitwise its own."""
    path = case_checkpoint(ckpt_root, case)
    ids = prompt_ids(path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def logprobs_beside(others: list[list[int]]) -> list[float]:
        engine = make_engine(path, dtype="float32" if dtype == torch.float32 else "bfloat16", batch_invariant=True,
                             max_num_batched_tokens=40, long_prefill_token_threshold=16)
        family = CASES[case][0]
        assert (engine.model.cpu_layers is not None) == (family in FUSED_MOE_FAMILIES)
        return probe_logprobs(engine, ids[1], params,
                              [(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in others])

    alone = logprobs_beside([])
    assert len(alone) == 8
    assert logprobs_beside([p * 3 for p in ids] + ids) == alone


def test_moe_model_with_a_lora_adapter_on_its_attention_matches_peft(ckpt_root, tmp_path):
    """LoRA on the attention projections of a mixture-of-experts model: transformers + PEFT's
    greedy tokens; an adapter on its experts' MLP is refused at load, naming the targets."""
    path = case_checkpoint(ckpt_root, "qwen3-moe-top2-of-8")
    attention = make_random_adapter(str(tmp_path / "attn"), path, rank=8, seed=4,
                                    target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    ids = prompt_ids(path)
    expected = hf_greedy(path, ids, MAX_TOKENS, adapter_dir=attention)
    assert expected != hf_greedy(path, ids, MAX_TOKENS)  # the adapter changes the output
    engine = make_engine(path, lora_modules={"attn": attention}, max_lora_rank=8)
    got = [r.output_token_ids for r in engine.generate(ids, [GREEDY.model_copy(update={"lora_name": "attn"})] * len(ids))]
    assert got == expected
    # A dense Qwen3 of the same attention shape gives an adapter with an MLP target.
    dense = case_checkpoint(ckpt_root, "qwen3-tied-qk-norm-hd16")
    mlp = make_random_adapter(str(tmp_path / "mlp"), dense, rank=8, seed=5, target_modules=("down_proj",))
    with pytest.raises(LoRAError, match="down_proj of layer 0, which routes its MLP to experts"):
        make_engine(path, lora_modules={"mlp": mlp}, max_lora_rank=8)


@pytest.mark.parametrize("case, rope_type, theta", [
    ("llama3-rope-scaling-hd128", "llama3", 500000.0), ("llama2-linear-rope-untied-gqa4", "linear", 10000.0),
    ("qwen2-yarn-rope-scaling", "yarn", 1000000.0), ("phi3-longrope", "longrope", 10000.0),
])
def test_rope_scaling_is_applied(ckpt_root, tmp_path, case, rope_type, theta):
    """The scaled cases would pass vacuously if the scaling did not change the logits."""
    path = case_checkpoint(ckpt_root, case)
    arch, _ = load_arch(path)
    assert arch.rope_scaling["rope_type"] == rope_type and arch.rope_theta == theta
    unscaled = str(tmp_path / "unscaled")
    shutil.copytree(path, unscaled)
    config = json.load(open(os.path.join(unscaled, "config.json")))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    json.dump(config, open(os.path.join(unscaled, "config.json"), "w"))
    assert load_arch(unscaled)[0].rope_scaling is None
    ids = prompt_ids(path)[1]
    assert (hf_logits(path, ids) - hf_logits(unscaled, ids)).abs().max() > 1e-3


# ---- loading ------------------------------------------------------------------------------


def _state(path: str, dtype=torch.float32):
    model, _ = load_model(path, dtype, torch.device("cpu"), 64, pack_weights=False)
    return {k: v for k, v in model.state_dict().items()}


def test_sharded_checkpoint_with_index(ckpt_root, tmp_path):
    single = case_checkpoint(ckpt_root, "qwen2-untied-qkv-bias-gqa")
    family, overrides, _ = CASES["qwen2-untied-qkv-bias-gqa"]
    sharded = make_tiny_checkpoint(str(tmp_path / "sharded"), family=family, max_shard_size="1MB", **overrides)
    shards = [n for n in os.listdir(sharded) if n.endswith(".safetensors")]
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json")) and len(shards) >= 3
    a, b = _state(single), _state(sharded)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # A shard the index names but that is gone is a load error naming the shard.
    os.remove(os.path.join(sharded, shards[0]))
    with pytest.raises(CheckpointError, match=shards[0]):
        load_model(sharded, torch.float32, torch.device("cpu"), 64)


def test_bf16_checkpoint_loads_in_its_dtype_or_the_configured_one(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "bf16"), family="qwen3", dtype=torch.bfloat16)
    assert checkpoint_dtype(path) == torch.bfloat16
    ids = prompt_ids(path)
    # dtype auto on CPU computes in float32: the same as transformers upcasting the weights.
    engine = make_engine(path)
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    assert engine_greedy(engine) == hf_greedy(path, ids, MAX_TOKENS)
    # dtype bfloat16: weights and KV cache in bf16; logits close to transformers in bf16.
    engine = make_engine(path, dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    # bf16 rounding differs op by op; ours may stray from the float32 truth about as far
    # as transformers' own bf16 forward does.
    ours = our_logits(engine.model, ids[1])
    truth = hf_logits(path, ids[1])
    theirs = hf_logits(path, ids[1], dtype=torch.bfloat16)
    assert (ours - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 1e-2
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() > 0.9
    outputs = engine_greedy(engine)
    assert [len(o) for o in outputs] == [MAX_TOKENS] * len(PROMPTS)


def _rewrite_weights(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _copy(ckpt_root, tmp_path, case="llama2-tied-gqa-hd16") -> str:
    dest = str(tmp_path / "ckpt")
    shutil.copytree(case_checkpoint(ckpt_root, case), dest)
    return dest


def test_missing_tensor_is_named(ckpt_root, tmp_path):
    path = _copy(ckpt_root, tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_extra_tensor_is_named(ckpt_root, tmp_path):
    path = _copy(ckpt_root, tmp_path)
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\).*model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_misshapen_tensor_is_named(ckpt_root, tmp_path):
    path = _copy(ckpt_root, tmp_path)

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    _rewrite_weights(path, shrink)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight .*shape \(127, 64\).*\(128, 64\)"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_engine_refuses_a_checkpoint_with_a_missing_tensor(ckpt_root, tmp_path):
    path = _copy(ckpt_root, tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        make_engine(path)


def test_unsupported_architecture_is_named(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_arch(str(tmp_path))


def test_remote_code_architecture_is_refused_without_running_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FancyForCausalLM"], "model_type": "fancy",
        "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"},
    }))
    with pytest.raises(CheckpointError, match="unsupported architecture 'FancyForCausalLM'.*LlamaForCausalLM"):
        load_arch(str(tmp_path))


def _config_only(tmp_path, family: str, **overrides) -> str:
    config_cls, model_cls, defaults = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM", {}),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM", {}),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM", {}),
        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM", {}),
        "phi3": (transformers.Phi3Config, "Phi3ForCausalLM", {}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM", {}),
        "qwen2_moe": (transformers.Qwen2MoeConfig, "Qwen2MoeForCausalLM", {}),
        "mixtral": (transformers.MixtralConfig, "MixtralForCausalLM", {}),
        "olmoe": (transformers.OlmoeConfig, "OlmoeForCausalLM", {}),
    }[family]
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    config = config_cls(**{**shape, **defaults, **overrides})
    config.architectures = [model_cls]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("family, overrides, message", [
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)), r"rope_scaling\.rope_type='dynamic'"),
    ("llama", dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    ("olmoe", dict(clip_qkv=8.0), r"clip_qkv=8\.0"),
    ("qwen3", dict(hidden_act="relu"), r"hidden_act='relu'"),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=3), r"num_key_value_heads=3"),
])
def test_unsupported_config_field_is_named(tmp_path, family, overrides, message):
    path = _config_only(tmp_path, family, **overrides)
    with pytest.raises(CheckpointError, match="unsupported config field " + message):
        load_arch(path)


def test_unsupported_quantization_method_is_refused(tmp_path):
    path = _config_only(tmp_path, "llama")
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="quantization_config \\(quant_method='bitsandbytes'\\)"):
        load_arch(path)


@pytest.mark.parametrize("family, overrides, windows", [
    ("mistral", dict(sliding_window=64), (64, 64)),
    ("phi3", dict(sliding_window=64), (64, 64)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), (0, 64)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), (64, 64)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), (64, 64)),
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=64), ()),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=64, max_window_layers=28), (64, 0)),
    ("mixtral", dict(sliding_window=64), (64, 64)),
])
def test_sliding_windows_are_read_as_transformers_reads_them(tmp_path, family, overrides, windows):
    """Per layer, the window transformers' modeling code masks to; served past the window."""
    path = _config_only(tmp_path, family, **overrides)
    arch, _ = load_arch(path)
    assert arch.layer_windows == windows
    assert arch.sliding_window == (64 if windows and 0 not in windows else None)
    assert resolve_max_model_len(0, arch) == 1024  # the whole context, windows or not


@pytest.mark.parametrize("family, overrides, message", [
    # transformers would fail at the first forward pass (no window for the sliding layers).
    ("qwen2", dict(use_sliding_window=False, sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
     r"sliding_window=None"),
    ("mistral", dict(sliding_window=0), r"sliding_window=0"),
])
def test_sliding_layers_without_a_window_are_refused(tmp_path, family, overrides, message):
    with pytest.raises(CheckpointError, match=r"unsupported config field " + message):
        load_arch(_config_only(tmp_path, family, **overrides))


def test_longrope_past_the_pretraining_context_is_refused(ckpt_root):
    rope = load_arch(case_checkpoint(ckpt_root, "phi3-longrope"))[0].rope_scaling
    assert rope["factor"] == 4.0  # 1024 / 256: the attention factor is not 1
    with pytest.raises(CheckpointError, match=r"LongRoPE.*set max_model_len <= 256 \(it is 512\)"):
        load_model(case_checkpoint(ckpt_root, "phi3-longrope"), torch.float32, torch.device("cpu"), 512)


def test_sliding_window_never_reached_is_full_attention(tmp_path):
    # Qwen's default sliding_window only matters with use_sliding_window; Mistral's only
    # when shorter than max_position_embeddings.
    assert load_arch(_config_only(tmp_path / "q", "qwen2", sliding_window=64))[0].sliding_window is None
    assert load_arch(_config_only(tmp_path / "m", "mistral", sliding_window=4096))[0].sliding_window is None


def test_sliding_window_model_past_its_window_matches_transformers(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path / "mistral-window"), family="mistral", sliding_window=8)
    ids = prompt_ids(path)
    engine = make_engine(path, max_model_len=0)
    assert engine.arch.sliding_window == 8 and engine.max_model_len == 1024
    assert max(len(p) for p in ids) + MAX_TOKENS > 3 * 8
    assert engine_greedy(engine) == hf_greedy(path, ids, MAX_TOKENS)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    path = _config_only(tmp_path, "llama")
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model\.bin\)"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_checkpoint_without_weights_is_refused(tmp_path):
    path = _config_only(tmp_path, "llama")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


# ---- EOS from generation_config.json ------------------------------------------------------


def test_several_eos_ids_from_generation_config(ckpt_root, tmp_path):
    path = _copy(ckpt_root, tmp_path, "qwen3-tied-qk-norm-hd16")
    ids = prompt_ids(path)
    free = hf_greedy(path, ids, MAX_TOKENS)

    # Pick a (from prompt 0's continuation) and b (from prompt 1's) so that prompt 0 stops
    # at a and prompt 1 stops at b, both after a few tokens.
    def pick():
        for i, a in enumerate(free[0][2:], start=2):
            for j, b in enumerate(free[1][2:], start=2):
                if a != b and b not in free[0][:i + 1] and a not in free[1][:j + 1] and a not in free[0][:i]:
                    if b not in free[1][:j]:
                        return a, b
        pytest.fail(f"no pair of EOS candidates in {free[:2]}")

    a, b = pick()
    generation = json.load(open(os.path.join(path, "generation_config.json")))
    generation["eos_token_id"] = [a, b]
    json.dump(generation, open(os.path.join(path, "generation_config.json"), "w"))

    engine = make_engine(path)
    assert engine.eos_token_ids == frozenset({a, b})
    requests = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    got = [r.output_token_ids for r in requests]
    assert got == hf_greedy(path, ids, MAX_TOKENS, ignore_eos=False)
    assert got[0][-1] == a and got[1][-1] == b
    assert requests[0].finish_reason.value == requests[1].finish_reason.value == "stop"
    for r, out in zip(requests[2:], got[2:]):
        assert r.finish_reason.value == ("stop" if out[-1] in (a, b) else "length")


def test_config_without_architectures_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unsupported architecture \\(none listed; model_type 'gpt2'\\)"):
        load_arch(str(tmp_path))


def test_progress_bar_for_large_checkpoints(ckpt_root, monkeypatch, capsys):
    from backend.models import loader

    path = case_checkpoint(ckpt_root, "llama2-tied-gqa-hd16")
    load_model(path, torch.float32, torch.device("cpu"), 64)
    assert "loading weights" not in capsys.readouterr().err  # small: quiet
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_model(path, torch.float32, torch.device("cpu"), 64)
    assert "loading weights" in capsys.readouterr().err


# ---- config.json as released checkpoints write it (transformers 4 field names) ---------------

_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, rms_norm_eps=1e-5, vocab_size=1000, hidden_act="silu")


@pytest.mark.parametrize("raw, want", [
    # Llama 3.1: rope_scaling + top-level rope_theta, several EOS ids, bf16.
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=131072,
          rope_theta=500000.0, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192, rope_type="llama3"),
          eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16", tie_word_embeddings=False),
     dict(rope_theta=500000.0, rope_type="llama3", sliding_window=None, dtype=torch.bfloat16)),
    # Mistral 7B v0.1: a 4096 window under a 32768 context.
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", max_position_embeddings=32768,
          rope_theta=10000.0, sliding_window=4096, torch_dtype="bfloat16"),
     dict(rope_theta=10000.0, rope_type=None, sliding_window=4096, dtype=torch.bfloat16)),
    # Qwen2.5: a window that use_sliding_window switches off.
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
          rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False, sliding_window=131072,
          max_window_layers=21, tie_word_embeddings=True, torch_dtype="bfloat16"),
     dict(rope_theta=1000000.0, rope_type=None, sliding_window=None, dtype=torch.bfloat16)),
    # Qwen3: explicit head_dim, attention_bias false.
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=40960, head_dim=128,
          rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False, sliding_window=None,
          attention_bias=False, torch_dtype="float16"),
     dict(rope_theta=1000000.0, rope_type=None, sliding_window=None, dtype=torch.float16)),
    # Qwen2.5 with the YaRN block its model card adds for contexts past 32768.
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=131072,
          rope_theta=1000000.0, rope_scaling=dict(factor=4.0, original_max_position_embeddings=32768, type="yarn"),
          use_sliding_window=False, sliding_window=131072, torch_dtype="bfloat16"),
     dict(rope_theta=1000000.0, rope_type="yarn", sliding_window=None, dtype=torch.bfloat16)),
    # Phi-3-mini-4k: a 2047 window under a 4096 context.
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", max_position_embeddings=4096,
          original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None, sliding_window=2047,
          torch_dtype="bfloat16", tie_word_embeddings=False),
     dict(rope_theta=10000.0, rope_type=None, sliding_window=2047, dtype=torch.bfloat16)),
    # Phi-4: no window.
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", max_position_embeddings=16384,
          original_max_position_embeddings=16384, rope_theta=250000.0, rope_scaling=None, sliding_window=None,
          torch_dtype="bfloat16", tie_word_embeddings=False),
     dict(rope_theta=250000.0, rope_type=None, sliding_window=None, dtype=torch.bfloat16)),
])
def test_released_config_json_is_read(tmp_path, raw, want):
    (tmp_path / "config.json").write_text(json.dumps({**_SMALL, **raw}))
    arch, _ = load_arch(str(tmp_path))
    assert arch.architecture == raw["architectures"][0]
    assert arch.rope_theta == want["rope_theta"]
    assert (arch.rope_scaling or {}).get("rope_type") == want["rope_type"]
    assert arch.sliding_window == want["sliding_window"]
    assert arch.head_dim == raw.get("head_dim", 16)
    assert checkpoint_dtype(str(tmp_path)) == want["dtype"]


def test_the_default_checkpoints_shape_is_its_own(tmp_path):
    """`--shape smollm2-135m` (random_checkpoint.SHAPES) is the default checkpoint's model but
    for its weights: what a machine without that checkpoint benchmarks instead."""
    from backend.models.random_checkpoint import SHAPES

    transformers.LlamaConfig(**SHAPES["smollm2-135m"], architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert load_arch(str(tmp_path))[0] == load_arch(DEFAULT_CHECKPOINT)[0]


@pytest.mark.parametrize("shape", ["llama3-1b", "llama3-8b"])
def test_the_gpu_benchmark_shapes_are_the_models_they_name(shape, tmp_path):
    """docs/benchmarks.md's GPU shapes (random_checkpoint.SHAPES): the engine takes their configs
    as Llama-3.2-1B's and Llama-3-8B's (only config.json is written: the weights are GBs)."""
    from backend.models.random_checkpoint import SHAPES

    transformers.LlamaConfig(**SHAPES[shape], architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    arch, _ = load_arch(str(tmp_path))
    params = (arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
              + arch.num_layers * (arch.hidden_size * arch.head_dim * (2 * arch.num_heads + 2 * arch.num_kv_heads)
                                   + 3 * arch.hidden_size * arch.intermediate_size))
    expected = {"llama3-1b": 1.24e9, "llama3-8b": 8.03e9}[shape]
    assert abs(params / expected - 1) < 0.01, params
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.num_kv_heads == 8 and arch.vocab_size == 128256
