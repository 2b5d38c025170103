"""`structured_outputs` in sampling_parameters: what is accepted, and that every refusal
names `structured_outputs` and says what is wrong."""

from __future__ import annotations

import json

import pytest

from backend.request import MAX_STRUCTURED_OUTPUT_CHARS, RequestError
from backend.validation import parse_sampling_params

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("given, kind, text", [
    ({"json": SCHEMA}, "json", json.dumps(SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
    (json.dumps({"regex": "[0-9]+"}), "regex", "[0-9]+"),
    ({"choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"json_object": True}, "json_object", "true"),
    ({"json_object": "true"}, "json_object", "true"),
])
def test_accepted_forms(given, kind, text):
    params = parse_sampling_params({"structured_outputs": given})
    assert params.structured_outputs.constraint == (kind, text)


def test_a_schema_keeps_its_property_order():
    """The order of `properties` is the order they are generated in: not normalised away."""
    kind, text = parse_sampling_params({"structured_outputs": {"json": SCHEMA}}).structured_outputs.constraint
    assert list(json.loads(text)["properties"]) == ["b", "a"]


@pytest.mark.parametrize("given, needle", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json_object": False}, "must be true"),
    ({"choice": []}, "at least 1"),
    ({"regex": ""}, "at least 1"),
    ({"json": "[1, 2]"}, "JSON object"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"whitespace_pattern": " "}, "whitespace_pattern"),
    ("{bad", "not valid JSON"),
    ([1], "JSON object"),
    ({"grammar": "x" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)}, str(MAX_STRUCTURED_OUTPUT_CHARS)),
])
def test_refusals_name_structured_outputs(given, needle):
    with pytest.raises(RequestError) as info:
        parse_sampling_params({"structured_outputs": given})
    assert info.value.code == RequestError.INVALID_ARG
    assert str(info.value).startswith("structured_outputs: ") and needle in str(info.value), str(info.value)
