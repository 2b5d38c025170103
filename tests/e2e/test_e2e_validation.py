"""Bad requests end to end, through the real tritonserver (the session's `triton_server`):
a table of them, each answered at once with INVALID_ARG naming the parameter (and the limit),
over gRPC and HTTP generate, while a long stream runs on.

Error codes do not reach clients of a decoupled model through Triton 2.51: a gRPC stream
response carries only `error_message`, and HTTP generate answers 400 for every error
response (INTERNAL ones too, see test_e2e_cancel.py). So each rejection is checked by its
message (the parameter and the limit; "<param>: <why>" is what client/openai/translation.py
maps to 400) and by HTTP 400, the status INVALID_ARG has in every Triton version.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import pytest
import requests

from tests.e2e.e2e_util import AFTER_FINAL_GRACE_S, Stream, inputs_for, output, tensor, wait_for, wait_until

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2's vocabulary
MAX_MODEL_LEN = 8192  # SmolLM2's 8192 positions (the engine's cap)


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server


@dataclass
class Bad:
    """One bad request: what to send, which words the error must contain, and how to send it."""

    id: str
    sampling: dict | str | None = None
    prompt: str | bytes | None = "Hello"
    stream: bool | None = None
    exclude: bool | None = None
    parameters: dict | None = None  # Triton request parameters (no sampling tensor then)
    raw_inputs: Callable[[], list] | None = None  # gRPC tensors as they are (Triton's own checks)
    names: tuple[str, ...] = ()
    http: bool = True  # also through HTTP generate (expects 400)

    def grpc_inputs(self) -> list:
        if self.raw_inputs is not None:
            return self.raw_inputs()
        return inputs_for(self.prompt, self.sampling, stream=self.stream, exclude_input=self.exclude)

    def body(self) -> dict:
        body: dict = {}
        if self.prompt is not None:
            body["text_input"] = self.prompt
        if self.sampling is not None:
            body["sampling_parameters"] = self.sampling if isinstance(self.sampling, str) else json.dumps(self.sampling)
        if self.stream is not None:
            body["stream"] = self.stream
        if self.exclude is not None:
            body["exclude_input_in_output"] = self.exclude
        if self.parameters is not None:
            body["parameters"] = self.parameters
        return body


LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 100)

def bad_requests(kv_blocks: int) -> list[Bad]:
    """The table; one row depends on the size of the server's KV pool."""
    beyond_pool = kv_blocks * 16 + 64  # tokens: more than the whole pool holds
    rows = BAD_REQUESTS
    if beyond_pool < MAX_MODEL_LEN - 16:  # else max_model_len is the limit that answers
        rows = rows + [Bad("max_tokens beyond the KV pool", sampling={"max_tokens": beyond_pool},
                           names=("max_tokens", f"the whole pool has {kv_blocks}"))]
    return rows


