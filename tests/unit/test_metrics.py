"""EngineMetrics against a test double of pb_utils' metric API (the real /metrics
endpoint is exercised by the end-to-end tests)."""

from __future__ import annotations

import threading

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.metrics import EngineMetrics
from backend.request import SamplingParams
from tests.checkpoints import make_tiny_checkpoint


class FakeMetric:
    def __init__(self, family, labels, buckets=None):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value = 0.0
        self.sets = 0
        self.observations = []

    def increment(self, by):
        assert by >= 0, "counters only go up"
        self.value += by

    def set(self, value):
        self.value = value
        self.sets += 1

    def observe(self, value):
        self.observations.append(value)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    registry: dict = {}

    def __init__(self, name, description, kind):
        assert name not in self.registry, f"metric family {name} registered twice"
        self.name, self.kind = name, kind
        self.metrics = []
        self.registry[name] = self

    def Metric(self, labels, buckets=None):
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        metric = FakeMetric(self, labels, buckets)
        self.metrics.append(metric)
        return metric


class FakePbUtils:
    MetricFamily = FakeMetricFamily


def value(name, **labels):
    family = FakeMetricFamily.registry[name]
    matches = [m for m in family.metrics if all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels)
    return matches[0]


def tiny_engine(tmp_path_factory) -> LLMEngine:
    """A fresh fake registry and an engine on a tiny checkpoint (max_num_seqs 4, 64 blocks)."""
    FakeMetricFamily.registry = {}
    model = make_tiny_checkpoint(str(tmp_path_factory.mktemp("metrics") / "tiny-llama"))
    return LLMEngine(EngineConfig(model_path=model, max_num_seqs=4, num_kv_blocks=64))


@pytest.fixture
def loop(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory)
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    loop = EngineLoop(lambda: engine, observer=metrics)
    yield loop
    loop.shutdown()


def test_gauges_are_published_before_the_loop_runs(tmp_path_factory):
    """A scrape right after the model reports ready must see the pool and batch sizes: the
    loop's first on_step comes only after its first idle wait. No loop here, so only the
    constructor can have set them."""
    engine = tiny_engine(tmp_path_factory)
    EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max").value == engine.kv.pool.num_blocks > 0
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free").value == engine.kv.pool.num_blocks
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per").value == engine.kv.block_size
    assert value("nv_trt_llm_request_metrics", request_type="max").value == 4
    assert value("inflight_iterations_total").value == 0


def test_metrics_move_and_return_to_idle(loop):
    done = []
    event = threading.Event()

    def on_output(output):
        if output.finished:
            done.append(output)
            if len(done) == 3:
                event.set()

    for i in range(3):
        loop.add_request(f"r{i}", "count the tokens " * (i + 1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), on_output)
    assert event.wait(60)
    loop.shutdown()  # the loop's last on_step runs before it exits
    engine = loop.engine

    assert value("vllm:generation_tokens_total", model="llm").value == 18
    assert value("vllm:prompt_tokens_total").value == sum(o.num_prompt_tokens for o in done)
    assert len(value("vllm:time_to_first_token_seconds").observations) == 3
    assert len(value("vllm:e2e_request_latency_seconds").observations) == 3
    assert all(t > 0 for t in value("vllm:time_per_output_token_seconds").observations)
    assert value("vllm:request_generation_tokens").observations == [6, 6, 6]
    assert value("inflight_requests_finished_total", finish_reason="length").value == 3
    assert value("vllm:request_success_total", finished_reason="length").value == 3
    assert value("inflight_iterations_total").value == engine.stats.totals.steps
    # Idle again: nothing running or waiting, no KV in use.
    assert value("vllm:num_requests_running").value == 0
    assert value("inflight_requests_waiting").value == 0
    assert value("nv_trt_llm_request_metrics", request_type="active").value == 0
    assert value("nv_trt_llm_request_metrics", request_type="max").value == 4
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used").value == 0
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max").value == 64
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per").value == 16
    assert value("inflight_kv_cache_usage_ratio").value == 0
    for family in FakeMetricFamily.registry.values():
        for metric in family.metrics:
            assert metric.labels["model"] == "llm" and metric.labels["version"] == "1"


def test_a_step_that_changes_nothing_sets_no_gauge(tmp_path_factory):
    """Every set is an IPC round trip to the Triton process: unchanged values are not sent again."""
    engine = tiny_engine(tmp_path_factory)
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    gauges = [m for f in FakeMetricFamily.registry.values() if f.kind == f.GAUGE for m in f.metrics]

    def sets():
        return sum(m.sets for m in gauges)

    first = sets()
    assert first >= len(gauges)  # the constructor publishes every gauge
    metrics.on_step()
    assert sets() == first
    engine.add_request("r", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    metrics.on_step()
    assert value("inflight_requests_running").value == 1 and sets() > first
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used").value == engine.kv.pool.num_used > 0


def test_updates_go_through_publish_and_only_apply_there(tmp_path_factory):
    """The Triton adapter queues the loop's metric updates for its response thread, the one
    thread that calls Triton (model.py): reading the engine must not touch a metric."""
    from backend.metrics import apply

    engine = tiny_engine(tmp_path_factory)
    queued = []
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine, publish=queued.append)
    assert not queued  # the constructor's first publication is applied at once (before ready)
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max").value == 64
    engine.add_request("r", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        metrics.on_step()
    metrics.on_finished(next(o for o in outputs if o.finished))
    assert queued and value("inflight_iterations_total").value == 0
    assert value("vllm:request_generation_tokens").observations == []
    for updates in queued:
        apply(updates)
    assert value("inflight_iterations_total").value == engine.stats.totals.steps
    assert value("vllm:request_generation_tokens").observations == [2]
    assert value("vllm:request_success_total", finished_reason="length").value == 1
