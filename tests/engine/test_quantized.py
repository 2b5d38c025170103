"""Quantized weights: the engine computes the float model of the de-quantized weights.

The oracle is transformers' `generate()` on those de-quantized weights in float32: for a GGUF
file transformers reads the file itself (gguf-py de-quantizes, transformers undoes llama.cpp's
rotary permutation); for the `quantization` parameter and the packed Hugging Face formats, a
float checkpoint of the weights the format defines, written here. Greedy tokens must be the
oracle's under continuous arrivals, chunked prefill, prefix-cache hits and preemption, as for
float checkpoints (tests/engine/test_engine_equivalence.py). Tiny random Llama whose sizes
are multiples of 256, as llama.cpp's K-quants need.
"""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models.llama import Linear
from backend.models.loader import CheckpointError, load_model
from backend.models.quantization import gguf_quantized
from backend.request import SamplingParams
from kernels.linear import BF16_ROWS_BESIDE_TILES, VECTOR_ROWS_BESIDE_TILES
from tests.checkpoints import make_gguf_checkpoint, make_tiny_checkpoint
from tests.engine.test_engine_equivalence import (
    MAX_TOKENS,
    PROMPTS,
    SHARED_PROMPTS,
    assert_matches_oracle,
    hf_greedy,
    probe_logprobs,
    run_engine,
    spread_arrivals,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 16
ALL_PROMPTS = PROMPTS + SHARED_PROMPTS


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _oracle(model_dir: str, gguf_file: str | None = None) -> dict:
    outputs = hf_greedy(model_dir, ALL_PROMPTS, MAX_NEW, gguf_file=gguf_file)
    return {tuple(p): out for p, out in zip(ALL_PROMPTS, outputs)}


def _scenarios(model_path: str, oracle: dict, **config) -> None:
    """Continuous arrivals into a full batch with chunks crossing block edges, then prefix-cache
    hits, then preemption under a tiny pool: every request gets the oracle's tokens."""
    arrivals = spread_arrivals(len(PROMPTS), every=1)
    _, streamed, by_id = run_engine(model_path, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=6,
                                    long_prefill_token_threshold=7, max_num_batched_tokens=40, num_kv_blocks=256,
                                    **config)
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)
    prompts = SHARED_PROMPTS + PROMPTS[:6]
    max_tokens = MAX_TOKENS[: len(prompts)]
    engine, streamed, by_id = run_engine(model_path, prompts, max_tokens, [0] + [3 + i // 4 for i in range(len(prompts) - 1)],
                                         max_num_seqs=5, long_prefill_token_threshold=20, num_kv_blocks=256, **config)
    assert engine.stats.totals.prefix_hit_tokens >= 32 * (len(SHARED_PROMPTS) - 1)
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)
    prompts = PROMPTS[:10] + SHARED_PROMPTS[:3]
    max_tokens = MAX_TOKENS[: len(prompts)]
    engine, streamed, by_id = run_engine(model_path, prompts, max_tokens, spread_arrivals(len(prompts), every=1),
                                         max_num_seqs=6, block_size=8, num_kv_blocks=14, long_prefill_token_threshold=13,
                                         max_preemptions=3, **config)
    assert engine.stats.totals.preemptions > 0
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


# --------------------------------------------------------------------------------------
# GGUF


def _random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * k // block_elems
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    scale_at = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
                "Q6_K": [208]}[type_name]
    for at in scale_at:  # finite float16 scales of both signs
        blocks[:, at:at + 2] = np.frombuffer(rng.standard_normal(n).astype(np.float16).tobytes(), np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_gguf_blocks_read_as_gguf_py_dequantizes_them(type_name):
    """Every block type's integers, scales and mins give gguf-py's own de-quantized floats,
    to the bit (up to the sign of zero, which Q4_0's d * (q - 8) gives as -0 for a negative d)."""
    rng = np.random.default_rng(1)
    raw = _random_blocks(type_name, 6, 512, rng)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)) + np.float32(0)
    got = gguf_quantized(type_name, raw, (6, 512)).dequantize().numpy() + np.float32(0)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))


@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("gguf")
    return make_gguf_checkpoint(tiny_checkpoint, str(folder / "tiny.gguf"))


