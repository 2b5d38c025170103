"""The benchmark harness (client/bench/: workloads, stats, runners, targets, plot, table, overhead, cli).

Its arithmetic and reports without an engine: workloads, goodput arithmetic, text prompts,
plots, tables, targets. The runs on the engine itself are tests/engine/test_bench_runs.py's,
and the same harness against a real tritonserver is tests/e2e/test_bench_targets.py's.
"""

from __future__ import annotations

import json
import re
import socketserver
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from client.bench import cli, flops, plot, stats, table, workloads
from client.bench.records import RequestRecord, SystemRun, git_commit
from client.bench.stats import summarize
from client.bench.targets import Target, parse_target, run_target
from tests.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


# ---------------------------------------------------------------------------- workloads


def test_default_prompt_source_draws_output_length_prompt_length_then_ids():
    """A synthetic workload draws from its seed in this fixed order, so the workload of every
    saved result can be drawn again."""
    rng = np.random.default_rng(5)
    out = int(min(512, max(1, round(rng.exponential(64)))))
    ids = rng.integers(workloads.TOKEN_LOW, workloads.TOKEN_HIGH, size=int(rng.integers(32, 129))).tolist()
    first = workloads.w1_variance(seed=5, num_requests=3).requests[0]
    assert (first.prompt_token_ids, first.max_tokens) == (ids, out)


def test_w3_rates_stretch_one_arrival_pattern_over_the_same_prompts():
    slow, fast = workloads.w3_online(seed=1, num_requests=200, rate_per_s=2.0), workloads.w3_online(seed=1, num_requests=200, rate_per_s=8.0)
    assert [r.prompt_token_ids for r in slow.requests] == [r.prompt_token_ids for r in fast.requests]
    assert all(len(r.prompt_token_ids) == 128 and r.max_tokens == 128 for r in slow.requests)
    assert np.allclose([r.arrival_s * 2 for r in slow.requests], [r.arrival_s * 8 for r in fast.requests])
    gaps = np.diff([0.0] + [r.arrival_s for r in slow.requests])
    assert 0.4 < gaps.mean() < 0.6  # Poisson at 2/s: mean gap 0.5 s
    assert all(r.arrival_s == 0 for r in workloads.w3_online(num_requests=5, rate_per_s=0).requests)


def test_attach_text_encodes_to_exactly_the_workload_tokens(tokenizer):
    w = workloads.attach_text(workloads.w3_online(num_requests=16, input_len=64), tokenizer)
    for r in w.requests:
        assert tokenizer.encode(r.prompt_text) == r.prompt_token_ids and len(r.prompt_token_ids) == 64
    # A shared prefix stays shared.
    w4 = workloads.attach_text(workloads.w4_shared_prefix(num_requests=4, prefix_len=64, tail_len=16), tokenizer)
    assert len({tuple(r.prompt_token_ids[:48]) for r in w4.requests}) == 1
    assert all(len(r.prompt_token_ids) == 80 for r in w4.requests)


def test_text_prompts_come_from_the_file_at_the_workload_lengths(tmp_path, tokenizer):
    path = tmp_path / "prompts.txt"
    path.write_text("Tell me about the ocean.\n\nWhy is grass green?\nName three rivers in Africa.\n")
    source = workloads.TextPrompts.from_file(str(path), tokenizer)
    w = workloads.w3_online(num_requests=6, input_len=24, output_len=4, source=source)
    assert w.summary()["prompts"] == f"text:{path}"
    workloads.attach_text(w, tokenizer, source)
    for r in w.requests:
        assert len(r.prompt_token_ids) == 24 and tokenizer.encode(r.prompt_text) == r.prompt_token_ids
        assert any(p in r.prompt_text for p in ("ocean", "grass", "rivers"))
    builtin = workloads.TextPrompts(workloads.BUILTIN_PROMPTS, tokenizer)
    text = tokenizer.decode(workloads.w3_online(num_requests=1, input_len=40, source=builtin).requests[0].prompt_token_ids)
    assert any(p[:20] in text for p in workloads.BUILTIN_PROMPTS)


# ---------------------------------------------------------------------------- metrics


