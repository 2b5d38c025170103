"""The Triton adapter: a decoupled Python-based backend around the inflight engine.

This is the only module that imports ``triton_python_backend_utils``; everything below
it is plain Python + torch. Triton calls:

- ``initialize``: parse ``config.pbtxt`` parameters into ``EngineConfig``, load the
  engine, start its loop thread and the response thread.
- ``execute``: for each request read and validate the inputs, hand the request to the
  engine loop, return at once. A bad request gets one final error response
  (INVALID_ARG naming the input) and the others go on.
- ``finalize``: stop the loop (every live request gets its final response), then the
  response thread once everything queued has been sent.

Threads: the engine loop calls ``on_output`` once per step per request; that only
queues the output. The response thread builds the Triton responses, sends them, polls
cancellation (``response_sender.is_cancelled()`` is an IPC round trip, so the engine
reads a cached flag instead) and applies the metric updates the loop queues beside the
outputs, so that one thread makes the IPC calls to Triton while requests are served.
With the loop thread updating metrics while the response thread sent responses,
tritonserver 2.51 sometimes kept the model loaded after a load at a low request rate
(W3 at 0.5 req/s, then Ctrl-C: 10 of 16 shutdowns waited out the exit timeout and
exited 1); with the updates off or on the response thread, none of 11 did. The
readiness thread notices an unload or a server shutdown while requests are live and
aborts them, so each still gets its final response.

Responses: ``stream`` true sends one response per new piece of text, and the last
response (which may carry an empty string) has the final flag. ``stream`` false sends
exactly one final response with the whole text, so HTTP ``/generate`` works; unless
``exclude_input_in_output`` is true the prompt is prepended to it (like Triton's vLLM
backend).

Every response carries every output its request asks for: Triton's requested outputs,
which are all six declared outputs unless the client names some. perf_analyzer 2.51
names all six, and for an output a response lacks it exports whatever bytes its empty
buffer points at: a float among them that reads as NaN stops its JSON writer before the
first flush and leaves genai-perf a zero-length profile export. The `return_*` inputs of
Triton's vLLM backend are accepted and validated but add nothing: an output a client
names or leaves to the default is already there (and Triton drops the ones it did not ask
for).
"""

from __future__ import annotations

import locale

# The stub's Python starts in the C locale: make text I/O UTF-8 before torch and
# transformers are imported.
try:
    locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
except locale.Error:  # pragma: no cover - every glibc system has C.UTF-8
    pass

import faulthandler
import itertools
import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.readiness import HttpReadinessProbe
from backend.request import RETURN_FLAGS, RequestStatus

# Request-level switches (inputs of the model, BOOL[1]). When a client sends no
# `sampling_parameters` input, they may also arrive among the request's parameters
# (HTTP generate's "parameters": {...}), like Triton's vLLM backend accepts.
STREAM = "stream"
EXCLUDE_INPUT = "exclude_input_in_output"
REQUEST_SWITCHES = (STREAM, EXCLUDE_INPUT) + RETURN_FLAGS

INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
] + [{"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in RETURN_FLAGS]
OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
]
OUTPUT_NAMES = frozenset(spec["name"] for spec in OUTPUTS)

# How often live requests that sent nothing lately are asked whether they were cancelled
# (a streaming request is asked after each response it sends). A request in prefill is
# asked more often: it sends nothing until its first token, and a prefill can end well
# within 0.25 s, after which a request whose client is gone would generate tokens. Each ask
# is one IPC round trip (~50 us): ~0.5% of a core per request in prefill, of which there
# are few at a time.
CANCEL_POLL_INTERVAL_S = 0.25
PREFILL_CANCEL_POLL_INTERVAL_S = 0.01
# How often, while requests are live, the model checks that Triton still has it READY
# (backend/readiness.py). Triton's shutdown stops the model and then waits for every
# decoupled request to send its final response (a live response sender keeps the model
# loaded, so `finalize` never comes): on that signal the live requests are ended at once.
READINESS_POLL_INTERVAL_S = 0.5
SHUTDOWN_TIMEOUT_S = 10.0


class BadRequest(Exception):
    """A problem with one request's inputs: answered with INVALID_ARG."""


def _error_code(name: str) -> Any:
    return getattr(pb_utils.TritonError, name, pb_utils.TritonError.INTERNAL)


def _parse_bool(name: str, value: Any) -> bool:
    """A boolean from a tensor element or a JSON value; the string "false" is false."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off", ""):
            return False
    elif isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    raise BadRequest(f"{name} must be a boolean, got {value!r}")


def _single(request, name: str) -> Any | None:
    """The one element of an optional [1]-shaped input, or None when absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise BadRequest(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"{name} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise BadRequest(f"{name} must be a string, got {type(value).__name__}")


@dataclass
class ParsedRequest:
    prompt: str
    sampling: dict[str, Any]
    stream: bool
    prepend_prompt: bool
    # The declared outputs this request asks for (Triton fills in all of them when a
    # client names none); each response carries exactly these.
    outputs: frozenset[str]


def parse_request(request) -> ParsedRequest:
    """Read and validate one Triton request's inputs (sampling values checked later)."""
    raw_prompt = _single(request, "text_input")
    if raw_prompt is None:
        raise BadRequest("missing required input 'text_input' (STRING, shape [1]): the prompt to complete")
    prompt = _text("text_input", raw_prompt)
    if not prompt:
        raise BadRequest("input 'text_input' is empty: send a non-empty prompt")

    raw_params = _single(request, "sampling_parameters")
    from_request_parameters = raw_params is None
    if raw_params is None:
        raw_params = request.parameters() or "{}"
    params_text = _text("sampling_parameters", raw_params).strip() or "{}"
    try:
        sampling = json.loads(params_text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(sampling, dict):
        raise BadRequest(f"sampling_parameters must be a JSON object, got {type(sampling).__name__}")

    switches: dict[str, bool] = {}
    if from_request_parameters:
        # HTTP generate's "parameters": {...} carries switches and sampling values together.
        for name in REQUEST_SWITCHES:
            if name in sampling:
                switches[name] = _parse_bool(name, sampling.pop(name))
    for name in REQUEST_SWITCHES:
        value = _single(request, name)
        if value is not None:
            switches[name] = _parse_bool(name, value)

    stream = switches.get(STREAM, False)
    exclude = switches.get(EXCLUDE_INPUT, stream)
    if stream and not exclude:
        # As Triton's vLLM backend: streamed responses carry only new text, never the prompt.
        raise BadRequest(
            f"{EXCLUDE_INPUT} must be true when {STREAM} is true: streamed responses carry only the new text"
        )
    return ParsedRequest(
        prompt=prompt,
        sampling=sampling,
        stream=stream,
        prepend_prompt=not stream and not exclude,
        outputs=frozenset(request.requested_output_names()) & OUTPUT_NAMES,
    )


@dataclass(eq=False)
class _Live:
    """Response-side state of one request that has not had its final response yet."""

    request_id: str
    sender: Any
    parsed: ParsedRequest
    # The engine's Request (read-only here: its status and output tokens, set by the loop).
    request: Any = None
    cancelled: bool = False
    last_cancel_poll: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    pending_tokens: int = 0  # output tokens not yet reported (streaming skips empty deltas)
    pending_logprobs: list[dict] = field(default_factory=list)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """A config.pbtxt with only `backend: "inflight"` gets the full interface."""
        config = auto_complete_model_config.as_dict()
        have_inputs = {i["name"] for i in config.get("input", [])}
        have_outputs = {o["name"] for o in config.get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_inputs:
                auto_complete_model_config.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_outputs:
                auto_complete_model_config.add_output(spec)
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, args: dict[str, str]) -> None:
        # A crash of the stub otherwise leaves no trace in the server log, only a model
        # that never unloads.
        faulthandler.enable(all_threads=True)
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", self.model_config.get("name", "?"))
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                f"model '{self.model_name}': the inflight backend streams tokens and needs "
                "`model_transaction_policy { decoupled: true }` in config.pbtxt"
            )
        params = {
            name: value.get("string_value", "") if isinstance(value, dict) else str(value)
            for name, value in self.model_config.get("parameters", {}).items()
        }
        model_dir = f"{args['model_repository']}/{args['model_version']}"

        import torch  # after the locale fix above

        from backend.config import EngineConfig
        from backend.engine import LLMEngine
        from backend.engine_loop import EngineLoop

        try:
            config = EngineConfig.from_parameters(params, model_dir)
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"model '{self.model_name}': {exc}") from None

        def build_engine() -> LLMEngine:
            # On the engine's own thread (EngineLoop): CUDA's current device is per thread too.
            if args.get("model_instance_kind") == "GPU" and torch.cuda.is_available():
                torch.cuda.set_device(int(args.get("model_instance_device_id", "0")))
            return LLMEngine(config)

        # Before the metrics, which queue their updates here for the response thread.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        t0 = time.monotonic()
        self.loop = EngineLoop(build_engine)
        self.loop.observer = self._metrics(args)
        self.logger.log_info(
            f"[inflight] model '{self.model_name}' ready in {time.monotonic() - t0:.1f}s: {config}"
        )

        self.model_version = str(args.get("model_version", ""))
        self._http_readiness = HttpReadinessProbe.for_parent_server(self.model_name, self.model_version)
        self.logger.log_info(
            "[inflight] unload detection: "
            + (f"GET {self._http_readiness.url}" if self._http_readiness else "pb_utils.is_model_ready (no HTTP endpoint found)")
        )
        self._ids = itertools.count()
        self._live: dict[str, _Live] = {}
        self._live_lock = threading.Lock()
        self._shutting_down = False
        self._stopped = threading.Event()
        self._response_thread = threading.Thread(
            target=self._response_loop, name="inflight-responses", daemon=True
        )
        self._response_thread.start()
        # Its own thread: a probe waits on the server and must never hold up responses.
        self._readiness_thread = threading.Thread(
            target=self._watch_readiness, name="inflight-readiness", daemon=True
        )
        self._readiness_thread.start()

    def _metrics(self, args: dict[str, str]):
        """Engine metrics on Triton's /metrics (None when the server runs without metrics)."""
        from backend.metrics import EngineMetrics

        # One engine per instance: an instance label keeps two instances' series apart.
        labels = {"model": self.model_name, "version": str(args.get("model_version", "1")),
                  "instance": args.get("model_instance_name", "")}
        try:
            self._engine_metrics = EngineMetrics(pb_utils, labels, self.loop.engine, publish=self._queue.put)
        except pb_utils.TritonModelException as exc:
            self.logger.log_info(f"[inflight] metrics disabled: {exc}")
            self._engine_metrics = None
        return self._engine_metrics

    def finalize(self) -> None:
        if not hasattr(self, "_response_thread"):  # initialize failed half-way
            return
        self._shutting_down = True
        self._stopped.set()
        self.logger.log_info(f"[inflight] finalize: {len(self._live)} live request(s) will be ended")
        try:
            self.loop.shutdown(SHUTDOWN_TIMEOUT_S)
        except Exception:  # still answer every live request below
            self.logger.log_error(f"[inflight] engine shutdown failed: {traceback.format_exc()}")
        self._queue.put(None)
        self._response_thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._readiness_thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        # Whatever the engine did not finish still gets its one final response.
        with self._live_lock:
            leftovers = list(self._live.values())
            self._live.clear()
        for live in leftovers:
            self._send_error(live.sender, "the model is shutting down", "UNAVAILABLE")
        # Released only here: the loop, stopped above, is what updates them.
        self.loop.observer = None
        if self._engine_metrics is not None:
            self._engine_metrics.close()
            self._engine_metrics = None

    # ------------------------------------------------------------------ requests

    def execute(self, requests):
        from backend.request import RequestError, SamplingParams

        for request in requests:
            sender = request.get_response_sender()
            try:
                if self._shutting_down:
                    raise RequestError("UNAVAILABLE", "the model is shutting down")
                parsed = parse_request(request)
                params = SamplingParams.from_dict(parsed.sampling)
            except BadRequest as exc:
                self._send_error(sender, str(exc), "INVALID_ARG")
                continue
            except RequestError as exc:
                self._send_error(sender, str(exc), exc.code)
                continue
            except Exception as exc:  # one bad request must not fail the batch
                self.logger.log_error(f"[inflight] bad request: {traceback.format_exc()}")
                self._send_error(sender, f"could not read the request: {exc}", "INVALID_ARG")
                continue

            request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
            live = _Live(request_id, sender, parsed)
            with self._live_lock:
                self._live[request_id] = live
            try:
                live.request = self.loop.add_request(
                    request_id,
                    parsed.prompt,
                    params,
                    on_output=lambda output, live=live: self._queue.put((live, output)),
                    is_cancelled=lambda live=live: live.cancelled,
                    needs_logprobs="cumulative_logprob" in parsed.outputs,
                )
            except RequestError as exc:
                self._forget(request_id)
                self._send_error(sender, str(exc), exc.code)
            except Exception as exc:
                self._forget(request_id)
                self.logger.log_error(f"[inflight] add_request failed: {traceback.format_exc()}")
                self._send_error(sender, f"internal error: {exc}", "INTERNAL")
        return None

    def _forget(self, request_id: str) -> None:
        with self._live_lock:
            self._live.pop(request_id, None)

    # ------------------------------------------------------------------ responses

    def _send_error(self, sender, message: str, code: str) -> None:
        try:
            response = pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(message, _error_code(code))
            )
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client may be gone
            self.logger.log_warn(f"[inflight] could not send error response: {traceback.format_exc()}")

    def _response_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=PREFILL_CANCEL_POLL_INTERVAL_S if self._live else CANCEL_POLL_INTERVAL_S)
            except queue.Empty:
                item = False
            if item is None:
                return
            if isinstance(item, list):  # metric updates from the loop (EngineMetrics)
                self._apply_metric_updates(item)
            elif item:
                live, output = item
                try:
                    self._respond(live, output)
                except Exception:  # keep serving the other requests
                    self.logger.log_error(f"[inflight] sending a response failed: {traceback.format_exc()}")
                    if output.finished:
                        self._forget(live.request_id)
                    else:
                        live.cancelled = True  # its client is unreachable: the engine drops it
            now = time.monotonic()
            if now - last_sweep >= PREFILL_CANCEL_POLL_INTERVAL_S:
                last_sweep = now
                self._poll_cancellation(now)

    def _apply_metric_updates(self, updates) -> None:
        from backend.metrics import apply

        try:
            apply(updates)
        except Exception:  # a metric must never stop the responses
            self.logger.log_error(f"[inflight] metric update failed: {traceback.format_exc()}")

    def _watch_readiness(self) -> None:
        while not self._stopped.wait(READINESS_POLL_INTERVAL_S):
            if self._live and not self._shutting_down:
                try:
                    self._check_still_loaded()
                except Exception:  # keep watching
                    self.logger.log_error(f"[inflight] readiness check failed: {traceback.format_exc()}")

    def _is_model_ready(self) -> bool | None:
        """READY (True), unloading or server stopping (False), or no answer (None)."""
        if self._http_readiness is not None:
            ready = self._http_readiness()
            if ready is not None:
                return ready
        # See backend/readiness.py: this IPC can crash the stub once the server stops.
        is_model_ready = getattr(pb_utils, "is_model_ready", None)
        if is_model_ready is None:
            return None
        try:
            return bool(is_model_ready(model_name=self.model_name, model_version=self.model_version))
        except Exception as exc:
            # Once shutdown has begun Triton answers "Server not ready"; anything else is
            # an unanswerable question, not a shutdown.
            return False if "not ready" in str(exc).lower() else None

    def _check_still_loaded(self) -> None:
        """End every live request once Triton unloads the model (server shutdown)."""
        if self._is_model_ready() is not False:
            return
        self._shutting_down = True
        with self._live_lock:
            request_ids = list(self._live)
        self.logger.log_info(f"[inflight] model is being unloaded: ending {len(request_ids)} live request(s)")
        for request_id in request_ids:
            self.loop.abort(request_id)

    def _poll_cancellation(self, now: float) -> None:
        def due(live: _Live) -> bool:
            quiet = now - live.last_cancel_poll
            if quiet >= CANCEL_POLL_INTERVAL_S:
                return True
            request = live.request
            in_prefill = (request is not None and request.status is RequestStatus.RUNNING
                          and not request.output_token_ids)
            return in_prefill and quiet >= PREFILL_CANCEL_POLL_INTERVAL_S

        with self._live_lock:
            stale = [l for l in self._live.values() if not l.cancelled and due(l)]
        for live in stale:
            live.last_cancel_poll = now
            try:
                live.cancelled = bool(live.sender.is_cancelled())
            except Exception:
                pass

    def _respond(self, live: _Live, output) -> None:
        parsed = live.parsed
        live.pending_tokens += len(output.token_ids_delta)
        if output.logprobs_delta:
            live.pending_logprobs.extend(output.logprobs_delta)
        if not output.finished:
            if output.text_delta:
                live.text.append(output.text_delta)
            if not parsed.stream or not output.text_delta:
                return
            live.sender.send(self._response(live, output, output.text_delta), flags=0)
            live.last_cancel_poll = time.monotonic()
            live.cancelled = live.cancelled or bool(live.sender.is_cancelled())
            return

        self._forget(live.request_id)
        error = output.error
        if error is None and output.finish_reason == "abort" and live.cancelled:
            self.logger.log_verbose(f"[inflight] request {live.request_id} cancelled by the client")
            error_message, code = "request was cancelled", "CANCELLED"
        elif error is not None:
            error_message, code = str(error), getattr(error, "code", "INTERNAL")
        else:
            error_message = None
        if error_message is not None:
            self._send_error(live.sender, error_message, code)
            return
        if parsed.stream:
            text = output.text_delta
        else:
            live.text.append(output.text_delta)
            text = "".join(live.text)
            if parsed.prepend_prompt:
                text = (output.prompt_text or parsed.prompt) + text
        live.sender.send(
            self._response(live, output, text), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _response(self, live: _Live, output, text: str):
        outputs = live.parsed.outputs
        tensors = []
        if "text_output" in outputs:
            tensors.append(pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)))
        if "finish_reason" in outputs:
            reason = str(output.finish_reason) if output.finished else "None"
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
        if "cumulative_logprob" in outputs:
            # Never None here: asking for this output makes the engine compute every token's
            # logprob (needs_logprobs), and a NaN stand-in would break perf_analyzer's export.
            value = float(output.cumulative_logprob)
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([value], dtype=np.float32)))
        if "logprobs" in outputs:
            # vLLM's JSON: per token {token id: {"logprob", "rank", "decoded_token"}}; null
            # unless sampling_parameters asked for "logprobs".
            entries = live.pending_logprobs or None
            tensors.append(pb_utils.Tensor("logprobs", np.array([json.dumps(entries).encode()], dtype=np.object_)))
        if "num_input_tokens" in outputs:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([output.num_prompt_tokens], dtype=np.uint32)))
        if "num_output_tokens" in outputs:
            count = live.pending_tokens if live.parsed.stream else output.num_output_tokens
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([count], dtype=np.uint32)))
        live.pending_tokens = 0
        live.pending_logprobs = []
        return pb_utils.InferenceResponse(output_tensors=tensors)
