"""The MoE block bench (client/bench/moe_block.py) on a tiny Qwen3-MoE checkpoint."""

from __future__ import annotations

import json

from client.bench import moe_block
from tests.checkpoints import make_tiny_checkpoint


def test_the_report_times_both_paths_on_checked_bits(tmp_path):
    checkpoint = make_tiny_checkpoint(str(tmp_path / "moe"), family="qwen3_moe")
    out = tmp_path / "moe_block.json"
    assert moe_block.main(["--model", checkpoint, "--tokens", "1", "16", "--seconds", "0.01", "--windows", "1",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_experts"] == 8 and report["top_k"] == 2
    assert [r["tokens"] for r in report["results"]] == [1, 16]
    for row in report["results"]:
        assert row["cpp_ms"] > 0 and row["loop_ms"] > 0 and 2 <= row["experts_touched"] <= 8


def test_a_dense_checkpoint_is_refused(tmp_path, capsys):
    checkpoint = make_tiny_checkpoint(str(tmp_path / "dense"))
    assert moe_block.main(["--model", checkpoint]) == 1
    assert "no mixture-of-experts layer" in capsys.readouterr().err
