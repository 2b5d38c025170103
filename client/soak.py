"""A soak against a running tritonserver: a closed loop of gRPC streams for a set time.

`run_soak(SoakConfig(...))` keeps `streams` requests in flight, each on a gRPC stream of
its own, with random prompt lengths and sampling. Requests are numbered as they start:
every `bad_every`-th is a bad request (it must be refused with an error naming its
parameter), every other `cancel_every`-th is cancelled at a random point (before its first
token or after a few), and the rest must finish with "stop" or "length". Anything else
(an error on a valid request, a bad request accepted or refused without its parameter's
name, no final response within the timeout) is an unexpected error.

Each minute it records requests done, unexpected errors, the p99 inter-token latency
(between consecutive streamed responses, by the arrival of the later one), the RSS of the
server's process tree (tritonserver and its Python backend stubs, from /proc) and the load
average (the machine may be shared). At the end it waits for the engine to empty and reads
the used KV blocks and the running/waiting gauges from /metrics.

Pass (`SoakReport.criteria`): 0 unexpected errors; 0 used blocks, running and waiting at
the end; RSS growth, and anonymous RSS growth, under 50 MB from the end of minute 2 to the
end; p99 ITL of the last minute within 1.2x that of minute 2. The last two need a run of at least 3 minutes and read
None (not judged) in a shorter one.
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from backend.protocol import SAMPLING_PARAMETERS, STREAM, TEXT_INPUT
from client.metrics import metric_sum, read_metrics
from client.triton import grpc_input, is_final, make_inputs, output_value

RSS_GROWTH_LIMIT_MB = 50.0
ITL_RATIO_LIMIT = 1.2
# Minutes of warm-up before RSS and ITL are compared: allocator pools and the prefix cache fill.
WARMUP_MINUTES = 2

# Bad requests the soak sends in turn, each with the name its error must carry.
BAD_SAMPLING: tuple[tuple[str, str], ...] = (
    ('{"temperature": -1}', "temperature"),
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"top_p": 0}', "top_p"),
    ('{"stop": 5}', "stop"),
    ('{"max_tokens": 8, "priority": "high"}', "priority"),
    ('{"max_tokens": 8', "sampling_parameters"),
    ('{"stop_token_ids": [100000000]}', "stop_token_ids"),
    ('{"max_tokns": 8}', "max_tokns"),
)

WORDS = ("the quick brown fox jumps over lazy dog river mountain light keeper story ocean city "
         "tell me about a long day in spring under sky with seven small birds singing").split()


@dataclass
class SoakConfig:
    grpc_url: str
    metrics_url: str
    model: str = "llm"
    server_pid: int | None = None  # whose process tree's RSS is sampled; None: not sampled
    minutes: float = 1.0
    streams: int = 16
    cancel_every: int = 10
    bad_every: int = 20
    seed: int = 0
    max_prompt_words: int = 300
    max_tokens: tuple[int, int] = (8, 128)
    request_timeout_s: float = 300.0
    note: str = ""  # what else ran on the machine


@dataclass
class Minute:
    index: int  # 0-based: minute `index` of the run
    requests_done: int = 0  # requests that got their final response (refusals and cancels included)
    completed: int = 0
    cancelled: int = 0
    refused: int = 0
    unexpected_errors: int = 0
    itl_samples: int = 0
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    server_rss_mb: float | None = None  # at the end of this minute
    server_rss_anon_mb: float | None = None
    loadavg_1m: float | None = None
    _itls: list[float] = field(default_factory=list, repr=False)


@dataclass
class SoakReport:
    config: dict
    started_at: str
    duration_s: float
    minutes: list[dict]
    totals: dict
    rss_start_mb: float | None
    end_state: dict  # used KV blocks, running, waiting once the loop stopped
    unexpected: list[str]  # the first distinct unexpected errors
    criteria: dict
    passed: bool
    machine: dict = field(default_factory=dict)
    git_commit: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# ---------------------------------------------------------------------------- measurements

def descendants(pid: int) -> set[int]:
    """The PIDs of every process under `pid` (Linux /proc): tritonserver's backend stubs."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        found.add(p)
        todo.extend(children.get(p, ()))
    return found


def process_tree_rss_mb(pid: int) -> tuple[float, float]:
    """(RSS, anonymous RSS) of `pid` and all its descendants, in MB.

    Anonymous memory (the heap, torch's tensors) is where a leak shows; the rest of RSS is
    mostly mapped libraries and model files, which the kernel drops and reloads as the
    machine's memory pressure changes."""
    total_kb = anon_kb = 0
    for p in {pid} | descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "RssAnon:")))
        except OSError:
            continue
        total_kb += int(fields.get("VmRSS", "0 kB").split()[0])
        anon_kb += int(fields.get("RssAnon", "0 kB").split()[0])
    return total_kb / 1024.0, anon_kb / 1024.0


