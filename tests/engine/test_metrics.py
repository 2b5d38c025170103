"""EngineMetrics of a real engine on the tiny checkpoint, against a test double of pb_utils'
metric API (the real /metrics endpoint is exercised by the end-to-end tests)."""

from __future__ import annotations

import threading
import time

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.metrics import EngineMetrics
from backend.request import SamplingParams


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


def tiny_engine(checkpoint: str, max_num_seqs: int = 4) -> LLMEngine:
    """A fresh fake registry and an engine on `checkpoint` (max_num_seqs 4 unless told, 64 blocks)."""
    FakeMetricFamily.registry = {}
    return LLMEngine(EngineConfig(model_path=checkpoint, max_num_seqs=max_num_seqs, num_kv_blocks=64))


@pytest.fixture
def loop(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint)
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    loop = EngineLoop(lambda: engine, observer=metrics)
    yield loop
    loop.shutdown()


def test_gauges_are_published_before_the_loop_runs(tiny_checkpoint):
    """A scrape right after the model reports ready must see the pool and batch sizes: the
    loop's first on_step comes only after its first idle wait. No loop here, so only the
    constructor can have set them."""
    engine = tiny_engine(tiny_checkpoint)
    EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max").value == engine.kv.pool.num_blocks > 0
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free").value == engine.kv.pool.num_blocks
    assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per").value == engine.kv.block_size
    assert value("nv_trt_llm_request_metrics", request_type="max").value == 4
    assert value("inflight_iterations_total").value == 0


