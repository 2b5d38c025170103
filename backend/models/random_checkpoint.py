"""Random-weight Hugging Face checkpoints of the supported families, made on the spot.

Each is a real `transformers` model saved with safetensors and the default model's
tokenizer, so the engine, `transformers` and vLLM all load it. Tests use the tiny shape
(a forward pass in milliseconds); the benchmarks use the small shape, a Llama of a few
million parameters where the per-step overhead of a serving engine, not the matmuls,
sets the speed (docs/benchmarks.md), and on a GPU the shapes of Llama-3.2-1B and Llama-3.1-8B.
`python -m tools.random_checkpoint` writes one from the command line.
"""

from __future__ import annotations

import os
import shutil

import torch
import transformers

from backend.paths import DEFAULT_CHECKPOINT

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# Small enough to run a forward pass in milliseconds, big enough to have GQA and
# several layers; vocabulary shared with the default tokenizer. initializer_range is
# ~1/sqrt(hidden_size) rather than transformers' 0.02: with tiny weights every layer is
# a small perturbation of the residual stream, so greedy decoding of a tied-embedding
# model collapses to repeating one token and compares nothing; at 0.2 it is diverse.
TINY_SHAPE = dict(
    initializer_range=0.2,
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False, use_sliding_window=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16, use_sliding_window=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(tie_word_embeddings=False, head_dim=16, use_sliding_window=False, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(tie_word_embeddings=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                       norm_topk_prob=False)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, pad_token_id=0)),
    # Gemma: a small window (16) so that prompts cross it; sliding and global layers both.
    # Untied: with the embedding scaled by sqrt(hidden_size) a tied tiny Gemma repeats a few
    # tokens whatever the prompt, which would compare little.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(tie_word_embeddings=False, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                    pad_token_id=0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(tie_word_embeddings=False, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                    num_hidden_layers=3, sliding_window_pattern=3,  # 2 local : 1 global (Gemma 3's own: 5 : 1)
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 1000000.0}},
                    pad_token_id=0)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(tie_word_embeddings=False, sliding_window=None,
                                                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def copy_tokenizer(dest: str, source: str | os.PathLike = DEFAULT_CHECKPOINT) -> None:
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source} is missing: run `make setup` first (it makes the default checkpoint)")
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.exists(path):
            shutil.copy(path, dest)


def make_tiny_checkpoint(dest: str, family: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                         dtype: torch.dtype = torch.float32, tokenizer_source: str | os.PathLike = DEFAULT_CHECKPOINT,
                         **overrides) -> str:
    """Write a random-weight checkpoint of `family` to `dest` (idempotent) and return it.

    `overrides` go to the family's `transformers` config (e.g. head_dim=64,
    attention_bias=True, rope_parameters={...}); `max_shard_size` (e.g. "1MB") saves
    shards with an index; `dtype` is the dtype the weights are stored in; the tokenizer
    files are `tokenizer_source`'s (its vocabulary must fit the config's vocab_size).
    """
    if os.path.exists(os.path.join(dest, "config.json")):
        return dest
    config_cls, model_cls, family_defaults = FAMILIES[family]
    config = config_cls(**{**TINY_SHAPE, **family_defaults, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so those code paths matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    os.makedirs(dest, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(dest, safe_serialization=True, **kwargs)
    copy_tokenizer(dest, tokenizer_source)
    return dest


# A few million parameters, most of them the embedding (49152 x 128): per-token matmul
# work is ~1/20 of the default model's, so per-iteration overhead dominates.
SMALL_SHAPE = dict(TINY_SHAPE, initializer_range=0.1, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
# The GPU benchmarks' shapes (docs/benchmarks.md): Llama-3.2-1B and Llama-3.1-8B, vocabulary and
# RoPE scaling included. Their weights are random, so only the speed they give means anything;
# token ids past the default tokenizer's vocabulary decode to nothing, which the benchmarks
# never ask for.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA3_1B_SHAPE = dict(
    initializer_range=0.02, vocab_size=128256, tie_word_embeddings=True, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters={**_LLAMA3_ROPE, "factor": 32.0},
    bos_token_id=1, eos_token_id=2,
)
LLAMA3_8B_SHAPE = dict(
    LLAMA3_1B_SHAPE, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    head_dim=128, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0},
)
# The default checkpoint's shape (SmolLM2-135M-Instruct): its speed where its weights are not
# at hand (a machine without the package they come from).
SMOLLM2_135M_SHAPE = dict(
    initializer_range=0.02, vocab_size=49152, tie_word_embeddings=True, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=9.999999747378752e-06, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=1,
    eos_token_id=2,
)
# A Qwen3-MoE-shaped model for 2-core CPUs (with --family qwen3_moe): SmolLM2-135M's attention
# and vocabulary, 16 experts a layer and 2 of them a token, as Qwen3-30B-A3B routes 8 of 128;
# ~230M parameters, ~60M of them read per token.
QWEN3_MOE_SMALL_SHAPE = dict(
    SMOLLM2_135M_SHAPE, num_hidden_layers=12, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
    intermediate_size=1536, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
SHAPES = {"tiny": TINY_SHAPE, "small": SMALL_SHAPE, "smollm2-135m": SMOLLM2_135M_SHAPE, "llama3-1b": LLAMA3_1B_SHAPE,
          "llama3-8b": LLAMA3_8B_SHAPE, "qwen3-moe-small": QWEN3_MOE_SMALL_SHAPE}

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapter(dest: str, base_model: str, rank: int = 8, seed: int = 0,
                        target_modules: tuple[str, ...] = LORA_TARGET_MODULES, lora_alpha: int | None = None,
                        std: float = 0.1, use_rslora: bool = False) -> str:
    """Write a random PEFT LoRA adapter for the checkpoint at `base_model` to `dest`
    (idempotent) and return it.

    PEFT itself makes and saves it (adapter_config.json + adapter_model.safetensors). Both A
    and B are random (PEFT initialises B to zero, which would change nothing): entries of
    std `std` / sqrt(fan-in), so the delta is a small but real change of every target's output.
    """
    if os.path.exists(os.path.join(dest, "adapter_config.json")):
        return dest
    import peft  # only for making adapters: the engine reads the files itself

    base = transformers.AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=lora_alpha or 2 * rank, target_modules=list(target_modules),
                             lora_dropout=0.0, bias="none", use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std / param.shape[1] ** 0.5)
    os.makedirs(dest, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    return dest
