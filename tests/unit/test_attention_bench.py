"""G2's attention microbenchmark (client/bench/attention.py) at tiny shapes on the CPU: its
report, its FLOP count, and its refusal to time a kernel that disagrees with the reference."""

from __future__ import annotations

import json

import pytest
import torch

from client.bench import attention

TINY = ["--device", "cpu", "--batch", "1,2", "--context", "16,40", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--chunk", "8", "--prefill-seqs", "2", "--prefill-context", "24",
        "--prefill-decodes", "2", "--seconds", "0.01", "--windows", "2", "--copy-megabytes", "8"]


def test_report_has_every_decode_shape_and_the_mixed_prefill_for_every_implementation(tmp_path):
    out = tmp_path / "g2" / "attention.json"
    assert attention.main([*TINY, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].endswith("-m client.bench.attention " + " ".join([*TINY, "--json", str(out)]))
    assert report["machine"]["cores"] >= 1 and report["git_commit"] and report["timestamp"]
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["kv_cache_dtype"] == "auto"
    assert report["copy_bandwidth_gbps"] > 0
    assert [(row["batch"], row["context"]) for row in report["decode"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for row in report["decode"]:
        # K and V, 2 KV heads x 16 dims of float32 per token.
        assert row["kv_bytes"] == row["batch"] * row["context"] * 2 * 16 * 2 * 4
        for name in attention.IMPLEMENTATIONS:
            assert row[name]["ms"] > 0 and row[name]["gb_per_s"] > 0
            assert row[name]["fraction_of_copy_bandwidth"] == pytest.approx(
                row[name]["gb_per_s"] / report["copy_bandwidth_gbps"])
    prefill = report["prefill"]
    assert (prefill["prefill_seqs"], prefill["chunk"], prefill["prefill_context"], prefill["decodes"],
            prefill["decode_context"]) == (2, 8, 24, 2, 32)
    assert prefill["flops"] == attention.attention_flops([1, 1, 8, 8], [32] * 4, 4, 16)
    assert prefill["sdpa_flops"] == attention.attention_flops([8, 8], [32, 32], 4, 16)
    for name in attention.IMPLEMENTATIONS:
        assert prefill[name]["ms"] > 0 and prefill[name]["tflop_per_s"] > 0


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_is_timed_on_every_implementation_and_its_bytes_counted_as_stored(tmp_path, kind):
    out = tmp_path / "attention.json"
    assert attention.main([*TINY, "--kv-cache-dtype", kind, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == kind and report["dtype"] == "float32"
    for row in report["decode"]:
        # K and V, 2 KV heads x (16 one-byte values + a float32 scale) per token.
        assert row["kv_bytes"] == row["batch"] * row["context"] * 2 * (16 + 4) * 2
        assert all(row[name]["gb_per_s"] > 0 for name in attention.IMPLEMENTATIONS)
    assert all(report["prefill"][name]["tflop_per_s"] > 0 for name in attention.IMPLEMENTATIONS)


def test_attention_flops_counts_the_keys_each_query_token_attends():
    q_lens, seq_lens, heads, head_dim = [1, 5, 3, 7, 0], [9, 5, 20, 7, 4], 3, 8
    keys = 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        for position in range(seq_len - q_len, seq_len):
            keys += sum(1 for key in range(seq_len) if key <= position)
    assert attention.attention_flops(q_lens, seq_lens, heads, head_dim) == 4 * heads * head_dim * keys


def test_an_engine_kernel_that_disagrees_with_the_reference_is_refused(monkeypatch):
    monkeypatch.setattr(attention.kernels, "paged_attention", lambda query, *args: torch.zeros_like(query))
    with pytest.raises(RuntimeError, match="the engine kernel disagrees with the torch reference on decode batch"):
        attention.main(TINY)
