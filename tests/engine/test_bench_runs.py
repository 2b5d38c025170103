"""The benchmark's commands and runners on the engine itself, on the tiny checkpoint: closed-loop
concurrency, the W3 rate sweep's report and plot, repeated runs, the structured-output cost,
the host-overhead benchmark and G1's decode roofline. Their arithmetic alone is
tests/unit/test_bench_harness.py's; the same harness against a real tritonserver is
tests/e2e/test_bench_targets.py's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models.loader import load_arch
from client.bench import cli, overhead, plot, roofline, runners, table, workloads
from client.bench.stats import summarize

# A small KV pool: the default 1 GiB is needless for a few tiny requests.
ENGINE = {"kv_cache_memory_mb": 64}


def test_closed_loop_keeps_n_requests_in_flight(tiny_checkpoint):
    w = workloads.w3_online(num_requests=6, input_len=16, output_len=6, rate_per_s=0.01)  # arrivals ~100 s apart
    run = runners.run_engine(w, tiny_checkpoint, {**ENGINE, "scheduling_policy": "fcfs"}, "continuous", progress=False,
                             concurrency=2)
    assert run.duration_s < 60  # the arrival times were ignored
    assert all(r.finish_reason == "length" and r.num_output_tokens == 6 for r in run.records)
    for r in run.records:  # how many were in flight when this one was sent: itself and at most one other
        in_flight = sum(1 for o in run.records if o.arrival <= r.arrival < o.token_times[-1])
        assert in_flight <= 2
    assert max(sum(1 for o in run.records if o.arrival <= r.arrival < o.token_times[-1]) for r in run.records) == 2
    result = summarize(run, w)
    assert result["concurrency"] == 2 and result["rate_per_s"] is None and result["all_token_counts_right"]


def test_a_closed_loop_tenant_keeps_its_requests_in_flight_beside_an_open_loop_one(tiny_checkpoint):
    """W8a's shape, scaled down: tenant A a closed loop of 3, tenant B at arrival times."""
    w = workloads.w8a_flood(num_requests=3, rate_per_s=50.0, in_flight=3, long_output=12, chat_output=4,
                            prompt_len=8, max_num_seqs=2)
    assert w.tenant_concurrency == {"A": 3} and [r.max_tokens for r in w.requests[:3]] == [4, 8, 12]
    run = runners.run_engine(w, tiny_checkpoint, {**ENGINE, "scheduling_policy": "fair"}, "fair", progress=False)
    assert all(r.finish_reason == "length" for r in run.records)
    flood = [r for r, spec in zip(run.records, w.requests) if spec.tenant == "A"]
    for r in flood:
        assert sum(1 for o in flood if o.arrival <= r.arrival < o.token_times[-1]) <= 3
    service = run.engine_kpis["service_by_tenant"]
    expected = {t: sum(len(q.prompt_token_ids) + 2 * q.max_tokens for q in w.requests if q.tenant == t) for t in "AB"}
    assert service == expected
    timeline = run.engine_kpis["service_timeline"]
    assert timeline["A"][-1] == expected["A"] and timeline["B"][-1] == expected["B"]
    assert len(timeline["t_s"]) == len(timeline["A"]) == len(timeline["B"])
    assert all(a <= b for a, b in zip(timeline["A"], timeline["A"][1:]))
    result = summarize(run, w)
    assert result["by_class"]["B"]["output_tokens"] == 3 * 4
    assert result["by_class"]["A"]["output_token_share"] + result["by_class"]["B"]["output_token_share"] == \
        pytest.approx(1.0)


