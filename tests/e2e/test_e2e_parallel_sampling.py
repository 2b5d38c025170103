"""Parallel sampling (`n`, `best_of`) through a real tritonserver: outputs of shape [n] on a
gRPC stream and from HTTP generate, one final response, sequence i equal to a request of its
own with seed s + i, and best_of > n refused when streaming."""

from __future__ import annotations

import json

import pytest
import requests

from backend.protocol import CUMULATIVE_LOGPROB, FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, TEXT_OUTPUT
from tests.e2e.e2e_util import generate, inputs_for, scrape, wait_until

pytestmark = pytest.mark.e2e

PROMPT = "Write one sentence about the sea:"
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 12, "seed": 5}


def texts(response) -> list[str]:
    return [v.decode() for v in response.as_numpy(TEXT_OUTPUT)]


def test_grpc_stream_sends_arrays_of_n_and_one_final_flag(triton_server):
    outcome = generate(triton_server.grpc_url, triton_server.model,
                       inputs_for(PROMPT, {**SAMPLING, "n": 3}, stream=True))
    assert outcome.error is None and outcome.finals == 1 and outcome.after_final == 0
    streamed = ["", "", ""]
    tokens = [0, 0, 0]
    for response in outcome.responses:
        for name in (TEXT_OUTPUT, FINISH_REASON, CUMULATIVE_LOGPROB, NUM_OUTPUT_TOKENS):
            assert response.as_numpy(name).shape == (3,), name
        assert response.as_numpy(NUM_INPUT_TOKENS).shape == (1,)
        for i, text in enumerate(texts(response)):
            streamed[i] += text
        tokens = [t + int(k) for t, k in zip(tokens, response.as_numpy(NUM_OUTPUT_TOKENS))]
    last = outcome.last
    assert [v.decode() for v in last.as_numpy(FINISH_REASON)] == ["length"] * 3
    assert tokens == [12, 12, 12]
    # Sequence i is the request with seed 5 + i, sent alone.
    for i in range(3):
        alone = generate(triton_server.grpc_url, triton_server.model,
                         inputs_for(PROMPT, {**SAMPLING, "seed": 5 + i}, stream=True), grace=0)
        assert streamed[i] == alone.text, f"sequence {i}"
    assert len(set(streamed)) > 1


def test_http_generate_returns_every_sequence_whole_counted_once(triton_server):
    model = triton_server.model
    before = scrape(triton_server.metrics_port)
    r = requests.post(f"{triton_server.http_url}/v2/models/{model}/generate", timeout=300, json={
        "text_input": PROMPT, "exclude_input_in_output": True,
        "parameters": {**SAMPLING, "n": 2, "best_of": 3, "return_trace": True},
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body[TEXT_OUTPUT], list) and len(body[TEXT_OUTPUT]) == 2, body
    assert body[FINISH_REASON] == ["length", "length"] and body[NUM_OUTPUT_TOKENS] == [12, 12]
    # best_of 3: the two with the highest cumulative logprob, best first.
    assert body[CUMULATIVE_LOGPROB][0] >= body[CUMULATIVE_LOGPROB][1]
    trace = json.loads(body["trace"])  # the leader's: it prefilled the prompt
    assert trace["events"][0]["event"] == "queued" and trace["events"][-1]["event"] == "finished"

    def delta(name: str, **labels) -> float:
        return scrape(triton_server.metrics_port).get(name, model=model, **labels) - before.get(name, model=model,
                                                                                               **labels)

    # The request once, its tokens per sequence: all 3 of best_of sampled 12.
    wait_until(lambda: delta("vllm:request_success_total", finished_reason="length") == 1, what="request counted")
    assert delta("vllm:generation_tokens_total") == 36
    assert delta("vllm:prompt_tokens_total") == body[NUM_INPUT_TOKENS]
    assert delta("vllm:time_to_first_token_seconds_count") == 1


def test_streaming_with_best_of_above_n_is_refused_naming_best_of(triton_server):
    outcome = generate(triton_server.grpc_url, triton_server.model,
                       inputs_for(PROMPT, {**SAMPLING, "n": 1, "best_of": 2}, stream=True), grace=0)
    assert outcome.error is not None and outcome.message.startswith("best_of: "), outcome.message
    outcome = generate(triton_server.grpc_url, triton_server.model,
                       inputs_for(PROMPT, {**SAMPLING, "n": 17}, stream=True), grace=0)
    assert outcome.error is not None and outcome.message.startswith("n: "), outcome.message