def test_goodput_and_latency_arithmetic():
    w = workloads.Workload("T", "test", [workloads.BenchRequest([1, 2, 3], n) for n in (5, 5, 1, 5, 5)],
                           params={"rate_per_s": 2.0})
    records = [
        # TTFT 0.5 s, E2EL 0.8 s, 5 tokens in 3 pieces -> TPOT (0.8 - 0.5) / 4 = 75 ms: meets both.
        RequestRecord(arrival=10.0, token_times=[10.5, 10.7, 10.8], num_output_tokens=5, expected_output_tokens=5,
                      finish_reason="length"),
        # TTFT 1.2 s: misses TTFT.
        RequestRecord(arrival=10.0, token_times=[11.2, 11.3], num_output_tokens=5, expected_output_tokens=5,
                      finish_reason="length", end_time=11.4),
        # One token: no TPOT, TTFT 0.1 s: meets.
        RequestRecord(arrival=10.0, token_times=[10.1], num_output_tokens=1, expected_output_tokens=1,
                      finish_reason="length"),
        # TPOT (2.5 - 0.5) / 4 = 500 ms: misses TPOT.
        RequestRecord(arrival=10.0, token_times=[10.5, 12.5], num_output_tokens=5, expected_output_tokens=5,
                      finish_reason="length"),
        # Failed: counts nowhere but num_failed.
        RequestRecord(arrival=10.0, expected_output_tokens=5, error="boom"),
    ]
    result = summarize(SystemRun("s", records, duration_s=4.0), w)
    assert result["num_completed"] == 4 and result["num_failed"] == 1 and result["errors"] == ["boom"]
    assert result["slo_met"] == 2
    assert result["goodput_requests_per_s"] == pytest.approx(2 / 4.0)
    assert result["requests_per_s"] == pytest.approx(4 / 4.0)
    assert result["output_tokens"] == 16 and not result["all_token_counts_right"]
    assert result["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert result["e2el_ms"]["mean"] == pytest.approx(1e3 * (0.8 + 1.4 + 0.1 + 2.5) / 4)
    assert result["tpot_ms"]["p50"] == pytest.approx(75.0)
    assert result["tpot_ms"]["mean"] == pytest.approx(1e3 * (0.075 + 0.05 + 0.5) / 3)
    assert result["itl_ms"]["mean"] == pytest.approx(1e3 * (0.2 + 0.1 + 0.1 + 2.0) / 4)
    assert result["rate_per_s"] == 2.0 and result["concurrency"] is None
    # A stricter SLO from the command line.
    strict = summarize(SystemRun("s", records, duration_s=4.0), w, {"ttft_ms": 200.0, "tpot_ms": 1000.0})
    assert strict["slo_met"] == 1 and strict["slo"] == {"ttft_ms": 200.0, "tpot_ms": 1000.0}


def test_each_class_gets_its_own_latencies_and_goodput():
    w = workloads.Workload("T", "test", [workloads.BenchRequest([1], 3) for _ in range(3)])
    records = [
        RequestRecord(arrival=0.0, token_times=[0.1, 0.2, 0.3], num_output_tokens=3, expected_output_tokens=3,
                      finish_reason="length", label="chat"),
        # ITL 1 s and TPOT 1 s: misses the TPOT half of the SLO.
        RequestRecord(arrival=0.0, token_times=[0.1, 1.1, 2.1], num_output_tokens=3, expected_output_tokens=3,
                      finish_reason="length", label="chat"),
        RequestRecord(arrival=0.0, token_times=[3.0, 3.01, 3.02], num_output_tokens=3, expected_output_tokens=3,
                      finish_reason="length", label="long"),
    ]
    result = summarize(SystemRun("s", records, duration_s=2.0), w, {"ttft_ms": 5000.0, "tpot_ms": 100.0})
    chat, long = result["by_class"]["chat"], result["by_class"]["long"]
    assert chat["num_completed"] == 2 and chat["goodput_requests_per_s"] == pytest.approx(0.5)
    assert chat["itl_ms"]["mean"] == pytest.approx(1e3 * (0.1 + 0.1 + 1.0 + 1.0) / 4)
    assert chat["tpot_ms"]["p50"] == pytest.approx(1e3 * (0.1 + 1.0) / 2)
    assert long["ttft_ms"]["p50"] == pytest.approx(3000.0) and long["goodput_requests_per_s"] == pytest.approx(0.5)
    assert result["goodput_requests_per_s"] == pytest.approx(1.0)


def test_w10_sends_long_prompts_at_a_steady_interval_among_poisson_chats():
    w = workloads.WORKLOADS["W10"](seed=3, duration_s=60.0, chat_rate_per_s=2.0, long_every_s=20.0)
    longs = [r for r in w.requests if r.label == "long"]
    chats = [r for r in w.requests if r.label == "chat"]
    assert [r.arrival_s for r in longs] == [10.0, 30.0, 50.0]
    assert all(len(r.prompt_token_ids) == 2000 and r.max_tokens == 16 for r in longs)
    assert all(len(r.prompt_token_ids) == 128 and r.max_tokens == 256 for r in chats)
    assert 80 <= len(chats) <= 160 and all(0 <= r.arrival_s < 60.0 for r in chats)
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    again = workloads.WORKLOADS["W10"](seed=3, duration_s=60.0, chat_rate_per_s=2.0, long_every_s=20.0)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in w.requests]


