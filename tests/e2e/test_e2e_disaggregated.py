"""Disaggregated serving through a real tritonserver: model_repository_disaggregated/'s
`llm` (a BLS model) sends each request to llm_prefill and its KV transfer to llm_decode, in
one server. A tritonclient gRPC stream must see the aggregated engine's tokens in one
ordinary stream with exactly one final response, and both engines end holding no block. A
stream cancelled mid-prefill or mid-decode is cancelled in the engine that holds it, and
leaves no block, transfer or cancel flag behind. Under pressure (a full decode model) requests wait, or past kv_transfer_wait_timeout_s get
UNAVAILABLE; the prefill model's process SIGKILLed mid-request ends that request with one
error while the decode model's requests finish, and no block or transfer is left behind.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from backend.cancel_flag import CANCEL_FLAG_PREFIX
from backend.disagg import SHM_PREFIX
from backend.paths import REPO_ROOT
from tests.e2e.e2e_util import (
    Stream,
    generate,
    greedy_tokens_and_texts,
    inputs_for,
    output,
    scrape,
    tensor,
    wait_for,
    wait_idle,
    wait_until,
)
from tests.e2e.server import E2E_PARAMETERS

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers and explain why each is prime, step by step, in detail."]
MAX_TOKENS = 12

pytestmark = [pytest.mark.e2e, pytest.mark.alone]


def serve_disaggregated(tritonserver, prefill: dict, decode: dict, args=()):
    """A started tritonserver of model_repository_disaggregated/: the BLS `llm` in front of
    `llm_prefill` and `llm_decode` with these engine parameters."""
    return tritonserver({"llm": {}, "llm_prefill": prefill, "llm_decode": decode}, args=args,
                        source_repository=REPO_ROOT / "model_repository_disaggregated",
                        sources={name: name for name in ("llm", "llm_prefill", "llm_decode")})


@pytest.fixture(scope="module")
def disaggregated_server(tritonserver):
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8")  # several prefill chunks a prompt
    server = serve_disaggregated(tritonserver, engine, engine)
    try:
        yield server
    finally:
        server.stop()


def test_disaggregated_greedy_tokens_are_the_aggregated_servers(disaggregated_server, triton_server):
    aggregated = greedy_tokens_and_texts(triton_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    disaggregated = greedy_tokens_and_texts(disaggregated_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    assert disaggregated == aggregated
    for model in ("llm_prefill", "llm_decode"):
        wait_idle(disaggregated_server.metrics_port, model)


def test_a_stream_is_one_ordinary_stream_with_one_final_response(disaggregated_server, triton_server):
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    inputs = lambda: inputs_for(PROMPTS[1], sampling, stream=True)
    aggregated = generate(triton_server.grpc_url, "llm", inputs())
    outcome = generate(disaggregated_server.grpc_url, "llm", inputs())
    assert outcome.error is None, outcome.message
    assert outcome.finals == 1 and outcome.after_final == 0
    assert outcome.text == aggregated.text and len(outcome.responses) > 1
    assert outcome.total("num_output_tokens") == MAX_TOKENS
    assert output(outcome.last, "finish_reason") == "length"
    wait_idle(disaggregated_server.metrics_port, "llm_decode")
    metrics = wait_idle(disaggregated_server.metrics_port, "llm_prefill")
    # Every request handed over was taken: the same transfers and bytes on both sides.
    exported, imported = ({name: metrics.get(name, model=model) for name in (
        "inflight_kv_transfers_total", "inflight_kv_transfer_bytes_total", "inflight_kv_transfer_seconds_count")}
        for model in ("llm_prefill", "llm_decode"))
    assert exported == imported and exported["inflight_kv_transfer_bytes_total"] > 0
    assert exported["inflight_kv_transfers_total"] == exported["inflight_kv_transfer_seconds_count"] >= 4
    # The prefill model ends its part of each request with "transferred"; the decode model
    # finishes the request.
    assert metrics.get("inflight_requests_finished_total", model="llm_decode", finish_reason="length") >= 1


def test_a_first_token_that_ends_the_request_is_answered_by_the_prefill_model(disaggregated_server):
    outcome = generate(disaggregated_server.grpc_url, "llm",
                       inputs_for(PROMPTS[0], {"temperature": 0, "max_tokens": 1, "ignore_eos": True}, stream=True))
    assert outcome.error is None, outcome.message
    assert outcome.finals == 1 and outcome.after_final == 0 and outcome.text
    assert output(outcome.last, "finish_reason") == "length"


def test_a_handle_that_names_no_transfer_ends_with_one_clear_error(disaggregated_server):
    missing = SHM_PREFIX + "0" * 24
    inputs = inputs_for(PROMPTS[0], {"max_tokens": 4}) + [tensor("transfer", missing, "BYTES")]
    outcome = generate(disaggregated_server.grpc_url, "llm_decode", inputs)
    assert outcome.finals == 1 and outcome.after_final == 0 and not outcome.responses
    assert f"no KV transfer named '{missing}'" in outcome.message
    assert "transfer:" in outcome.message


def test_an_invalid_request_is_refused_by_name_through_the_bls_model(disaggregated_server):
    outcome = generate(disaggregated_server.grpc_url, "llm", inputs_for(PROMPTS[0], {"temperature": -1}))
    assert outcome.finals == 1 and outcome.error is not None
    assert outcome.message.startswith("temperature")


def _shm_transfers() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)]


class WaitingWatch:
    """Polls a model's waiting-queue gauge on a thread of its own; `peak` is the most seen."""

    def __init__(self, metrics_port: int, model: str):
        self.peak = 0.0
        self._stop = threading.Event()

        def poll() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, scrape(metrics_port).get("vllm:num_requests_waiting", model_name=model))
                time.sleep(0.05)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_a_full_decode_model_makes_requests_wait_and_nothing_leaks(disaggregated_server):
    """12 requests at once against a decode model of max_num_seqs 8: the prefill model hands
    over the first 8 together, and the 4 after them reach a decode batch still busy with those
    8 for dozens of steps. They wait in the decode model (its waiting gauge shows them), each
    request ends with exactly one final response and all its tokens; then neither engine holds
    a block or a transfer."""
    from concurrent.futures import ThreadPoolExecutor

    sampling = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}

    def ask(i: int):  # a stream each: an error response carries no request id
        return generate(disaggregated_server.grpc_url, "llm", inputs_for(f"{PROMPTS[2]} ({i})", sampling, stream=True),
                        timeout=300)

    watch = WaitingWatch(disaggregated_server.metrics_port, "llm_decode")
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(ask, range(12)))
    peak = watch.stop()
    assert all(o.finals == 1 and o.after_final == 0 for o in outcomes)
    assert [o.message for o in outcomes if o.error is not None] == []
    assert all(o.total("num_output_tokens") == 48 for o in outcomes)
    assert 1 <= peak <= 4, peak  # the decode model's queue: handed-over requests waiting for room
    for model in ("llm_prefill", "llm_decode"):
        wait_idle(disaggregated_server.metrics_port, model)
    assert not _shm_transfers()