def test_gguf_weights_are_transformers_dequantized_ones_and_stay_quantized(gguf_file):
    import transformers

    model, _ = load_model(gguf_file, torch.float32, torch.device("cpu"), 128, pack_weights=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_file), gguf_file="tiny.gguf",
                                                           dtype=torch.float32).state_dict()
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        qkv, gate_up = layer.self_attn.qkv_proj.quantized, layer.mlp.gate_up_proj.quantized
        # q (Q4_0), k (Q5_0) and v (Q6_K) fused: in 8-bit groups of 16, the widest and smallest.
        assert (qkv.bits, qkv.group_size) == (8, 16)
        assert torch.equal(qkv.dequantize(), torch.cat([hf[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
        assert (gate_up.bits, gate_up.group_size) == (8, 32)  # gate Q5_1, up Q4_1
        assert torch.equal(gate_up.dequantize(), torch.cat([hf[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]))
        assert torch.equal(layer.mlp.down_proj.quantized.dequantize(), hf[prefix + "mlp.down_proj.weight"])
    assert torch.equal(model.embed_tokens.quantized.dequantize(), hf["model.embed_tokens.weight"])
    assert model.tied_lm_head_packed is not None  # the tied head is the quantized embedding
    assert all(not p.is_floating_point() or p.stride() == (0, 0) for n, p in model.named_parameters() if "proj" in n)


def test_gguf_file_greedy_matches_transformers(tiny_checkpoint, gguf_file):
    oracle = _oracle(os.path.dirname(gguf_file), "tiny.gguf")
    _scenarios(gguf_file, oracle, tokenizer=tiny_checkpoint)


def test_gguf_file_with_an_untied_quantized_head(tiny_checkpoint, tmp_path):
    path = make_gguf_checkpoint(tiny_checkpoint, str(tmp_path / "untied.gguf"), tied=False)
    oracle = _oracle(str(tmp_path), "untied.gguf")
    arrivals = spread_arrivals(len(PROMPTS), every=1)
    _, streamed, by_id = run_engine(path, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=6, num_kv_blocks=256,
                                    tokenizer=tiny_checkpoint)
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)


def test_unsupported_gguf_block_type_is_named(tiny_checkpoint, tmp_path):
    path = make_gguf_checkpoint(tiny_checkpoint, str(tmp_path / "q5k.gguf"), types={"ffn_up": "Q5_K"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight .* block type Q5_K; supported: Q8_0, Q4_0"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_quantizing_a_quantized_checkpoint_is_refused(gguf_file):
    with pytest.raises(CheckpointError, match=r"quantization='int4' .* already quantized \(GGUF\)"):
        load_model(gguf_file, torch.float32, torch.device("cpu"), 64, quantization="int4")


# --------------------------------------------------------------------------------------
# The `quantization` parameter


def _dequantized_checkpoint(source: str, dest: str, bits: int, group: int | None) -> str:
    """`source` with every projection replaced by its de-quantized weight, and the output head
    (the embedding, when tied) by its int8 per-channel one (the oracle's model)."""
    if os.path.isdir(dest):
        return dest
    shutil.copytree(source, dest)
    weights = load_file(os.path.join(source, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        head = "model.embed_tokens.weight" if json.load(f).get("tie_word_embeddings") else "lm_head.weight"
    assert head in weights
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = kernels.quantize(w, bits, group).dequantize().to(w.dtype)
        elif name == head:
            weights[name] = kernels.quantize(w, 8, None).dequantize().to(w.dtype)
    save_file(weights, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("mode, group", [("int8", 128), ("int4", 32), ("int4", 128)])
def test_quantization_at_load_matches_the_dequantized_model(tiny_checkpoint, tmp_path_factory, mode, group):
    bits = 8 if mode == "int8" else 4
    reference = _dequantized_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("deq") / "m"), bits,
                                        None if bits == 8 else group)
    _scenarios(tiny_checkpoint, _oracle(reference), quantization=mode, quantization_group_size=group)


def test_a_tied_output_head_is_quantized_int8_per_channel_and_looked_up_from_the_same_table(tmp_path_factory):
    """With tied embeddings the head is the embedding table: `quantization` holds it int8 per
    output channel, and the embedding's lookups read the same integers as the head's GEMM."""
    root = tmp_path_factory.mktemp("tied")
    tied = make_tiny_checkpoint(str(root / "m"), tie_word_embeddings=True)
    model, _ = load_model(tied, torch.float32, torch.device("cpu"), 64, quantization="int4",
                          quantization_group_size=32)
    table = model.embed_tokens.quantized
    assert model.lm_head is None and table is not None and table.bits == 8 and table.group_size == table.shape[1]
    assert model.layers[0].mlp.down_proj.quantized.bits == 4
    reference = _dequantized_checkpoint(tied, str(root / "deq"), 4, 32)
    _scenarios(tied, _oracle(reference), quantization="int4", quantization_group_size=32)


def test_the_experts_of_a_mixture_of_experts_model_quantize_at_load(tmp_path_factory):
    """Each expert is a projection like any other: held int4 and packed, while the router stays
    float; greedy tokens are transformers' on the de-quantized experts."""
    root = tmp_path_factory.mktemp("moe")
    moe = make_tiny_checkpoint(str(root / "m"), family="qwen3_moe")
    engine = LLMEngine(EngineConfig(model_path=moe, device="cpu", dtype="float32", num_kv_blocks=64,
                                    quantization="int4", quantization_group_size=32))
    block = engine.model.layers[0].mlp
    assert all(e.gate_up_proj.quantized.bits == 4 and e.down_proj.quantized.bits == 4 for e in block.experts)
    assert block.gate.quantized is None
    reference = _dequantized_checkpoint(moe, str(root / "deq"), 4, 32)
    oracle = _oracle(reference)
    outputs = engine.generate([list(p) for p in oracle], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                          ignore_eos=True))
    assert [r.output_token_ids for r in outputs] == list(oracle.values())


def test_quantization_shrinks_the_resident_weights(tiny_checkpoint):
    sizes = {}
    for mode in ("none", "int8", "int4"):
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=16,
                                        quantization=mode, quantization_group_size=64))
        sizes[mode] = engine.weight_bytes
        assert engine.weight_bytes == engine.model.resident_weight_bytes()
    projections = sum(p.numel() for n, p in load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), 64,
                                                        pack_weights=False)[0].named_parameters() if "proj" in n)
    # float32 projections are 4 bytes a weight; int8 ~1 byte, int4 ~0.5 (plus scales, mins).
    assert sizes["none"] - sizes["int8"] >= 2.8 * projections
    assert sizes["int8"] - sizes["int4"] >= 0.3 * projections


def test_a_bad_quantization_parameter_is_named(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"quantization='int3', expected one of \('none', 'int8', 'int4'\)"):
        EngineConfig(model_path=tiny_checkpoint, quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_group_size=100, expected one of \(32, 64, 128\)"):
        EngineConfig(model_path=tiny_checkpoint, quantization="int4", quantization_group_size=100)


@pytest.mark.parametrize("dtype, activations", [("float32", "none"), ("bfloat16", "int8")])
def test_batch_invariant_logprobs_with_quantized_weights(tiny_checkpoint, dtype, activations):
    """A probe's logprobs alone and in a busy batch, bitwise: the quantized GEMM reduces each row in
    an order of its own, as the float one does; with int8 activations the integer dot products are
    exact and each row's float steps its own, on one kernel for every row count."""
    probe = SHARED_PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def logprobs_beside(others: list[list[int]]) -> list[float]:
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype=dtype, num_kv_blocks=256,
                                        quantization="int4", quantization_group_size=32, batch_invariant=True,
                                        activation_quantization=activations, max_num_batched_tokens=64,
                                        long_prefill_token_threshold=16))
        return probe_logprobs(engine, probe, params,
                              [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for p in others])

    alone = logprobs_beside([])
    assert len(alone) == 12
    assert logprobs_beside(PROMPTS[:9]) == alone


# --------------------------------------------------------------------------------------
# int8 activations (activation_quantization): numbers of their own, so the oracle is the same
# model computed with torch's int8_activation_linear for every quantized weight (kernels/quantized.py)


def _torch_int8_activations(engine: LLMEngine) -> None:
    """Every quantized weight repacked as the C++ kernels' absence packs it (int8_activation_linear
    in torch, per call), and the model run module by module."""
    with mock.patch.object(kernels.cpu_ext, "load", return_value=None):
        for module in engine.model.modules():
            if isinstance(module, Linear) and module.quantized is not None:
                module.packed = kernels.pack_linear_weight(module.quantized, dtype=engine.dtype, int8_activations=True)
                assert module.packed.kind == "quant"
        embed = engine.model.embed_tokens
        if engine.model.lm_head is None:
            engine.model.tied_lm_head_packed = kernels.pack_linear_weight(embed.quantized, dtype=engine.dtype,
                                                                          int8_activations=True)
    engine.model.cpu_layers = None


def _int8_activations_oracle(model_path: str, **config) -> dict:
    """Each prompt alone, one after another, on the torch model."""
    _, streamed, by_id = run_engine(model_path, ALL_PROMPTS, [MAX_NEW] * len(ALL_PROMPTS), [0] * len(ALL_PROMPTS),
                                    on_engine=_torch_int8_activations, max_num_seqs=1, num_kv_blocks=256, **config)
    return {tuple(by_id[rid]): tokens for rid, tokens in streamed.items()}


@pytest.mark.parametrize("quantization, group", [("int4", 32), ("int8", 128)])
def test_int8_activations_give_their_torch_models_tokens_under_every_scheduling_feature(
        tiny_checkpoint, quantization, group):
    config = dict(quantization=quantization, quantization_group_size=group, activation_quantization="int8")
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", num_kv_blocks=16, **config))
    packed = [m.packed for m in engine.model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert packed and {(p.kind, p.isa, p.vector_rows) for p in packed} == {
        ("quant_panels", kernels.cpu_ext.QUANT_INT8_DOTS, 0)}
    assert engine.model.cpu_layers is not None  # the fused C++ layers run them
    _scenarios(tiny_checkpoint, _int8_activations_oracle(tiny_checkpoint, **config), **config)


def test_int8_activations_without_quantized_weights_are_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"activation_quantization='int4', expected one of \('none', 'int8'\)"):
        EngineConfig(model_path=tiny_checkpoint, activation_quantization="int4")
    with pytest.raises(CheckpointError, match="activation_quantization='int8' applies to quantized weights"):
        LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", num_kv_blocks=16,
                               activation_quantization="int8"))