def test_w10_systems_give_each_role_its_half_of_the_cores_and_serve_only_their_models(tmp_path):
    from client.bench import disaggregated

    chosen = {s.name: s for s in disaggregated.systems([4, 5, 6, 7], caps=[64])}
    assert set(chosen) == {"disaggregated", "aggregated", "aggregated-cap64"}
    disagg = chosen["disaggregated"]
    assert disagg.threads == 2 and chosen["aggregated"].threads == 4
    repository = disaggregated.prepare_repository(disagg, tmp_path / "d", {"dtype": "float32"})
    assert sorted(p.name for p in repository.iterdir()) == ["llm", "llm_decode", "llm_prefill"]
    prefill = (repository / "llm_prefill" / "config.pbtxt").read_text()
    decode = (repository / "llm_decode" / "config.pbtxt").read_text()
    assert '"omp_threads_bind", value: { string_value: "4,5" }' in prefill
    assert '"omp_threads_bind", value: { string_value: "6,7" }' in decode
    assert '"dtype", value: { string_value: "float32" }' in decode
    assert "dtype" not in (repository / "llm" / "config.pbtxt").read_text()  # the BLS model takes none
    capped = disaggregated.prepare_repository(chosen["aggregated-cap64"], tmp_path / "c", {})
    assert [p.name for p in capped.iterdir()] == ["llm"]
    assert '"long_prefill_token_threshold", value: { string_value: "64" }' in \
        (capped / "llm" / "config.pbtxt").read_text()
    capped_prefill = disaggregated.systems([0, 1], caps=[], prefill_cap=128)[0]
    assert capped_prefill.name == "disaggregated-cap128"
    assert capped_prefill.model_parameters["llm_prefill"] == {"omp_threads_bind": "0", "kv_transfer": "shm",
                                                              "long_prefill_token_threshold": "128"}
    assert disaggregated.systems([0, 1], caps=[], kv_transfer="tcp")[0].name == "disaggregated-tcp"
    with pytest.raises(ValueError, match="at least 2 cores"):
        disaggregated.systems([0], caps=[])


