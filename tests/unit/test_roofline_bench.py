"""G1's decode roofline (client/bench/roofline.py), on the CPU with tiny models."""

from __future__ import annotations

import os

import pytest
from safetensors import safe_open

from backend.models.loader import load_arch
from backend.paths import DEFAULT_CHECKPOINT
from client.bench import roofline
from tests.checkpoints import make_tiny_checkpoint


def _tensor_bytes(checkpoint: str) -> int:
    total = 0
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
                                              ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_a_decode_step_reads_every_weight_but_an_untied_embedding(family, overrides, tmp_path):
    """What the roofline counts is the checkpoint's weights, less the embedding table where the
    output head has its own (a step reads only its batch's rows of the table)."""
    checkpoint = make_tiny_checkpoint(str(tmp_path / "ckpt"), family=family, **overrides)
    arch, _ = load_arch(checkpoint)
    unread = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size * 4
    assert roofline.weight_bytes_read(arch, 4) == _tensor_bytes(checkpoint) - unread


def test_the_default_checkpoints_weights():
    arch, _ = load_arch(str(DEFAULT_CHECKPOINT))
    assert roofline.weight_bytes_read(arch, 4) == _tensor_bytes(str(DEFAULT_CHECKPOINT))


def test_a_mixture_of_experts_model_is_refused(tmp_path):
    arch, _ = load_arch(make_tiny_checkpoint(str(tmp_path / "moe"), family="qwen3_moe"))
    with pytest.raises(ValueError, match="reads the experts its batch routes to"):
        roofline.weight_bytes_read(arch, 4)
