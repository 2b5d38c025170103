"""The disaggregated entry model's request bookkeeping (model_repository_disaggregated/llm/1/model.py),
with a test double for Triton's `triton_python_backend_utils` (the end-to-end tests run it in a
real tritonserver: tests/e2e/test_e2e_disaggregated.py).

What is checked here is what a real server shows only now and then: once the client's final
response is sent, the model never again asks Triton whether the request is cancelled (2.51 frees
the response factory with the final response, and asking reads freed memory: a SIGSEGV that took
the whole server down in CI when llm_decode refused a request).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from backend.paths import REPO_ROOT

FINAL = 1


class TritonError:
    UNAVAILABLE, CANCELLED, INTERNAL = "UNAVAILABLE", "CANCELLED", "INTERNAL"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self._outputs, self._error = list(output_tensors), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output_tensors(self) -> list:
        return self._outputs


@pytest.fixture(scope="module")
def bls(monkeypatch_module):
    double = types.ModuleType("triton_python_backend_utils")
    double.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    double.TritonError, double.InferenceResponse = TritonError, InferenceResponse
    double.get_output_tensor_by_name = lambda response, name: None
    monkeypatch_module.setitem(sys.modules, "triton_python_backend_utils", double)
    spec = importlib.util.spec_from_file_location("disaggregated_llm_model",
                                                  REPO_ROOT / "model_repository_disaggregated" / "llm" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


class Request:
    """A request that counts how often it is asked whether it is cancelled."""

    def __init__(self):
        self.asked = 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return False


class Sender:
    def __init__(self):
        self.sent: list[tuple[InferenceResponse, int]] = []

    def send(self, response: InferenceResponse, flags: int = 0) -> None:
        self.sent.append((response, flags))


def ask(cancel) -> bool:
    cancel._next_poll = 0.0  # past CANCEL_POLL_S
    return cancel.poll()


@pytest.mark.parametrize("ending", ["error", "data then close"])
def test_after_the_final_response_the_request_is_never_asked_whether_it_is_cancelled(bls, ending):
    request, sender = Request(), Sender()
    relay = bls._Relay(sender)
    cancel = bls._Cancel(request, relay)
    assert not ask(cancel) and request.asked == 1
    cancel.relay(InferenceResponse(["token"]))
    assert not ask(cancel) and request.asked == 2  # one response held back: nothing final yet
    if ending == "error":  # llm_decode refusing the request (UNAVAILABLE): the final response
        cancel.relay(InferenceResponse(error=TritonError("no room", TritonError.UNAVAILABLE)))
    else:  # the end of the serving thread's request
        relay.close()
    assert [flags for _, flags in sender.sent].count(FINAL) == 1 and sender.sent[-1][1] == FINAL
    for _ in range(3):  # what _exec does while it drains the model's last responses
        assert not ask(cancel)
    assert request.asked == 2
    cancel.relay(InferenceResponse(["after the end"]))
    assert len(sender.sent) == 1  # the one final response (an error drops the held one), nothing after it


def test_a_cancelled_request_raises_its_flag_once_and_stops_asking(bls):
    class Cancelled(Request):
        def is_cancelled(self) -> bool:
            super().is_cancelled()
            return True

    request = Cancelled()
    cancel = bls._Cancel(request, bls._Relay(Sender()))
    try:
        assert ask(cancel) and ask(cancel) and request.asked == 1
    finally:
        cancel.close()