BAD_REQUESTS = [
    # inputs
    Bad("missing text_input", prompt=None, sampling={"max_tokens": 4}, names=("text_input",)),
    Bad("empty text_input", prompt="", names=("text_input", "empty")),
    Bad("text_input not UTF-8", prompt=b"\xff\xfe", names=("text_input", "UTF-8"), http=False),
    Bad("two prompts", raw_inputs=lambda: [tensor("text_input", ["a", "b"], "BYTES", [2])], names=("text_input",), http=False),
    Bad("stream of the wrong type", raw_inputs=lambda: [tensor("text_input", "a", "BYTES"), tensor("stream", "yes", "BYTES")],
        names=("stream", "BOOL"), http=False),
    Bad("prompt beyond max_model_len", prompt=LONG_PROMPT, names=("text_input", f"max_model_len is {MAX_MODEL_LEN}")),
    Bad("stream without exclude_input_in_output", stream=True, exclude=False, names=("exclude_input_in_output", "stream")),
    Bad("bad stream string in request parameters", parameters={"stream": "maybe"}, names=("stream", "boolean"), http=False),
    Bad("bad return flag in request parameters", parameters={"return_logprobs": "perhaps"}, names=("return_logprobs",), http=False),
    # sampling_parameters as a whole
    Bad("bad JSON", sampling="{not json", names=("sampling_parameters", "JSON")),
    Bad("JSON not an object", sampling="[1, 2]", names=("sampling_parameters", "object")),
    Bad("unknown key", sampling={"temprature": 0.5}, names=("temprature", "known parameters", "'temperature'", "'max_tokens'")),
    Bad("unknown key in request parameters", parameters={"max_tokns": 4}, names=("max_tokns", "known parameters")),
    # temperature
    Bad("temperature NaN", sampling='{"temperature": NaN}', names=("temperature: temperature must be a finite number, got nan.",)),
    Bad("temperature Infinity", sampling='{"temperature": Infinity}', names=("temperature", "finite")),
    Bad("temperature 'inf' string", sampling={"temperature": "inf"}, names=("temperature", "finite")),
    Bad("temperature overflowing to inf", sampling='{"temperature": 1e400}', names=("temperature", "finite")),
    Bad("temperature negative", sampling={"temperature": -0.5}, names=("temperature: temperature must be non-negative, got -0.5.",)),
    Bad("temperature too high", sampling={"temperature": 101}, names=("temperature: temperature must be in [0, 100], got 101.0.",)),
    Bad("temperature not a number", sampling={"temperature": "hot"}, names=("temperature", "number")),
    Bad("temperature a boolean", sampling={"temperature": True}, names=("temperature", "boolean")),
    # top_p, top_k, min_p
    Bad("top_p zero", sampling={"top_p": 0}, names=("top_p: top_p must be in (0, 1], got 0.0.",)),
    Bad("top_p above one", sampling={"top_p": 1.5}, names=("top_p: top_p must be in (0, 1], got 1.5.",)),
    Bad("top_k below -1", sampling={"top_k": -2}, names=("top_k: top_k must be 0 (disable), or at least 1, got -2.",)),
    Bad("top_k above the vocabulary", sampling={"top_k": VOCAB + 1}, names=("top_k", f"vocabulary size {VOCAB}")),
    Bad("top_k fractional", sampling={"top_k": 2.5}, names=("top_k", "integer")),
    Bad("min_p above one", sampling={"min_p": 1.5}, names=("min_p: min_p must be in [0, 1], got 1.5.",)),
    # penalties
    Bad("repetition_penalty zero", sampling={"repetition_penalty": 0}, names=("repetition_penalty: repetition_penalty must be greater than zero, got 0.0.",)),
    Bad("repetition_penalty too high", sampling={"repetition_penalty": "11"}, names=("repetition_penalty: repetition_penalty must be in (0, 10], got 11.0.",)),
    Bad("presence_penalty too high", sampling={"presence_penalty": 2.5}, names=("presence_penalty: presence_penalty must be in [-2, 2], got 2.5.",)),
    Bad("frequency_penalty too low", sampling={"frequency_penalty": -3}, names=("frequency_penalty: frequency_penalty must be in [-2, 2], got -3.0.",)),
    # logprobs
    Bad("logprobs above 20", sampling={"logprobs": 21}, names=("logprobs: logprobs must be in [0, 20], got 21.",)),
    Bad("logprobs negative", sampling={"logprobs": -1}, names=("logprobs: logprobs must be in [0, 20], got -1.",)),
    # stop_token_ids
    Bad("stop_token_ids outside the vocabulary", sampling={"stop_token_ids": [2, VOCAB]},
        names=("stop_token_ids", f"vocabulary size {VOCAB}")),
    Bad("stop_token_ids negative", sampling={"stop_token_ids": [-1]}, names=("stop_token_ids", ">= 0")),
    Bad("stop_token_ids not a list", sampling={"stop_token_ids": 7}, names=("stop_token_ids", "list")),
    # max_tokens, min_tokens
    Bad("max_tokens zero", sampling={"max_tokens": 0}, names=("max_tokens: max_tokens must be at least 1, got 0.",)),
    Bad("max_tokens '0' as a string", sampling={"max_tokens": "0"}, names=("max_tokens: max_tokens must be at least 1, got 0.",)),
    Bad("max_tokens zero in request parameters", parameters={"max_tokens": 0}, names=("max_tokens",)),
    Bad("max_tokens fractional", sampling={"max_tokens": 8.5}, names=("max_tokens", "integer")),
    Bad("max_tokens a boolean", sampling={"max_tokens": True}, names=("max_tokens", "boolean")),
    Bad("max_tokens beyond max_model_len", sampling={"max_tokens": 100_000}, names=("max_tokens", f"max_model_len {MAX_MODEL_LEN}")),
    Bad("min_tokens above max_tokens", sampling={"min_tokens": 10, "max_tokens": "5"}, names=("min_tokens: min_tokens must be less than or equal to max_tokens=5, got 10.",)),
    Bad("min_tokens negative", sampling={"min_tokens": -1}, names=("min_tokens: min_tokens must be greater than or equal to 0, got -1.",)),
    # stop strings
    Bad("too many stop strings", sampling={"stop": [f"s{i}" for i in range(65)]}, names=("stop", "at most 64")),
    Bad("stop string too long", sampling={"stop": ["x" * 257]}, names=("stop", "256")),
    Bad("empty stop string", sampling={"stop": ["ok", ""]}, names=("stop: stop cannot contain an empty string.",)),
    Bad("stop not strings", sampling={"stop": [1, 2]}, names=("stop", "string")),
    # booleans, seed, priority
    Bad("ignore_eos bad boolean string", sampling={"ignore_eos": "maybe"}, names=("ignore_eos", "boolean")),
    Bad("skip_special_tokens bad boolean string", sampling={"skip_special_tokens": "nope"}, names=("skip_special_tokens", "boolean")),
    Bad("include_stop_str_in_output number", sampling={"include_stop_str_in_output": 2}, names=("include_stop_str_in_output", "boolean")),
    Bad("seed negative", sampling={"seed": -1}, names=("seed", "greater than or equal to 0")),
    Bad("seed not a number", sampling={"seed": "abc"}, names=("seed", "integer")),
    Bad("priority beyond int32", sampling={"priority": 2**31}, names=("priority", str(2**31 - 1))),
    Bad("stream_interval zero", sampling={"stream_interval": 0}, names=("stream_interval", "greater than or equal to 1")),
    Bad("stream_interval a boolean", sampling={"stream_interval": True}, names=("stream_interval", "boolean")),
]