def test_metrics_are_summed_over_the_samples_with_the_asked_labels():
    from client.metrics import metric_sum, parse_metrics

    samples = parse_metrics(
        '# HELP x y\n'
        'inflight_kv_transfers_total{model="llm_prefill",version="1"} 3\n'
        'inflight_kv_transfers_total{model="llm_decode",version="1"} 4\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="llm"} 7\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="llm"} 9\n'
        'process_open_fds 12\n')
    assert metric_sum(samples, "inflight_kv_transfers_total") == 7
    assert metric_sum(samples, "inflight_kv_transfers_total", model="llm_decode") == 4
    assert metric_sum(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") == 7
    assert metric_sum(samples, "process_open_fds") == 12 and metric_sum(samples, "absent") == 0


def test_g5_is_w1_at_gpu_size():
    g5 = workloads.WORKLOADS["G5"](seed=2)
    assert g5.name == "G5" and len(g5.requests) == 1024 and g5.engine_overrides == {"max_num_seqs": 256}
    w1 = workloads.w1_variance(seed=2, num_requests=1024, max_num_seqs=256)
    assert [(r.prompt_token_ids, r.max_tokens) for r in g5.requests] == [(r.prompt_token_ids, r.max_tokens)
                                                                       for r in w1.requests]
    assert max(r.max_tokens for r in g5.requests) > 4 * statistics.mean(r.max_tokens for r in g5.requests)


def test_g3_is_w2_at_gpu_size():
    g3 = workloads.WORKLOADS["G3"](seed=2)
    assert g3.name == "G3" and len(g3.requests) == 256 and g3.engine_overrides == {"max_num_seqs": 256}
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in g3.requests)
    assert all(r.temperature == 0.6 for r in g3.requests)
    # the same draws as W2 with GPU-sized bounds: one definition of the workload
    w2 = workloads.w2_offline(seed=2, num_requests=256, low=100, high=1024, max_num_seqs=256)
    assert [r.prompt_token_ids for r in g3.requests] == [r.prompt_token_ids for r in w2.requests]


def test_the_engines_device_and_dtype_are_the_peers(monkeypatch):
    """The peers and the FLOP bound run where the engine does, in its dtype: `auto` is
    float32 on a CPU and bfloat16 on CUDA, as for the engine."""
    import torch

    from client.bench.systems import engine_device, engine_dtype_name

    assert engine_device({"device": "cpu"}) == torch.device("cpu")
    assert engine_dtype_name({"device": "cpu"}) == "float32"
    assert engine_dtype_name({"device": "cpu", "dtype": "bfloat16"}) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device({}) == torch.device("cuda")
    assert engine_dtype_name({"device": "auto"}) == "bfloat16"


# ---------------------------------------------------------------------------- reports


def test_bar_plot_of_a_single_load_report(tmp_path):
    result = {"system": "a", "rate_per_s": None, "concurrency": 4, "output_tokens_per_s": 10.0,
              "ttft_ms": {"p99": 5.0}, "tpot_ms": {"p99": 1.0}}
    report = {"workload": {"name": "W1", "description": "d"}, "machine": {"cpu": "x", "cores": 2},
              "results": [result, {**result, "system": "b", "output_tokens_per_s": 7.0}]}
    assert not plot.is_rate_sweep(report)
    path = plot.plot_report(report, str(tmp_path / "bars.png"))
    assert open(path, "rb").read(4) == b"\x89PNG"
    assert plot.plot_path(str(tmp_path / "results" / "x.json"), "W1") == str(tmp_path / "x.png")
    assert plot.plot_path(str(tmp_path / "x.json"), "W1") == str(tmp_path / "x.png")
    assert plot.plot_path(str(tmp_path / "results" / "avx2" / "x.json"), "W1") == str(tmp_path / "avx2" / "x.png")


def _result(system: str, tokens_per_s: float, ttft_p99: float, run: int) -> dict:
    return {"system": system, "rate_per_s": None, "run": run, "output_tokens_per_s": tokens_per_s,
            "ttft_ms": {"mean": ttft_p99 / 2, "p99": ttft_p99}}


def test_repeated_runs_give_the_median_of_each_runs_ratio():
    # Run 2 is fast for both systems: pooling the runs' throughputs first would give
    # (100 + 300 + 110) / (50 + 100 + 100) = 2.04x; the runs' own ratios are 2.0, 3.0 and 1.1x.
    results = [
        _result("continuous", 100.0, 10.0, 1), _result("vllm-offline", 50.0, 40.0, 1),
        _result("continuous", 300.0, 10.0, 2), _result("vllm-offline", 100.0, 20.0, 2),
        _result("continuous", 110.0, 10.0, 3), _result("vllm-offline", 100.0, 10.0, 3),
    ]
    entry = stats.ratios("W1", results)["continuous/vllm-offline"]
    assert entry["output_tokens_per_s"] == pytest.approx(2.0)
    assert entry["runs"] == pytest.approx([2.0, 3.0, 1.1])
    assert entry["ttft_p99"] == pytest.approx(0.5)  # median of 0.25, 0.5 and 1.0
    text = stats.format_ratio(entry)
    assert "output tokens per s 2.00x" in text and text.endswith("per run 2.00x, 3.00x, 1.10x")
    # One run: no per-run list, the ratio of that run.
    single = stats.ratios("W1", [{**r, "run": None} for r in results[:2]])["continuous/vllm-offline"]
    assert single["output_tokens_per_s"] == pytest.approx(2.0) and "runs" not in single


