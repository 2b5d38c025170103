"""Gemma 2 and Gemma 3 (text) through the engine's scheduler, against `transformers`.

tests/engine/test_model_families.py checks each family's logits and greedy tokens on a batch
of prompts; here the Gemma checkpoints' sliding windows (16 positions, so that every longer
prompt crosses them) and soft-capping go through what changes the attention's inputs:
staggered arrivals with chunked prefill, prefix-cache hits, preemption by recompute and by
swap, the CUDA path's Triton kernel (in Triton's interpreter), and batch-invariant logprobs.
Then the fields Gemma would get wrong are refused, naming them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from backend.models.loader import CheckpointError, load_arch
from backend.request import SamplingParams
from tests.checkpoints import hf_greedy, make_random_adapter, make_tiny_checkpoint
from tests.engine.test_engine_equivalence import assert_matches_oracle, probe_logprobs, run_engine, spread_arrivals
from tests.engine.windowed_scenarios import (
    CHOSEN,
    MAX_NEW,
    checkpoint_and_oracle,
    chunked_prefill_with_arrivals,
    preemption_under_a_tiny_kv_pool,
    prefix_cache_hits,
    with_config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Gemma 2 with caps small enough to bite on these random weights (its defaults are 50 and 30).
CASES = {
    "gemma2": ("gemma2", dict(attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3": ("gemma3", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory):
    """(checkpoint, {prompt: transformers' greedy continuation})."""
    family, overrides = CASES[request.param]
    return checkpoint_and_oracle(tmp_path_factory.mktemp(request.param), family, **overrides)


def test_the_window_and_the_caps_change_the_output(gemma, tmp_path):
    """Otherwise the tests here would pass with full, uncapped attention."""
    path, _ = gemma
    arch, _ = load_arch(path)
    assert 16 in arch.layer_windows and 0 in arch.layer_windows
    variants = {"sliding_window": 4096}
    if arch.attn_logit_softcapping:
        variants.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    longest = max(CHOSEN, key=len)
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = original(torch.tensor([longest])).logits
    for field, value in variants.items():
        changed = with_config(path, tmp_path / field, **{field: value})
        model = transformers.AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32).eval()
        with torch.inference_mode():
            assert (model(torch.tensor([longest])).logits - expected).abs().max() > 1e-3, field


@pytest.mark.parametrize("device", ["cpu", pytest.param("triton-on-cpu", marks=pytest.mark.slow)])
def test_chunked_prefill_across_the_window_with_arrivals(gemma, device):
    engine = chunked_prefill_with_arrivals(*gemma, device)
    assert engine.model.cpu_layers is None   # Gemma's layers run as modules


def test_prefix_cache_hits(gemma):
    prefix_cache_hits(*gemma)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_kv_pool(gemma, mode):
    preemption_under_a_tiny_kv_pool(*gemma, mode)


def test_logprobs_are_the_same_bits_alone_and_in_a_busy_batch(gemma):
    from tests.engine.test_model_families import make_engine

    path, _ = gemma
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    probe = max(CHOSEN, key=len)

    def logprobs_beside(others: list[list[int]]) -> list[float]:
        engine = make_engine(path, dtype="float32", batch_invariant=True, max_num_batched_tokens=40,
                             long_prefill_token_threshold=16)
        return probe_logprobs(engine, probe, params,
                              [(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in others])

    alone = logprobs_beside([])
    assert len(alone) == 8
    assert logprobs_beside(CHOSEN[:6]) == alone


# ---- bf16 and LoRA ----------------------------------------------------------------------


def test_a_bf16_checkpoint(gemma, tmp_path):
    """Stored in bf16: dtype auto (float32 on the CPU, as transformers upcasts) gives
    transformers' tokens; dtype bfloat16 strays from the float32 truth about as far as
    transformers' own bf16 forward does."""
    from tests.engine.test_model_families import hf_logits, our_logits

    path, _ = gemma
    model_type = json.load(open(os.path.join(path, "config.json")))["model_type"]
    family, overrides = CASES[{"gemma2": "gemma2", "gemma3_text": "gemma3"}[model_type]]
    bf16 = make_tiny_checkpoint(str(tmp_path / "bf16"), family=family, dtype=torch.bfloat16, **overrides)
    prompts = CHOSEN[:4]
    max_tokens = [MAX_NEW] * len(prompts)
    oracle = {tuple(p): out for p, out in zip(prompts, hf_greedy(bf16, prompts, MAX_NEW))}
    engine, streamed, by_id = run_engine(bf16, prompts, max_tokens, [0] * len(prompts), dtype="auto",
                                         num_kv_blocks=64, max_model_len=256)
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)

    engine, _, _ = run_engine(bf16, prompts, max_tokens, [0] * len(prompts), dtype="bfloat16",
                              num_kv_blocks=64, max_model_len=256)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    longest = max(prompts, key=len)
    ours, truth = our_logits(engine.model, longest), hf_logits(bf16, longest)
    theirs = hf_logits(bf16, longest, dtype=torch.bfloat16)
    assert (ours - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 1e-2
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() > 0.9


def test_a_lora_adapter_matches_peft(gemma, tmp_path):
    """An adapter on every projection, attention and MLP: transformers + PEFT's greedy tokens,
    beside requests of the base model in the same batches."""
    path, oracle = gemma
    adapter = make_random_adapter(str(tmp_path / "adapter"), path, rank=8, seed=3)
    prompts = CHOSEN[:4]
    expected = hf_greedy(path, prompts, MAX_NEW, adapter_dir=adapter)
    assert expected != [oracle[tuple(p)] for p in prompts]   # the adapter changes the output
    both = prompts + prompts
    max_tokens = [MAX_NEW] * len(both)
    engine, streamed, by_id = run_engine(path, both, max_tokens, spread_arrivals(len(both)),
                                         lora_names=["a"] * len(prompts) + [None] * len(prompts),
                                         lora_modules={"a": adapter}, max_lora_rank=8, num_kv_blocks=128,
                                         long_prefill_token_threshold=13, max_model_len=256)
    assert [streamed[f"r{i}"] for i in range(len(prompts))] == expected
    assert_matches_oracle(oracle, {f"r{i + len(prompts)}": streamed[f"r{i + len(prompts)}"] for i in range(len(prompts))},
                          by_id, max_tokens)


# ---- refused ------------------------------------------------------------------------------


def _config_only(tmp_path, config_cls, architecture: str, **overrides) -> str:
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    config = config_cls(**{**shape, **overrides})
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


GEMMA2 = (transformers.Gemma2Config, "Gemma2ForCausalLM")
GEMMA3 = (transformers.Gemma3TextConfig, "Gemma3ForCausalLM")


@pytest.mark.parametrize("family, overrides, message", [
    (GEMMA2, dict(hidden_activation="gelu"), r"hidden_activation='gelu'"),
    (GEMMA3, dict(hidden_activation="silu"), r"hidden_activation='silu'"),
    (GEMMA3, dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True"),
    (GEMMA3, dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     r"rope_parameters\.sliding_attention\.rope_type='linear'"),
    (GEMMA3, dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
     r"rope_scaling\.rope_type='dynamic'"),
])
def test_unsupported_gemma_config_field_is_named(tmp_path, family, overrides, message):
    path = _config_only(tmp_path, *family, **overrides)
    with pytest.raises(CheckpointError, match="unsupported config field " + message):
        load_arch(path)


def test_released_gemma_configs_are_read(tmp_path):
    """Gemma 2 (2B's fields) and Gemma 3 (1B's): windows by layer, the scale, caps and RoPE bases."""
    gemma2 = _config_only(tmp_path / "g2", *GEMMA2, num_hidden_layers=4, head_dim=256, query_pre_attn_scalar=256,
                          sliding_window=4096, max_position_embeddings=8192)
    arch, _ = load_arch(gemma2)
    assert arch.layer_windows == (4096, 0, 4096, 0) and arch.sliding_window is None
    assert arch.attention_scale == 256 ** -0.5
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    assert arch.local_rope_theta is None and arch.rope_theta == 10000.0
    gemma3 = _config_only(tmp_path / "g3", *GEMMA3, num_hidden_layers=12, sliding_window=512,
                          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                              "rope_theta": 1000000.0}})
    arch, _ = load_arch(gemma3)
    assert arch.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)   # 5 local : 1 global
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (0.0, 0.0)
    assert arch.local_rope_theta == 10000.0 and arch.rope_theta == 1000000.0
    assert arch.rope_scaling["rope_type"] == "linear" and arch.rope_scaling["factor"] == 8.0
