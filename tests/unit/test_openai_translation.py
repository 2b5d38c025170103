"""The OpenAI frontend's translation without a server (client/openai/translation.py): a
request's fields become the backend's sampling_parameters and Triton inputs, bad fields are
refused with the field's name, and backend responses become OpenAI's bodies and events.
Responses are real tritonclient InferResults built from the protobuf Triton sends.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from client.openai.schema import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from client.openai.translation import (
    Job,
    Piece,
    client_names,
    piece_of,
    pieces_of,
    sampling_parameters,
    validate_sampling,
)


def translate(model_cls, body: dict) -> Job:
    """What the app does with a body before it reaches Triton (the chat template aside)."""
    req = parse_request(model_cls, body)
    checked = req.check()
    sampling = sampling_parameters(req)
    validate_sampling(sampling, client_names(req))
    prompt = checked if isinstance(checked, str) else json.dumps(checked)
    return Job.of(req, prompt, sampling)


def refusal(model_cls, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        translate(model_cls, body)
    assert info.value.status == 400
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    return info.value


def inputs_of(job: Job) -> dict:
    """Each Triton input of the job's request, decoded: str for BYTES, bool for BOOL."""
    values = {}
    for tensor in job.triton_inputs():
        assert tensor.shape() == [1]
        raw = tensor._get_content()
        if tensor.datatype() == "BYTES":
            values[tensor.name()] = deserialize_bytes_tensor(raw)[0].decode("utf-8")
        else:
            assert tensor.datatype() == "BOOL"
            values[tensor.name()] = bool(np.frombuffer(raw, dtype=bool)[0])
    return values


def triton_response(text: str = "", finish_reason: str | None = None, num_input_tokens: int | None = None,
                    num_output_tokens: int = 1, logprobs: list | None = None, final: bool = False) -> InferResult:
    """One stream response as backend/model.py encodes it (finish_reason "None" until the end)."""
    response = service_pb2.ModelInferResponse(model_name="llm", id="1")

    def add(name: str, datatype: str, raw: bytes) -> None:
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(raw)

    def add_string(name: str, value: str) -> None:
        add(name, "BYTES", serialize_byte_tensor(np.array([value.encode("utf-8")], dtype=np.object_)).item())

    add_string("text_output", text)
    add_string("finish_reason", str(finish_reason))
    if num_input_tokens is not None:
        add("num_input_tokens", "UINT32", np.array([num_input_tokens], dtype=np.uint32).tobytes())
    add("num_output_tokens", "UINT32", np.array([num_output_tokens], dtype=np.uint32).tobytes())
    add_string("logprobs", json.dumps(logprobs))
    response.parameters["triton_final_response"].bool_param = final
    return InferResult(response)


def sse_payload(event: bytes):
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    return json.loads(event[6:-2])


HI = [{"role": "user", "content": "Hi"}]
# What every request of the kind sends whatever the client set: a chat's prompt, rendered by the
# chat template, already holds its special tokens, so the backend adds none.
ALWAYS = {CompletionRequest: {}, ChatCompletionRequest: {"add_special_tokens": False}}
CHAT = ALWAYS[ChatCompletionRequest]


# ---------------------------------------------------------------------------- requests


def test_chat_with_logprobs_asks_the_backend_for_them():
    job = translate(ChatCompletionRequest, {
        "model": "llm", "messages": HI, "max_completion_tokens": 16, "temperature": 0, "stop": ["\n\n", "User:"],
        "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert job.sampling == {**CHAT, "max_tokens": 16, "temperature": 0.0, "stop": ["\n\n", "User:"], "logprobs": 3}
    assert (job.kind, job.model, job.stream, job.include_usage, job.logprobs) == ("chat", "llm", True, True, 3)
    assert job.request_id.startswith("chatcmpl-")
    inputs = inputs_of(job)
    assert json.loads(inputs.pop("sampling_parameters")) == job.sampling
    assert inputs == {"text_input": job.prompt, "stream": True, "exclude_input_in_output": True,
                      "return_finish_reason": True, "return_num_input_tokens": True,
                      "return_num_output_tokens": True, "return_logprobs": True}


def test_chat_without_logprobs_sends_only_what_the_client_set():
    job = translate(ChatCompletionRequest, {
        "model": "llm", "messages": [{"role": "developer", "content": "Be brief."}, *HI], "max_tokens": 8})
    assert job.sampling == {**CHAT, "max_tokens": 8}
    assert job.logprobs is None and not job.stream and not job.include_usage
    assert "return_logprobs" not in inputs_of(job)
    # A developer message is a system message to the chat template; content parts are joined.
    req = ChatCompletionRequest.model_validate({"model": "llm", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]})
    assert req.check() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    # logprobs without top_logprobs asks the backend for the sampled token's logprob only.
    assert translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "logprobs": True}).sampling == \
        {**CHAT, "logprobs": 0}