# ---- a client's cancel, passed on by the BLS model (tritonserver 2.51 cannot cancel a BLS request) ----

MODELS = ("llm_prefill", "llm_decode")


def _cancel_flags() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(CANCEL_FLAG_PREFIX)]


def _counts(metrics_port: int, name: str) -> dict[str, float]:
    metrics = scrape(metrics_port)
    return {model: metrics.get(name, model=model) for model in MODELS}


def _assert_cancelled_at(server, model: str, cancellations_before: dict[str, float]) -> None:
    """The cancel reached `model` alone (its engine aborted the request), then both engines
    hold no block and no request, no transfer or cancel flag is left on the host, the BLS
    model ended the request without an error of its own, and the next request is served."""
    for name in MODELS:
        wait_idle(server.metrics_port, name)
    cancellations = _counts(server.metrics_port, "inflight_cancellations_total")
    assert {m: cancellations[m] - cancellations_before[m] for m in MODELS} == {
        m: float(m == model) for m in MODELS}
    assert not _shm_transfers()
    wait_until(lambda: not _cancel_flags(), 10, 0.1, "the cancel flag removed")
    assert "[disaggregated llm]" not in server.log(), server.log_tail(40)
    outcome = generate(server.grpc_url, "llm", inputs_for(PROMPTS[1], {"temperature": 0, "max_tokens": MAX_TOKENS,
                                                                         "ignore_eos": True}, stream=True))
    assert outcome.error is None and outcome.finals == 1 and outcome.after_final == 0, outcome.message
    assert outcome.total("num_output_tokens") == MAX_TOKENS
    for name in MODELS:
        wait_idle(server.metrics_port, name)


