"""Structured outputs through the OpenAI-compatible frontend, driven by the official `openai`
client against the session's tritonserver (SmolLM2): `response_format` json_schema (also via
the client's own `parse()` with a pydantic model), json_object, vLLM's `guided_choice`, a
schema that does not compile answered with a 400 naming `response_format`, and forced tool
choices (also with n > 1); tool_choice "auto" is test_openai_tools.py's, on a Qwen template."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.openai_frontend import run_frontend

pytestmark = pytest.mark.e2e

MODEL = "llm"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
        "country": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


class Capital(pydantic.BaseModel):
    country: Annotated[str, pydantic.Field(pattern="^[A-Za-z ]{1,24}$")]
    capital: Annotated[str, pydantic.Field(pattern="^[A-Za-z ]{1,24}$")]


@pytest.fixture(scope="module")
def client(triton_server) -> openai.OpenAI:
    with run_frontend(triton_server.grpc_url) as frontend:
        yield frontend.openai()


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_response_format_json_schema(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask("Tell me about a big city, as JSON."), max_tokens=80, temperature=0.7, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), CITY)


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=ask("What is the capital of France?"),
                                          max_tokens=60, temperature=0, response_format=Capital)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital), reply


def test_response_format_json_object_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=ask('Reply in JSON: {"name": ..., "age": ...} for a cat named Tom who is 3.'),
                                            max_tokens=120, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text


def test_guided_choice_on_completions(client):
    reply = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                                      extra_body={"guided_choice": [" yes", " no"]})
    assert reply.choices[0].text in (" yes", " no")


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ask("Hi"), max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "wat"}}})
    error = info.value.body
    assert error["param"] == "response_format" and "does not compile" in error["message"], error


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Za-z/_]{1,32}$"}},
                   "required": ["zone"], "additionalProperties": False}}}


def test_tool_choice_required(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), max_tokens=60,
                                           temperature=0, tools=[WEATHER, TIME], tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert choice.message.tool_calls, choice
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])


def test_a_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("What is the weather in Rome?"), max_tokens=40, temperature=0, stream=True,
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c for c in stream if c.choices]
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "stop" and len(calls) == 1, chunks
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_tool_choice_required_with_n_choices_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=ask("What is the weather in Paris?"), max_tokens=60, temperature=0.8, seed=4,
                  tools=[WEATHER, TIME], tool_choice="required", n=2)
    whole = client.chat.completions.create(**kwargs)
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    streamed, reasons = {0: [], 1: []}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    assert streamed == {c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
                        for c in whole.choices}


def test_tool_choice_auto_is_a_clear_400(client):
    """SmolLM2's chat template has no tool-call format, so there is nothing to parse a call from."""
    for tool_choice in (openai.NOT_GIVEN, "auto"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=8, tools=[WEATHER],
                                           tool_choice=tool_choice)
        assert info.value.body["param"] == "tool_choice", info.value.body
        assert "auto" in info.value.body["message"] and "chat template" in info.value.body["message"]