def test_user_becomes_the_tenant_and_a_bad_one_is_refused_as_user():
    for model_cls, body in ((ChatCompletionRequest, {"model": "llm", "messages": HI}),
                            (CompletionRequest, {"model": "llm", "prompt": "x"})):
        assert translate(model_cls, {**body, "user": "team-a@example.com"}).sampling == \
            {**ALWAYS[model_cls], "tenant": "team-a@example.com"}
        assert "tenant" not in translate(model_cls, body).sampling
        error = refusal(model_cls, {**body, "user": "no spaces please"})
        assert (error.param, error.code) == ("user", "invalid_value")
        assert error.message.startswith("user: "), error.message


def test_completion_stop_max_tokens_and_logprobs():
    job = translate(CompletionRequest, {"model": "llm", "prompt": ["Once"], "max_tokens": 5, "stop": ".",
                                        "logprobs": 2, "seed": 7, "ignore_eos": True, "echo": False})
    assert job.prompt == "Once" and job.kind == "completion" and job.request_id.startswith("cmpl-")
    assert job.sampling == {"max_tokens": 5, "stop": ".", "logprobs": 2, "seed": 7, "ignore_eos": True}
    assert job.logprobs == 2 and inputs_of(job)["return_logprobs"] is True
    assert translate(CompletionRequest, {"model": "llm", "prompt": "x"}).sampling == {}
    # vLLM's extras (extra_body) travel under their own names.
    extras = {"bad_words": ["Paris"], "spaces_between_special_tokens": False, "skip_special_tokens": False,
              "include_stop_str_in_output": True, "stream_interval": 4}
    assert translate(CompletionRequest, {"model": "llm", "prompt": "x", **extras}).sampling == extras


# What vllm-router 0.1.17 adds to each request it forwards (captured from the bodies it sends
# on; tests/e2e/test_cluster.py sends requests through the router itself).
ROUTER_ADDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
               "return_hidden_states": False}
ROUTER_ADDS_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                    "return_hidden_states": False, "include_reasoning": True}


def test_the_fields_a_router_adds_at_their_defaults_change_nothing():
    chat = {"model": "llm", "messages": HI, "max_tokens": 8, "stop": "."}
    # ignore_eos and skip_special_tokens are vLLM's and were accepted before; the router sends
    # their defaults, which the backend applies anyway.
    defaults = {"ignore_eos": False, "skip_special_tokens": True}
    assert translate(ChatCompletionRequest, {**chat, **ROUTER_ADDS_CHAT}).sampling == \
        {**translate(ChatCompletionRequest, chat).sampling, **defaults} == \
        {**CHAT, "max_tokens": 8, "stop": ".", **defaults}
    completion = {"model": "llm", "prompt": "x", "max_tokens": 8}
    assert translate(CompletionRequest, {**completion, **ROUTER_ADDS}).sampling == {"max_tokens": 8, **defaults}
    # A client's own include_stop_str_in_output survives the router's no_stop_trim false.
    assert translate(CompletionRequest, {**completion, **ROUTER_ADDS, "include_stop_str_in_output": True}
                     ).sampling == {"max_tokens": 8, "include_stop_str_in_output": True, **defaults}


@pytest.mark.parametrize("model_cls, body", [
    (CompletionRequest, {"model": "llm", "prompt": "x"}), (ChatCompletionRequest, {"model": "llm", "messages": HI})])
