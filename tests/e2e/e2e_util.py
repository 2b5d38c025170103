"""Helpers of the end-to-end tests: requests over gRPC streams with every response recorded
(final flags counted), /metrics scraping, and waiting for an idle engine. The servers
themselves come from the `tritonserver` fixture (tests/e2e/conftest.py, tests/e2e/server.py).

Imported by tests/e2e/test_e2e_interface.py, tests/e2e/test_e2e_cancel.py, tests/e2e/test_genai_perf.py
and by the client processes those tests start (tests/e2e/e2e_stream_client.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.protocol import EXCLUDE_INPUT, SAMPLING_PARAMETERS, STREAM, TEXT_INPUT, TEXT_OUTPUT
from client.metrics import read_metrics
from client.triton import (
    grpc_input,
    is_final,
    output_value as output,
)

# How long a test waits, after a request's final response, for anything (wrongly) sent after it.
AFTER_FINAL_GRACE_S = 0.3


# ---------------------------------------------------------------------------- requests

def tensor(name: str, value: Any, dtype: str, shape: list[int] | None = None):
    """Any gRPC input tensor, of any datatype and shape (for requests the interface refuses;
    `inputs_for` builds the ones it accepts). BYTES values may be str (UTF-8 encoded here) or bytes."""
    import tritonclient.grpc as grpcclient

    values = value if isinstance(value, list) else [value]
    if dtype == "BYTES":
        array = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    elif dtype == "BOOL":
        array = np.array(values, dtype=bool)
    else:
        from tritonclient.utils import triton_to_np_dtype

        array = np.array(values, dtype=triton_to_np_dtype(dtype))
    t = grpcclient.InferInput(name, shape or list(array.shape), dtype)
    t.set_data_from_numpy(array.reshape(shape or array.shape))
    return t


def inputs_for(prompt: str | bytes | None = "Hello", sampling: dict | str | None = None, stream: bool | None = None,
               exclude_input: bool | None = None, returns: tuple[str, ...] = ()) -> list:
    """Input tensors of one request; None leaves an input out. `sampling` may be raw text."""
    values = {
        TEXT_INPUT: prompt,
        STREAM: stream,
        SAMPLING_PARAMETERS: sampling if sampling is None or isinstance(sampling, str) else json.dumps(sampling),
        EXCLUDE_INPUT: exclude_input,
        **{flag: True for flag in returns},
    }
    return [grpc_input(name, value) for name, value in values.items() if value is not None]


@dataclass
class Outcome:
    """Everything one request got back: responses in order, the error if any, and when."""

    responses: list = field(default_factory=list)
    error: Exception | None = None
    finals: int = 0  # responses with the final flag, plus an error response
    after_final: int = 0  # anything that arrived after the first final response
    sent_at: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each response (or the error)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def chunks(self) -> list[str]:
        return [output(r, TEXT_OUTPUT) or "" for r in self.responses]

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def last(self):
        return self.responses[-1]

    def total(self, name: str) -> int:
        return sum(int(output(r, name) or 0) for r in self.responses)

    def record(self, result, error) -> None:
        now = time.monotonic()
        if self.done.is_set():
            self.after_final += 1
        self.times.append(now)
        if error is not None:
            self.error = self.error or error
            self.finals += 1
            self.done.set()
            return
        self.responses.append(result)
        if is_final(result):
            self.finals += 1
            self.done.set()

    @property
    def message(self) -> str:
        if self.error is None:
            return ""
        message = getattr(self.error, "message", None)
        return (message() if callable(message) else None) or str(self.error)


class Stream:
    """One gRPC bidirectional stream carrying any number of requests, each recorded in an Outcome.

    Requests are told apart by request id (an error response carries none: send requests
    that may fail on a stream of their own).
    """

    _ids = iter(range(1, 1 << 62))

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.outcomes: dict[str, Outcome] = {}
        self.orphans: list = []  # errors or responses with no known request id
        self._lock = threading.Lock()
        self.closed = False
        self.client.start_stream(callback=self._callback)

    def _callback(self, result, error) -> None:
        if self.closed:  # what comes after stop_stream is the client's own doing ("Locally cancelled")
            return
        with self._lock:
            request_id = result.get_response().id if result is not None else None
            if request_id in self.outcomes:
                self.outcomes[request_id].record(result, error)
            elif error is not None and len(self.outcomes) == 1:
                next(iter(self.outcomes.values())).record(None, error)
            else:
                self.orphans.append((result, error))

    def send(self, model: str, inputs: list, parameters: dict | None = None, request_id: str | None = None) -> Outcome:
        request_id = request_id or f"r{next(self._ids)}"
        outcome = Outcome(sent_at=time.monotonic())
        with self._lock:
            self.outcomes[request_id] = outcome
        self.client.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters,
                                       enable_empty_final_response=True)
        return outcome

    def close(self, cancel: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=not all(o.done.is_set() for o in self.outcomes.values()))


def wait_for(outcome: Outcome, timeout: float = 120.0) -> Outcome:
    assert outcome.done.wait(timeout), f"no final response within {timeout:.0f}s ({len(outcome.responses)} responses so far)"
    return outcome


def wait_while_streaming(outcome: Outcome, idle_s: float = 60.0) -> Outcome:
    """Waits for a long stream's final response for as long as responses keep coming, failing
    only when none has come for `idle_s`: a stream that still streams is not hung, however
    slow a loaded machine makes it."""
    while not outcome.done.wait(1.0):
        last = outcome.times[-1] if outcome.times else outcome.sent_at
        idle = time.monotonic() - last
        assert idle < idle_s, f"no response for {idle:.0f}s and no final one ({len(outcome.responses)} responses so far)"
    return outcome


def generate(url: str, model: str, inputs: list, parameters: dict | None = None, timeout: float = 120.0,
             grace: float = AFTER_FINAL_GRACE_S) -> Outcome:
    """One request on a stream of its own; waits for its final response, then `grace` more
    seconds so that anything sent after the final response is seen (`after_final`)."""
    with Stream(url) as stream:
        outcome = wait_for(stream.send(model, inputs, parameters), timeout)
        if grace:
            time.sleep(grace)
    return outcome


# ---------------------------------------------------------------------------- metrics

@dataclass
class Metrics:
    samples: list[tuple[str, dict[str, str], float]]

    def get(self, name: str, **labels: str) -> float:
        """The value of the one sample of `name` with these labels (0 when absent)."""
        found = [v for n, ls, v in self.samples if n == name and all(ls.get(k) == str(x) for k, x in labels.items())]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else 0.0

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


def scrape(metrics_port: int, host: str = "127.0.0.1") -> Metrics:
    return Metrics(read_metrics(f"http://{host}:{metrics_port}/metrics"))


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)


def engine_state(m: Metrics, model: str) -> dict[str, float]:
    return {
        "used_blocks": m.get("nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="used"),
        "running": m.get("inflight_requests_running", model=model),
        "waiting": m.get("inflight_requests_waiting", model=model),
        "kv_usage": m.get("inflight_kv_cache_usage_ratio", model=model),
    }


def wait_idle(metrics_port: int, model: str, timeout: float = 60.0, host: str = "127.0.0.1") -> Metrics:
    """Poll /metrics until the model's engine holds no KV block and no request, and the
    model's series read the same on two scrapes in a row; returns the last scrape.

    The engine sets its gauges one at a time while the endpoint may be read, so one scrape
    can catch the update that empties the engine half done (e.g. KV blocks used 0, and the
    KV fraction, set later in the same update, still the busy value)."""
    last: dict = {}
    previous: list = []

    def idle():
        m = scrape(metrics_port, host)
        last.update(engine_state(m, model))
        if any(last.values()):
            previous.clear()
            return None
        series = sorted((n, sorted(ls.items()), repr(v)) for n, ls, v in m.samples if ls.get("model") == model)
        if previous and previous[0] == series:
            return m
        previous[:] = [series]
        return None

    try:
        return wait_until(idle, timeout, 0.2, "idle engine")
    except AssertionError:
        raise AssertionError(f"model {model} not idle after {timeout:.0f}s: {last}") from None


def greedy_tokens_and_texts(grpc_url: str, model: str, prompts: list[str], max_tokens: int,
                            timeout_s: float = 300) -> list[tuple[list[int], str]]:
    """Every prompt at once, one gRPC stream each, greedy with EOS ignored: each request's
    sampled token ids (from its logprobs) and text, from its one (non-streamed) response."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as grpcclient

    from client.triton import make_inputs, stream_generate, text_of

    sampling = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}

    def ask(i: int) -> tuple[list[int], str]:
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            inputs = make_inputs(prompts[i], sampling, stream=False, returns=("return_logprobs",))
            responses = list(stream_generate(client, model, inputs, request_id=str(i), timeout_s=timeout_s))
        finally:
            client.close()
        assert len(responses) == 1
        entries = json.loads(responses[0].as_numpy("logprobs").reshape(-1)[0])
        return [int(next(iter(entry))) for entry in entries], text_of(responses[0])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, range(len(prompts))))
