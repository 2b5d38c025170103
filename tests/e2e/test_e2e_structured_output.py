"""Structured outputs through the real tritonserver and the default model (SmolLM2): a JSON
schema over a gRPC stream, a choice over HTTP generate, and a constraint that does not compile
refused with INVALID_ARG naming `structured_outputs` while the others run."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from tests.e2e.e2e_util import Stream, inputs_for, wait_for

pytestmark = pytest.mark.e2e

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server


def test_json_schema_over_a_grpc_stream_and_a_bad_schema_beside_it(server):
    prompt = CHAT.format("Describe a person who lives in Paris, as JSON.")
    with Stream(server.grpc_url) as stream, Stream(server.grpc_url) as bad_stream:
        sent = [stream.send(server.model, inputs_for(prompt, {
            "temperature": 0.8, "seed": seed, "max_tokens": 80, "structured_outputs": {"json": PERSON}},
            stream=True, exclude_input=True, returns=("return_finish_reason",))) for seed in range(4)]
        bad = bad_stream.send(server.model, inputs_for(prompt, {
            "max_tokens": 8, "structured_outputs": json.dumps({"json": {"$ref": "#/$defs/nowhere"}})}))
        assert "structured_outputs" in wait_for(bad).message and bad.finals == 1 and not bad.responses, bad.message
        for outcome in sent:
            wait_for(outcome)
            assert outcome.error is None, outcome.message
            jsonschema.validate(json.loads(outcome.text), PERSON)


def test_choice_over_http_generate(server):
    body = {
        "text_input": CHAT.format("Is the sky blue? Answer yes or no."),
        "exclude_input_in_output": True,
        "parameters": {"temperature": 0, "max_tokens": 8,
                       "structured_outputs": json.dumps({"choice": ["yes", "no", "it depends"]})},
    }
    r = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] in ("yes", "no", "it depends")


def test_two_constraints_are_refused_over_http(server):
    body = {"text_input": "Hi", "sampling_parameters": json.dumps({"structured_outputs": {"regex": "a", "choice": ["a"]}})}
    r = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", json=body, timeout=60)
    assert r.status_code == 400 and "structured_outputs" in r.text and "exactly one" in r.text, r.text