def test_no_stop_trim_keeps_the_stop_string_as_include_stop_str_in_output_does(model_cls, body):
    assert translate(model_cls, {**body, "no_stop_trim": True}).sampling == \
        {**ALWAYS[model_cls], "include_stop_str_in_output": True}


def test_the_reasoning_switches_are_accepted_whatever_their_value():
    # No reasoning parser runs here: all text is content, with or without them.
    for value in (True, False):
        job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "separate_reasoning": value,
                                                "include_reasoning": value})
        assert job.sampling == CHAT


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("body, param, code", [
    ({"model": "llm", "messages": HI, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"model": "llm"}, "messages", "missing_required_parameter"),
    ({"model": "llm", "messages": HI, "temperature": "hot"}, "temperature", "invalid_value"),
    ({"model": "llm", "messages": [{"role": "function", "content": "x"}]}, "messages.0.role", "invalid_value"),
    ({"model": "llm", "messages": HI, "n": 17}, "n", "invalid_value"),  # the backend's limit: 16
    ({"model": "llm", "messages": HI, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"model": "llm", "messages": HI, "tools": [{"type": "function"}]}, "tools.0.function", "missing_required_parameter"),
    ({"model": "llm", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "unsupported_value"),
    # The backend's own table (backend/request.py) decides, under the name the client used.
    ({"model": "llm", "messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"model": "llm", "messages": HI, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "llm", "messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"model": "llm", "messages": HI, "stop": ["s"] * 65}, "stop", "invalid_value"),
    # What a client got wrong among the fields routers add.
    ({"model": "llm", "messages": HI, "continue_final_message": True}, "continue_final_message", "invalid_value"),
    ({"model": "llm", "messages": HI, "return_hidden_states": True}, "return_hidden_states", "unsupported_value"),
    ({"model": "llm", "messages": HI, "no_stop_trim": True, "include_stop_str_in_output": False}, "no_stop_trim",
     "invalid_value"),
    ({"model": "llm", "messages": HI, "no_stop_trim": "sometimes"}, "no_stop_trim", "invalid_value"),
    ({"model": "llm", "messages": HI, "separate_reasoning": "yes please"}, "separate_reasoning", "invalid_value"),
])
def test_bad_chat_fields_are_refused_naming_the_field(body, param, code):
    error = refusal(ChatCompletionRequest, body)
    assert (error.param, error.code) == (param, code), error.message


def test_an_aliased_field_is_named_in_the_message_too():
    error = refusal(ChatCompletionRequest, {"model": "llm", "messages": HI, "max_completion_tokens": 0})
    assert error.message.startswith("max_completion_tokens:"), error.message


@pytest.mark.parametrize("body, param", [
    ({"model": "llm", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "llm", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "llm", "prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"model": "llm", "prompt": ["x", "y"]}, "prompt"),
    ({"model": "llm", "prompt": ""}, "prompt"),
    # The backend's table decides best_of (1-16, at least n).
    ({"model": "llm", "prompt": "x", "best_of": 0}, "best_of"),
    ({"model": "llm", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"model": "llm", "prompt": "x", "best_of": 17}, "best_of"),
    ({"model": "llm", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "llm", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "", "prompt": "x"}, "model"),
    ({"model": "llm", "prompt": "x", "return_hidden_states": True}, "return_hidden_states"),
    # Chat's reasoning switches mean nothing to a completion.
    ({"model": "llm", "prompt": "x", "separate_reasoning": True}, "separate_reasoning"),
])
def test_bad_completion_fields_are_refused_naming_the_field(body, param):
    assert refusal(CompletionRequest, body).param == param


def test_backend_refusals_name_the_field_the_client_sent():
    chat = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "max_completion_tokens": 9000})
    error = chat.backend_error("max_tokens: prompt (5 tokens) + max_tokens (9000) = 9005 exceeds max_model_len 8192")
    assert (error.status, error.param) == (400, "max_completion_tokens")
    error = chat.backend_error("text_input: prompt has 9000 tokens; max_model_len is 8192")
    assert (error.status, error.param) == (400, "messages")
    completion = translate(CompletionRequest, {"model": "llm", "prompt": "x"})
    assert completion.backend_error("text_input: prompt has 9000 tokens").param == "prompt"
    assert completion.backend_error("waiting queue is full (1 requests); retry later").status == 503


# ---------------------------------------------------------------------------- responses


def test_a_triton_response_becomes_a_piece():
    entries = [{"7": {"logprob": -0.25, "rank": 1, "decoded_token": " Paris"}}]
    piece = piece_of(triton_response(" Paris", num_input_tokens=12, logprobs=entries))
    assert (piece.text, piece.num_input_tokens, piece.num_output_tokens) == (" Paris", 12, 1)
    assert piece.finish_reason is None and piece.logprobs == entries and not piece.final
    last = piece_of(triton_response("", finish_reason="length", num_output_tokens=0, final=True))
    assert (last.text, last.finish_reason, last.num_input_tokens, last.logprobs, last.final) == \
        ("", "length", None, [], True)


def test_chat_pieces_become_one_chat_completion_with_usage_and_logprobs():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "logprobs": True, "top_logprobs": 1})
    pieces = [piece_of(r) for r in (
        triton_response("Hel", num_input_tokens=20, logprobs=[
            {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "Hel"}, "2": {"logprob": -0.1, "rank": 1,
                                                                               "decoded_token": "Hi"}}]),
        triton_response("lo", finish_reason="abort", logprobs=[
            {"3": {"logprob": -0.2, "rank": 1, "decoded_token": "lo"}}], final=True),
    )]
    body = job.whole(pieces)
    assert body["object"] == "chat.completion" and body["id"] == job.request_id and body["model"] == "llm"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert choice["finish_reason"] == "stop"  # a cancelled ("abort") request ends as OpenAI's "stop"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}
    content = choice["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("Hel", -0.5), ("lo", -0.2)]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Hi"]


