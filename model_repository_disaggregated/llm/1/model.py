"""The entry model of disaggregated serving: an ordinary BLS model (Triton's Python
backend, decoupled) in front of a role-prefill and a role-decode inflight model.

Each request goes to the prefill model with the client's own inputs. Its one response is
either the handle of the request's KV transfer (the `transfer` output: the prefill engine
ran the prompt and the first token and exported the request, backend/disagg.py) or, when
the first token already ended the request, or it failed, the request's whole answer. A
handle goes, with the client's inputs, to the decode model, which imports the request and
streams every token from the first, as the `llm` model of model_repository/ would; its
responses are the client's. Each response is passed on once the next has arrived, so the
final flag rides on the last response that carries data, and the client gets exactly one
final response whatever happens on the way. llm_decode's errors come in its `error` output
(backend/protocol.py ERROR_TENSOR says why), and go on to the client as errors.

A client that cancels its stream (or whose connection goes) cancels the request at the
model it waits on: tritonserver 2.51's Python backend cannot cancel a BLS request, so each
request sent carries a cancel flag (backend/cancel_flag.py) that this model raises once its
own request reads cancelled; the engine model then aborts it, frees its blocks and answers
one CANCELLED error, which this model drains. A transfer the prefill model exported before
it saw the flag is let go at once (`discard_transfer`: its segment unlinked, or its TCP
holder told to drop it), never sent to the decode model. The client's request ends with one
CANCELLED error.

A stub process that dies leaves its requests unanswered (tritonserver 2.51 neither ends
them nor marks the model not ready), so while a request waits on llm_prefill or llm_decode
this model watches the processes serving that model: when one dies, the request ends with
one UNAVAILABLE error naming the model and the process. With more than one prefill model
(`prefill_model`: a comma-separated list), requests take them in turn, skipping one whose
process is dead, and a request whose prefill model's process dies before it answered is sent
once more, to another prefill model whose processes live; without one, it ends with that
error. A transfer the dead prefill process had exported but not yet answered with expires
and is swept (backend/disagg.py); one a dead decode process had claimed went with it.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.cancel_flag import CANCEL_FLAG_TENSOR, lower_cancel_flag, new_cancel_flag, raise_cancel_flag
from backend.protocol import ERROR_TENSOR, TRANSFER_TENSOR, read_error_output

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often a request waiting on a model asks whether the model's processes still live.
LIVENESS_POLL_S = 0.5
# How often a request asks Triton whether its client cancelled it (an IPC round trip).
CANCEL_POLL_S = 0.1
# How long a cancelled request waits for the engine model to end it before giving up on it.
CANCEL_DRAIN_S = 30.0
_END = object()


class ModelProcessDied(Exception):
    """A process serving the model a request waits on has died: no answer will come."""

    def __init__(self, model: str, message: str):
        super().__init__(message)
        self.model = model


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the disaggregated `llm` model streams and needs "
                                                "`model_transaction_policy { decoupled: true }`")
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.prefill_models = [m.strip() for m in parameters.get("prefill_model", "llm_prefill").split(",") if m.strip()]
        if not self.prefill_models:
            raise pb_utils.TritonModelException("prefill_model: names no model (expected one or more model names, "
                                                "comma-separated)")
        self._turn = itertools.count()
        self.decode_model = parameters.get("decode_model", "llm_decode")
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]
        self.logger = pb_utils.Logger
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def execute(self, requests):
        # Decoupled: each request is served on a thread of its own and execute returns at once,
        # so that many requests are in flight in the engines together.
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def finalize(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)

    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        relay = _Relay(sender)
        cancel = _Cancel(request, relay)
        try:
            inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.input_names) if t is not None]
            inputs.append(pb_utils.Tensor(CANCEL_FLAG_TENSOR, np.array([cancel.flag.encode()], dtype=np.object_)))
            requested = sorted(request.requested_output_names() or self.output_names)
            transfer = None
            prefill_model, retried = self._prefill_model(), False
            while True:
                answered = False
                try:
                    for response in self._exec(prefill_model, inputs, [*requested, TRANSFER_TENSOR], cancel):
                        answered = True
                        handle = pb_utils.get_output_tensor_by_name(response, TRANSFER_TENSOR)
                        if handle is not None and not response.has_error():
                            transfer = handle.as_numpy().reshape(-1)[0]
                        else:  # the request ended on the prefill model: its answer is the client's
                            cancel.relay(response)
                    break
                except ModelProcessDied as exc:
                    retry = None if answered or retried or cancel.raised else self._prefill_model(exclude=prefill_model)
                    if retry is None:
                        raise
                    self.logger.log_warn(f"[disaggregated llm] {exc.model}: its process died while serving a "
                                         f"request; sending it to {retry} instead")
                    prefill_model, retried = retry, True
            if transfer is not None:
                imported = False
                try:
                    if not cancel.poll():
                        handle = np.array([transfer], dtype=np.object_)
                        for response in self._exec(self.decode_model,
                                                   [*inputs, pb_utils.Tensor(TRANSFER_TENSOR, handle)],
                                                   [*requested, ERROR_TENSOR], cancel):
                            imported = imported or _error(response) is None
                            cancel.relay(response)
                finally:
                    if not imported:  # maybe never claimed: this model lets it go, not its expiry
                        _discard(transfer)
        except ModelProcessDied as exc:
            self.logger.log_error(f"[disaggregated llm] {exc}")
            relay.fail(str(exc), pb_utils.TritonError.UNAVAILABLE)
            return
        except Exception as exc:
            self.logger.log_error(f"[disaggregated llm] {traceback.format_exc()}")
            relay.fail(f"internal error in the disaggregated `llm` model: {exc}")
            return
        finally:
            cancel.close()
            with self._lock:
                self._threads.discard(threading.current_thread())
        try:
            if cancel.raised:
                relay.fail("request was cancelled", pb_utils.TritonError.CANCELLED)
            else:
                relay.close()
        except Exception as exc:  # its client is gone
            self.logger.log_warn(f"[disaggregated llm] could not send a request's final response: {exc}")

    def _prefill_model(self, exclude: str | None = None) -> str | None:
        """The prefill model the next request goes to: the models take turns, skipping any
        whose process is dead (or, when none lives, the next in turn, which answers with its
        own error). With `exclude` (a retry): another one whose processes all live, or None."""
        models = [m for m in self.prefill_models if m != exclude]
        if len(models) > 1 or exclude is not None:
            alive = [m for m in models if _processes_live(m)]
            if alive or exclude is not None:
                models = alive
        return models[next(self._turn) % len(models)] if models else None

    def _exec(self, model: str, inputs, requested: list[str], cancel: _Cancel):
        """The responses of `model` to one request, as they come (empty ones skipped); raises
        ModelProcessDied when a process serving `model` dies before the last one. The
        responses are read on a thread of their own, so that this one can watch meanwhile.
        Once `cancel` is raised, the model has CANCEL_DRAIN_S to end the request."""
        stubs = _stub_pids(model)
        bls = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=requested)
        responses: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                for response in bls.exec(decoupled=True):
                    responses.put(response)
            except Exception as exc:  # raised on the serving thread
                responses.put(exc)
            responses.put(_END)

        threading.Thread(target=read, name=f"bls-{model}", daemon=True).start()
        next_liveness = time.monotonic() + LIVENESS_POLL_S
        drain_until = None
        while True:
            try:
                item = responses.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if cancel.poll() and drain_until is None:
                drain_until = now + CANCEL_DRAIN_S
            if item is None:
                if now >= next_liveness:
                    next_liveness = now + LIVENESS_POLL_S
                    dead = [pid for pid in stubs if not _alive(pid)]
                    if dead:  # the reader thread stays blocked on the dead stub: nothing will wake it
                        raise ModelProcessDied(model, f"{model}: its process (pid {dead[0]}) died while serving "
                                               "this request; the request is lost, retry it") from None
                if drain_until is not None and now > drain_until:
                    self.logger.log_error(f"[disaggregated llm] {model} did not end a cancelled request within "
                                          f"{CANCEL_DRAIN_S:g}s; no longer waiting for it")
                    return
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            if item.has_error() or item.output_tensors():
                yield item


def _stub_pids(model: str) -> list[int]:
    """The Python backend stubs serving `model`'s instances: tritonserver's (this stub's
    parent's) children whose command line names an instance of it (`<model>_<group>_<index>`)."""
    instance = re.compile(rf"{re.escape(model)}_\d+_\d+".encode())
    parent = str(os.getppid())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[1].decode() != parent:
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if b"stub" in args[0] and any(instance.fullmatch(arg) for arg in args):
            pids.append(int(entry))
    return pids


def _processes_live(model: str) -> bool:
    """`model` has stub processes, and none is dead."""
    pids = _stub_pids(model)
    return bool(pids) and all(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Alive, not a zombie waiting for tritonserver to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _error(response):
    """The error `response` ends its request with: its own, or the one llm_decode sends in
    its ERROR_TENSOR output (backend/protocol.py says why); None for a response with data."""
    if response.has_error():
        return response.error()
    tensor = pb_utils.get_output_tensor_by_name(response, ERROR_TENSOR)
    if tensor is None:
        return None
    code, message = read_error_output(tensor.as_numpy())
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))