def test_named_server_targets_get_the_first_ones_ratio_to_each_other():
    # Two tritonservers, this backend's and a peer's (e.g. Triton's vLLM backend), each a named
    # target: no built-in pair names them, so the CLI asks for first/other.
    results = [_result("inflight", 300.0, 10.0, 1), _result("vllm_backend", 200.0, 40.0, 1)]
    assert stats.ratios("W3", results) == {}
    entry = stats.ratios("W3", results, [("inflight", "vllm_backend")])["inflight/vllm_backend"]
    assert entry["output_tokens_per_s"] == pytest.approx(1.5) and entry["ttft_p99"] == pytest.approx(0.25)


def test_the_table_leaves_reports_without_per_system_results_to_their_sections(tmp_path):
    run = Path(REPO_ROOT) / "bench" / "results" / "avx2" / "w1_vs_vllm_fp32.json"
    soak = tmp_path / "soak.json"
    soak.write_text(json.dumps({"command": "python -m tools.soak", "minutes": 30, "leaked_blocks": 0}))
    # The sampler's micro-benchmark has results, by parameter rather than by system.
    sampler = tmp_path / "sampler.json"
    sampler.write_text(json.dumps({"command": "python -m client.bench.sampling", "machine": {"cpu_kind": "avx2"},
                                   "results": {"sampler_ms": {"top_p 0.9": 2.1}}}))
    text = table.tables([str(run), str(soak), str(sampler)])
    assert text.count("#### Machine kind: ") == 1 and "soak.json" not in text and "sampler.json" not in text


def test_the_table_of_every_committed_report_is_made():
    # What docs/results.md is generated from: no report under bench/results may break it.
    text = table.tables(sorted(str(p) for p in (Path(REPO_ROOT) / "bench" / "results").glob("*/*.json")))
    assert "#### Machine kind: avx512_bf16" in text