def engine_gauges(metrics_url: str, model: str) -> dict[str, float]:
    """Used KV blocks and running/waiting requests of `model`'s engine, from /metrics."""
    samples = read_metrics(metrics_url)
    return {"used_blocks": metric_sum(samples, "nv_trt_llm_kv_cache_block_metrics", model=model,
                                      kv_cache_block_type="used"),
            "running": metric_sum(samples, "inflight_requests_running", model=model),
            "waiting": metric_sum(samples, "inflight_requests_waiting", model=model)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


# ---------------------------------------------------------------------------- the loop

class _Soak:
    def __init__(self, config: SoakConfig):
        self.config = config
        self.lock = threading.Lock()
        self.count = 0
        self.t0 = time.monotonic()
        self.deadline = self.t0 + config.minutes * 60
        n_minutes = max(1, int(-(-config.minutes // 1)))
        self.minutes = [Minute(i) for i in range(n_minutes)]
        self.unexpected: list[str] = []

    def minute(self, t: float) -> Minute:
        return self.minutes[min(len(self.minutes) - 1, int((t - self.t0) // 60))]

    def next_number(self) -> int:
        with self.lock:
            self.count += 1
            return self.count

    def record(self, outcome: str, itls: list[tuple[float, float]], problem: str | None = None) -> None:
        now = time.monotonic()
        with self.lock:
            m = self.minute(now)
            m.requests_done += 1
            setattr(m, outcome, getattr(m, outcome) + 1)
            for t, itl in itls:
                self.minute(t)._itls.append(itl)
            if problem is not None:
                m.unexpected_errors += 1
                if problem not in self.unexpected and len(self.unexpected) < 20:
                    self.unexpected.append(problem)

    def worker(self, index: int) -> None:
        import tritonclient.grpc as grpcclient

        rng = random.Random(self.config.seed * 1000 + index)
        client = grpcclient.InferenceServerClient(self.config.grpc_url)
        try:
            while time.monotonic() < self.deadline:
                n = self.next_number()
                if n % self.config.bad_every == 0:
                    self.bad_request(client, n)
                elif n % self.config.cancel_every == 0:
                    self.request(client, n, rng, cancel_after=rng.randint(0, 4))
                else:
                    self.request(client, n, rng, cancel_after=None)
        finally:
            client.close()

    def sampling(self, rng: random.Random, cancel: bool) -> dict[str, Any]:
        lo, hi = self.config.max_tokens
        sampling: dict[str, Any] = {"max_tokens": rng.randint(lo, hi) if not cancel else hi * 4,
                                    "temperature": rng.choice([0.0, 0.7, 1.0])}
        if cancel:
            sampling["ignore_eos"] = True
        if rng.random() < 0.5:
            sampling["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.3:
            sampling["top_k"] = rng.choice([1, 20, 50])
        if rng.random() < 0.3:
            sampling["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.2:
            sampling["repetition_penalty"] = rng.choice([1.1, 1.3])
        if rng.random() < 0.1 and not cancel:  # a request to cancel must still be running then
            sampling["stop"] = [rng.choice(WORDS)]
        return sampling

    def request(self, client, n: int, rng: random.Random, cancel_after: int | None) -> None:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, self.config.max_prompt_words)))
        sampling = self.sampling(rng, cancel_after is not None)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((time.monotonic(), result, error)))
        itls: list[tuple[float, float]] = []
        last: float | None = None
        got = 0
        outcome, problem = "completed", None
        try:
            client.async_stream_infer(self.config.model, make_inputs(prompt, sampling, stream=True),
                                      request_id=str(n), enable_empty_final_response=True)
            if cancel_after == 0:
                time.sleep(rng.uniform(0, 0.2))  # before or during its prefill
                return
            deadline = time.monotonic() + self.config.request_timeout_s
            while True:
                try:
                    t, result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    problem = f"no final response within {self.config.request_timeout_s:.0f}s"
                    return
                if error is not None:
                    problem = f"error on a valid request: {error}"
                    return
                if output_value(result, "text_output"):
                    if last is not None:
                        itls.append((t, t - last))
                    last = t
                    got += 1
                if is_final(result):
                    if cancel_after is not None:
                        problem = f"request to cancel ended before it was cancelled ({got} responses)"
                        return
                    reason = output_value(result, "finish_reason")
                    if reason not in ("stop", "length"):
                        problem = f"finish_reason {reason!r}"
                    return
                if cancel_after is not None and got >= cancel_after:
                    return
        finally:
            finished_normally = cancel_after is None
            client.stop_stream(cancel_requests=not finished_normally or problem is not None)
            if cancel_after is not None and problem is None:
                outcome = "cancelled"
            self.record(outcome, itls, problem)

    def bad_request(self, client, n: int) -> None:
        text, name = BAD_SAMPLING[(n // self.config.bad_every) % len(BAD_SAMPLING)]
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        problem = None
        try:
            inputs = [grpc_input(TEXT_INPUT, "Hello there"), grpc_input(STREAM, True),
                      grpc_input(SAMPLING_PARAMETERS, text)]
            client.async_stream_infer(self.config.model, inputs, request_id=str(n), enable_empty_final_response=True)
            try:
                result, error = responses.get(timeout=self.config.request_timeout_s)
            except queue.Empty:
                problem = f"bad request {text!r}: no answer"
                return
            if error is None:
                problem = f"bad request {text!r} accepted"
            elif name not in str(error):
                problem = f"bad request {text!r}: error does not name {name!r}: {error}"
        finally:
            client.stop_stream(cancel_requests=problem is not None)
            self.record("refused", [], problem)

    def close_minute(self, m: Minute) -> None:
        if self.config.server_pid is not None:
            m.server_rss_mb, m.server_rss_anon_mb = (round(x, 1) for x in process_tree_rss_mb(self.config.server_pid))
        m.loadavg_1m = round(os.getloadavg()[0], 2)


def run_soak(config: SoakConfig, progress=None) -> SoakReport:
    """Run the soak for `config.minutes`; `progress(minute)` is called as each minute ends."""
    from client.bench.records import git_commit, machine

    # Read before the run: a commit that lands during a 30-minute run is not what ran.
    commit, machine_info = git_commit(), machine()
    soak = _Soak(config)
    rss_start = process_tree_rss_mb(config.server_pid)[0] if config.server_pid is not None else None
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    stop = threading.Event()

    def minutes_thread() -> None:
        for m in soak.minutes:
            end = soak.t0 + min((m.index + 1) * 60, config.minutes * 60)
            if stop.wait(max(0.0, end - time.monotonic())):
                return
            soak.close_minute(m)
            if progress is not None:
                progress(m)

    sampler = threading.Thread(target=minutes_thread, name="soak-minutes", daemon=True)
    sampler.start()
    workers = [threading.Thread(target=soak.worker, args=(i,), name=f"soak-{i}", daemon=True)
               for i in range(config.streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    duration = time.monotonic() - soak.t0
    sampler.join(timeout=90)
    stop.set()

    # Cancelled requests free their blocks within a step or two; wait for the engine to empty.
    end_state = engine_gauges(config.metrics_url, config.model)
    deadline = time.monotonic() + 30
    while any(end_state.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        end_state = engine_gauges(config.metrics_url, config.model)

    minutes = []
    for m in soak.minutes:
        m.itl_samples = len(m._itls)
        p50, p99 = percentile(m._itls, 50), percentile(m._itls, 99)
        m.itl_p50_ms = None if p50 is None else round(p50 * 1000, 2)
        m.itl_p99_ms = None if p99 is None else round(p99 * 1000, 2)
        minutes.append({k: v for k, v in asdict(m).items() if not k.startswith("_")})
    totals = {key: sum(m[key] for m in minutes)
              for key in ("requests_done", "completed", "cancelled", "refused", "unexpected_errors")}

    judged = len(minutes) > WARMUP_MINUTES
    rss_growth = anon_growth = None
    if judged and config.server_pid is not None:
        rss_growth = round(minutes[-1]["server_rss_mb"] - minutes[WARMUP_MINUTES - 1]["server_rss_mb"], 1)
        anon_growth = round(minutes[-1]["server_rss_anon_mb"] - minutes[WARMUP_MINUTES - 1]["server_rss_anon_mb"], 1)
    itl_ratio = None
    if judged and minutes[1]["itl_p99_ms"] and minutes[-1]["itl_p99_ms"]:
        itl_ratio = round(minutes[-1]["itl_p99_ms"] / minutes[1]["itl_p99_ms"], 3)
    criteria = {
        "unexpected_errors": {"value": totals["unexpected_errors"], "limit": 0,
                              "passed": totals["unexpected_errors"] == 0},
        "end_state_empty": {"value": end_state, "passed": not any(end_state.values())},
        "rss_growth_after_warmup_mb": {"value": rss_growth, "limit": RSS_GROWTH_LIMIT_MB,
                                       "passed": None if rss_growth is None else rss_growth < RSS_GROWTH_LIMIT_MB},
        "rss_anon_growth_after_warmup_mb": {"value": anon_growth, "limit": RSS_GROWTH_LIMIT_MB,
                                            "passed": None if anon_growth is None else anon_growth < RSS_GROWTH_LIMIT_MB},
        "itl_p99_last_over_minute_2": {"value": itl_ratio, "limit": ITL_RATIO_LIMIT,
                                       "passed": None if itl_ratio is None else itl_ratio <= ITL_RATIO_LIMIT},
    }
    passed = all(c["passed"] is not False for c in criteria.values())
    return SoakReport(
        config={k: v for k, v in asdict(config).items()},
        started_at=started_at,
        duration_s=round(duration, 1),
        minutes=minutes,
        totals=totals,
        rss_start_mb=None if rss_start is None else round(rss_start, 1),
        end_state=end_state,
        unexpected=soak.unexpected,
        criteria=criteria,
        passed=passed,
        machine=machine_info,
        git_commit=commit,
    )