def test_w8b_report_has_the_ratios_and_a_service_plot(tiny_checkpoint, tmp_path):
    out = tmp_path / "results" / "w8b.json"
    code = cli.main(["W8b", "--model", tiny_checkpoint, "--num-requests", "6", "--rate", "40", "--output-len", "40",
                     "--engine", "kv_cache_memory_mb=64",
                     "--json", str(out), "--plot", "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["results"]] == ["fcfs", "priority", "fair"]
    assert set(report["ratios"]) == {"fair/fcfs", "priority/fcfs"}
    assert set(report["ratios"]["fair/fcfs"]["e2el_p99_by_class"]) == {"chat", "long"}
    assert (tmp_path / "w8b.png").stat().st_size > 10_000


def test_w7_runs_groups_and_their_sequences_as_separate_requests_alike(tiny_checkpoint, tmp_path):
    out = tmp_path / "w7.json"
    code = cli.main(["W7", "--model", tiny_checkpoint, "--num-requests", "3", "--input-len", "20", "--output-len", "5",
                     "--engine", "kv_cache_memory_mb=64", "--json", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["system"] for r in report["results"]] == ["continuous", "separate-no-prefix-cache"]
    assert report["workload"]["n"] == 4 and report["workload"]["total_output_tokens"] == 3 * 4 * 5
    for r in report["results"]:  # every request's record counts all 4 sequences' tokens
        assert r["num_completed"] == 3 and r["all_token_counts_right"] and r["output_tokens"] == 60
    assert "continuous/separate-no-prefix-cache" in report["ratios"]


def test_w3_rate_sweep_report_plot_and_redraw(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "results" / "w3_sweep.json"
    code = cli.main(["W3", "--model", tiny_checkpoint, "--systems", "continuous", "--rates", "20,inf", "--num-requests", "4",
                     "--input-len", "16", "--output-len", "4", "--engine", "kv_cache_memory_mb=64",
                     "--slo-ttft-ms", "5000", "--json", str(out), "--plot", "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [(r["system"], r["rate_per_s"]) for r in report["results"]] == [("continuous", 20.0), ("continuous", 0.0)]
    assert report["workload"]["rates_per_s"] == [20.0, 0.0] and report["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 100.0}
    for r in report["results"]:
        assert r["num_completed"] == 4 and r["all_token_counts_right"]
        assert 0 <= r["goodput_requests_per_s"] <= r["requests_per_s"]
        assert r["goodput_requests_per_s"] == pytest.approx(r["slo_met"] / r["duration_s"])
    png = tmp_path / "w3_sweep.png"  # bench/results/X.json -> bench/X.png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.is_rate_sweep(report)
    redrawn = tmp_path / "again.png"
    assert plot.main([str(out), "-o", str(redrawn)]) == 0
    assert redrawn.stat().st_size > 10_000
    assert "continuous  20/s" in capsys.readouterr().out


def test_repeat_interleaves_the_systems_and_labels_every_run(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "results" / "w2_repeat.json"
    code = cli.main(["W2", "--model", tiny_checkpoint, "--systems", "continuous,static", "--num-requests", "3", "--repeat", "2",
                     "--engine", "kv_cache_memory_mb=64", "--json", str(out), "--plot", "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    # Run i's workload is seed i - 1's, for every system.
    assert [(r["system"], r["run"], r["seed"]) for r in report["results"]] == [
        ("continuous", 1, 0), ("static", 1, 0), ("continuous", 2, 1), ("static", 2, 1)]
    assert all(r["num_completed"] == 3 and r["all_token_counts_right"] for r in report["results"])
    entry = report["ratios"]["continuous/static"]
    per_run = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
               for a, b in zip(report["results"][0::2], report["results"][1::2])]
    assert entry["runs"] == pytest.approx(per_run)
    assert entry["output_tokens_per_s"] == pytest.approx(float(np.median(per_run)))
    printed = capsys.readouterr().out
    assert "run" in printed.splitlines()[2].split() and "per run" in printed
    assert (tmp_path / "w2_repeat.png").read_bytes()[:4] == b"\x89PNG"
    rows = table.table([str(out)])
    assert "| continuous @ run 2 |" in rows and "per run" in rows


def test_overhead_benchmark_times_every_phase_of_full_decode_batches(tiny_checkpoint, tmp_path):
    out = tmp_path / "overhead.json"
    assert overhead.main(["--model", tiny_checkpoint, "--running", "4,16", "--prompt-len", "40", "--iterations", "6",
                          "--warmup-iterations", "2", "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert [r["running"] for r in report["results"]] == [4, 16]
    for result in report["results"]:
        phases = result["phases_ms"]
        assert set(phases) == {*overhead.PHASES, "schedule+prepare"}
        for phase in overhead.PHASES:
            assert 0 < phases[phase]["p50"] <= phases[phase]["p99"], (phase, phases[phase])
        assert phases["schedule+prepare"]["mean"] == pytest.approx(
            phases["schedule"]["mean"] + phases["prepare"]["mean"])
    assert report["meets_target"] == all(
        r["phases_ms"]["schedule+prepare"]["p50"] <= report["target_ms"]["schedule+prepare"] for r in report["results"])


def test_structured_half_constrains_every_other_request_and_keeps_the_token_counts(tiny_checkpoint, tmp_path):
    """The structured-output cost benchmark: the same W2, half its requests under the JSON
    constraint that no request completes before its max_tokens, so both systems do the same work."""
    out = tmp_path / "results" / "w2_structured.json"
    code = cli.main(["W2", "--model", tiny_checkpoint, "--systems", "structured-half,continuous", "--num-requests", "4",
                     "--engine", "kv_cache_memory_mb=64", "--json", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert all(r["num_completed"] == 4 and r["all_token_counts_right"] for r in report["results"])
    assert "structured-half/continuous" in report["ratios"]
    seen = []
    w = workloads.w2_offline(num_requests=4, low=4, high=8)
    original = runners.SamplingParams

    def recording(**kwargs):
        seen.append(kwargs.get("structured_outputs"))
        return original(**kwargs)

    runners.SamplingParams = recording
    try:
        runners.run_engine(w, tiny_checkpoint, ENGINE, "structured-half", progress=False,
                           structured_outputs=workloads.BENCH_STRUCTURED_OUTPUTS)
    finally:
        runners.SamplingParams = original
    seen = seen[1:]  # the warm-up request
    by_index = dict(zip(sorted(range(4), key=lambda i: w.requests[i].arrival_s), seen))
    assert [by_index[i] is not None for i in range(4)] == [True, False, True, False]


def test_the_roofline_of_each_batch_and_context(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint
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
    assert report["kv_blocks"] == "consecutive"
    assert report["machine"]["cpu_flags"] is not None and report["command"].startswith("python -m client.bench.roofline")


def test_scattered_blocks_are_the_same_blocks_in_another_order_and_give_the_same_logits(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", block_size=16, num_kv_blocks=12))
    runner = engine.runner
    q_lens = [40, 17, 33]  # 3 + 2 + 3 blocks
    in_order = runner.synthetic_inputs(q_lens)
    scattered = runner.synthetic_inputs(q_lens, scatter_seed=0)

    def blocks(inputs) -> list[list[int]]:
        tables = inputs.meta.block_tables.numpy()
        return [tables[i, :-(-n // 16)].tolist() for i, n in enumerate(q_lens)]

    assert blocks(in_order) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert sorted(sum(blocks(scattered), [])) == list(range(8)) and blocks(scattered) != blocks(in_order)
    assert blocks(runner.synthetic_inputs(q_lens, scatter_seed=0)) == blocks(scattered)
    slots = scattered.meta.slot_mapping.numpy()
    tables = scattered.meta.block_tables.numpy()
    positions = scattered.positions.numpy()
    rows = np.repeat(np.arange(3), q_lens)
    assert (slots == tables[rows, positions // 16] * 16 + positions % 16).all()
    assert torch.equal(runner.forward_logits(scattered), runner.forward_logits(in_order))


def test_the_roofline_reports_whether_the_blocks_were_scattered(tiny_checkpoint, tmp_path):
    out = tmp_path / "g1.json"
    assert roofline.main(["--model", tiny_checkpoint, "--device", "cpu", "--batch", "2", "--context", "40",
                          "--scatter-blocks", "--seconds", "0.01", "--windows", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kv_blocks"] == "scattered"


def test_the_interleaved_comparison_of_quantizations(tiny_checkpoint, tmp_path):
    """Q1's interleaved form: every engine timed in every round, each round's ratios and fractions
    its own times' and bandwidth's, the medians over the rounds; the quantized engines read fewer bytes."""
    out = tmp_path / "q1.json"
    assert roofline.main(["--model", tiny_checkpoint, "--device", "cpu", "--batch", "1", "--context", "17",
                          "--quantization", "none,int8,int4", "--group-size", "32", "--seconds", "0.01",
                          "--rounds", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = ["none", "int8", "int4"]
    assert report["quantizations"] == names and len(report["rounds"]) == 3
    reads = report["bytes_read"]
    assert reads["none"] > reads["int8"] > reads["int4"] > 0
    for r in report["rounds"]:
        for name in names:
            assert r["step_ms"][name] > 0
            assert r["speedup_over_none"][name] == pytest.approx(r["step_ms"]["none"] / r["step_ms"][name])
            assert r["fraction_of_roofline"][name] == pytest.approx(
                reads[name] / (r["copy_bandwidth_gbps"] * 1e9) * 1e3 / r["step_ms"][name])
    for key in ("step_ms", "fraction_of_roofline", "speedup_over_none"):
        for name in names:
            assert report["median"][key][name] == pytest.approx(sorted(r[key][name] for r in report["rounds"])[1])
    with pytest.raises(SystemExit, match="one --batch and one --context"):
        roofline.main(["--model", tiny_checkpoint, "--batch", "1,2", "--quantization", "none,int8"])
