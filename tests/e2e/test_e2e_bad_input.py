"""Bad input end to end (issue #26): a table of malformed requests against the session's one
server, over gRPC streaming, HTTP generate and HTTP generate_stream.

Every case gets exactly one error, whose message names the input or parameter at fault
(or, for the few values that are valid after all, one normal answer); never a hang, never
a 5xx that the model caused. After each case the server serves a valid request and its
engine holds no KV block and no running or waiting request; at the end the Python
backend stub is the one that started (it never crashed).

Triton 2.51's HTTP generate layer refuses some bodies itself, before the backend sees
them, some with HTTP 500 and some without naming the field: those cases pin the exact
status and message (`frontend`), which docs/operations.md "Bad input and soak" lists; a newer
Triton that answers them differently fails here, and docs/operations.md must follow.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from client.soak import descendants
from tests.e2e.e2e_util import Stream, engine_state, inputs_for, output, scrape, tensor, wait_for, wait_idle, wait_until

pytestmark = pytest.mark.e2e

VOCAB = 49152  # SmolLM2's vocabulary
MAX_MODEL_LEN = 8192
MIB = 1 << 20
OK = "served"  # a case whose value is valid: one normal answer
# Triton 2.51's HTTP generate layer, for a JSON value of the wrong type where a STRING or a
# BOOL input is declared (it names neither the field nor the type it wanted).
NOT_A_STRING = "Unable to parse JSON bytes array: attempt to access JSON non-string as string"
NOT_A_BOOLEAN = "Unable to parse 'data': attempt to access JSON non-boolean as boolean"


@dataclass(frozen=True)
class Case:
    """One bad request. `sampling` is the sampling_parameters text (a dict is sent as JSON);
    `grpc` replaces the whole gRPC request by these tensors (name, value, datatype, shape);
    `body` replaces the whole HTTP body (bytes are sent as they are). `names` must all be in
    the error message, or `names` is OK. `frontend` pins Triton's own HTTP answer
    (status, message) to a case the backend never sees."""

    id: str
    sampling: Any = None
    prompt: Any = "Hello"
    grpc: tuple | None = None
    body: Any = None
    names: Any = ()
    over: tuple[str, ...] = ("grpc", "http", "sse")
    frontend: tuple[int, str] | None = None
    model: str | None = None

    def sampling_text(self) -> str | None:
        if self.sampling is None or isinstance(self.sampling, str):
            return self.sampling
        return json.dumps(self.sampling, allow_nan=True)

    def grpc_inputs(self) -> list:
        if self.grpc is not None:
            return [tensor(*spec) for spec in self.grpc]
        return inputs_for(self.prompt, self.sampling_text())

    def http_body(self) -> Any:
        if self.body is not None:
            return self.body
        body = {} if self.prompt is None else {"text_input": self.prompt}
        if self.sampling is not None:
            body["sampling_parameters"] = self.sampling_text()
        return body


def s(case_id: str, sampling: Any, *names: str, **kw) -> Case:
    """A sampling_parameters case: max_tokens 2 unless the case sets it, so that the values
    that are valid after all (names OK) answer quickly."""
    if isinstance(sampling, dict):
        sampling = {"max_tokens": 2, **sampling}
    return Case(case_id, sampling=sampling, names=names if names != (OK,) else OK, **kw)


GRPC = ("grpc",)
HTTP = ("http", "sse")

CASES = [
    # inputs: data types, shapes, names (gRPC; Triton checks them against config.pbtxt)
    Case("text_input INT32", grpc=(("text_input", [3], "INT32"),), names=("text_input", "INT32"), over=GRPC),
    Case("text_input FP32", grpc=(("text_input", [1.5], "FP32"),), names=("text_input", "FP32"), over=GRPC),
    Case("stream INT32", grpc=(("text_input", "Hi", "BYTES"), ("stream", [1], "INT32")), names=("stream", "INT32"),
         over=GRPC),
    Case("exclude_input_in_output as a string", grpc=(("text_input", "Hi", "BYTES"), ("exclude_input_in_output", "yes", "BYTES")),
         names=("exclude_input_in_output", "BYTES"), over=GRPC),
    Case("text_input shape [2]", grpc=(("text_input", ["a", "b"], "BYTES", [2]),), names=("text_input",), over=GRPC),
    Case("text_input shape [1,1]", grpc=(("text_input", ["a"], "BYTES", [1, 1]),), names=("text_input",), over=GRPC),
    Case("unknown input name", grpc=(("text_input", "Hi", "BYTES"), ("txt_input", "Hi", "BYTES")), names=("txt_input",),
         over=GRPC),
    Case("missing text_input", prompt=None, sampling={"max_tokens": 2}, names=("text_input",)),
    Case("unknown model", names=("nope",), model="nope"),
    # prompts
    Case("empty prompt", prompt="", names=("text_input", "empty")),
    Case("1 MiB prompt", prompt="hello " * (MIB // 6), names=("text_input", f"max_model_len is {MAX_MODEL_LEN}")),
    Case("invalid UTF-8 prompt", prompt=b"\xff\xfe", names=("text_input", "UTF-8"), over=GRPC),
    Case("NUL bytes in the prompt", prompt="a\x00b\x00c", sampling={"max_tokens": 2}, names=OK),
    # sampling_parameters as a whole
    s("sampling_parameters a JSON array", "[1, 2]", "sampling_parameters", "object"),
    s("sampling_parameters a number", "42", "sampling_parameters", "object"),
    s("sampling_parameters null", "null", "sampling_parameters", "object"),
    s("sampling_parameters a JSON string", '"max_tokens"', "sampling_parameters", "object"),
    s("sampling_parameters invalid JSON", "{not json", "sampling_parameters", "JSON"),
    s("sampling_parameters nested object", {"temperature": {"value": 1}}, "temperature"),
    s("sampling_parameters nested 100,000 deep", "[" * 100_000, "sampling_parameters", "at most"),
    s("sampling_parameters nested 5,000 deep", '{"a": ' * 5_000 + "1" + "}" * 5_000, "sampling_parameters", "nested"),
    s("sampling_parameters 1 MiB", '{"stop": ["' + "x" * MIB + '"]}', "sampling_parameters", "at most"),
    s("unknown sampling parameter", {"temprature": 0.5}, "temprature", "known parameters"),
    # every numeric parameter: each side of its limit, NaN, inf, a string
    s("temperature -0.01", {"temperature": -0.01}, "temperature", "0"),
    s("temperature 0", {"temperature": 0}, OK),
    s("temperature 100", {"temperature": 100}, OK),
    s("temperature 100.01", {"temperature": 100.01}, "temperature", "100"),
    s("temperature NaN", {"temperature": math.nan}, "temperature", "finite"),
    s("temperature inf", {"temperature": math.inf}, "temperature", "finite"),
    s("temperature a string", {"temperature": "hot"}, "temperature", "number"),
    s("top_p 0", {"top_p": 0}, "top_p", "(0, 1]"),
    s("top_p 1e-6", {"top_p": 1e-6}, OK),
    s("top_p 1", {"top_p": 1}, OK),
    s("top_p 1.0001", {"top_p": 1.0001}, "top_p", "1"),
    s("top_p NaN", {"top_p": math.nan}, "top_p", "got nan"),
    s("top_p a string", {"top_p": "most"}, "top_p", "number"),
    s("top_k -2", {"top_k": -2}, "top_k", "at least 1"),
    s("top_k -1", {"top_k": -1}, OK),
    s("top_k the vocabulary", {"top_k": VOCAB}, OK),
    s("top_k beyond the vocabulary", {"top_k": VOCAB + 1}, "top_k", f"vocabulary size {VOCAB}"),
    s("top_k inf", {"top_k": math.inf}, "top_k"),
    s("top_k a string", {"top_k": "many"}, "top_k", "integer"),
    s("min_p -0.01", {"min_p": -0.01}, "min_p", "0"),
    s("min_p 1", {"min_p": 1}, OK),
    s("min_p 1.01", {"min_p": 1.01}, "min_p", "1"),
    s("min_p NaN", {"min_p": math.nan}, "min_p", "got nan"),
    s("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty", "greater than zero"),
    s("repetition_penalty 10", {"repetition_penalty": 10}, OK),
    s("repetition_penalty 10.01", {"repetition_penalty": 10.01}, "repetition_penalty", "10"),
    s("repetition_penalty inf", {"repetition_penalty": math.inf}, "repetition_penalty", "finite"),
    s("presence_penalty -2", {"presence_penalty": -2}, OK),
    s("presence_penalty -2.01", {"presence_penalty": -2.01}, "presence_penalty", "-2"),
    s("presence_penalty 2.01", {"presence_penalty": 2.01}, "presence_penalty", "2"),
    s("presence_penalty NaN", {"presence_penalty": math.nan}, "presence_penalty", "got nan"),
    s("frequency_penalty 2", {"frequency_penalty": 2}, OK),
    s("frequency_penalty -2.01", {"frequency_penalty": -2.01}, "frequency_penalty", "-2"),
    s("frequency_penalty a string", {"frequency_penalty": "some"}, "frequency_penalty", "number"),
    s("seed -1", {"seed": -1}, "seed", "0"),
    s("seed 2**63-1", {"seed": 2**63 - 1}, OK),
    s("seed 2**63", {"seed": 2**63}, "seed"),
    s("seed a string", {"seed": "abc"}, "seed", "integer"),
    s("max_tokens 0", {"max_tokens": 0}, "max_tokens", "at least 1"),
    s("max_tokens 1", {"max_tokens": 1}, OK),
    s("max_tokens beyond max_model_len", {"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens", f"max_model_len {MAX_MODEL_LEN}"),
    s("max_tokens inf", '{"max_tokens": Infinity}', "max_tokens"),
    s("max_tokens NaN", '{"max_tokens": NaN}', "max_tokens"),
    s("max_tokens a string", {"max_tokens": "lots"}, "max_tokens", "integer"),
    s("min_tokens -1", {"min_tokens": -1}, "min_tokens", "0"),
    s("min_tokens above max_tokens", {"min_tokens": 3}, "min_tokens", "max_tokens"),
    s("logprobs -1", {"logprobs": -1}, "logprobs", "0"),
    s("logprobs 20", {"logprobs": 20}, OK),
    s("logprobs 21", {"logprobs": 21}, "logprobs", "20"),
    s("priority 2**31", {"priority": 2**31}, "priority", str(2**31 - 1)),
    s("priority -2**31-1", {"priority": -(2**31) - 1}, "priority", str(-(2**31))),
    s("priority as a word", {"priority": "high"}, "priority", "integer"),
    # stop handling
    s("stop as a number", {"stop": 5}, "stop"),
    s("stop as 1000 strings", {"stop": [f"s{i}" for i in range(1000)]}, "stop", "at most 64"),
    s("stop as 64 strings", {"stop": [f"s{i}" for i in range(64)]}, OK),
    s("stop as a 10 KB string", {"stop": "x" * 10_000}, "stop", "256"),
    s("stop_token_ids out of the vocabulary", {"stop_token_ids": [VOCAB]}, "stop_token_ids", f"vocabulary size {VOCAB}"),
    s("stop_token_ids the last id", {"stop_token_ids": [VOCAB - 1]}, OK),
    s("stop_token_ids a string", {"stop_token_ids": "eos"}, "stop_token_ids"),
    # other fields
    s("ignore_eos as a word", {"ignore_eos": "maybe"}, "ignore_eos", "boolean"),
    # HTTP bodies: every top-level field is an input (by name) or a request parameter
    Case("typo of sampling_parameters beside it", body={
        "text_input": "Hi", "sampling_parameters": '{"max_tokens": 2}', "sampling_parameter": '{"max_tokens": 2}'},
        names=("sampling_parameter:", "beside the sampling_parameters input"), over=HTTP),
    Case("typo of sampling_parameters alone", body={"text_input": "Hi", "sampling_parameter": '{"max_tokens": 2}'},
        names=("sampling_parameter:", "unknown sampling parameter"), over=HTTP),
    Case("unknown field holding an object", body={"text_input": "Hi", "foo": {"a": 1}}, names=("foo",), over=HTTP),
    Case("text_input [a, b]", body={"text_input": ["a", "b"]}, names=("text_input",), over=HTTP),
    Case("invalid UTF-8 in the body", body=b'{"text_input": "\xff\xfe"}', names=("text_input", "UTF-8"), over=HTTP),
    # ... and what Triton 2.51's HTTP generate layer answers itself (docs/operations.md, "Bad input and soak")
    Case("text_input [[...]] (flattened)", body={"text_input": [["Hi"]], "sampling_parameters": '{"max_tokens": 2}'},
         names=OK, over=HTTP),
    Case("text_input a number", body={"text_input": 5}, over=HTTP, frontend=(500, NOT_A_STRING)),
    Case("text_input null", body={"text_input": None}, over=HTTP, frontend=(500, NOT_A_STRING)),
    Case("sampling_parameters a JSON object, not a string", body={"text_input": "Hi", "sampling_parameters": {"max_tokens": 2}},
         over=HTTP, frontend=(500, NOT_A_STRING)),
    Case("sampling_parameters a JSON number, not a string", body={"text_input": "Hi", "sampling_parameters": 7},
         over=HTTP, frontend=(500, NOT_A_STRING)),
    Case("stream: \"yes\"", body={"text_input": "Hi", "stream": "yes"}, over=HTTP, frontend=(500, NOT_A_BOOLEAN)),
    Case("exclude_input_in_output: \"yes\"", body={"text_input": "Hi", "exclude_input_in_output": "yes"}, over=HTTP,
         frontend=(500, NOT_A_BOOLEAN)),
    Case("exclude_input_in_output a word in \"parameters\"", body={
        "text_input": "Hi", "parameters": {"exclude_input_in_output": "perhaps"}}, over=HTTP,
        frontend=(500, "Converting keyword: 'parameters': " + NOT_A_BOOLEAN)),
    Case("parameters not an object", body={"text_input": "Hi", "parameters": 5}, over=HTTP, frontend=(
        500, "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object")),
    Case("body a JSON array", body=[1, 2], over=HTTP, frontend=(500, "attempt to get members for non-object")),
    Case("empty body", body=b"", over=HTTP,
         frontend=(500, "failed to parse the request JSON buffer: The document is empty. at 0")),
    Case("invalid JSON body", body=b"{not json", over=HTTP,
         frontend=(500, "failed to parse the request JSON buffer: Missing a name for object member. at 1")),
]


def by_transport(transport: str) -> list[Case]:
    return [case for case in CASES if transport in case.over]


def test_the_table_has_at_least_60_distinct_cases():
    assert len({case.id for case in CASES}) == len(CASES) >= 60


# ---------------------------------------------------------------------------- sending

@dataclass
class Answer:
    error: str | None  # the one error's message, None when served
    text: str = ""
    problems: tuple[str, ...] = ()  # anything besides one final answer


def send_grpc(server, case: Case) -> Answer:
    with Stream(server.grpc_url) as stream:
        got = wait_for(stream.send(case.model or server.model, case.grpc_inputs()), 60)
    problems = []
    if got.finals != 1 or got.after_final or stream.orphans:
        problems.append(f"{got.finals} finals, {got.after_final} after the final one, {len(stream.orphans)} orphans")
    if got.error is not None:
        if got.responses:
            problems.append(f"{len(got.responses)} data responses beside the error")
        return Answer(got.message, problems=tuple(problems))
    return Answer(None, got.text, tuple(problems))


def _post(server, case: Case, path: str, **kw) -> requests.Response:
    body = case.http_body()
    url = f"{server.http_url}/v2/models/{case.model or server.model}/{path}"
    if isinstance(body, bytes):
        return requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60, **kw)
    return requests.post(url, data=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"},
                         timeout=60, **kw)


def _error_of(r: requests.Response) -> str:
    try:
        return str(r.json().get("error", r.text))
    except ValueError:
        return r.text


def send_http(server, case: Case) -> tuple[Answer, int]:
    r = _post(server, case, "generate")
    if r.status_code == 200:
        return Answer(None, r.json().get("text_output", "")), 200
    return Answer(_error_of(r)), r.status_code


def send_sse(server, case: Case) -> tuple[Answer, int]:
    r = _post(server, case, "generate_stream", stream=True)
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return Answer(_error_of(r)), r.status_code
    events = [json.loads(line[len("data:"):]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        problems = () if len(events) == 1 else (f"{len(events)} events beside the error: {events[:3]}",)
        return Answer(errors[0], problems=problems), r.status_code
    return Answer(None, "".join(e.get("text_output", "") for e in events)), r.status_code


# ---------------------------------------------------------------------------- checks

def check(case: Case, answer: Answer, status: int | None) -> list[str]:
    problems = list(answer.problems)
    if case.frontend is not None and status is not None:
        want_status, want_message = case.frontend
        if (status, answer.error) != (want_status, want_message):
            problems.append(f"Triton's HTTP layer answered {status} {answer.error!r}, "
                            f"docs/operations.md says {want_status} {want_message!r}")
        return problems
    if case.names == OK:
        if answer.error is not None:
            problems.append(f"refused a valid value: {answer.error!r}")
        elif status not in (None, 200):
            problems.append(f"status {status}")
        return problems
    if answer.error is None:
        problems.append(f"accepted, got {answer.text[:80]!r}")
        return problems
    missing = [n for n in case.names if n not in answer.error]
    if missing:
        problems.append(f"message lacks {missing}: {answer.error[:300]!r}")
    if status is not None and status >= 500:
        problems.append(f"status {status}: {answer.error[:200]!r}")
    return problems


def serves_a_valid_request(server) -> list[str]:
    with Stream(server.grpc_url) as stream:
        got = wait_for(stream.send(server.model, inputs_for("Hello", {"max_tokens": 2, "temperature": 0})), 60)
    if got.error is not None or output(got.last, "finish_reason") != "length":
        return [f"then a valid request failed: {got.message or output(got.last, 'finish_reason')}"]
    state = wait_until(lambda: (lambda st: st if not any(st.values()) else None)(
        engine_state(scrape(server.metrics_port), server.model)) or None, 30, 0.05, "idle engine")
    return [] if state is not None else ["engine not idle"]


@pytest.fixture(scope="module")
def server(triton_server):
    stubs = descendants(triton_server.proc.pid)
    assert stubs, "no Python backend stub under tritonserver"
    yield triton_server
    assert descendants(triton_server.proc.pid) == stubs, "the Python backend stub was replaced (it crashed)"


@pytest.mark.parametrize("transport", ["grpc", "http", "sse"])
def test_every_bad_input_gets_one_error_naming_it_and_the_server_serves_on(server, transport):
    send = {"grpc": lambda c: (send_grpc(server, c), None), "http": lambda c: send_http(server, c),
            "sse": lambda c: send_sse(server, c)}[transport]
    problems = []
    for case in by_transport(transport):
        answer, status = send(case)
        found = check(case, answer, status) + serves_a_valid_request(server)
        problems += [f"{case.id} ({transport}): {p}" for p in found]
    wait_idle(server.metrics_port, server.model, 30)
    assert not problems, "\n".join(problems)