@pytest.mark.skipif(kernels.cpu_ext.isa() < kernels.cpu_ext.Isa.AMX, reason="no AMX tiles here")
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_bf16_models_projections_follow_the_batch_invariant_mode(tiny_checkpoint, batch_invariant, quantization):
    """The engine's mode reaches the packing: outside it every projection of a bf16 model (and the
    tied output head) runs calls of a few rows beside the tiles (kernels/linear.py: bf16 weights on
    vdpbf16ps, int8 and int4 on the bf16 dots), in it none does; and the
    fused C++ layers take the same path as the modules, so that a request's tokens are the same
    either way (the CPU runs the fused layers; the modules are what the other devices run)."""
    prompts = PROMPTS[:3]
    Isa = kernels.cpu_ext.Isa
    beside = {"none": (BF16_ROWS_BESIDE_TILES, Isa.AVX512_BF16), "int4": (VECTOR_ROWS_BESIDE_TILES, kernels.cpu_ext.QUANT_BF16_DOTS),
              "int8": (VECTOR_ROWS_BESIDE_TILES, kernels.cpu_ext.QUANT_BF16_DOTS)}
    rows, vector_isa = (0, Isa.NONE) if batch_invariant else beside[quantization]

    def check_packing(engine: LLMEngine) -> None:
        assert engine.runner.batch_invariant == batch_invariant
        packed = [m.packed for m in engine.model.modules() if isinstance(m, Linear) and m.packed is not None]
        if quantization == "none" and engine.model.tied_lm_head_packed is not None:
            packed.append(engine.model.tied_lm_head_packed)
        assert len(packed) > 1 and {(p.isa, p.vector_rows, p.vector_isa) for p in packed} == {
            (Isa.AMX, rows, vector_isa)}

    def unfuse(engine: LLMEngine) -> None:
        check_packing(engine)
        engine.model.cpu_layers = None

    config = dict(dtype="bfloat16", quantization=quantization, batch_invariant=batch_invariant, num_kv_blocks=64)
    _, fused, _ = run_engine(tiny_checkpoint, prompts, [8] * 3, [0, 2, 4], on_engine=check_packing, **config)
    _, modules, _ = run_engine(tiny_checkpoint, prompts, [8] * 3, [0, 2, 4], on_engine=unfuse, **config)
    assert fused == modules and all(len(t) == 8 for t in fused.values())


