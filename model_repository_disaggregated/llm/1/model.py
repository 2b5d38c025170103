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
final response whatever happens on the way.

A stub process that dies leaves its requests unanswered (tritonserver 2.51 neither ends
them nor marks the model not ready), so while a request waits on llm_prefill or llm_decode
this model watches the processes serving that model: when one dies, the request ends with
one UNAVAILABLE error naming the model and the process (no retry: there is one instance of
each). A transfer the dead prefill process had exported but not yet answered with expires
and is swept (backend/disagg.py); one a dead decode process had claimed went with it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol import TRANSFER_TENSOR

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often a request waiting on a model asks whether the model's processes still live.
LIVENESS_POLL_S = 0.5
_END = object()


class ModelProcessDied(Exception):
    """A process serving the model a request waits on has died: no answer will come."""


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the disaggregated `llm` model streams and needs "
                                                "`model_transaction_policy { decoupled: true }`")
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.prefill_model = parameters.get("prefill_model", "llm_prefill")
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
        try:
            inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.input_names) if t is not None]
            requested = sorted(request.requested_output_names() or self.output_names)
            transfer = None
            for response in self._exec(self.prefill_model, inputs, [*requested, TRANSFER_TENSOR]):
                handle = pb_utils.get_output_tensor_by_name(response, TRANSFER_TENSOR)
                if handle is not None and not response.has_error():
                    transfer = handle.as_numpy().reshape(-1)[0]
                else:  # the request ended on the prefill model: its answer is the client's
                    relay.put(response)
            if transfer is not None:
                handle = np.array([transfer], dtype=np.object_)
                try:
                    for response in self._exec(self.decode_model, [*inputs, pb_utils.Tensor(TRANSFER_TENSOR, handle)],
                                               requested):
                        relay.put(response)
                finally:
                    if not relay.forwarded_any:  # never imported: its segment is this model's to remove
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
            with self._lock:
                self._threads.discard(threading.current_thread())
        relay.close()

    def _exec(self, model: str, inputs, requested: list[str]):
        """The responses of `model` to one request, as they come (empty ones skipped); raises
        ModelProcessDied when a process serving `model` dies before the last one. The
        responses are read on a thread of their own, so that this one can watch meanwhile."""
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
        while True:
            try:
                item = responses.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                dead = [pid for pid in stubs if not _alive(pid)]
                if dead:  # the reader thread stays blocked on the dead stub: nothing will wake it
                    raise ModelProcessDied(f"{model}: its process (pid {dead[0]}) died while serving this request; "
                                           "the request is lost, retry it") from None
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


def _alive(pid: int) -> bool:
    """Alive, not a zombie waiting for tritonserver to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _discard(transfer) -> None:
    from backend.disagg import discard_transfer

    discard_transfer(transfer.decode() if isinstance(transfer, bytes) else str(transfer))


class _Relay:
    """Passes responses on one behind, so that the last carries the final flag."""

    def __init__(self, sender):
        self.sender = sender
        self.held = None
        self.forwarded_any = False
        self.ended = False

    def put(self, response) -> None:
        if self.ended:
            return
        self.forwarded_any = True
        if response.has_error():  # an error ends the request: one final response
            self.held = None
            self.ended = True
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=response.error()), flags=FINAL)
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