def test_streamed_chat_is_role_then_deltas_then_usage():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "stream": True,
                                            "stream_options": {"include_usage": True}})
    [first] = job.first_chunks()
    head = sse_payload(first)
    assert head["object"] == "chat.completion.chunk" and "usage" not in head
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    delta = sse_payload(job.chunk(piece_of(triton_response("Hi", num_input_tokens=9)), offset=0))
    assert delta["choices"] == [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]
    # An empty response that is not the last sends no event; the last one carries the reason.
    assert job.chunk(piece_of(triton_response("", num_output_tokens=0)), offset=2) is None
    end = sse_payload(job.chunk(piece_of(triton_response("", finish_reason="stop", num_output_tokens=0,
                                                         final=True)), offset=2))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    usage = sse_payload(job.usage_chunk(9, 1))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 1,
                                                         "total_tokens": 10}


def test_completion_echo_puts_the_prompt_before_the_text():
    job = translate(CompletionRequest, {"model": "llm", "prompt": "2+2=", "echo": True, "max_tokens": 1})
    body = job.whole([piece_of(triton_response("4", finish_reason="length", num_input_tokens=4, final=True))])
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "2+2=4", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == 1


# ---------------------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, {"json_object": True}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
    ({"guided_regex": "a|b"}, {"regex": "a|b"}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
])
def test_structured_output_fields_become_the_backends_structured_outputs(fields, want):
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, **fields})
    assert job.sampling == {**CHAT, "structured_outputs": want}


def test_text_response_format_asks_for_nothing():
    assert translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "response_format": {"type": "text"}}).sampling == CHAT


def test_completions_take_the_vllm_structured_output_fields():
    job = translate(CompletionRequest, {"model": "llm", "prompt": "x", "guided_choice": ["yes", "no"]})
    assert job.sampling == {"structured_outputs": {"choice": ["yes", "no"]}}


@pytest.mark.parametrize("fields, param, needle", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "send one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "send one"),
    ({"guided_choice": []}, "guided_choice", "at least 1"),
    ({"guided_json": "[1]"}, "guided_json", "JSON object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
])
def test_bad_structured_output_fields_are_refused_naming_the_field(fields, param, needle):
    error = refusal(ChatCompletionRequest, {"model": "llm", "messages": HI, **fields})
    assert error.param == param and needle in error.message, (error.param, error.message)


