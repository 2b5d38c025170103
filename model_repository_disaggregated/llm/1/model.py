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
"""

from __future__ import annotations

import json
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol import TRANSFER_TENSOR

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
        except Exception as exc:
            self.logger.log_error(f"[disaggregated llm] {traceback.format_exc()}")
            relay.fail(f"internal error in the disaggregated `llm` model: {exc}")
            return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
        relay.close()

    def _exec(self, model: str, inputs, requested: list[str]):
        """The responses of `model` to one request, as they come (empty ones skipped)."""
        bls = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=requested)
        for response in bls.exec(decoupled=True):
            if response.has_error() or response.output_tensors():
                yield response


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

    def fail(self, message: str) -> None:
        if not self.ended:
            self.ended = True
            self.held = None
            self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                             flags=FINAL)

    def close(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.held is not None:
            self.sender.send(self.held, flags=FINAL)
        else:
            self.fail("neither llm_prefill nor llm_decode answered")
