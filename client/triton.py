"""Triton client helpers shared by the CLI, the benchmark, the load tools and the tests.

Requests are built from the backend's own table (``backend/protocol.py``), so no client
spells an input name or datatype a second time: ``request_values`` gives one request's
inputs as JSON-ready values (HTTP generate's body, a row of perf_analyzer's input data),
``make_inputs`` the same as tritonclient gRPC tensors. ``stream_generate`` runs one
request over a gRPC stream; ``is_final``, ``output_value`` and ``text_of`` read its
responses.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Any, Iterator

import numpy as np

from backend.protocol import EXCLUDE_INPUT, INPUTS, SAMPLING_PARAMETERS, STREAM, TEXT_INPUT, TEXT_OUTPUT


def request_values(prompt: str, sampling: dict[str, Any], stream: bool = True, exclude_input: bool = True,
                   returns: tuple[str, ...] = ()) -> dict[str, Any]:
    """The inputs of one request by name, as JSON values (vLLM-backend conventions);
    `returns` names the return_* inputs (protocol.RETURN_FLAGS) to set true."""
    return {
        TEXT_INPUT: prompt,
        STREAM: stream,
        SAMPLING_PARAMETERS: json.dumps(sampling),
        EXCLUDE_INPUT: exclude_input,
        **{flag: True for flag in returns},
    }


def grpc_input(name: str, value: Any):
    """The one-element gRPC input tensor `name`, of the datatype the table gives it
    (a str is sent as its UTF-8 bytes)."""
    import tritonclient.grpc as grpcclient

    spec = INPUTS[name]
    if isinstance(value, str):
        value = value.encode("utf-8")
    tensor = grpcclient.InferInput(name, [1], spec.datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=spec.numpy_dtype))
    return tensor


def make_inputs(prompt: str, sampling: dict[str, Any], stream: bool = True, exclude_input: bool = True,
                returns: tuple[str, ...] = ()) -> list:
    """The gRPC input tensors of one request (`request_values`)."""
    values = request_values(prompt, sampling, stream=stream, exclude_input=exclude_input, returns=returns)
    return [grpc_input(name, value) for name, value in values.items()]


def stream_generate(client, model: str, inputs: list, request_id: str = "1", timeout_s: float = 600.0) -> Iterator[Any]:
    """Yield each response (an InferResult) of one request; raise its error if it fails.

    `client` is a tritonclient.grpc.InferenceServerClient with no stream open.
    """
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no final response after {timeout_s:.0f}s")
            result, error = responses.get(timeout=remaining)
            if error is not None:
                raise error
            finished = is_final(result)
            yield result
            if finished:
                return
    finally:
        # Leaving early (error, Ctrl-C, a consumer that stops reading) cancels the request.
        client.stop_stream(cancel_requests=not finished)


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def output_value(result, name: str):
    """The one element of a gRPC response's output `name` (str for BYTES), or None when the
    response lacks it (a server may send only the outputs a request asked for)."""
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def text_of(result) -> str:
    array = result.as_numpy(TEXT_OUTPUT)
    if array is None or array.size == 0:
        return ""
    return b"".join(x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)).decode("utf-8")