def test_a_backend_compile_error_names_the_clients_field():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI,
                                            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
    error = job.backend_error("structured_outputs: the json constraint does not compile: Unsupported type")
    assert (error.status, error.param) == (400, "response_format")


# ---------------------------------------------------------------------------- tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_a_named_function_is_constrained_to_its_parameters():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "tools": [WEATHER, TIME],
                                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert job.sampling == {**CHAT, "structured_outputs": {"json": WEATHER["function"]["parameters"]}}
    assert job.forced_tool == "get_weather"
    reply = job.whole([piece('{"city": "Paris"}', "stop")])
    message = reply["choices"][0]["message"]
    assert message["content"] is None and reply["choices"][0]["finish_reason"] == "stop"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_required_is_an_array_of_calls_of_the_tools():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "tools": [WEATHER, TIME],
                                            "tool_choice": "required", "parallel_tool_calls": False})
    schema = job.sampling["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    reply = job.whole([piece(text, "stop")])
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in reply["choices"][0]["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_a_forced_tool_choice_with_several_choices_parses_each():
    body = {"model": "llm", "messages": HI, "tools": [WEATHER], "n": 2, "tool_choice": "required"}
    calls = ['[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
             '[{"name": "get_weather", "arguments": {"city": "Rome"}}]']
    reply = translate(ChatCompletionRequest, body).whole([piece(calls[0], "stop"), piece(calls[1], "stop", index=1)])
    assert [(c["index"], c["finish_reason"], c["message"]["tool_calls"][0]["function"]["arguments"])
            for c in reply["choices"]] == [(0, "tool_calls", '{"city": "Oslo"}'), (1, "tool_calls", '{"city": "Rome"}')]
    # Streamed, each choice's text is its own, and a choice that ends before the request's last
    # response sends its calls then, with its index.
    job = translate(ChatCompletionRequest, {**body, "stream": True})
    half = len(calls[0]) // 2
    assert job.chunk(piece(calls[0][:half], None, final=False), 0) is None
    assert job.chunk(piece(calls[1][:half], None, final=False, index=1), 0) is None
    ended = sse_payload(job.chunk(piece(calls[1][half:], "stop", final=False, index=1), 0))["choices"]
    last = sse_payload(job.chunk(piece(calls[0][half:], "stop"), 0))["choices"]
    for [choice], index, city in ((ended, 1, "Rome"), (last, 0, "Oslo")):
        assert (choice["index"], choice["finish_reason"]) == (index, "tool_calls")
        assert choice["delta"]["tool_calls"][0]["function"]["arguments"] == json.dumps({"city": city})


def test_best_of_is_passed_on_and_a_whole_reply_is_asked_for_in_one_response():
    job = translate(CompletionRequest, {"model": "llm", "prompt": "x", "n": 2, "best_of": 3, "seed": 1})
    assert job.sampling == {"n": 2, "best_of": 3, "seed": 1} and job.ranks_at_end
    # The backend streams no best_of > n request: it answers once the ranking is known.
    assert inputs_of(job)["stream"] is False
    for body in ({"n": 2, "best_of": 2}, {"n": 2}, {}):
        assert inputs_of(translate(CompletionRequest, {"model": "llm", "prompt": "x", **body}))["stream"] is True
    # A streamed one goes as asked, for the backend to refuse naming best_of.
    streamed = translate(CompletionRequest, {"model": "llm", "prompt": "x", "best_of": 2, "stream": True})
    assert inputs_of(streamed)["stream"] is True


def test_a_call_cut_short_is_returned_as_text():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "tools": [WEATHER], "tool_choice": "required"})
    reply = job.whole([piece('[{"name": "get_wea', "length")])
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": '[{"name": "get_wea'}
    assert reply["choices"][0]["finish_reason"] == "length"