def test_bad_requests_are_rejected_at_once_naming_the_parameter_while_a_stream_runs(server, kv_blocks):
    table = bad_requests(kv_blocks)
    assert len(table) >= 30
    long_stream = Stream(server.grpc_url)
    long = long_stream.send(server.model, inputs_for(
        "Write a long story about a lighthouse keeper.", {"temperature": 0, "max_tokens": 64, "ignore_eos": True},
        stream=True, returns=("return_num_output_tokens", "return_finish_reason")))
    try:
        wait_until(lambda: long.responses, 120, 0.02, "the long stream's first token")
        burst_start = time.monotonic()
        problems = []
        # Every bad request at once, each on a stream of its own (an error names no request id).
        streams = [Stream(server.grpc_url) for _ in table]
        try:
            sent = [stream.send(server.model, case.grpc_inputs(), parameters=case.parameters)
                    for stream, case in zip(streams, table)]
            for case, got in zip(table, sent):
                where = f"{case.id} (gRPC)"
                if not got.done.wait(60):
                    problems.append(f"{where}: no answer")
                    continue
                if got.error is None:
                    problems.append(f"{where}: accepted, got {got.text!r}")
                    continue
                missing = [n for n in case.names if n not in got.message]
                if missing:
                    problems.append(f"{where}: message lacks {missing}: {got.message!r}")
                latency = got.times[0] - got.sent_at
                if latency > 10:
                    problems.append(f"{where}: answered after {latency:.1f}s")
            time.sleep(AFTER_FINAL_GRACE_S)  # anything sent after the final response arrives by now
            for case, got in zip(table, sent):
                if got.done.is_set() and (got.finals != 1 or got.after_final or got.responses):
                    problems.append(f"{case.id} (gRPC): {got.finals} finals, {got.after_final} after the final one, "
                                    f"{len(got.responses)} data responses")
        finally:
            for stream in streams:
                stream.close()
        for case in table:
            if not case.http:
                continue
            r = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", json=case.body(), timeout=60)
            message = r.json().get("error", "") if r.headers.get("content-type", "").startswith("application/json") else r.text
            if r.status_code != 400:  # INVALID_ARG (and, in Triton 2.51, any error response)
                problems.append(f"{case.id} (HTTP): status {r.status_code}, expected 400: {r.text[:300]}")
            missing = [n for n in case.names if n not in message]
            if missing:
                problems.append(f"{case.id} (HTTP): message lacks {missing}: {message!r}")
        burst_end = time.monotonic()
        assert not problems, "\n".join(problems)

        wait_for(long, 300)
    finally:
        long_stream.close()
    # The long stream ran on through the burst and ended normally.
    assert long.error is None, long.message
    assert long.finals == 1 and long.after_final == 0
    assert output(long.last, "finish_reason") == "length"
    assert long.total("num_output_tokens") == 64
    during = [t for t in long.times if burst_start <= t <= burst_end]
    assert during, "the long stream got no token while the bad requests were answered"


