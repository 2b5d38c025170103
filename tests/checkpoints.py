"""The tests' checkpoints and their oracle.

Random-weight checkpoints come from backend/models/random_checkpoint.py (made on the spot, no
download), each family's with its own chat template (`FAMILY_CHAT_TEMPLATES`); `hf_greedy` is the
correctness oracle, transformers' own `generate()`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers.processors import TemplateProcessing

from backend.models import random_checkpoint
from backend.models.random_checkpoint import make_random_adapter
from backend.paths import DEFAULT_CHECKPOINT

__all__ = ["FAMILY_CHAT_TEMPLATES", "hf_greedy", "make_gguf_checkpoint", "make_random_adapter", "make_tiny_checkpoint"]

CHAT_TEMPLATES_DIR = Path(__file__).parent / "data" / "chat_templates"


@dataclass(frozen=True)
class ChatTemplate:
    """A model's own chat template (tests/data/chat_templates/, unmodified) and the tokens it
    emits that the default (SmolLM2) tokenizer lacks: added as special tokens, so that each is
    one token as in the model's own tokenizer. `bos`/`eos`: the model's BOS/EOS text where the
    template writes `bos_token`/`eos_token`. `adds_bos`: the model's tokenizer starts every
    encoding with its BOS too (Gemma's, Mistral's), so a rendered chat encoded with the special
    tokens would start with two."""

    file: str
    special_tokens: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    adds_bos: bool = False

    @property
    def text(self) -> str:
        return (CHAT_TEMPLATES_DIR / self.file).read_text()

    def tokenizer(self):
        """The default checkpoint's tokenizer with this template and its tokens."""
        tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
        tokens = [*self.special_tokens, *(t for t in (self.bos, self.eos) if t)]
        tokenizer.add_tokens([transformers.AddedToken(t, special=True, normalized=False) for t in tokens],
                             special_tokens=True)
        if self.bos:
            tokenizer.bos_token = self.bos
        if self.eos:
            tokenizer.eos_token = self.eos
        if self.adds_bos:
            bos_id = tokenizer.convert_tokens_to_ids(self.bos)
            tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
                single=f"{self.bos} $A", pair=f"{self.bos} $A {self.bos} $B", special_tokens=[(self.bos, bos_id)])
        tokenizer.chat_template = self.text
        return tokenizer


_QWEN25 = ChatTemplate("Qwen-Qwen2.5-7B-Instruct.jinja")  # <|im_start|>, <|im_end|>: SmolLM2 has them
_QWEN3 = ChatTemplate("Qwen-Qwen3-0.6B.jinja")
# family -> the chat template of an instruct model of that family. Llama keeps the default
# checkpoint's own (SmolLM2-135M-Instruct is a Llama). Mixtral, Qwen2-MoE, OLMoE and Gemma 3
# keep it too: their makers' templates are not in tests/data/chat_templates/ (README.md there).
FAMILY_CHAT_TEMPLATES = {
    "gemma2": ChatTemplate("google-gemma-2-2b-it.jinja", ("<start_of_turn>", "<end_of_turn>"), bos="<bos>",
                           eos="<eos>", adds_bos=True),
    "phi3": ChatTemplate("microsoft-Phi-3.5-mini-instruct.jinja", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                         eos="<|endoftext|>"),
    "qwen2": _QWEN25,
    "qwen3": _QWEN3,
    "qwen3_moe": _QWEN3,  # the Qwen3 release's MoE models (Qwen3-30B-A3B) share its template
    "mistral": ChatTemplate("mistralai-Mistral-Nemo-Instruct-2407.jinja", ("[INST]", "[/INST]"), bos="<s>", eos="</s>",
                            adds_bos=True),
}
# The vocabulary grows by the added tokens, rounded up as models pad theirs.
VOCAB_MULTIPLE = 256