def test_a_stream_cancelled_mid_prefill_is_cancelled_in_the_prefill_model(disaggregated_server):
    """The long prompt runs in llm_prefill (a chunk of 8 tokens a step) when the client
    cancels its gRPC stream: llm_prefill's engine aborts it before its first token, so
    nothing is exported and llm_decode never hears of it."""
    url, metrics_port = disaggregated_server.grpc_url, disaggregated_server.metrics_port
    before = _counts(metrics_port, "inflight_cancellations_total")
    transfers_before = _counts(metrics_port, "inflight_kv_transfers_total")
    stream = Stream(url)
    cancelled = stream.send("llm", inputs_for(LONG_PROMPT, {"temperature": 0, "max_tokens": 8}, stream=True))
    wait_until(lambda: scrape(metrics_port).get("inflight_requests_running", model="llm_prefill") >= 1,
               60, 0.02, "llm_prefill running the long prompt")
    stream.close(cancel=True)
    _assert_cancelled_at(disaggregated_server, "llm_prefill", before)
    assert not cancelled.responses
    transfers = _counts(metrics_port, "inflight_kv_transfers_total")
    # One transfer more each: the request served after the cancel; none for the cancelled one.
    assert {m: transfers[m] - transfers_before[m] for m in MODELS} == {m: 1 for m in MODELS}


# Well under the `llm` model's CANCEL_DRAIN_S (30 s): a cancelled request whose engine model's
# final response did not reach the BLS model would take that long (and leave its reader thread).
BLS_ENDS_CANCELLED_WITHIN_S = 10.0


def _bls_threads(server) -> int:
    """The threads of the `llm` model's stub: one serving thread and one reader a request."""
    return len(os.listdir(f"/proc/{_stub_pid(server, 'llm')}/task"))


def cancel_mid_decode(server) -> None:
    """A stream cancelled once llm_decode streams its tokens: the BLS model ends the request
    within BLS_ENDS_CANCELLED_WITHIN_S, left with no thread of it; llm_decode's engine
    cancelled it (llm_prefill's had handed it over), both engines hold no block and the
    next request is served."""
    before = _counts(server.metrics_port, "inflight_cancellations_total")
    outcome = generate(server.grpc_url, "llm", inputs_for(PROMPTS[1], {"temperature": 0, "max_tokens": 2},
                                                          stream=True))
    assert outcome.error is None and outcome.finals == 1, outcome.message
    idle_threads = _bls_threads(server)
    stream = Stream(server.grpc_url)
    cancelled = _long_decode(stream)
    assert _bls_threads(server) > idle_threads
    stream.close(cancel=True)
    wait_until(lambda: _bls_threads(server) == idle_threads, BLS_ENDS_CANCELLED_WITHIN_S, 0.05,
               "the `llm` model's threads of the cancelled request ended")
    _assert_cancelled_at(server, "llm_decode", before)
    assert cancelled.finals == 0  # a client that cancels hears nothing more
    assert _bls_threads(server) == idle_threads


def test_a_stream_cancelled_mid_decode_is_cancelled_in_the_decode_model(disaggregated_server):
    cancel_mid_decode(disaggregated_server)


# ---- pressure and failure, on a server of their own (its prefill model's process is killed) ----

PRESSURE_WAIT_S = 1.0  # llm_decode's kv_transfer_wait_timeout_s
PRESSURE_LIFETIME_S = 3.0  # llm_prefill's kv_transfer_timeout_s
# A prompt that takes llm_prefill a second or more in chunks of 8 tokens.
LONG_PROMPT = " ".join(f"item {i} is a number of some interest;" for i in range(150))


