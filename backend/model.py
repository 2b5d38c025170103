"""The Triton adapter: a decoupled Python-based backend around the inflight engine.

This is the only module that imports ``triton_python_backend_utils``; everything below
it is plain Python + torch. Triton calls:

- ``initialize``: parse ``config.pbtxt`` parameters into ``EngineConfig``, load the
  engine, start its loop thread and the response thread.
- ``execute``: for each request decode the input tensors (``backend/protocol.py``,
  which also says what each response carries), map them onto the request's checks
  (``backend/validation.py`` checks every value; this module only refuses requests while
  the model is unhealthy or shutting down), submit it to the engine loop, return at once. A bad request gets one final error response
  (INVALID_ARG naming the input) and the others go on.
- ``finalize``: stop the loop (every live request gets its final response), then the
  response thread once everything queued has been sent.

Threads: the engine loop calls ``on_output`` once per step per request; that only
queues the output. The response thread builds the Triton responses, sends them (after a
stream's first text, one per `stream_interval` tokens; the outputs of a stream that queued up
while sends fell behind go as one, `merge_queued_responses`), polls
cancellation (``response_sender.is_cancelled()`` is an IPC round trip, so the engine
reads a cached flag instead) and applies the metric updates the loop queues, all in queue
order: a step's tokens, its metric updates, then its final responses (so a client that has
its final response finds its last step on /metrics), one thread making every IPC call to
Triton while requests are served.
With the loop thread updating metrics while the response thread sent responses,
tritonserver 2.51 sometimes kept the model loaded after a load at a low request rate
(W3 at 0.5 req/s, then Ctrl-C: 10 of 16 shutdowns waited out the exit timeout and
exited 1); with the updates off or on the response thread, none of 11 did. The
readiness thread notices an unload or a server shutdown while requests are live and
aborts them, so each still gets its final response; with ENABLE_VLLM_HEALTH_CHECK it also
asks the engine loop whether it still serves (`EngineLoop.health`). Where the engine loop's
OpenMP threads are pinned (`omp_threads_bind`), every other thread of the stub is kept off
the engine thread's CPU (backend/thread_binding.py).
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
import gc
import itertools
import json
import os
import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import thread_binding
from backend.cancel_flag import CANCEL_FLAG_TENSOR, cancel_flag_path
from backend.protocol import (
    ERROR_TENSOR,
    INPUTS,
    NUM_INPUT_TOKENS,
    OUTPUTS,
    TRANSFER_TENSOR,
    BadRequest,
    ResponseEncoder,
    error_output,
    parse_request,
)
from backend.readiness import HttpReadinessProbe, model_ready
from backend.request import RequestStatus
from backend.response_queue import EngineOutput, FailLive, LiveRequest, MetricUpdates, StopResponses

if TYPE_CHECKING:
    from backend.output import RequestOutput

# How often each live request is asked whether it was cancelled, streaming or not. Each ask
# is an IPC round trip through the stub's queue to a tritonserver thread; asked after every
# response, a stream paid two round trips a token instead of one, which on 2 busy cores cost
# the engine CPU it needed (the response thread's send already waits ~0.6 ms a token for
# tritonserver at 32 streams). A request in prefill is asked more often: it sends nothing
# until its first token, and a prefill can end well within 0.25 s, after which a request
# whose client is gone would generate tokens.
CANCEL_POLL_INTERVAL_S = 0.25
PREFILL_CANCEL_POLL_INTERVAL_S = 0.01
# How often, while requests are live, the model checks that Triton still has it READY
# (backend/readiness.py). Triton's shutdown stops the model and then waits for every
# decoupled request to send its final response (a live response sender keeps the model
# loaded, so `finalize` never comes): on that signal the live requests are ended at once.
READINESS_POLL_INTERVAL_S = 0.5
# For this long after load the endpoint is asked at this pace until it has said READY
# (`_watch_readiness`); an endpoint that never does (a restricted health API) is then asked
# at the usual pace.
READINESS_LEARN_S = 30.0
READINESS_LEARN_INTERVAL_S = 0.05
SHUTDOWN_TIMEOUT_S = 10.0
# Most queued items the response thread takes in one pass (it merges a stream's outputs
# only within a pass): a bound on how long a pass keeps anything waiting.
MAX_ITEMS_PER_PASS = 4096
# Triton's vLLM backend's words for a request to, or in, an unhealthy engine (ENABLE_VLLM_HEALTH_CHECK).
UNHEALTHY_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"


def _error_code(name: str) -> Any:
    return getattr(pb_utils.TritonError, name, pb_utils.TritonError.INTERNAL)


def _input_reader(request):
    """`get_input` of protocol.parse_request for one Triton request."""
    def get_input(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()
    return get_input


def _cancel_flag(request) -> str | None:
    """The file of the request's `cancel_flag` input (backend/cancel_flag.py), if it has one."""
    name = _input_reader(request)(CANCEL_FLAG_TENSOR)
    if name is None:
        return None
    name = name.reshape(-1)[0]
    return cancel_flag_path(name.decode(errors="replace") if isinstance(name, bytes) else str(name))


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """A config.pbtxt with only `backend: "inflight"` gets the full interface."""
        config = auto_complete_model_config.as_dict()
        have_inputs = {i["name"] for i in config.get("input", [])}
        have_outputs = {o["name"] for o in config.get("output", [])}
        for spec in INPUTS.values():
            if spec.name not in have_inputs:
                auto_complete_model_config.add_input(spec.config())
        for spec in OUTPUTS.values():
            if spec.name not in have_outputs:
                auto_complete_model_config.add_output(spec.config())
        role = config.get("parameters", {}).get("role", {}).get("string_value", "both")
        transfer = {"name": TRANSFER_TENSOR, "data_type": "TYPE_STRING", "dims": [1]}
        if role == "prefill" and TRANSFER_TENSOR not in have_outputs:
            auto_complete_model_config.add_output(transfer)
        if role == "decode" and TRANSFER_TENSOR not in have_inputs:
            auto_complete_model_config.add_input({**transfer, "optional": True})
        if role == "decode" and ERROR_TENSOR not in have_outputs:
            auto_complete_model_config.add_output({"name": ERROR_TENSOR, "data_type": "TYPE_STRING", "dims": [1]})
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

        from backend.config import EngineConfig, ServingOptions
        from backend.engine import LLMEngine
        from backend.engine_loop import EngineLoop

        try:
            config = EngineConfig.from_parameters(params, model_dir)
            self.options = ServingOptions.from_parameters(params)
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
        if self.loop.binding is not None:
            moved = thread_binding.keep_other_threads_off_the_engine_cpu(self.loop.binding)
            self.logger.log_info(f"[inflight] OpenMP threads {self.loop.binding.thread_ids} on CPUs "
                                 f"{self.loop.binding.cpus}; {len(moved)} other thread(s) kept off CPU "
                                 f"{self.loop.binding.engine_cpu}")
        self._engine_metrics = self._metrics(args) if self.options.report_custom_metrics else None
        self.loop.observer = self._engine_metrics
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
        self._live: dict[str, LiveRequest] = {}
        self._live_lock = threading.Lock()
        self._shutting_down = False
        # Why the engine is unhealthy, once the health check has found it so (for good).
        self._unhealthy: str | None = None
        self._stopped = threading.Event()
        self._outputs_delivered = 0
        # Test-only fault injection: the response loop raises once, right after delivering
        # this many engine outputs (0: never).
        self._fail_response_loop_at = int(os.environ.get("INFLIGHT_FAULT_RESPONSE_LOOP_AT", "0") or 0)
        # Test-only: a tritonserver that takes this long to accept each response.
        self._send_delay_s = float(os.environ.get("INFLIGHT_FAULT_SEND_DELAY_S", "0") or 0)
        self._response_thread = threading.Thread(
            target=self._response_loop, name="inflight-responses", daemon=True
        )
        self._response_thread.start()
        # Its own thread: a probe waits on the server and must never hold up responses.
        self._readiness_thread = threading.Thread(
            target=self._watch_readiness, name="inflight-readiness", daemon=True
        )
        self._readiness_thread.start()
        # What initialize built (torch, transformers, the tokenizer, the engine) lives as long
        # as the stub: out of the collector's sight, its full collections no longer walk those
        # millions of objects while requests stream, and the stub's exit no longer spends
        # seconds collecting them (4 s of a model unload on a 2-core EPYC).
        gc.collect()
        gc.freeze()

    def _metrics(self, args: dict[str, str]):
        """Engine metrics on Triton's /metrics (None when the server runs without metrics)."""
        from backend.metrics import EngineMetrics

        # One engine per instance: an instance label keeps two instances' series apart.
        labels = {"model": self.model_name, "version": str(args.get("model_version", "1")),
                  "instance": args.get("model_instance_name", "")}
        try:
            self._engine_metrics = EngineMetrics(pb_utils, labels, self.loop.engine,
                                                 publish=lambda updates: self._queue.put(MetricUpdates(updates)))
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
            # A hung engine never comes round to stop: its live requests are answered below.
            self.loop.shutdown(0.0 if self._unhealthy else SHUTDOWN_TIMEOUT_S)
        except Exception:  # still answer every live request below
            self.logger.log_error(f"[inflight] engine shutdown failed: {traceback.format_exc()}")
        self._queue.put(StopResponses())
        self._response_thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._readiness_thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        # Whatever the engine did not finish still gets its one final response.
        with self._live_lock:
            leftovers = list(self._live.values())
            self._live.clear()
        for live in leftovers:
            self._send_error(live.sender, "the model is shutting down", "UNAVAILABLE", live.error_as_output)
        # Released only here: the loop, stopped above, is what updates them.
        self.loop.observer = None
        if self._engine_metrics is not None:
            self._engine_metrics.close()
            self._engine_metrics = None

    # ------------------------------------------------------------------ requests

    def execute(self, requests):
        from backend.request import RequestError
        from backend.validation import parse_sampling_params

        for request in requests:
            sender = request.get_response_sender()
            try:
                if self._unhealthy:
                    raise RequestError(RequestError.UNAVAILABLE, UNHEALTHY_MESSAGE)
                if self._shutting_down:
                    raise RequestError("UNAVAILABLE", "the model is shutting down")
                parsed = parse_request(_input_reader(request), request.parameters(),
                                       request.requested_output_names())
                params = parse_sampling_params(parsed.sampling, stream=parsed.stream)
                cancel_flag = _cancel_flag(request)
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

            # Role decode: a request handed over by a prefill model, or one that never was (a
            # router's plain request, or one whose first token ended it on the prefill side),
            # served whole, as a vLLM decode instance serves a request without kv_transfer_params.
            transfer = None
            if self.loop.engine.config.role == "decode":
                transfer = _input_reader(request)(TRANSFER_TENSOR)
                if transfer is not None:
                    transfer = transfer.reshape(-1)[0]
                    transfer = transfer.decode() if isinstance(transfer, bytes) else str(transfer)
            request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
            # Only a response after the first can be lost (backend/protocol.py ERROR_TENSOR), so
            # an error answered before the request is live goes as an error.
            error_as_output = cancel_flag is not None and ERROR_TENSOR in (request.requested_output_names() or ())
            stream_interval = max(self.options.stream_interval, params.stream_interval or 1)
            live = LiveRequest(request_id, sender, ResponseEncoder(parsed, stream_interval), cancel_flag=cancel_flag,
                               error_as_output=error_as_output)
            with self._live_lock:
                self._live[request_id] = live
            try:
                if transfer is not None:
                    self.loop.submit_transfer(request_id, transfer, parsed.prompt,
                                              on_output=lambda output, live=live: self._queue.put(EngineOutput(live, output)),
                                              is_cancelled=lambda live=live: live.cancelled,
                                              params=params)
                else:
                    live.request = self.loop.submit(
                        request_id,
                        parsed.prompt,
                        params,
                        on_output=lambda output, live=live: self._queue.put(EngineOutput(live, output)),
                        is_cancelled=lambda live=live: live.cancelled,
                        needs_logprobs=parsed.needs_logprobs,
                        trace=parsed.trace,
                    )
            except RequestError as exc:
                self._forget(request_id)
                self._send_error(sender, str(exc), exc.code)
            except Exception as exc:
                self._forget(request_id)
                self.logger.log_error(f"[inflight] submit failed: {traceback.format_exc()}")
                self._send_error(sender, f"internal error: {exc}", "INTERNAL")
            if self._unhealthy:  # found so while this request was being added: the engine will not end it
                self._queue.put(FailLive(UNHEALTHY_MESSAGE, "UNAVAILABLE"))
            elif self._shutting_down:
                # The unload's sweep (_check_still_loaded) sets the flag, then aborts what is live:
                # a request it missed, or whose abort reached the loop before its submit, is ended
                # here, its abort now queued behind its submit.
                self.loop.abort(request_id)
        return None

    def _forget(self, request_id: str) -> None:
        with self._live_lock:
            self._live.pop(request_id, None)

    # ------------------------------------------------------------------ responses

    def _send_error(self, sender, message: str, code: str, as_output: bool = False) -> None:
        """The request's final response: the error `code` (a pb_utils.TritonError name) with
        `message`; with `as_output` (its request asked for ERROR_TENSOR), an ordinary response
        that carries them in that output."""
        try:
            if as_output:
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(ERROR_TENSOR, error_output(message, code))])
            else:
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
                items = [self._queue.get(timeout=PREFILL_CANCEL_POLL_INTERVAL_S if self._live else CANCEL_POLL_INTERVAL_S)]
            except queue.Empty:
                items = []  # nothing came: only the cancellation sweep below
            items.extend(self._queued_now())
            # A stream whose outputs queued up behind each other gets one response for all of
            # them (merge_queued_responses): a send is a round trip to tritonserver, and when
            # sends fall behind the engine, one per token falls further behind every step. Its
            # first text still goes alone, so that a stream is never one final response.
            merge = self.options.merge_queued_responses
            last_output_of = {id(item.live): i for i, item in enumerate(items) if isinstance(item, EngineOutput)}
            for i, item in enumerate(items or [None]):  # None: only the sweep
                if isinstance(item, StopResponses):
                    return
                try:
                    match item:
                        case EngineOutput(live, output):
                            self._on_engine_output(live, output, respond=not merge or not live.streaming
                                          or last_output_of[id(live)] == i)
                            self._outputs_delivered += 1
                            if self._outputs_delivered == self._fail_response_loop_at:
                                raise RuntimeError("injected fault (INFLIGHT_FAULT_RESPONSE_LOOP_AT)")
                        case MetricUpdates(updates):
                            self._apply_metric_updates(updates)
                        case FailLive(message, code):
                            self._fail_live(message, code)
                    now = time.monotonic()
                    if now - last_sweep >= PREFILL_CANCEL_POLL_INTERVAL_S:
                        last_sweep = now
                        self._poll_cancellation(now)
                except Exception:
                    # Every live request's responses go through this thread: were it to end here,
                    # they would all wait forever, with no error anywhere.
                    self.logger.log_error(f"[inflight] response loop: {traceback.format_exc()}")

    def _queued_now(self) -> list:
        items = []
        while len(items) < MAX_ITEMS_PER_PASS:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _fail_live(self, message: str, code: str) -> None:
        with self._live_lock:
            lives = list(self._live.values())
            self._live.clear()
        for live in lives:
            live.ended = True
            self._send_error(live.sender, message, code, live.error_as_output)

    def _on_engine_output(self, live: LiveRequest, output: RequestOutput, respond: bool = True) -> None:
        """Sends the response `output` calls for, or (respond False, a later output of the same
        stream is queued) keeps what it adds for that output's response."""
        if live.ended:  # already answered (the health check failed it)
            return
        try:
            if respond or output.finished:
                self._respond(live, output)
            else:
                live.encoder.absorb(output)
        except Exception:
            self.logger.log_error(f"[inflight] sending a response failed: {traceback.format_exc()}")
            if output.transfer is not None:  # nobody will hear of it: let it go now, not at its expiry
                from backend.disagg import discard_transfer

                discard_transfer(output.transfer)
            if output.finished:
                self._forget(live.request_id)
            else:
                live.cancelled = True  # its client is unreachable: the engine drops it

    def _apply_metric_updates(self, updates) -> None:
        from backend.metrics import apply

        try:
            apply(updates)
        except Exception:  # a metric must never stop the responses
            self.logger.log_error(f"[inflight] metric update failed: {traceback.format_exc()}")

    def _watch_readiness(self) -> None:
        probe = self._http_readiness
        # Until the endpoint has said READY, it is asked whether requests are live or not, and
        # often at first: only an endpoint that has said so is believed when it refuses ("the
        # server is stopping"), and without that the check falls back to is_model_ready, the
        # call that crashes the stub during shutdown (backend/readiness.py). A SIGTERM may come
        # before any poll has found a request live.
        learn_until = time.monotonic() + READINESS_LEARN_S
        while not self._stopped.wait(READINESS_LEARN_INTERVAL_S if probe is not None and not probe.seen_ready
                                     and time.monotonic() < learn_until else READINESS_POLL_INTERVAL_S):
            if self.options.enable_health_check and not self._unhealthy and not self._shutting_down:
                self._check_health()
            try:
                if self._live and not self._shutting_down:
                    self._check_still_loaded()
                elif probe is not None and not probe.seen_ready:
                    probe()
            except Exception:  # keep watching
                self.logger.log_error(f"[inflight] readiness check failed: {traceback.format_exc()}")

    def _check_health(self) -> None:
        """ENABLE_VLLM_HEALTH_CHECK: once the engine loop is dead, hung or without its device,
        answer every live and later request with the vLLM backend's error, and stop being ready."""
        reason = self.loop.health(self.options.health_check_stall_s)
        if reason is None:
            return
        self._unhealthy = reason
        self.logger.log_error(f"[inflight] engine is not healthy and the model will be unloaded: {reason}")
        self._queue.put(FailLive(UNHEALTHY_MESSAGE, "UNAVAILABLE"))
        self._report_not_ready()

    def _report_not_ready(self) -> None:
        """As Triton's vLLM backend does: ask Triton to unload the model (it does not wait),
        which turns its readiness false. Triton allows that only with
        --model-control-mode=explicit; otherwise the model stays READY and each request is
        refused with UNHEALTHY_MESSAGE."""
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:
            self.logger.log_error(
                f"[inflight] could not unload model '{self.model_name}' ({exc}); it stays loaded and refuses "
                "every request (readiness turns false only with --model-control-mode=explicit)")

    def _check_still_loaded(self) -> None:
        """End every live request once Triton unloads the model (server shutdown)."""
        if model_ready(self._http_readiness, getattr(pb_utils, "is_model_ready", None),
                       self.model_name, self.model_version) is not False:
            return
        self._shutting_down = True
        with self._live_lock:
            request_ids = list(self._live)
        self.logger.log_info(f"[inflight] model is being unloaded: ending {len(request_ids)} live request(s)")
        for request_id in request_ids:
            self.loop.abort(request_id)

    def _poll_cancellation(self, now: float) -> None:
        def due(live: LiveRequest) -> bool:
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
                live.cancelled = bool(live.sender.is_cancelled()) or (
                    live.cancel_flag is not None and os.path.exists(live.cancel_flag))
            except Exception:
                pass

    def _respond(self, live: LiveRequest, output: RequestOutput) -> None:
        if output.finished:
            self._forget(live.request_id)
            live.ended = True
            if output.error is not None:
                self._send_error(live.sender, str(output.error), getattr(output.error, "code", "INTERNAL"),
                                 live.error_as_output)
                return
            if output.finish_reason == "abort" and live.cancelled:
                self.logger.log_verbose(f"[inflight] request {live.request_id} cancelled by the client")
                self._send_error(live.sender, "request was cancelled", "CANCELLED", live.error_as_output)
                return
            if output.transfer is not None:  # role prefill: the decode model generates the rest
                tensors = [pb_utils.Tensor(TRANSFER_TENSOR, np.array([output.transfer.encode()], dtype=np.object_))]
                if NUM_INPUT_TOKENS in live.encoder.request.outputs:
                    # The prompt's tokens were computed here: a router's usage takes them from this half.
                    tensors.append(pb_utils.Tensor(NUM_INPUT_TOKENS,
                                                   np.array([output.num_prompt_tokens], dtype=np.uint32)))
                live.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
        arrays = live.encoder.encode(output)
        if arrays is None:
            return
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items()]
        )
        if self._send_delay_s:
            time.sleep(self._send_delay_s)
        if output.finished:
            live.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        live.sender.send(response, flags=0)
        live.streaming = True
