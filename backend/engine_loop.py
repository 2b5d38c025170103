"""The engine loop: one thread that owns an `LLMEngine` and steps it, and the only way in
from other threads (Triton's `execute`, its response thread).

Requests, aborts and shutdown reach the loop as commands (`SubmitRequest`, `AbortRequest`,
`Wake`) on a queue, which the loop applies between steps; outputs leave through each
request's callback, on the loop thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from backend import thread_binding
from backend.disagg import Transfer
from backend.disagg_tcp import is_tcp_handle
from backend.engine import LLMEngine
from backend.output import RequestOutput
from backend.request import FinishReason, Request, RequestError, RequestStatus, SamplingParams

log = logging.getLogger("inflight")


OutputCallback = Callable[[RequestOutput], None]
CancelCheck = Callable[[], bool]


@dataclass(frozen=True)
class SubmitRequest:
    """A validated request for the engine, and where its outputs go; the loop keeps it as
    the request's handler until its final output is delivered."""

    request: Request
    on_output: OutputCallback
    is_cancelled: CancelCheck | None = None


@dataclass(frozen=True)
class ImportRequest:
    """A request a prefill engine exported (`transfer`, backend/disagg.py), for a role-decode
    engine to take into its running batch (LLMEngine.import_request); then as SubmitRequest.
    A TCP handle is pulled first, off the loop thread: the command comes back with the
    pulled transfer, or the error that ended its pull."""

    transfer: str | Transfer | RequestError
    request_id: str
    prompt_text: str
    on_output: OutputCallback
    is_cancelled: CancelCheck | None = None
    params: SamplingParams | None = None  # the decode half's own (LLMEngine.import_request)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Carries nothing: wakes a loop idling on the queue, so that it sees shutdown at once."""


Command = SubmitRequest | ImportRequest | AbortRequest | Wake