# --------------------------------------------------------------------------------------
# Hugging Face quantization_config: AWQ, GPTQ, compressed-tensors


def _pack_int32(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack values (last dim a multiple of 32 // bits) into int32 words, lowest bits first, the
    word's i-th field holding value order[i] of its group (AWQ's interleave)."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., order]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per_word):
        word |= (v[..., i] & ((1 << bits) - 1)) << (bits * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _packed_checkpoint(source: str, dest: str, method: str, group: int, act_order: bool = False) -> tuple[str, str]:
    """`source` in `method`'s layout (and its float reference checkpoint), from round-to-nearest
    int4 (AWQ, GPTQ: asymmetric, zeros; compressed-tensors: symmetric, offset 8)."""
    reference = dest + "-reference"
    if os.path.isdir(dest):
        return dest, reference
    shutil.copytree(source, dest)
    shutil.copytree(source, reference)
    weights = load_file(os.path.join(source, "model.safetensors"))
    packed, floats = {}, {}
    rng = torch.Generator().manual_seed(5)
    perms: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith("_proj.weight"):
            packed[name] = floats[name] = w
            continue
        out, k = w.shape
        groups = k // group
        if method == "compressed-tensors":
            scale = (w.view(out, groups, group).abs().amax(-1) / 7.0).clamp_min(1e-8)
            scale = scale.to(torch.float16)
            q = torch.round(w.view(out, groups, group) / scale.float()[..., None]).clamp(-8, 7).view(out, k)
            floats[name] = q * scale.float().repeat_interleave(group, 1)
            packed[prefix + ".weight_packed"] = _pack_int32(q + 8, 4)
            packed[prefix + ".weight_scale"] = scale
            packed[prefix + ".weight_shape"] = torch.tensor([out, k], dtype=torch.int64)
            continue
        # The inputs' groups: in order, or (GPTQ act-order) a permutation shared by the layers
        # that read the same input.
        shared = prefix.rsplit(".", 1)[0] + (".qkv" if "self_attn" in prefix and "o_proj" not in prefix else
                                             ".gate_up" if "mlp" in prefix and "down" not in prefix else "." + prefix)
        if act_order and shared not in perms:
            perms[shared] = torch.randperm(k, generator=rng)
        g_idx = (torch.arange(k) // group)[torch.argsort(perms[shared])] if act_order else torch.arange(k) // group
        lo = torch.zeros(out, groups).scatter_reduce(1, g_idx.expand(out, k), w, "amin", include_self=False)
        hi = torch.zeros(out, groups).scatter_reduce(1, g_idx.expand(out, k), w, "amax", include_self=False)
        scale = ((hi - lo) / 15.0).clamp_min(1e-6).to(torch.float16).float()
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = torch.round(w / scale[:, g_idx] + zero[:, g_idx]).clamp(0, 15)
        floats[name] = (q - zero[:, g_idx]) * scale[:, g_idx]
        if method == "awq":  # [in, out] packed along out, interleaved
            awq = [0, 2, 4, 6, 1, 3, 5, 7]
            packed[prefix + ".qweight"] = _pack_int32(q.t().contiguous(), 4, awq)
            packed[prefix + ".qzeros"] = _pack_int32(zero.t().contiguous(), 4, awq)
            packed[prefix + ".scales"] = scale.t().contiguous().to(torch.float16)
        else:  # gptq: qweight packed along in, zeros stored minus one
            packed[prefix + ".qweight"] = _pack_int32(q.t().reshape(k // 8, 8, out).permute(0, 2, 1), 4)[..., 0].contiguous()
            packed[prefix + ".qzeros"] = _pack_int32((zero - 1).t().contiguous(), 4)
            packed[prefix + ".scales"] = scale.t().contiguous().to(torch.float16)
            packed[prefix + ".g_idx"] = g_idx.to(torch.int32)
    save_file(packed, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    save_file({n: t.float() for n, t in floats.items()}, os.path.join(reference, "model.safetensors"),
              metadata={"format": "pt"})
    config = json.load(open(os.path.join(dest, "config.json")))
    if method == "compressed-tensors":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
            "ignore": ["lm_head"]}
    else:
        config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group,
                                          **({"version": "gemm", "zero_point": True} if method == "awq" else
                                             {"desc_act": act_order, "sym": False})}
    json.dump(config, open(os.path.join(dest, "config.json"), "w"))
    return dest, reference


@pytest.mark.parametrize("method, act_order", [("awq", False), ("gptq", False), ("gptq", True),
                                               ("compressed-tensors", False)])
def test_packed_checkpoint_matches_its_dequantized_model(tiny_checkpoint, tmp_path_factory, method, act_order):
    path, reference = _packed_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp(method) / "m"), method, 128,
                                         act_order)
    oracle = _oracle(reference)
    arrivals = spread_arrivals(len(PROMPTS), every=1)
    engine, streamed, by_id = run_engine(path, PROMPTS, MAX_TOKENS, arrivals, max_num_seqs=6, num_kv_blocks=256,
                                         long_prefill_token_threshold=7, max_num_batched_tokens=40)
    assert engine.model.layers[0].self_attn.qkv_proj.quantized.bits == 4
    assert (engine.model.layers[0].mlp.down_proj.input_perm is not None) == act_order
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'.*supported methods: awq, gptq, compressed-tensors"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, r"quant_method='awq'.*bits=3; supported: 4"),
    ({"quant_method": "fp8"}, r"quant_method='fp8'"),
])
def test_unsupported_quantization_config_is_named(tiny_checkpoint, tmp_path, qcfg, message):
    shutil.copytree(tiny_checkpoint, tmp_path / "m")
    config = json.load(open(tmp_path / "m" / "config.json"))
    config["quantization_config"] = qcfg
    json.dump(config, open(tmp_path / "m" / "config.json", "w"))
    with pytest.raises(CheckpointError, match=message):
        load_model(str(tmp_path / "m"), torch.float32, torch.device("cpu"), 64)