def test_a_streamed_tool_call_is_one_delta_at_the_end():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "tools": [WEATHER], "stream": True,
                                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert job.chunk(piece('{"city": ', None, final=False), 0) is None
    event = json.loads(job.chunk(piece('"Rome"}', "stop"), 0).decode()[len("data: "):])
    choice = event["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["delta"]["tool_calls"][0]["index"] == 0
    assert choice["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_tools_with_none_generate_text():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "tools": [WEATHER], "tool_choice": "none"})
    assert job.sampling == CHAT and job.forced_tool is None


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools.0.function.name"),
])
def test_bad_tool_requests_are_refused_naming_the_field(fields, param):
    assert refusal(ChatCompletionRequest, {"model": "llm", "messages": HI, **fields}).param == param


def piece(text: str, reason: str | None, final: bool = True, index: int = 0) -> Piece:
    return Piece(text=text, num_input_tokens=3, num_output_tokens=1, finish_reason=reason, logprobs=[], final=final,
                 index=index)


def test_a_lora_adapter_as_the_model_runs_on_its_base_model_with_lora_name():
    req = parse_request(CompletionRequest, {"model": "sql", "prompt": "SELECT", "max_tokens": 4})
    sampling = sampling_parameters(req)
    job = Job.of(req, "SELECT", sampling, triton_model="llm")
    assert (job.model, job.triton_model, job.sampling["lora_name"]) == ("sql", "llm", "sql")
    assert "lora_name" not in sampling  # the caller's dict is left alone
    plain = Job.of(parse_request(CompletionRequest, {"model": "llm", "prompt": "x"}), "x", {}, triton_model="llm")
    assert plain.triton_model == "llm" and "lora_name" not in plain.sampling
    assert Job.of(parse_request(CompletionRequest, {"model": "llm", "prompt": "x"}), "x", {}).triton_model == "llm"


def triton_response_of_n(texts: list[str], reasons: list[str | None], num_output_tokens: list[int],
                         final: bool = False) -> InferResult:
    """A stream response of a request with n sequences: outputs of shape [n] (num_input_tokens [1])."""
    response = service_pb2.ModelInferResponse(model_name="llm", id="1")

    def add(name: str, datatype: str, array: np.ndarray) -> None:
        response.outputs.add(name=name, datatype=datatype, shape=[array.size])
        raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
        response.raw_output_contents.append(raw)

    add("text_output", "BYTES", np.array([t.encode() for t in texts], dtype=np.object_))
    add("finish_reason", "BYTES", np.array([str(r).encode() for r in reasons], dtype=np.object_))
    add("num_input_tokens", "UINT32", np.array([7], dtype=np.uint32))
    add("num_output_tokens", "UINT32", np.array(num_output_tokens, dtype=np.uint32))
    add("logprobs", "BYTES", np.array([b"null"] * len(texts), dtype=np.object_))
    response.parameters["triton_final_response"].bool_param = final
    return InferResult(response)