def make_tiny_checkpoint(dest: str, family: str = "llama", **kwargs) -> str:
    """backend.models.random_checkpoint.make_tiny_checkpoint, with the tokenizer and chat template
    of the family's own model (`FAMILY_CHAT_TEMPLATES`) where there is one (idempotent)."""
    template = FAMILY_CHAT_TEMPLATES.get(family)
    if template is None or os.path.exists(os.path.join(dest, "config.json")):
        return random_checkpoint.make_tiny_checkpoint(dest, family, **kwargs)
    tokenizer = template.tokenizer()
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    kwargs.setdefault("vocab_size", max(vocab_size, random_checkpoint.TINY_SHAPE["vocab_size"]))
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        return random_checkpoint.make_tiny_checkpoint(dest, family, tokenizer_source=tokenizer_dir, **kwargs)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True,
              dtype: torch.dtype = torch.float32, adapter_dir: str | None = None,
              gguf_file: str | None = None) -> list[list[int]]:
    """The oracle: transformers `generate()` one prompt at a time (no padding effects);
    with `adapter_dir`, of the base model with that PEFT LoRA adapter (`PeftModel`); with
    `gguf_file` (in model_dir), of that GGUF file as transformers de-quantizes it.

    With ignore_eos=False it stops at the EOS ids of the checkpoint's generation_config.json
    (the EOS token is the last one returned).
    """
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra)
    if adapter_dir is not None:
        import peft

        # Unmerged: PEFT adds each LoRA delta beside the base projection, as the engine does.
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            if ignore_eos:
                kwargs["eos_token_id"] = None
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


# The block type of each projection in `make_gguf_checkpoint`'s file: every type the engine
# reads, and a q|k|v and a gate|up whose parts differ (as in llama.cpp's Q4_K_M mixes).
GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q4_K",
              "ffn_gate": "Q5_1", "ffn_up": "Q4_1", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K"}
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _k_quant_blocks(type_name: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bytes of a K-quant type (gguf-py cannot quantize them): random integers, scales sized
    so that the weights keep about `weight`'s magnitude."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = weight.size // block_elems
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    std = float(weight.std())

    def f16(values):
        return np.frombuffer(values.astype(np.float16).tobytes(), np.uint8).reshape(n, 2)

    if type_name == "Q4_K":  # w = d * sc * q - dmin * m, sc and m up to 63, q up to 15
        blocks[:, 0:2] = f16(np.abs(rng.standard_normal(n)) * std / 200)
        blocks[:, 2:4] = f16(np.abs(rng.standard_normal(n)) * std / 30)
    elif type_name == "Q6_K":  # w = d * scale * (q - 32), int8 scales
        blocks[:, 208:210] = f16(np.abs(rng.standard_normal(n)) * std / 2000)
    # Other K types: random bytes (for files the engine must refuse).
    return blocks.reshape(weight.shape[0], -1)


def make_gguf_checkpoint(source: str, dest: str, types: dict[str, str] | None = None, tied: bool = True) -> str:
    """A GGUF file of `source`'s tiny Llama (hidden and intermediate sizes multiples of 256) as
    llama.cpp's converter writes one: q and k rows permuted for its rotary layout, the
    projections in `types`' block types (Q8_0/Q4_0/Q4_1 quantized from the weights by gguf-py,
    Q4_K/Q6_K random blocks), norms in F32. The engine's oracle is transformers reading the file."""
    import gguf
    from safetensors.torch import load_file

    types = {**GGUF_TYPES, **(types or {})}
    if os.path.exists(dest):
        return dest
    config = json.load(open(os.path.join(source, "config.json")))
    weights = load_file(os.path.join(source, "model.safetensors"))
    writer = gguf.GGUFWriter(dest, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_bos_token_id(config.get("bos_token_id") or 1)
    writer.add_eos_token_id(config.get("eos_token_id") or 2)
    rng = np.random.default_rng(0)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def add(name: str, kind: str, w: np.ndarray):
        if kind == "F32":
            writer.add_tensor(name, w.astype(np.float32))
            return
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        data = _k_quant_blocks(kind, w, rng) if kind.endswith("_K") else gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    for key, tensor in weights.items():
        w = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            add("token_embd.weight", types["token_embd"], w)
        elif key == "model.norm.weight":
            add("output_norm.weight", "F32", w)
        elif key == "lm_head.weight":
            if not tied:
                add("output.weight", types["output"], w)
        else:
            layer, module = key.removeprefix("model.layers.").split(".", 1)
            module = module.removesuffix(".weight")
            short = _GGUF_NAMES[module]
            if short == "attn_q":
                w = permute(w, config["num_attention_heads"])
            elif short == "attn_k":
                w = permute(w, config["num_key_value_heads"])
            add(f"blk.{layer}.{short}.weight", types.get(short, "F32"), w)
    if not tied and "lm_head.weight" not in weights:
        add("output.weight", types["output"], weights["model.embed_tokens.weight"].float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