@pytest.fixture(scope="module")
def pressure_server(tritonserver):
    """A decode model with room for one request, which waits PRESSURE_WAIT_S for room; a
    prefill model whose transfers live PRESSURE_LIFETIME_S unclaimed."""
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8", kv_transfer_timeout_s=str(PRESSURE_LIFETIME_S))
    server = serve_disaggregated(tritonserver, engine,
                                 dict(engine, max_num_seqs="1", kv_transfer_wait_timeout_s=str(PRESSURE_WAIT_S)),
                                 args=["--exit-timeout-secs=3"])  # a killed model's unload never ends
    try:
        yield server
    finally:
        server.stop()


def _long_decode(stream: Stream, max_tokens: int = 400):
    """A request that holds llm_decode's one place for seconds, once its first token is out."""
    outcome = stream.send("llm", inputs_for(PROMPTS[0], {"temperature": 0, "max_tokens": max_tokens,
                                                         "ignore_eos": True}, stream=True))
    wait_until(lambda: outcome.responses, 120, 0.02, "the first request's first token")
    return outcome


def test_a_request_that_waits_past_kv_transfer_wait_timeout_s_gets_unavailable(pressure_server):
    url = pressure_server.grpc_url
    with Stream(url) as stream:
        running = _long_decode(stream)
        t0 = time.monotonic()
        refused = generate(url, "llm", inputs_for(PROMPTS[1], {"temperature": 0, "max_tokens": 8}, stream=True),
                           timeout=60)
        waited = time.monotonic() - t0
        assert refused.finals == 1 and refused.after_final == 0 and not refused.responses
        assert "decode instance is full" in refused.message and "max_num_seqs=1" in refused.message
        assert f"kv_transfer_wait_timeout_s={PRESSURE_WAIT_S:g}s" in refused.message
        assert refused.message.endswith("retry later")
        assert waited >= PRESSURE_WAIT_S
        wait_for(running, 300)
    assert running.error is None and running.finals == 1 and running.total("num_output_tokens") == 400
    for model in ("llm_prefill", "llm_decode"):
        wait_idle(pressure_server.metrics_port, model)
    assert not _shm_transfers()


def _stub_pid(server, model: str) -> int:
    """The Python backend stub that serves `model`'s one instance."""
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if f"{model}_0_0".encode() in args:
            pids.append(int(pid))
    assert len(pids) == 1, (model, pids)
    return pids[0]


def test_a_prefill_process_killed_mid_request_ends_it_with_one_error_and_nothing_leaks(pressure_server):
    """A request in llm_decode, and one whose long prompt llm_prefill is running: llm_prefill's
    stub is SIGKILLed. The second ends with one UNAVAILABLE error naming llm_prefill within
    seconds (tritonserver 2.51 itself would never answer it), the first streams on to its
    last token; then the decode model holds no block and no transfer is left on the host."""
    url, metrics_port = pressure_server.grpc_url, pressure_server.metrics_port
    with Stream(url) as stream:
        running = _long_decode(stream, max_tokens=200)
        with Stream(url) as doomed_stream:
            doomed = doomed_stream.send("llm", inputs_for(LONG_PROMPT, {"temperature": 0, "max_tokens": 8},
                                                          stream=True))
            wait_until(lambda: scrape(metrics_port).get("inflight_requests_running", model="llm_prefill") >= 1,
                       60, 0.02, "llm_prefill running the long prompt")
            pid = _stub_pid(pressure_server, "llm_prefill")
            os.kill(pid, 9)
            t0 = time.monotonic()
            wait_for(doomed, 30)
            ended_s = time.monotonic() - t0
            time.sleep(0.3)
        if pressure_server.proc.poll() is not None:
            # The other outcome tritonserver 2.51 has (docs/operations.md, Reliability): the
            # stub died holding a shared-memory mutex and the server aborted; the stream ends
            # with the connection's one error all the same.
            assert "boost::interprocess::lock_exception" in pressure_server.log(), pressure_server.log_tail(40)
            assert doomed.finals == 1 and doomed.error is not None
            return
        assert doomed.finals == 1 and doomed.after_final == 0 and not doomed.responses
        assert f"llm_prefill: its process (pid {pid}) died while serving this request" in doomed.message
        assert ended_s < 5, ended_s
        print(f"llm_prefill's stub SIGKILLed mid-prefill: the request's one error came {ended_s:.2f}s after the kill")
        wait_for(running, 300)
    assert running.error is None and running.finals == 1 and running.total("num_output_tokens") == 200
    wait_idle(metrics_port, "llm_decode")
    # A transfer the dead process had exported would be swept once expired, by llm_decode.
    wait_until(lambda: not _shm_transfers(), PRESSURE_LIFETIME_S + 5, 0.2, "no KV transfer left")
    # The dead model refuses at once from now on, with one error; nothing hangs.
    refused = generate(url, "llm", inputs_for(PROMPTS[1], {"max_tokens": 4}, stream=True), timeout=30)
    assert refused.finals == 1 and refused.error is not None


