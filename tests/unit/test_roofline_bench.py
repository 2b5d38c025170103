"""G1's decode roofline (client/bench/roofline.py), on the CPU with tiny models."""

from __future__ import annotations

import json
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


def test_the_roofline_of_each_batch_and_context(tmp_path):
    checkpoint = make_tiny_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "g1.json"
    assert roofline.main(["--model", checkpoint, "--device", "cpu", "--batch", "1,3", "--context", "17,40",
                          "--seconds", "0.01", "--windows", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in report["results"]] == [(1, 17), (1, 40), (3, 17), (3, 40)]
    arch, _ = load_arch(checkpoint)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    for row in report["results"]:
        assert row["step_ms"] > 0 and row["roofline_ms"] > 0
        assert row["kv_bytes"] == row["batch"] * row["context"] * per_token
        assert row["fraction_of_roofline"] == pytest.approx(row["roofline_ms"] / row["step_ms"])
    assert report["copy_bandwidth_gbps"] > 0 and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["machine"]["cpu_flags"] is not None and report["command"].startswith("python -m client.bench.roofline")