def test_lora_adapters_apply_in_float_over_a_quantized_base(tiny_checkpoint, tmp_path_factory):
    """Adapters made for the float model, served over its int4 quantization: each request gets
    transformers + PEFT's tokens on the de-quantized base with its adapter."""
    from tests.checkpoints import make_random_adapter

    root = tmp_path_factory.mktemp("quantized-lora")
    reference = _dequantized_checkpoint(tiny_checkpoint, str(root / "deq"), 4, 64)
    adapters = {"all-r8": make_random_adapter(str(root / "all-r8"), tiny_checkpoint, rank=8, seed=1),
                "qv-r16": make_random_adapter(str(root / "qv-r16"), tiny_checkpoint, rank=16, seed=2,
                                              target_modules=("q_proj", "v_proj"))}
    names = [(None, "all-r8", "qv-r16")[i % 3] for i in range(len(PROMPTS))]
    oracle = {}
    for name in (None, *adapters):
        outs = hf_greedy(reference, PROMPTS, MAX_NEW, adapter_dir=adapters[name] if name else None)
        oracle.update({(name, tuple(p)): o for p, o in zip(PROMPTS, outs)})
    engine, streamed, by_id = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, spread_arrivals(len(PROMPTS), every=1),
                                         lora_names=names, lora_modules=adapters, max_lora_rank=16, max_loras=3,
                                         max_num_seqs=8, num_kv_blocks=256, quantization="int4",
                                         quantization_group_size=64)
    assert engine.model.layers[0].self_attn.qkv_proj.quantized is not None
    for rid, tokens in streamed.items():
        i = int(rid[1:])
        assert tokens == oracle[(names[i], tuple(by_id[rid]))][: MAX_TOKENS[i]], rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_on_cuda_match_the_dequantized_model(tiny_checkpoint, tmp_path_factory, mode):
    """The Triton W8A16/W4A16 kernel in the engine on a GPU, float32 (IEEE dot products)."""
    bits = 8 if mode == "int8" else 4
    reference = _dequantized_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("deq-cuda") / "m"), bits,
                                        None if bits == 8 else 64)
    _scenarios(tiny_checkpoint, _oracle(reference), device="cuda", quantization=mode, quantization_group_size=64)