# ---- two prefill models: a request whose prefill model's process dies is sent to the other ----

@pytest.fixture(scope="module")
def two_prefill_server(tritonserver):
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8", kv_transfer_timeout_s=str(PRESSURE_LIFETIME_S))
    server = tritonserver({"llm": {"prefill_model": "llm_prefill,llm_prefill_b"}, "llm_prefill": engine,
                           "llm_prefill_b": engine, "llm_decode": engine},
                          source_repository=REPO_ROOT / "model_repository_disaggregated",
                          sources={"llm": "llm", "llm_prefill": "llm_prefill", "llm_prefill_b": "llm_prefill",
                                   "llm_decode": "llm_decode"},
                          args=["--exit-timeout-secs=3"])  # the killed model's unload never ends: no drain to wait for
    try:
        yield server
    finally:
        server.stop()


def test_a_request_whose_prefill_process_dies_is_retried_once_on_the_other_prefill_model(two_prefill_server):
    """The long prompt runs in one of two prefill models when that model's stub is SIGKILLed:
    the request goes once more, to the other, and streams the same tokens as an undisturbed
    request, with one final response; later requests go to the live prefill model only."""
    url, metrics_port = two_prefill_server.grpc_url, two_prefill_server.metrics_port
    sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    prefills = ("llm_prefill", "llm_prefill_b")

    def running_prefill():
        metrics = scrape(metrics_port)
        return next((m for m in prefills if metrics.get("inflight_requests_running", model=m) >= 1), None)

    with Stream(url) as stream:
        retried = stream.send("llm", inputs_for(LONG_PROMPT, sampling, stream=True))
        killed = wait_until(running_prefill, 60, 0.02, "a prefill model running the long prompt")
        os.kill(_stub_pid(two_prefill_server, killed), 9)
        wait_for(retried, 120)
    if two_prefill_server.proc.poll() is not None:  # tritonserver 2.51's other outcome (see the test above)
        assert "boost::interprocess::lock_exception" in two_prefill_server.log(), two_prefill_server.log_tail(40)
        return
    assert retried.error is None, retried.message
    assert retried.finals == 1 and retried.after_final == 0
    assert f"{killed}: its process" in two_prefill_server.log() and "sending it to" in two_prefill_server.log()
    live = next(m for m in prefills if m != killed)
    handed_over = scrape(metrics_port).get("inflight_kv_transfers_total", model=live)
    for _ in range(2):  # neither goes to the dead model, which would refuse it
        undisturbed = generate(url, "llm", inputs_for(LONG_PROMPT, sampling, stream=True))
        assert undisturbed.error is None and undisturbed.finals == 1, undisturbed.message
        assert undisturbed.text == retried.text
    assert scrape(metrics_port).get("inflight_kv_transfers_total", model=live) == handed_over + 2
    for model in (live, "llm_decode"):
        wait_idle(metrics_port, model)
    wait_until(lambda: not _shm_transfers(), PRESSURE_LIFETIME_S + 5, 0.2, "no KV transfer left")