def test_n_is_passed_on_and_each_sequence_becomes_a_choice():
    job = translate(CompletionRequest, {"model": "llm", "prompt": "x", "n": 2, "seed": 4})
    assert job.sampling["n"] == 2 and job.n == 2
    responses = [
        triton_response_of_n(["a", "b"], [None, None], [1, 1]),
        triton_response_of_n(["", "c"], ["length", None], [0, 1]),
        triton_response_of_n(["", ""], ["length", "stop"], [0, 0], final=True),
    ]
    pieces = [p for r in responses for p in pieces_of(r)]
    assert [(p.index, p.text, p.final) for p in pieces[:2]] == [(0, "a", False), (1, "b", False)]
    body = job.whole(pieces)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "a", "length"),
                                                                                      (1, "bc", "stop")]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_streamed_chat_with_n_sends_each_choice_with_its_index():
    job = translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "n": 2, "stream": True})
    heads = [sse_payload(c)["choices"][0] for c in job.first_chunks()]
    assert [(h["index"], h["delta"]) for h in heads] == [(0, {"role": "assistant", "content": ""}),
                                                         (1, {"role": "assistant", "content": ""})]
    one, two = pieces_of(triton_response_of_n(["", "Hi"], ["stop", None], [0, 1]))
    assert sse_payload(job.chunk(one, 0))["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert sse_payload(job.chunk(two, 0))["choices"] == [
        {"index": 1, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]


def test_a_chat_asks_for_no_special_tokens_unless_its_client_does():
    assert translate(ChatCompletionRequest, {"model": "llm", "messages": HI}).sampling == {"add_special_tokens": False}
    assert translate(ChatCompletionRequest, {"model": "llm", "messages": HI, "add_special_tokens": True}
                     ).sampling == {"add_special_tokens": True}
    assert translate(CompletionRequest, {"model": "llm", "prompt": "x"}).sampling == {}
    assert translate(CompletionRequest, {"model": "llm", "prompt": "x", "add_special_tokens": False}
                     ).sampling == {"add_special_tokens": False}


# ---------------------------------------------------------------------------- disaggregated (kv_transfer_params)


def _transfer_response(handle: str) -> InferResult:
    """A role-prefill model's answer that hands its request over: the handle alone, final."""
    response = service_pb2.ModelInferResponse(model_name="llm", id="1")
    response.outputs.add(name="transfer", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_byte_tensor(np.array([handle.encode()], dtype=np.object_)).item())
    response.parameters["triton_final_response"].bool_param = True
    return InferResult(response)


@pytest.mark.parametrize("model_cls, body", [
    (CompletionRequest, {"model": "llm", "prompt": "Hi", "max_tokens": 1}),
    (ChatCompletionRequest, {"model": "llm", "messages": HI, "max_completion_tokens": 1, "max_tokens": 1}),
])
def test_the_prefill_half_drops_the_routers_one_token_and_answers_the_handle(model_cls, body):
    """vllm-router's prefill request: max_tokens and min_tokens 1, stream false, do_remote_decode.
    The role-prefill model samples the first token free of both (the decode half brings the
    client's) and hands over; its handle becomes kv_transfer_params."""
    job = translate(model_cls, {**body, "temperature": 0, "min_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}})
    assert job.hand_over and job.transfer is None
    assert json.loads(inputs_of(job)["sampling_parameters"]).keys() == {"temperature", *ALWAYS[model_cls]}
    assert "transfer" not in inputs_of(job)
    job.check_role("prefill")
    with pytest.raises(ApiError) as refused:
        job.check_role("both")
    assert refused.value.status == 400 and refused.value.param == "kv_transfer_params"
    assert "role 'prefill'" in str(refused.value) and "role 'both'" in str(refused.value)
    answer = job.whole([piece_of(_transfer_response("tcp://10.0.0.1:5555/abc"))])
    assert answer["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                            "inflight_transfer": "tcp://10.0.0.1:5555/abc"}


def test_the_decode_half_sends_the_handle_as_the_transfer_input():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "inflight_transfer": "shm:abc"}
    job = translate(CompletionRequest, {"model": "llm", "prompt": "Hi", "max_tokens": 9, "stream": True,
                                        "kv_transfer_params": params})
    assert job.transfer == "shm:abc" and not job.hand_over
    inputs = inputs_of(job)
    assert inputs["transfer"] == "shm:abc" and json.loads(inputs["sampling_parameters"])["max_tokens"] == 9
    job.check_role("decode")
    with pytest.raises(ApiError) as refused:
        job.check_role("prefill")
    assert refused.value.param == "kv_transfer_params" and "role 'decode'" in str(refused.value)
    plain = translate(CompletionRequest, {"model": "llm", "prompt": "Hi"})
    plain.check_role("decode")  # a decode model serves a request that was never handed over whole
    assert "kv_transfer_params" not in plain.whole([piece_of(triton_response("x", final=True))])


def test_a_prefill_half_that_streams_or_a_handle_that_is_no_string_is_refused():
    streamed = refusal(CompletionRequest, {"model": "llm", "prompt": "Hi", "stream": True,
                                           "kv_transfer_params": {"do_remote_decode": True}})
    assert streamed.param == "kv_transfer_params" and "stream false" in str(streamed)
    handle = refusal(CompletionRequest, {"model": "llm", "prompt": "Hi", "kv_transfer_params": {"inflight_transfer": 7}})
    assert handle.param == "kv_transfer_params"