class EngineLoop:
    """Builds an engine and runs `engine.step()` on one daemon thread; thread-safe `submit` and `abort`.

    The engine is built on the loop's thread, not the caller's: torch's CPU kernels run on
    OpenMP, and GNU OpenMP gives every thread that enters a parallel region a worker team
    of its own. Loading and packing weights on the caller's thread would leave that team
    alive beside the loop thread's; with more OpenMP threads than CPUs, libgomp stops
    spinning between parallel regions and its workers sleep and wake hundreds of times a
    step (a decode step at batch 32 took 243 ms against 177 ms on one thread, measured on
    2 cores). So one thread owns the engine from its first tensor to its last step.

    Cancellation callbacks are polled once per iteration, so a cancelled request is seen
    and its blocks freed within one step. Every request's callback receives exactly one
    output with finished=True, including on shutdown. An optional `observer` (metrics)
    gets `on_step()` after every iteration, once the iteration's tokens have gone to their
    callbacks and before its final outputs do, and `on_finished(output)` per ended
    request, just before its final output.
    """

    IDLE_WAIT_S = 0.1
    # How often, at most, a forward pass asks between its layers whether a running request
    # was cancelled (each ask reads every handler's flag): a cancel then waits for one
    # layer, not for a whole step, which a long prefill can stretch to seconds.
    INTERRUPT_POLL_S = 0.02

    def __init__(self, build_engine: Callable[[], LLMEngine], observer=None):
        """`build_engine` runs on the loop thread; its exception, if any, is raised here."""
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handlers: dict[str, SubmitRequest] = {}
        # Imports whose transfer is being pulled over TCP, by request id.
        self._pulling: dict[str, ImportRequest] = {}
        self._stop = threading.Event()
        # When the loop last came round (monotonic): a step that never returns stops it.
        self._last_progress = time.monotonic()
        self._last_interrupt_poll = 0.0
        self.engine: LLMEngine  # set by the loop thread before it answers `build_failure`
        # Where the loop thread's OpenMP team is pinned (backend/thread_binding.py), or None.
        self.binding: thread_binding.Binding | None = None
        build_failure: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._build_and_run, args=(build_engine, build_failure),
                                        name="inflight-engine", daemon=True)
        self._thread.start()
        failure = build_failure.get()
        if failure is not None:
            raise failure

    def _build_and_run(self, build_engine: Callable[[], LLMEngine], build_failure: queue.SimpleQueue) -> None:
        try:
            self.engine = build_engine()
            if self.engine.device.type == "cpu":
                self.binding = thread_binding.bind_openmp_threads(self.engine.config.omp_threads_bind)
        except BaseException as exc:  # raised on the constructor's caller
            build_failure.put(exc)
            return
        build_failure.put(None)
        self._run()

    def submit(self, request_id: str, prompt: str, params: SamplingParams, on_output: OutputCallback,
               is_cancelled: CancelCheck | None = None, needs_logprobs: bool = False, trace: bool = False) -> Request:
        """Validate now, on the caller's thread (raising RequestError: LLMEngine.make_request,
        then the queue's room), then hand the request to the loop thread, which `accept`s it."""
        if self._stop.is_set():
            raise RequestError(RequestError.UNAVAILABLE, "the model is shutting down")
        request = self.engine.make_request(request_id, prompt, params, needs_logprobs, trace=trace)
        self.engine.check_queue_room(num_arriving=self._commands.qsize())
        self._commands.put(SubmitRequest(request, on_output, is_cancelled))
        return request

    def submit_transfer(self, request_id: str, transfer: str, prompt_text: str, on_output: OutputCallback,
                        is_cancelled: CancelCheck | None = None, params: SamplingParams | None = None) -> None:
        """Hand an exported request to the loop thread, which imports it between steps (the
        KV pool is the loop's); a refusal (RequestError) comes back as its one final output."""
        if self._stop.is_set():
            raise RequestError(RequestError.UNAVAILABLE, "the model is shutting down")
        self._commands.put(ImportRequest(transfer, request_id, prompt_text, on_output, is_cancelled, params))

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def health(self, stall_s: float) -> str | None:
        """None while the loop serves; otherwise why it does not: its thread has died, it
        has not come round for `stall_s` while requests wait on it (a step that hangs), or
        the device has failed for good (`LLMEngine.device_fault`). Safe from any thread."""
        if not self._thread.is_alive():
            return None if self._stop.is_set() else "the engine loop has died"
        fault = self.engine.device_fault
        if fault is not None:
            return f"the device failed and cannot run another step: {fault}"
        quiet = time.monotonic() - self._last_progress
        if quiet > stall_s and (self._handlers or not self._commands.empty()):
            return f"no engine step has finished for {quiet:.1f}s while requests wait (limit {stall_s:g}s)"
        return None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._commands.put(Wake())
        self._thread.join(timeout_s)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> None:
        match command:
            case SubmitRequest(request=request, on_output=on_output):
                try:
                    self.engine.accept(request)
                except RequestError as exc:  # refused at the door: its one output, an error
                    self._call_back(on_output, self.engine.finish(request, FinishReason.ERROR, error=exc))
                    return
                self._handlers[request.request_id] = command
            case ImportRequest(transfer=transfer, request_id=request_id, on_output=on_output):
                if is_tcp_handle(transfer) and self.engine.transfer_puller is not None:
                    # The steps go on while its KV crosses; it joins the batch once arrived.
                    self._pulling[request_id] = command
                    self.engine.transfer_puller.pull(transfer, lambda pulled, command=command: self._commands.put(
                        dataclasses.replace(command, transfer=pulled)))
                    return
                if not isinstance(transfer, str) and self._pulling.pop(request_id, None) is None:
                    return  # pulled after the shutdown answered its request
                if isinstance(transfer, RequestError):  # its pull failed
                    self._call_back(on_output, RequestOutput.refused(request_id, transfer))
                    return
                try:
                    request, first = self.engine.import_request(transfer, request_id, command.prompt_text,
                                                                params=command.params)
                except RequestError as exc:  # refused: its one output, an error
                    self._call_back(on_output, RequestOutput.refused(request_id, exc))
                    return
                self._handlers[request_id] = SubmitRequest(request, on_output, command.is_cancelled)
                if first is not None:  # None: it waits for room, and a later step brings it
                    self._dispatch([first])
            case AbortRequest(request_id=request_id):
                self.engine.abort(request_id)
            case Wake():
                pass

    def _poll_cancellations(self) -> None:
        for request_id, handler in list(self._handlers.items()):
            if handler.is_cancelled is None:
                continue
            try:
                cancelled = handler.is_cancelled()
            except Exception:  # a broken sender counts as a gone client
                cancelled = True
            if cancelled:
                self.engine.abort(request_id)

    def _running_request_cancelled(self) -> bool:
        """Asked by the forward pass between layers: abandon the step for a cancel? Only a
        running request's cancel is worth the work the step would lose (a waiting one holds
        no blocks); the abort itself happens at the top of the loop, as for any cancel."""
        now = time.monotonic()
        if now - self._last_interrupt_poll < self.INTERRUPT_POLL_S:
            return False
        self._last_interrupt_poll = now
        for handler in list(self._handlers.values()):
            if handler.is_cancelled is None or handler.request.status is not RequestStatus.RUNNING:
                continue
            try:
                if handler.is_cancelled():
                    return True
            except Exception:  # a broken sender counts as a gone client
                return True
        return False

    def _call_back(self, on_output: OutputCallback, output: RequestOutput) -> None:
        """Hand `output` to its request's callback, here on the loop thread."""
        try:
            on_output(output)
        except Exception:  # one client's failure must not stop the loop
            log.exception("output callback failed for request %s", output.request_id)
            if not output.finished:
                self.engine.abort(output.request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            handler = self._handlers.get(output.request_id)
            if handler is None:
                continue
            if output.finished:
                del self._handlers[output.request_id]
                self._observe(lambda: self.observer.on_finished(output))
            self._call_back(handler.on_output, output)

    def _observe(self, call: Callable[[], None]) -> None:
        if self.observer is None:
            return
        try:
            call()
        except Exception:  # metrics must never take serving down
            log.exception("metrics update failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._last_progress = time.monotonic()
            self._drain_commands(block=not self.engine.has_unfinished())
            if self._stop.is_set():
                break
            self._poll_cancellations()
            aborted = self.engine.take_aborted()
            if aborted:
                self._observe(self.observer.on_step if self.observer else None)
                self._dispatch(aborted)
            try:
                outputs = self.engine.step(self._running_request_cancelled)
            except Exception:  # keep serving; the step already failed its requests
                log.exception("engine step failed")
                outputs = []
            # The step's tokens first, then its metrics, then the requests it ended: a client
            # that has its final response finds that step on /metrics (the Triton adapter
            # sends and applies in this order), and no token waits for the metrics.
            self._dispatch([output for output in outputs if not output.finished])
            self._observe(self.observer.on_step if self.observer else None)
            self._dispatch([output for output in outputs if output.finished])
        # Shutdown: every live request gets its one final response, one still being pulled too.
        if self.engine.transfer_puller is not None:
            self.engine.transfer_puller.close()
        self._drain_commands(block=False)
        for request_id, command in list(self._pulling.items()):
            del self._pulling[request_id]
            self._call_back(command.on_output, RequestOutput.refused(
                request_id, RequestError(RequestError.UNAVAILABLE, "the model is shutting down")))
        for request_id in list(self._handlers):
            self.engine.abort(request_id)
        self._dispatch(self.engine.step() if self.engine.has_unfinished() else [])
        # Left: requests whose final output a failed step never returned. Each still gets
        # one, with its own finish reason (abort, if it had none).
        for request_id, handler in list(self._handlers.items()):
            del self._handlers[request_id]
            self._call_back(handler.on_output, self.engine.finish(handler.request, FinishReason.ABORT))
        self.engine.close()  # its sockets: a prefill engine's transfer server, its KV events
