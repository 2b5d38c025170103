"""Engine metrics on Triton's /metrics endpoint, in three naming families.

vLLM's names (what vLLM dashboards and genai-perf users read), TensorRT-LLM backend's
names (`nv_trt_llm_*`), and ours (`inflight_*`) for what neither exports. Triton owns the
registry and the endpoint; this module only needs something with pb_utils' metric API,
passed in so that `model.py` stays the one importer of `triton_python_backend_utils`.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from backend.config import DEFAULT_TENANT

# One step's metric updates: (metric method, value) pairs, applied in order.
Updates = list[tuple[Callable[[float], None], float]]

# Per step, the recent service behind the fairness index keeps this much of itself (a
# half-life of ~69 steps): recent enough to show a tenant starved now, long enough to
# span many requests.
FAIRNESS_DECAY = 0.99

# The per-tenant label of a tenant neither in tenant_weights nor "default": clients name
# tenants freely, and a label per name would let them grow the metrics without bound.
OTHER_TENANTS = "other"

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
# How often vllm:lora_requests_info's timestamp moves on (vLLM refreshes it at every stats
# record; each set here is an IPC round trip, so at most once a second).
LORA_INFO_REFRESH_S = 1.0
# Its series kept at most (one per adapter combination seen, as vLLM's; the oldest goes first).
MAX_LORA_INFO_SERIES = 64
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class EngineMetrics:
    """Reads the engine's stats snapshot (`engine.stats`, never its scheduler or KV manager)
    and final outputs on the loop thread (`on_step`, `on_finished`), and hands the metric
    updates that follow to `publish`, which applies them (`apply`) where it chooses: every
    update is an IPC call to the Triton process, and the Triton adapter makes all of its
    IPC calls from one thread (see model.py). Without `publish` they are applied at once."""

    def __init__(self, pb_utils, labels: dict[str, str], engine, publish: Callable[[Updates], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.engine = engine
        self._clock = clock  # wall time, the value of vllm:lora_requests_info
        MF = pb_utils.MetricFamily
        # Triton drops a family's metrics once its Python object is collected, so the
        # families live as long as this object (see `close`).
        self._families: list = []

        def family(name, description, kind):
            made = MF(name=name, description=description, kind=kind)
            self._families.append(made)
            return made

        def counter(name, description, base=labels, **extra):
            return family(name, description, MF.COUNTER).Metric(labels={**base, **extra})

        def gauge_family(name, description):
            return family(name, description, MF.GAUGE)

        def histogram(name, description, buckets, base=labels):
            return family(name, description, MF.HISTOGRAM).Metric(labels=base, buckets=buckets)

        # vLLM, with vLLM's own labels too (model_name, engine: what its dashboards and
        # routers select on) beside Triton's.
        vllm = {**labels, "model_name": labels["model"], "engine": "0"}
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", vllm)
        self.generation_tokens = counter("vllm:generation_tokens_total", "Number of generation tokens processed.", vllm)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LATENCY_BUCKETS, vllm)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", LATENCY_BUCKETS, vllm)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", LATENCY_BUCKETS, vllm)
        self.prompt_hist = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS, vllm)
        self.generation_hist = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS, vllm)
        vllm_running = gauge_family("vllm:num_requests_running", "Number of requests currently running.")
        vllm_waiting = gauge_family("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        vllm_kv = gauge_family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.vllm_running = vllm_running.Metric(labels=vllm)
        self.vllm_waiting = vllm_waiting.Metric(labels=vllm)
        self.vllm_kv = vllm_kv.Metric(labels=vllm)
        # What routers read besides the gauges above. The production-stack router still reads
        # vLLM's pre-v1 name of the KV usage. llm-d's endpoint picker parses two info gauges by
        # their labels: cache_config_info's block_size and num_gpu_blocks (vLLM labels it with
        # every CacheConfig field; these are the ones this engine has), and lora_requests_info,
        # whose value is the time of its last refresh (the picker keeps the newest sample), one
        # series per (max_lora, running adapters, waiting adapters) seen, as vLLM's.
        self.vllm_gpu_kv = gauge_family("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.").Metric(labels=vllm)
        cache_info = gauge_family("vllm:cache_config_info", "Information of the LLMEngine CacheConfig")
        self.cache_info = cache_info.Metric(labels={**labels, **cache_config_labels(engine)})
        self.cache_info.set(1)
        self._lora_family = gauge_family("vllm:lora_requests_info", "Running stats on lora requests.")
        self._lora_labels = labels
        self._lora_series: dict[tuple[str, str, str], object] = {}
        self._lora_key = self._lora_info_key(engine.stats)
        self._lora_series_of(self._lora_key)  # there for the first scrape
        self._lora_refreshed = 0.0
        success = family("vllm:request_success_total", "Count of successfully processed requests.", MF.COUNTER)
        self.success = {reason: success.Metric(labels={**vllm, "finished_reason": reason})
                        for reason in ("stop", "length", "abort", "error")}
        # Speculative decoding, as vLLM registers them: only where it is configured.
        self.spec_counters: list[tuple[str, object]] = []
        self.spec_per_position: list[object] = []
        speculative = getattr(engine, "speculative", None)
        if speculative is not None:
            self.spec_counters = [
                ("spec_drafts", counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", vllm)),
                ("spec_draft_tokens", counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", vllm)),
                ("spec_accepted_tokens", counter("vllm:spec_decode_num_accepted_tokens_total",
                                                 "Number of accepted tokens.", vllm)),
                ("spec_trimmed_draft_tokens", counter(
                    "inflight_spec_decode_num_trimmed_draft_tokens_total",
                    "Draft tokens not verified (or, for a draft model, not drafted): the adaptive budget judged they would not pay.", vllm)),
            ]
            per_position = family("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                  "Accepted tokens per draft position.", MF.COUNTER)
            self.spec_per_position = [per_position.Metric(labels={**vllm, "position": str(position)})
                                      for position in range(speculative.num_speculative_tokens)]

        # TensorRT-LLM backend
        requests = gauge_family("nv_trt_llm_request_metrics", "TRT LLM request metrics")
        self.trt_requests = {
            kind: requests.Metric(labels={**labels, "request_type": kind})
            for kind in ("active", "max", "scheduled", "context", "waiting")
        }
        blocks = gauge_family("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics")
        self.trt_blocks = {
            kind: blocks.Metric(labels={**labels, "kv_cache_block_type": kind})
            for kind in ("max", "free", "used", "tokens_per", "reused", "fraction")
        }

        # inflight
        def our_gauge(name, description):
            return gauge_family(name, description).Metric(labels=labels)

        self.running = our_gauge("inflight_requests_running", "Requests in the running batch.")
        self.waiting = our_gauge("inflight_requests_waiting", "Requests in the waiting queue.")
        self.kv_usage = our_gauge("inflight_kv_cache_usage_ratio", "Fraction of KV blocks in use.")
        self.prefix_hit_rate = our_gauge("inflight_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.")
        self.occupancy = our_gauge("inflight_slot_occupancy", "running / max_num_seqs in the last iteration.")
        self.tokens_per_iteration = our_gauge("inflight_tokens_per_iteration", "Tokens computed in the last iteration.")
        self.lora_adapters_running = our_gauge("inflight_lora_adapters_running",
                                               "LoRA adapters of the running batch (at most max_loras).")
        self.weight_bytes = our_gauge("inflight_model_weight_bytes",
                                      "Bytes the model's weights hold as served (packed, quantized or float).")
        self.weight_bytes.set(engine.weight_bytes)
        self.preemptions = counter("inflight_preemptions_total", "Requests preempted for lack of KV blocks or by priority.")
        self.cancellations = counter("inflight_cancellations_total", "Requests cancelled by the client or the server.")
        self.iterations = counter("inflight_iterations_total", "Engine iterations (forward passes).")
        self.queue_time = histogram("inflight_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        # Disaggregated serving (backend/disagg.py), only for a model of role prefill or decode.
        self.kv_transfer_counters: list[tuple[str, object]] = []
        self.kv_transfer_time = None
        self.kv_transfers_pending = self.kv_transfers_expired = None
        if engine.config.role != "both":
            self.kv_transfers_pending = our_gauge(
                "inflight_kv_transfers_pending",
                "TCP KV transfers exported and not yet pulled (role prefill), or being pulled (role decode).")
            self.kv_transfers_expired = counter(
                "inflight_kv_transfers_expired_total",
                "TCP KV transfers freed unpulled after kv_transfer_timeout_s (role prefill).")
            self.kv_transfer_counters = [
                ("kv_transfers", counter("inflight_kv_transfers_total",
                                         "Requests whose KV this model exported (role prefill) or imported (role decode).")),
                ("kv_transfer_bytes", counter("inflight_kv_transfer_bytes_total",
                                              "KV bytes this model exported (role prefill) or imported (role decode).")),
            ]
            self.kv_transfer_time = histogram("inflight_kv_transfer_seconds",
                                              "Time to export (role prefill) or import (role decode) one request's KV.",
                                              LATENCY_BUCKETS)
        finished = family("inflight_requests_finished_total", "Requests ended, by finish reason.", MF.COUNTER)
        self.finished = {
            reason: finished.Metric(labels={**labels, "finish_reason": reason})
            for reason in ("stop", "length", "abort", "error")
        }
        # Per tenant: one label per tenant in tenant_weights, "default", and "other" for the rest.
        tenant_labels = sorted({*engine.config.tenant_weights, DEFAULT_TENANT, OTHER_TENANTS})
        service = family("inflight_tenant_service_tokens_total",
                         "Service per tenant: input tokens computed x input cost + output tokens x output cost.", MF.COUNTER)
        tenant_running = gauge_family("inflight_tenant_requests_running", "Running requests per tenant.")
        tenant_waiting = gauge_family("inflight_tenant_requests_waiting", "Waiting requests per tenant.")
        self.tenant_service, self.tenant_running, self.tenant_waiting = ({
            tenant: fam.Metric(labels={**labels, "tenant": tenant}) for tenant in tenant_labels
        } for fam in (service, tenant_running, tenant_waiting))
        self.fairness = our_gauge(
            "inflight_tenant_fairness_index",
            "Jain's index of recent weighted service over the tenant labels with waiting requests (1: even).")
        self._weights = {label: engine.config.tenant_weights.get(label, 1.0) for label in tenant_labels}
        self._recent_service = dict.fromkeys(tenant_labels, 0.0)
        self._last = {"prefilled_prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "aborts": 0, "steps": 0,
                      "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_trimmed_draft_tokens": 0,
                      "kv_transfers": 0, "kv_transfer_bytes": 0, "kv_transfers_expired": 0}
        self._last_per_position = [0] * len(self.spec_per_position)
        # Last value set on each gauge (by id): every set is an IPC round trip to the Triton
        # process, so only changes go.
        self._published: dict[int, float] = {}
        # Publish every gauge now, before the model reports ready: the loop's first on_step
        # comes only after its first idle wait (EngineLoop.IDLE_WAIT_S), and a scrape right
        # after readiness must already see the KV pool's size. Nothing else calls Triton
        # yet, so they are applied here, at once; reading the engine's stats from this
        # thread is safe, a snapshot being immutable.
        self._publish = apply
        self.on_step()
        self._publish = publish or apply

    def close(self) -> None:
        """Release every metric, then the families: Triton refuses the other order."""
        families = self._families
        self.__dict__.clear()
        families.clear()

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self.tenant_service else OTHER_TENANTS

    def on_step(self) -> None:
        """Refresh gauges and counters from the engine's latest stats snapshot; called by the
        loop thread after each step."""
        stats = self.engine.stats
        totals = stats.totals
        config = self.engine.config
        updates: Updates = []
        # Each iteration's latency samples are in its own snapshot only; on_step runs after
        # every step, and a snapshot seen twice (no step in between) adds nothing.
        if totals.steps > self._last["steps"]:
            updates += [(self.ttft.observe, s) for s in stats.step.first_token_latencies_s]
            updates += [(self.tpot.observe, s) for s in stats.step.inter_token_latencies_s]
            if self.kv_transfer_time is not None:
                updates += [(self.kv_transfer_time.observe, s) for _, s in stats.step.kv_transfers]
            service: dict[str, float] = {}
            for tenant, value in stats.step.service_by_tenant:
                label = self.tenant_label(tenant)
                service[label] = service.get(label, 0.0) + value
            updates += [(self.tenant_service[label].increment, value) for label, value in service.items() if value > 0]
            for label in self._recent_service:
                self._recent_service[label] = self._recent_service[label] * FAIRNESS_DECAY + service.get(label, 0.0)
        for name, metric in (("prefilled_prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                             ("preemptions", self.preemptions), ("aborts", self.cancellations), ("steps", self.iterations),
                             *self.spec_counters, *self.kv_transfer_counters):
            value = getattr(totals, name)
            if value > self._last[name]:
                updates.append((metric.increment, value - self._last[name]))
                self._last[name] = value
        if self.kv_transfers_expired is not None and self.engine.transfer_server is not None:
            expired = self.engine.transfer_server.num_expired
            if expired > self._last["kv_transfers_expired"]:
                updates.append((self.kv_transfers_expired.increment, expired - self._last["kv_transfers_expired"]))
                self._last["kv_transfers_expired"] = expired
        for position, value in enumerate(totals.spec_accepted_per_position[: len(self.spec_per_position)]):
            if value > self._last_per_position[position]:
                updates.append((self.spec_per_position[position].increment, value - self._last_per_position[position]))
                self._last_per_position[position] = value
        running, waiting, usage = stats.num_running, stats.num_waiting, stats.kv_usage
        gauges = [
            (self.running, running), (self.vllm_running, running), (self.waiting, waiting),
            (self.vllm_waiting, waiting), (self.kv_usage, usage), (self.vllm_kv, usage), (self.vllm_gpu_kv, usage),
            (self.prefix_hit_rate, totals.prefix_hit_rate), (self.occupancy, running / config.max_num_seqs),
            (self.tokens_per_iteration, stats.step.num_scheduled_tokens),
            (self.lora_adapters_running, len(stats.running_lora_adapters)),
        ]
        gauges += [(self.trt_requests[kind], value) for kind, value in (
            ("active", running), ("max", config.max_num_seqs), ("scheduled", running),
            ("context", stats.num_prefilling), ("waiting", waiting))]
        gauges += [(self.trt_blocks[kind], value) for kind, value in (
            ("max", stats.num_kv_blocks), ("free", stats.num_free_kv_blocks), ("used", stats.num_used_kv_blocks),
            ("tokens_per", config.block_size), ("reused", totals.prefix_hit_tokens // config.block_size),
            ("fraction", usage))]
        now = self._clock()
        lora_key = self._lora_info_key(stats)
        if lora_key != self._lora_key or now - self._lora_refreshed >= LORA_INFO_REFRESH_S:
            # The series is made where the update is applied: making one is an IPC call too.
            updates.append((functools.partial(self._set_lora_info, lora_key), now))
            self._lora_key, self._lora_refreshed = lora_key, now
        by_label = {label: [0, 0] for label in self.tenant_running}
        for tenant, running_n, waiting_n in stats.requests_by_tenant:
            counts = by_label[self.tenant_label(tenant)]
            counts[0] += running_n
            counts[1] += waiting_n
        for label, (running_n, waiting_n) in by_label.items():
            gauges += [(self.tenant_running[label], running_n), (self.tenant_waiting[label], waiting_n)]
        shares = [self._recent_service[label] / self._weights[label] for label, (_, waiting_n) in by_label.items()
                  if waiting_n]
        gauges.append((self.fairness, jain_index(shares)))
        if self.kv_transfers_pending is not None:
            gauges.append((self.kv_transfers_pending, self.engine.num_pending_transfers))
        for metric, value in gauges:
            if self._published.get(id(metric)) != value:
                updates.append((metric.set, value))
                self._published[id(metric)] = value
        if updates:
            self._publish(updates)

    @staticmethod
    def _lora_info_key(stats) -> tuple[str, str, str]:
        return (str(stats.max_loras), ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters))

    def _lora_series_of(self, key: tuple[str, str, str]):
        series = self._lora_series.get(key)
        if series is None:
            if len(self._lora_series) >= MAX_LORA_INFO_SERIES:
                # The oldest series goes (Triton drops a metric whose object is collected): a
                # router keeps the newest sample anyway.
                del self._lora_series[next(iter(self._lora_series))]
            max_lora, running, waiting = key
            series = self._lora_family.Metric(labels={**self._lora_labels, "max_lora": max_lora,
                                                       "running_lora_adapters": running,
                                                       "waiting_lora_adapters": waiting})
            self._lora_series[key] = series
        return series

    def _set_lora_info(self, key: tuple[str, str, str], value: float) -> None:
        self._lora_series_of(key).set(value)

    def on_finished(self, output) -> None:
        """Once per ended request, from its final output: one count in request_success and
        one sample in each per-request histogram, whatever ended it, so that these families
        all count the same requests. (Time to first token and between tokens are observed as
        the tokens come, by on_step.)"""
        reason = output.finish_reason or "abort"
        updates: Updates = []
        if reason in self.finished:
            updates.append((self.finished[reason].increment, 1))
        if reason in self.success:
            updates.append((self.success[reason].increment, 1))
        updates.append((self.prompt_hist.observe, output.num_prompt_tokens))
        updates.append((self.generation_hist.observe, output.num_output_tokens))
        if output.first_scheduled_time is not None:
            updates.append((self.queue_time.observe, max(0.0, output.first_scheduled_time - output.arrival_time)))
        if output.finish_time is not None:
            updates.append((self.e2e.observe, output.finish_time - output.arrival_time))
        self._publish(updates)


def cache_config_labels(engine) -> dict[str, str]:
    """vLLM's cache_config_info labels that this engine has a value for, written as vLLM
    writes them (str() of the value: "True", "None")."""
    config = engine.config
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(engine.stats.num_kv_blocks),
        "cache_dtype": config.kv_cache_dtype,
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "engine": "0",
    }


def jain_index(values: list[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    has everything; 1 for fewer than two values or none served."""
    squares = sum(v * v for v in values)
    if len(values) < 2 or squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)


def apply(updates: Updates) -> None:
    for update, value in updates:
        update(value)
