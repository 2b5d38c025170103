"""End to end through a real tritonserver: gRPC streaming, HTTP generate(_stream), errors.

All tests share the session's `triton_server` (tests/e2e/conftest.py): the default
SmolLM2-135M-Instruct checkpoint behind the inflight backend, on free ports.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.paths import DEFAULT_CHECKPOINT
from client.generate import apply_chat_template
from client.triton import is_final, make_inputs, stream_generate, text_of

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_tokens": 24}
PROMPT = "The three primary colors are"


def grpc_generate(server, prompt: str, sampling: dict, stream: bool, exclude_input: bool = True,
                  returns: tuple[str, ...] = (), timeout_s: float = 300.0) -> list:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = make_inputs(prompt, sampling, stream=stream, exclude_input=exclude_input, returns=returns)
        return list(stream_generate(client, server.model, inputs, timeout_s=timeout_s))
    finally:
        client.close()


def grpc_raw(server, inputs: list, timeout_s: float = 60.0) -> list[tuple[object, object]]:
    """Send arbitrary inputs on a stream; collect (result, error) pairs until final or error."""
    import queue

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    pairs = []
    try:
        client.async_stream_infer(server.model, inputs, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout_s)
            pairs.append((result, error))
            if error is not None or is_final(result):
                return pairs
    finally:
        client.stop_stream()
        client.close()


def bytes_input(name: str, value: str):
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value.encode()], dtype=object))
    return t


@pytest.fixture(scope="module")
def reference_text(triton_server) -> str:
    """The greedy non-streamed completion of PROMPT (exactly one response)."""
    responses = grpc_generate(triton_server, PROMPT, GREEDY, stream=False)
    assert len(responses) == 1 and is_final(responses[0])
    text = text_of(responses[0])
    assert text.strip(), "empty completion"
    return text


def test_grpc_streaming_concatenates_to_non_streamed_text(triton_server, reference_text):
    responses = grpc_generate(
        triton_server, PROMPT, GREEDY, stream=True,
        returns=("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"),
    )
    assert len(responses) > 1, "streaming sent everything in one response"
    assert all(not is_final(r) for r in responses[:-1]) and is_final(responses[-1])
    assert "".join(text_of(r) for r in responses) == reference_text
    last = responses[-1]
    assert last.as_numpy("finish_reason").reshape(-1)[0].decode() in ("stop", "length")
    assert int(last.as_numpy("num_input_tokens").reshape(-1)[0]) > 0
    total = sum(int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in responses)
    assert 0 < total <= GREEDY["max_tokens"]


def test_non_streamed_output_includes_prompt_by_default(triton_server, reference_text):
    responses = grpc_generate(triton_server, PROMPT, GREEDY, stream=False, exclude_input=False)
    assert len(responses) == 1
    assert text_of(responses[0]) == PROMPT + reference_text


def test_http_generate(triton_server, reference_text):
    url = f"{triton_server.http_url}/v2/models/{triton_server.model}/generate"
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps(GREEDY), "exclude_input_in_output": True}
    r = requests.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == reference_text

    # vLLM-backend style: sampling values (strings allowed) and switches in "parameters".
    body = {"text_input": PROMPT, "parameters": {"temperature": "0", "max_tokens": "24", "stream": False}}
    r = requests.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == PROMPT + reference_text


def test_http_generate_stream_sse(triton_server, reference_text):
    url = f"{triton_server.http_url}/v2/models/{triton_server.model}/generate_stream"
    body = {"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(GREEDY)}
    events = []
    with requests.post(url, json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    assert len(events) > 1
    assert not any("error" in e for e in events), events
    assert "".join(e.get("text_output", "") for e in events) == reference_text


def test_sixteen_concurrent_streams_complete(triton_server):
    n = 16
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            responses = grpc_generate(
                triton_server, f"Request {i}: write a short sentence about the number {i}.",
                {"temperature": 0, "max_tokens": 8 + i % 5}, stream=True, timeout_s=400,
                returns=("return_finish_reason", "return_num_output_tokens"),
            )
            results[i] = responses
        except Exception as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=450)
    assert not any(t.is_alive() for t in threads), "some streams never finished"
    errors = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not errors, errors
    assert len(results) == n
    for i, responses in results.items():
        assert responses and is_final(responses[-1]), i
        tokens = sum(int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in responses)
        reason = responses[-1].as_numpy("finish_reason").reshape(-1)[0].decode()
        assert reason in ("stop", "length"), (i, reason)
        assert 1 <= tokens <= 8 + i % 5, (i, tokens)
        if reason == "length":
            assert tokens == 8 + i % 5, (i, tokens)


def test_missing_text_input_is_invalid_arg_and_server_keeps_serving(triton_server, reference_text):
    # gRPC: the error arrives on the stream and names the missing input.
    pairs = grpc_raw(triton_server, [bytes_input("sampling_parameters", json.dumps(GREEDY))])
    error = pairs[-1][1]
    assert isinstance(error, InferenceServerException)
    assert "text_input" in str(error)

    # HTTP: INVALID_ARG maps to 400.
    url = f"{triton_server.http_url}/v2/models/{triton_server.model}/generate"
    r = requests.post(url, json={"sampling_parameters": json.dumps(GREEDY)}, timeout=60)
    assert r.status_code == 400, r.text
    assert "text_input" in r.json()["error"]

    # Bad sampling parameters are named too.
    r = requests.post(url, json={"text_input": "hi", "sampling_parameters": json.dumps({"temprature": 1})}, timeout=60)
    assert r.status_code == 400 and "temprature" in r.json()["error"], r.text
    r = requests.post(url, json={"text_input": "hi", "sampling_parameters": "{not json"}, timeout=60)
    assert r.status_code == 400 and "sampling_parameters" in r.json()["error"], r.text

    # ... and the server still answers.
    responses = grpc_generate(triton_server, PROMPT, GREEDY, stream=False)
    assert text_of(responses[0]) == reference_text


def test_cancelled_stream_does_not_disturb_others(triton_server, reference_text):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        inputs = make_inputs(PROMPT, {"temperature": 0, "max_tokens": 200, "ignore_eos": True}, stream=True)
        for i, _ in enumerate(stream_generate(client, triton_server.model, inputs, timeout_s=120)):
            if i == 2:
                break  # leaving the generator cancels the request (stop_stream(cancel_requests=True))
    finally:
        client.close()
    responses = grpc_generate(triton_server, PROMPT, GREEDY, stream=False)
    assert text_of(responses[0]) == reference_text


def test_default_model_knows_the_capital_of_france(triton_server):
    prompt = apply_chat_template("What is the capital of France?", str(DEFAULT_CHECKPOINT))
    responses = grpc_generate(triton_server, prompt, {"temperature": 0, "max_tokens": 32}, stream=True)
    answer = "".join(text_of(r) for r in responses)
    assert "Paris" in answer, answer


def test_metrics_endpoint_exports_engine_metrics(triton_server, reference_text):
    text = requests.get(f"http://127.0.0.1:{triton_server.metrics_port}/metrics", timeout=30).text

    def value(name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and f'model="{triton_server.model}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    assert value("vllm:prompt_tokens_total") > 0
    assert value("vllm:generation_tokens_total") > 0
    assert value("inflight_iterations_total") > 0
    for name in ("vllm:num_requests_running", "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics",
                 "inflight_kv_cache_usage_ratio"):
        assert name in text, name


# The requests that a stop or an unload must end take this many tokens: tens of seconds of
# the tiny model's steps, so that they cannot end by themselves first, however quick the steps
# and however slow the server's stop (1000 tokens took about a second, and once ran out first).
LONG_REQUEST_TOKENS = 30000


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"max_position_embeddings": 2 * LONG_REQUEST_TOKENS}


def _tiny_model(checkpoint: str) -> dict[str, dict[str, str]]:
    """One model on the tiny random-weight checkpoint, for tests that stop or unload their own
    server, with room for two requests of LONG_REQUEST_TOKENS."""
    return {"llm": {"model_path": checkpoint, "max_model_len": str(2 * LONG_REQUEST_TOKENS), "kv_cache_memory_mb": "64"}}


def _two_long_requests(server) -> tuple[list[threading.Thread], dict[str, object]]:
    """A streaming and a non-streaming request of LONG_REQUEST_TOKENS, both live once this returns."""
    import time

    results: dict[str, object] = {}
    started = threading.Event()

    def run(stream: bool) -> None:
        try:
            sampling = {"max_tokens": LONG_REQUEST_TOKENS, "ignore_eos": True, "temperature": 0}
            responses = []
            for r in grpc_generate_iter(server, "Once upon a time", sampling, stream):
                responses.append(r)
                started.set()
            results["stream" if stream else "whole"] = responses
        except Exception as exc:  # reported by _assert_aborted
            results["stream" if stream else "whole"] = exc

    threads = [threading.Thread(target=run, args=(stream,)) for stream in (True, False)]
    for t in threads:
        t.start()
    assert started.wait(120), "no token streamed"
    time.sleep(0.5)
    return threads, results


def _assert_aborted(results: dict[str, object], server) -> None:
    for name in ("stream", "whole"):
        responses = results[name]
        assert not isinstance(responses, Exception), (name, responses, server.log_tail())
        assert is_final(responses[-1])
        assert responses[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == "abort"


def test_server_shutdown_ends_live_requests(tritonserver, tiny_checkpoint):
    """SIGTERM with streams in flight: each gets its final response (abort), the server exits 0.

    Triton keeps a decoupled model loaded while any response sender is open, so without
    the backend noticing the unload, shutdown would wait for the exit timeout and crash.
    The backend asks the server's HTTP endpoint, found on its command line, not
    `pb_utils.is_model_ready`, whose error path can crash the stub (backend/readiness.py).
    """
    import time

    with tritonserver(_tiny_model(tiny_checkpoint)) as server:
        expected = f"[inflight] unload detection: GET {server.http_url}/v2/models/llm/versions/1/ready"
        assert expected in server.log(), server.log_tail()
        threads, results = _two_long_requests(server)
        t0 = time.monotonic()
        server.proc.terminate()
        for t in threads:
            t.join(timeout=60)
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        assert time.monotonic() - t0 < 30
        _assert_aborted(results, server)
        assert "Fatal Python error" not in server.log()


def test_unloading_a_model_ends_its_live_requests(tritonserver, tiny_checkpoint):
    """An explicit unload with streams in flight ends each (abort) and the unload completes."""
    import time

    import tritonclient.http as httpclient

    explicit = ("--model-control-mode=explicit", "--load-model=llm")
    with tritonserver(_tiny_model(tiny_checkpoint), args=explicit) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        try:
            threads, results = _two_long_requests(server)
            client.unload_model("llm")
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads), server.log_tail()
            _assert_aborted(results, server)
            deadline = time.monotonic() + 30
            while client.get_model_repository_index()[0].get("state") != "UNAVAILABLE":
                assert time.monotonic() < deadline, (client.get_model_repository_index(), server.log_tail())
                time.sleep(0.2)
            assert client.is_server_live()
        finally:
            client.close()


def grpc_generate_iter(server, prompt: str, sampling: dict, stream: bool, model: str = "llm"):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = make_inputs(prompt, sampling, stream=stream, returns=("return_finish_reason",))
        yield from stream_generate(client, model, inputs, timeout_s=120)
    finally:
        client.close()