def test_what_routers_read_follows_the_engine(tiny_checkpoint):
    """The families llm-d's endpoint picker and the production-stack router parse, with
    vLLM's labels: gpu_cache_usage_perc moves with kv_cache_usage_perc, cache_config_info
    holds the pool's geometry in its labels, lora_requests_info's value is a refresh time."""
    from backend import metrics as metrics_module

    engine = tiny_engine(tiny_checkpoint)
    clock = [1000.0]
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine, clock=lambda: clock[0])
    info = value("vllm:cache_config_info")
    assert info.value == 1
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "64"
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["engine"] == "0"
    lora = value("vllm:lora_requests_info")
    assert {k: lora.labels[k] for k in ("max_lora", "running_lora_adapters", "waiting_lora_adapters")} == {
        "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value == 1000.0
    # vLLM's own labels on its families, beside Triton's.
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds"):
        assert value(name).labels == {"model": "llm", "version": "1", "model_name": "llm", "engine": "0"}, name

    engine.add_request("r", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    clock[0] += 0.5
    metrics.on_step()
    usage = value("vllm:kv_cache_usage_perc").value
    assert usage > 0 and value("vllm:gpu_cache_usage_perc").value == usage
    assert lora.value == 1000.0  # refreshed at most once per LORA_INFO_REFRESH_S
    clock[0] += metrics_module.LORA_INFO_REFRESH_S
    metrics.on_step()
    assert lora.value == clock[0]


def test_lora_requests_info_has_a_series_per_adapter_combination(tiny_checkpoint):
    """vLLM's lora_requests_info: the adapters running and waiting and max_lora are labels, the
    value the time of the sample; a new combination is a new series, at once."""
    import dataclasses

    engine = tiny_engine(tiny_checkpoint)
    clock = [1000.0]
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine, clock=lambda: clock[0])
    engine.stats = dataclasses.replace(engine.stats, max_loras=2, running_lora_adapters=("sql", "tone"),
                                       waiting_lora_adapters=("poem",))
    clock[0] += 0.25  # well inside the refresh interval: a change is published anyway
    metrics.on_step()
    series = value("vllm:lora_requests_info", max_lora="2", running_lora_adapters="sql,tone",
                   waiting_lora_adapters="poem")
    assert series.value == 1000.25
    assert value("inflight_lora_adapters_running").value == 2
    assert value("vllm:lora_requests_info", max_lora="0", running_lora_adapters="").value == 1000.0


def test_metrics_move_and_return_to_idle(loop):
    done = []
    event = threading.Event()

    def on_output(output):
        if output.finished:
            done.append(output)
            if len(done) == 3:
                event.set()

    for i in range(3):
        loop.submit(f"r{i}", "count the tokens " * (i + 1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), on_output)
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


def test_a_step_that_changes_nothing_sets_no_gauge(tiny_checkpoint):
    """Every set is an IPC round trip to the Triton process: unchanged values are not sent again."""
    engine = tiny_engine(tiny_checkpoint)
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


def test_updates_go_through_publish_and_only_apply_there(tiny_checkpoint):
    """The Triton adapter queues the loop's metric updates for its response thread, the one
    thread that calls Triton (model.py): reading the engine must not touch a metric."""
    from backend.metrics import apply

    engine = tiny_engine(tiny_checkpoint)
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


# ------------------------------------------------------------- vLLM's semantics, counted exactly

class StepClock:
    """`time` for the engine and the scheduler: monotonic() is the step number the test sets,
    so every latency the metrics see is a whole number of steps."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


@pytest.fixture
def stepped(tiny_checkpoint, monkeypatch):
    """An engine on a tiny checkpoint with two seats, its metrics, a step clock, and `run`,
    which drives it as the loop does (final outputs to on_finished, then on_step), one
    clock tick per step."""
    import backend.engine
    import backend.scheduler

    clock = StepClock()
    monkeypatch.setattr(backend.engine, "time", clock)
    monkeypatch.setattr(backend.scheduler, "time", clock)
    engine = tiny_engine(tiny_checkpoint, max_num_seqs=2)
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)

    def run(steps=None):
        done = 0
        while engine.has_unfinished() and (steps is None or done < steps):
            clock.now += 1
            for output in engine.step():
                if output.finished:
                    metrics.on_finished(output)
            metrics.on_step()
            done += 1

    return engine, metrics, run


def params(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def observations(name):
    return value(name).observations


def test_known_workload_gives_vllms_exact_counts_and_sums(stepped):
    """Three requests arrive at t=0 for two seats: prompts of 5, 17 and 40 tokens, 1, 4 and 9
    output tokens. Step 1 prefills the first two (first tokens at t=1; the 1-token request
    ends), step 2 admits the third (first token at t=2) beside a decode, then one token per
    request per step. vLLM's semantics: one time-to-first-token sample per request, one
    time-per-output-token sample per token after each request's first (0 + 3 + 8), each the
    time since that request's previous token; the per-request families once per request."""
    engine, metrics, run = stepped
    prompts, lengths = [5, 17, 40], [1, 4, 9]
    for i, (n, max_tokens) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"r{i}", list(range(100, 100 + n)), params(max_tokens), arrival_time=0.0)
    # Nothing is observed before the tokens come.
    assert observations("vllm:time_to_first_token_seconds") == []
    run()

    assert observations("vllm:time_to_first_token_seconds") == [1.0, 1.0, 2.0]
    assert observations("vllm:time_per_output_token_seconds") == [1.0] * sum(n - 1 for n in lengths)
    assert observations("vllm:e2e_request_latency_seconds") == [1.0, 4.0, 10.0]
    # A request's first token plus its intervals is its last token: its end here.
    assert (sum(observations("vllm:time_to_first_token_seconds")) + sum(observations("vllm:time_per_output_token_seconds"))
            == sum(observations("vllm:e2e_request_latency_seconds")))
    assert observations("vllm:request_prompt_tokens") == prompts
    assert observations("vllm:request_generation_tokens") == lengths
    assert value("vllm:prompt_tokens_total").value == sum(prompts)
    assert value("vllm:generation_tokens_total").value == sum(lengths)
    assert {reason: value("vllm:request_success_total", finished_reason=reason).value
            for reason in ("stop", "length", "abort", "error")} == {"stop": 0, "length": 3, "abort": 0, "error": 0}
    # A snapshot published twice adds no sample.
    metrics.on_step()
    assert len(observations("vllm:time_per_output_token_seconds")) == 11


def test_latencies_are_observed_when_the_tokens_come(stepped):
    engine, metrics, run = stepped
    engine.add_request("long", list(range(100, 120)), params(8), arrival_time=0.0)
    run(steps=3)
    assert observations("vllm:time_to_first_token_seconds") == [1.0]
    assert observations("vllm:time_per_output_token_seconds") == [1.0, 1.0]
    assert observations("vllm:e2e_request_latency_seconds") == []  # still running
    assert value("vllm:prompt_tokens_total").value == 20 and value("vllm:generation_tokens_total").value == 3


def test_aborted_requests_count_once_and_only_what_they_did(stepped):
    """One request cancelled after three tokens, one cancelled before its first: each is one
    request_success{abort} and one sample of every per-request histogram; the tokens and
    intervals are those produced; prompt_tokens_total counts the prompt only of the request
    whose prefill completed (vLLM counts a prompt when it yields its first token)."""
    engine, metrics, run = stepped
    engine.add_request("started", list(range(100, 130)), params(10), arrival_time=0.0)
    run(steps=3)
    engine.add_request("queued", list(range(200, 212)), params(10), arrival_time=3.0)
    assert engine.abort("started") and engine.abort("queued")
    run()

    assert value("vllm:request_success_total", finished_reason="abort").value == 2
    assert value("vllm:request_success_total", finished_reason="length").value == 0
    assert len(observations("vllm:e2e_request_latency_seconds")) == 2
    assert sorted(observations("vllm:request_prompt_tokens")) == [12, 30]
    assert sorted(observations("vllm:request_generation_tokens")) == [0, 3]
    assert observations("vllm:time_to_first_token_seconds") == [1.0]
    assert observations("vllm:time_per_output_token_seconds") == [1.0, 1.0]
    assert value("vllm:prompt_tokens_total").value == 30
    assert value("vllm:generation_tokens_total").value == 3
    assert engine.stats.totals.prompt_tokens == 42  # the engine's own total counts every enqueued prompt