def test_cli_refuses_what_does_not_apply():
    for argv in (["W1", "--rates", "1,2"], ["W3", "--rates", "1", "--concurrency", "2"], ["W1", "--input-len", "8"],
                 ["W3", "--target", "ftp://h:1"], ["W3", "--systems", "nope"],
                 ["W3", "--target", "grpc://h:1", "--target", "grpc://h:2"], ["W1", "--repeat", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv


# ---------------------------------------------------------------------------- servers


def test_parse_target():
    t = parse_target("grpc://127.0.0.1:8001")
    assert (t.name, t.scheme, t.address, t.model_name) == ("triton-grpc", "grpc", "127.0.0.1:8001", "llm")
    assert parse_target("http://h:8000/", "m").name == "triton-http"
    t = parse_target("vllm=openai://h:9000/v1", "Qwen")
    assert (t.name, t.address, t.model_name, t.url) == ("vllm", "h:9000/v1", "Qwen", "openai://h:9000/v1")
    for bad in ("h:8001", "tcp://h:1", "grpc://"):
        with pytest.raises(ValueError):
            parse_target(bad)


class _LlamaServerLike(socketserver.ThreadingTCPServer):
    """An OpenAI /v1/completions stream server that treats its connections as llama-server
    does: each response says `Connection: keep-alive`, yet the connection serves no second
    request (here: it reads the next request and closes unanswered, so that the client meets
    the closed connection every time rather than when it loses a race). `cut_after`: end the
    first stream after that many tokens, as a server that dies mid-response."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, cut_after: int | None = None):
        self.cut_after = cut_after
        self.answered: list[str] = []  # the prompts answered, in order
        self.dropped = 0  # requests read on a used connection and closed unanswered
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _LlamaServerLikeHandler)


class _LlamaServerLikeHandler(socketserver.StreamRequestHandler):
    server: _LlamaServerLike

    def _event(self, payload) -> None:
        data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def handle(self) -> None:
        for served in range(2):
            head = []
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                head.append(line.decode().strip())
            if not head:
                return
            length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
            body = json.loads(self.rfile.read(length))
            if served:
                with self.server.lock:
                    self.server.dropped += 1
                return  # closed unanswered
            with self.server.lock:
                self.server.answered.append(body["prompt"])
                cut = self.server.cut_after
                self.server.cut_after = None
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(body["max_tokens"]):
                if cut is not None and i == cut:
                    return
                last = i == body["max_tokens"] - 1
                self._event({"choices": [{"text": "a", "finish_reason": "length" if last else None}]})
            self._event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self._event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()


@pytest.fixture
def llama_server_like(request):
    server = _LlamaServerLike(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _text_workload(count: int) -> workloads.Workload:
    return workloads.Workload("T", "test", [workloads.BenchRequest([1, 2], 3 + i % 4, prompt_text=f"prompt {i}")
                                            for i in range(count)])


@pytest.mark.parametrize("concurrency", [1, 3, None])
def test_no_request_is_lost_to_a_server_that_closes_its_keep_alive_connections(llama_server_like, concurrency):
    """llama-server closes every streamed connection while its headers say keep-alive: a
    request that goes out on such a pooled connection is sent again on a fresh one."""
    w = _text_workload(12)
    run = run_target(Target("llama-server", "openai", f"127.0.0.1:{llama_server_like.server_address[1]}"), w,
                     concurrency=concurrency, progress=False)
    assert [r.error for r in run.records] == [None] * 12
    assert [r.num_output_tokens for r in run.records] == [r.max_tokens for r in w.requests]
    assert all(r.finish_reason == "length" for r in run.records)
    assert [r.text for r in run.records] == ["a" * r.max_tokens for r in w.requests]  # the streamed pieces, joined
    # Each request answered once (the warm-up first); pooled connections were met closed.
    assert sorted(llama_server_like.answered) == sorted(["Hello"] + [f"prompt {i}" for i in range(12)])
    if concurrency is not None:  # open loop sends every request before the first ends: no reuse
        assert llama_server_like.dropped >= 1


@pytest.mark.parametrize("llama_server_like", [{"cut_after": 2}], indirect=True)
def test_a_stream_cut_off_after_its_first_tokens_is_an_error_not_a_retry(llama_server_like):
    # The warm-up request takes the cut: the run refuses to start, naming what failed.
    target = Target("llama-server", "openai", f"127.0.0.1:{llama_server_like.server_address[1]}")
    with pytest.raises(RuntimeError, match="warm-up request"):
        run_target(target, _text_workload(2), concurrency=1, progress=False)
    assert llama_server_like.answered == ["Hello"]


def test_openai_frontend_passes_ignore_eos_to_the_backend():
    """vLLM's `ignore_eos` extension reaches the backend's sampling parameters (the openai target relies on it)."""
    from client.openai.schema import CompletionRequest
    from client.openai.translation import sampling_parameters, validate_sampling

    req = CompletionRequest.model_validate({"model": "llm", "prompt": "Hi", "max_tokens": 8, "ignore_eos": True,
                                            "seed": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert req.check() == "Hi"
    sampling = sampling_parameters(req)
    assert sampling["ignore_eos"] is True and sampling["max_tokens"] == 8 and sampling["seed"] == 3
    validate_sampling(sampling)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_flops_count_every_projection_per_token_and_the_head_per_output_token(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(str(tmp_path / family), family=family)
    model = AutoModelForCausalLM.from_pretrained(path)
    projections = sum(m.weight.numel() for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name != "lm_head")
    output_head = model.config.vocab_size * model.config.hidden_size  # tied or not, one matmul per output token
    assert flops.model_flops(path) == (2 * projections, 2 * output_head)


def test_flop_bound_is_model_flops_over_the_measured_peak(tiny_checkpoint):
    results = [{"total_tokens_per_s": 1000.0, "output_tokens_per_s": 400.0, "duration_s": 2.0}]
    bound = flops.add_flop_bound(results, tiny_checkpoint, "float32")
    assert bound["matmul_peak_gflops_at_256_rows"] > 0
    per_token, per_output_token = flops.model_flops(tiny_checkpoint)
    expected = (1000.0 * per_token + 400.0 * per_output_token) / 1e9
    assert results[0]["model_gflops_per_s"] == pytest.approx(expected)
    assert results[0]["fraction_of_flop_bound"] == pytest.approx(expected / bound["matmul_peak_gflops_at_256_rows"])


# ---------------------------------------------------------------------------- tables


def test_results_are_tabled_by_machine_kind_and_never_mixed():
    avx2 = Path(REPO_ROOT) / "bench" / "results" / "avx2" / "w1_vs_vllm_fp32.json"
    amx = avx2.parent.parent / "amx" / "w1_vs_vllm_fp32.json"
    text = table.tables([str(avx2), str(amx), str(avx2.parent / "w2_vs_peers_fp32.json")])
    sections = text.split("#### Machine kind: ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["avx2", "amx"]
    assert "results/avx2/w2_vs_peers_fp32.json" in sections[0] and "results/amx/" not in sections[0]
    assert "results/amx/w1_vs_vllm_fp32.json" in sections[1] and "results/avx2/" not in sections[1]


def test_a_serving_benchs_settings_each_get_a_row_and_their_ratios_a_line():
    report = Path(REPO_ROOT) / "bench" / "results" / "amx" / "kv_vs_llama_server.json"
    text = table.tables([str(report)])
    for system, setting in (("tritonserver", "auto"), ("tritonserver", "int8"), ("llama-server", "q8_0")):
        assert f"| {system} {setting} @ c=8 | bfloat16 |" in text
    assert re.search(r"tritonserver_over_llama_server_q8_0 int8: output tokens per s \d+\.\d\dx", text)
    assert not re.search(r": $", text, flags=re.M)  # no ratio line left empty


def test_a_gpu_run_is_tabled_apart_from_its_hosts_cpu_kind(tmp_path):
    cpu_run = Path(REPO_ROOT) / "bench" / "results" / "avx2" / "w1_vs_vllm_fp32.json"
    report = json.loads(cpu_run.read_text())
    report["device"] = "cuda"
    report["machine"]["gpu"] = "NVIDIA H200"
    gpu_run = tmp_path / "g3.json"
    gpu_run.write_text(json.dumps(report))
    sections = table.tables([str(cpu_run), str(gpu_run)]).split("#### Machine kind: ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["avx2", "gpu (NVIDIA H200)"]
    assert str(gpu_run.name) in sections[1] and "NVIDIA H200" in sections[1] and "g3.json" not in sections[0]


def test_the_table_command_takes_help_and_report_paths(capsys):
    with pytest.raises(SystemExit) as exited:
        table.main(["--help"])
    assert exited.value.code == 0 and "REPORT.json" in capsys.readouterr().out
    report = Path(REPO_ROOT) / "bench" / "results" / "avx2" / "w1_vs_vllm_fp32.json"
    assert table.main([str(report)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("#### Machine kind: ") == 1 and "results/avx2/w1_vs_vllm_fp32.json" in printed


def test_servers_get_the_tenant_and_refuse_a_closed_loop_tenant():
    from client.bench.targets import run_target, sampling_of

    chat = workloads.BenchRequest([5, 6], 4, tenant="B")
    assert sampling_of(chat, 1)["tenant"] == "B"
    assert "tenant" not in sampling_of(workloads.BenchRequest([5, 6], 4), 1)
    w = workloads.w8a_flood(num_requests=1, in_flight=2, long_output=4, chat_output=2, prompt_len=4)
    with pytest.raises(ValueError, match="only the in-process engine runner"):
        run_target(parse_target("grpc://127.0.0.1:1"), w, progress=False)


def test_w4_with_several_prefixes_keeps_one_prefix_per_request():
    one = workloads.w4_shared_prefix(num_requests=16, prefix_len=32, tail_len=8)
    assert len({tuple(r.prompt_token_ids[:32]) for r in one.requests}) == 1
    several = workloads.w4_shared_prefix(num_requests=64, prefix_len=32, tail_len=8, num_prefixes=4)
    prefixes = {tuple(r.prompt_token_ids[:32]) for r in several.requests}
    assert len(prefixes) == 4 and all(len(r.prompt_token_ids) == 40 for r in several.requests)
    # The first prefix, the arrivals and the tails are drawn as with one prefix.
    assert tuple(one.requests[0].prompt_token_ids[:32]) in prefixes
    assert several.params["num_prefixes"] == 4


def test_the_machine_records_the_cores_the_run_may_use():
    """A run pinned to cores (taskset, a container's cpuset) records those, not the host's."""
    run = subprocess.run(["taskset", "-c", "0", sys.executable, "-c",
                          "from client.bench.records import machine; print(machine()['cores'])"],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "1"


def test_a_report_names_the_commit_it_was_given(monkeypatch):
    head = git_commit()
    assert len(head) == 40 or head == "unknown"
    monkeypatch.setenv("INFLIGHT_GIT_COMMIT", "0123abc")
    assert git_commit() == "0123abc"


def test_step_profile_puts_each_function_in_its_class():
    from client.bench import step_profile

    report = """
# Samples: 10K of event 'cpu-clock'
    30.00%  inflight_cpu_kernels.so      [.] (anonymous namespace)::gemm<(anonymous namespace)::Avx2F32>(at::Tensor const&)
     6.00%  inflight_cpu_kernels.so      [.] (anonymous namespace)::bf16_dot_item<8, false>
     4.00%  inflight_cpu_kernels.so      [.] (anonymous namespace)::vector_item<(anonymous namespace)::Avx512, 8, false>
    12.00%  inflight_cpu_kernels.so      [.] paged_attention_kernel<8>
     8.00%  inflight_cpu_kernels.so      [.] (anonymous namespace)::attend_task_vectorised<float, 8, 8>
     9.00%  inflight_cpu_kernels.so      [.] rms_norm
     6.00%  inflight_cpu_kernels.so      [.] keep_nucleus_
     5.00%  libtorch_cpu.so              [.] at::native::(anonymous namespace)::softmax_lastdim_kernel_impl
     8.00%  libpython3.11.so.1.0         [.] _PyEval_EvalFrameDefault
     4.00%  libgomp.so.1.0.0             [.] 0x000000000001e2c3
     3.00%  libc.so.6                    [.] __memmove_avx_unaligned_erms
     2.00%  [kernel.kallsyms]            [k] clear_page_erms
     3.00%  libfoo.so                    [.] something_else
"""
    rows = step_profile.parse_report(report)
    assert len(rows) == 13 and rows[0][0] == 30.0
    classes, top = step_profile.shares(rows)
    assert classes == {"gemm": 0.4, "attention": 0.2, "sampler": 0.11, "elementwise": 0.09, "python": 0.08,
                       "openmp_wait": 0.04, "memory": 0.03, "other": 0.03, "linux_kernel": 0.02}
    assert next(iter(classes)) == "gemm" and top["sampler"][0][0] == 0.06


@pytest.mark.slow
def test_w9_reports_each_method_against_speculation_off(tmp_path):
    """The W9 harness end to end on a tiny checkpoint: every method's run completes its tokens,
    reports its acceptance, and carries its ratio to speculation off in the same workload.
    Without the draft budget, whose choices follow the machine's timings, the draft model
    drafts on every step."""
    from client.bench import speculative

    path = make_tiny_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "w9.json"
    assert speculative.main(["--model", path, "--requests", "2", "--max-tokens", "6", "--w1-requests", "0",
                             "--methods", "off", "suffix", "draft_int8", "--no-adaptive", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m client.bench.speculative --model")
    results = report["results"]
    assert [(r["workload"], r["concurrency"], r["system"]) for r in results] == [
        (w, c, m) for w, c in (("W9a", 1), ("W9a", 4), ("W9b", 1)) for m in ("off", "suffix", "draft_int8")]
    for result in results:
        assert result["all_token_counts_right"] and result["num_completed"] == 2
        if result["system"] != "off":
            assert result["ratio_to_off"]["output_tokens_per_s"] > 0
            assert 0 <= result["spec_acceptance_rate"] <= 1
    assert max(r["spec_draft_tokens"] for r in results if r["system"] == "draft_int8") > 0