def _discard(transfer) -> None:
    from backend.disagg import discard_transfer

    discard_transfer(transfer.decode() if isinstance(transfer, bytes) else str(transfer))


class _Cancel:
    """Whether the client cancelled the request, and its cancel flag (backend/cancel_flag.py),
    raised once it has: the engine model holding the request then ends it."""

    def __init__(self, request, relay: _Relay):
        self.request = request
        self.relay_to = relay
        self.flag = new_cancel_flag()
        self.raised = False
        self._next_poll = 0.0

    def poll(self) -> bool:
        """Cancelled? Triton is asked at most every CANCEL_POLL_S, and never once the client's
        final response is sent: Triton frees the request's response factory with it, and asking
        then reads freed memory (tritonserver 2.51 dies of a SIGSEGV in
        TRITONBACKEND_ResponseFactoryIsCancelled)."""
        now = time.monotonic()
        if not self.raised and not self.relay_to.ended and now >= self._next_poll:
            self._next_poll = now + CANCEL_POLL_S
            try:
                cancelled = bool(self.request.is_cancelled())
            except Exception:  # a request Triton no longer knows: its client is gone
                cancelled = True
            if cancelled:
                self.trip()
        return self.raised

    def trip(self) -> None:
        if not self.raised:
            self.raised = True
            raise_cancel_flag(self.flag)

    def relay(self, response) -> None:
        """`response` on to the client; a send that fails (its client gone) cancels."""
        if self.raised:
            return
        try:
            self.relay_to.put(response)
        except Exception:
            self.trip()

    def close(self) -> None:
        if self.raised:
            lower_cancel_flag(self.flag)


class _Relay:
    """Passes responses on one behind, so that the last carries the final flag."""

    def __init__(self, sender):
        self.sender = sender
        self.held = None
        self.ended = False

    def put(self, response) -> None:
        if self.ended:
            return
        error = _error(response)
        if error is not None:  # an error ends the request: one final response
            self.held = None
            self.ended = True
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
            return
        if self.held is not None:
            self.sender.send(self.held, flags=0)
        self.held = pb_utils.InferenceResponse(output_tensors=response.output_tensors())

    def fail(self, message: str, code=None) -> None:
        if not self.ended:
            self.ended = True
            self.held = None
            error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)

    def close(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.held is not None:
            self.sender.send(self.held, flags=FINAL)
        else:
            self.fail("neither llm_prefill nor llm_decode answered")