def test_a_failed_forward_pass_counts_as_error(stepped):
    engine, metrics, run = stepped
    engine._fail_at_batch = 1  # what INFLIGHT_FAULT_INJECT_AT_BATCH=1 sets
    engine.add_request("r", list(range(100, 110)), params(4), arrival_time=0.0)
    run()
    assert value("vllm:request_success_total", finished_reason="error").value == 1
    assert observations("vllm:e2e_request_latency_seconds") == [1.0]
    assert observations("vllm:request_generation_tokens") == [0]
    assert observations("vllm:time_to_first_token_seconds") == []
    assert value("vllm:prompt_tokens_total").value == 0 and value("vllm:generation_tokens_total").value == 0


# ------------------------------------------------------------- per tenant

@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_per_tenant_service_and_requests_with_a_bounded_label_set(tiny_checkpoint, policy):
    """Tenants in tenant_weights and "default" have their own label; every other tenant is
    counted under "other", however many there are."""
    FakeMetricFamily.registry = {}
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, max_num_seqs=2, num_kv_blocks=64, scheduling_policy=policy,
                                    tenant_weights={"gold": 2.0}, enable_prefix_caching=False))
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    tenants = ["gold", "gold", "default", "stranger-1", "stranger-2"]
    prompts = {}
    for i, tenant in enumerate(tenants):
        prompts[i] = list(range(100 + 10 * i, 105 + 10 * i + i))  # 5 + i tokens
        engine.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, tenant=tenant))
    engine.step()
    metrics.on_step()
    running = {t: value("inflight_tenant_requests_running", tenant=t).value for t in ("gold", "default", "other")}
    waiting = {t: value("inflight_tenant_requests_waiting", tenant=t).value for t in ("gold", "default", "other")}
    assert sum(running.values()) == 2 and sum(waiting.values()) == 3
    if policy == "fcfs":
        assert running == {"gold": 2, "default": 0, "other": 0}
    else:  # the second seat goes to a tenant with nothing served yet, not to gold again
        assert running["gold"] == 1
    while engine.has_unfinished():
        engine.step()
        metrics.on_step()
    # Input tokens cost 1 and output tokens 2 (tenant weights do not scale the service).
    expected = {"gold": 0.0, "default": 0.0, "other": 0.0}
    for i, tenant in enumerate(tenants):
        expected[tenant if tenant in expected else "other"] += len(prompts[i]) * 1.0 + 3 * 2.0
    assert {t: value("inflight_tenant_service_tokens_total", tenant=t).value for t in expected} == expected
    for family in ("inflight_tenant_service_tokens_total", "inflight_tenant_requests_running",
                   "inflight_tenant_requests_waiting"):
        assert sorted(m.labels["tenant"] for m in FakeMetricFamily.registry[family].metrics) == ["default", "gold", "other"]
    assert all(value("inflight_tenant_requests_running", tenant=t).value == 0 for t in expected)


@pytest.mark.parametrize("policy, fair", [("fcfs", False), ("fair", True)])
def test_fairness_index_over_backlogged_tenants(tiny_checkpoint, policy, fair):
    """Two tenants backlogged on one seat: fcfs serves the first flood only (index 1/2),
    fair alternates them (index near 1)."""
    FakeMetricFamily.registry = {}
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, max_num_seqs=1, num_kv_blocks=64, scheduling_policy=policy,
                                    tenant_weights={"a": 1.0, "b": 1.0}, enable_prefix_caching=False))
    metrics = EngineMetrics(FakePbUtils, {"model": "llm", "version": "1"}, engine)
    for tenant in ("a", "b"):
        for i in range(8):  # more than 12 steps serve: both stay backlogged
            engine.add_request(f"{tenant}{i}", list(range(100 + i, 104 + i)),
                               SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, tenant=tenant))
    for _ in range(12):
        engine.step()
        metrics.on_step()
    index = value("inflight_tenant_fairness_index").value
    assert index > 0.95 if fair else index == pytest.approx(0.5)
