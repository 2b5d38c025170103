"""backend/protocol.py without Triton: the table, parse_request on numpy inputs, and the
arrays of every response (ResponseEncoder over engine outputs, encode_response)."""

from __future__ import annotations

import json
import re

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from backend.output import RequestOutput
from backend.paths import REPO_ROOT
from backend.protocol import (
    CUMULATIVE_LOGPROB,
    ERROR_TENSOR,
    EXCLUDE_INPUT,
    FINISH_REASON,
    INPUTS,
    LOGPROBS,
    MAX_SAMPLING_PARAMETERS_BYTES,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_NAMES,
    OUTPUTS,
    RETURN_FLAGS,
    RETURN_LOGPROBS,
    RETURN_TRACE,
    SAMPLING_PARAMETERS,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TRACE,
    BadRequest,
    ParsedRequest,
    ResponseEncoder,
    encode_response,
    error_output,
    parse_request,
    read_error_output,
)
from backend.request import RequestError
from backend.validation import parse_sampling_params


def text(value) -> np.ndarray:
    return np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=np.object_)


def flag(value) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


def reader(**inputs: np.ndarray):
    """`get_input` over these arrays, recording which names the parser asked for."""
    asked: list[str] = []

    def get_input(name: str):
        asked.append(name)
        return inputs.get(name)

    get_input.asked = asked
    return get_input


def parse(parameters: str = "", requested_outputs=OUTPUT_NAMES, **inputs: np.ndarray) -> ParsedRequest:
    return parse_request(reader(**inputs), parameters, requested_outputs)


def bad(match: str, parameters: str = "", **inputs: np.ndarray) -> str:
    with pytest.raises(BadRequest, match=match) as info:
        parse(parameters, **inputs)
    return str(info.value)


# ---------------------------------------------------------------------------- the table

def test_table_is_the_vllm_backend_interface_plus_the_trace():
    assert list(INPUTS) == [TEXT_INPUT, STREAM, SAMPLING_PARAMETERS, EXCLUDE_INPUT, *RETURN_FLAGS, RETURN_TRACE]
    assert [INPUTS[n].optional for n in INPUTS] == [False] + [True] * 9
    assert {n: INPUTS[n].datatype for n in INPUTS} == {
        "text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL",
        "return_finish_reason": "BOOL", "return_cumulative_logprob": "BOOL", "return_logprobs": "BOOL",
        "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL", "return_trace": "BOOL",
    }
    assert {n: (OUTPUTS[n].datatype, OUTPUTS[n].dims) for n in OUTPUTS} == {
        "text_output": ("BYTES", (-1,)), "finish_reason": ("BYTES", (-1,)), "cumulative_logprob": ("FP32", (-1,)),
        "logprobs": ("BYTES", (-1,)), "num_input_tokens": ("UINT32", (1,)), "num_output_tokens": ("UINT32", (-1,)),
        "trace": ("BYTES", (-1,)),
    }
    assert OUTPUT_NAMES == frozenset(OUTPUTS)
    # The model config entries auto_complete_config adds: "optional" only where it is true.
    assert INPUTS[TEXT_INPUT].config() == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}
    assert INPUTS[STREAM].config() == {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True}
    assert OUTPUTS[CUMULATIVE_LOGPROB].config() == {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]}


def test_served_config_declares_exactly_the_table():
    config = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    entry = re.compile(r'\{\s*name:\s*"(\w+)",\s*data_type:\s*(\w+),\s*dims:\s*\[\s*(-?\d+)\s*\](,\s*optional:\s*true)?\s*\}')

    def declared(section: str) -> list[dict]:
        block = re.search(section + r"\s*\[(.*?)\n\]", config, re.S).group(1)
        return [{"name": n, "data_type": t, "dims": [int(d)], **({"optional": True} if o else {})}
                for n, t, d, o in entry.findall(block)]

    assert declared("input") == [spec.config() for spec in INPUTS.values()]
    assert declared("output") == [spec.config() for spec in OUTPUTS.values()]


# ---------------------------------------------------------------------------- requests

def test_minimal_request_defaults():
    get_input = reader(text_input=text("Hello"))
    parsed = parse_request(get_input)
    assert parsed == ParsedRequest(prompt="Hello", sampling={}, stream=False, prepend_prompt=True,
                                   outputs=OUTPUT_NAMES)
    # Every switch is read from its input.
    assert set(get_input.asked) == set(INPUTS)


def test_full_request():
    sampling = {"temperature": 0, "max_tokens": "100", "stop": ["\n"]}
    parsed = parse(text_input=text("Once upon a time"), stream=flag(True), exclude_input_in_output=flag(True),
                   sampling_parameters=text(json.dumps(sampling)), return_logprobs=flag(False),
                   requested_outputs=[TEXT_OUTPUT, NUM_OUTPUT_TOKENS, "not_an_output"])
    assert parsed.prompt == "Once upon a time"
    assert parsed.sampling == sampling  # values are checked later, by SamplingParams
    assert parsed.stream and not parsed.prepend_prompt
    assert parsed.outputs == {TEXT_OUTPUT, NUM_OUTPUT_TOKENS}
    assert not parsed.needs_logprobs
    assert parse(text_input=text("x"), requested_outputs=[CUMULATIVE_LOGPROB]).needs_logprobs


def test_exclude_input_defaults_to_stream_and_decides_prepend():
    assert parse(text_input=text("p"), exclude_input_in_output=flag(True)).prepend_prompt is False
    assert parse(text_input=text("p"), exclude_input_in_output=flag(False)).prepend_prompt is True
    streamed = parse(text_input=text("p"), stream=flag(True))
    assert streamed.stream and not streamed.prepend_prompt


@pytest.mark.parametrize("value, expected", [
    (flag(True), True), (flag(False), False), (text("false"), False), (text(" TRUE "), True), (text("0"), False),
    (text(""), False), (np.array([1], dtype=np.int32), True), (np.array([0], dtype=np.int64), False),
])
def test_booleans_in_any_spelling(value, expected):
    # Not streamed: the prompt is prepended exactly when exclude_input_in_output is false.
    assert parse(text_input=text("p"), exclude_input_in_output=value).prepend_prompt == (not expected)


def test_sampling_values_from_request_parameters():
    # No sampling_parameters input: the request's parameters carry sampling values and switches.
    parameters = json.dumps({"max_tokens": "6", "temperature": 0, "stream": "true", "exclude_input_in_output": True,
                             "return_finish_reason": "false"})
    parsed = parse(parameters, text_input=text("p"))
    assert parsed.sampling == {"max_tokens": "6", "temperature": 0}
    assert parsed.stream and not parsed.prepend_prompt
    # An input tensor wins over the same switch among the parameters.
    parsed = parse(json.dumps({"stream": True}), text_input=text("p"), stream=flag(False))
    assert not parsed.stream and parsed.sampling == {}
    # With a sampling_parameters input, a request parameter is refused by name (HTTP generate
    # makes one of every unknown top-level field, e.g. a typo of sampling_parameters).
    message = bad("beside the sampling_parameters input", json.dumps({"sampling_parameter": "{}", "max_tokens": 1}),
                  text_input=text("p"), sampling_parameters=text('{"seed": 3}'))
    assert message.startswith("max_tokens: unknown field ['max_tokens', 'sampling_parameter'] beside the ")
    assert parse("{}", text_input=text("p"), sampling_parameters=text('{"seed": 3}')).sampling == {"seed": 3}
    # Empty texts are an empty object.
    assert parse("", text_input=text("p")).sampling == {}
    assert parse(text_input=text("p"), sampling_parameters=text("  ")).sampling == {}


def test_missing_or_empty_prompt():
    message = bad("missing required input")
    assert message == "missing required input 'text_input' (STRING, shape [1]): the prompt to complete"
    assert bad("empty", text_input=text("")) == "input 'text_input' is empty: send a non-empty prompt"


def test_prompt_not_utf8_or_not_text():
    assert bad("UTF-8", text_input=text(b"\xff\xfe")).startswith("text_input is not valid UTF-8: ")
    assert bad("must be a string", text_input=np.array([3.5], dtype=np.float32)) == \
        "text_input must be a string, got float32"


def test_more_than_one_element_names_the_input_and_shape():
    assert bad("exactly one", text_input=np.array([b"a", b"b"], dtype=np.object_)) == \
        "text_input must hold exactly one element, got shape [2]"
    assert bad("exactly one", text_input=text("p"), stream=np.zeros((1, 2), dtype=np.bool_)) == \
        "stream must hold exactly one element, got shape [1, 2]"
    assert bad("exactly one", text_input=text("p"), sampling_parameters=np.array([], dtype=np.object_)) == \
        "sampling_parameters must hold exactly one element, got shape [0]"


def test_bad_sampling_parameters():
    assert bad("not valid JSON", text_input=text("p"), sampling_parameters=text("{not json")).startswith(
        "sampling_parameters is not valid JSON: ")
    assert bad("JSON object", text_input=text("p"), sampling_parameters=text("[1, 2]")) == \
        "sampling_parameters must be a JSON object, got list"
    assert bad("not valid JSON", "{oops", text_input=text("p")).startswith("sampling_parameters is not valid JSON")
    assert bad("UTF-8", text_input=text("p"), sampling_parameters=text(b"\xff")).startswith(
        "sampling_parameters is not valid UTF-8")


def test_sampling_parameters_too_big_or_too_deep_name_the_input():
    huge = '{"stop": ["' + "x" * (1 << 20) + '"]}'
    assert bad("at most", text_input=text("p"), sampling_parameters=text(huge)) == \
        f"sampling_parameters: {len(huge)} bytes, at most {MAX_SAMPLING_PARAMETERS_BYTES} bytes"
    assert bad("at most", huge, text_input=text("p")).startswith("sampling_parameters: ")
    # Deep enough to reach the interpreter's recursion limit, small enough to pass the size check.
    for nested in ("[" * 20_000, '{"a": ' * 5_000 + "1" + "}" * 5_000):
        assert bad("nested too deeply", text_input=text("p"), sampling_parameters=text(nested)) == \
            "sampling_parameters: JSON nested too deeply (a flat object is expected)"


def test_bad_switches_name_the_switch():
    assert bad("boolean", text_input=text("p"), stream=text("yes please")) == \
        "stream must be a boolean, got 'yes please'"
    assert bad("boolean", json.dumps({"stream": "maybe"}), text_input=text("p")) == \
        "stream must be a boolean, got 'maybe'"
    assert bad("boolean", json.dumps({"return_logprobs": "perhaps"}), text_input=text("p")).startswith(
        f"{RETURN_LOGPROBS} must be a boolean")
    assert bad("boolean", text_input=text("p"), exclude_input_in_output=np.array([2], dtype=np.int32)) == \
        "exclude_input_in_output must be a boolean, got 2"


def test_stream_without_exclude_input_is_refused_in_the_vllm_backends_words():
    assert bad("not allowed", text_input=text("p"), stream=flag(True), exclude_input_in_output=flag(False)) == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed.")


# ---------------------------------------------------------------------------- responses

def engine_output(text_delta: str = "", tokens: int = 0, finished: bool = False, reason: str | None = None,
                  num_output_tokens: int = 0, cumulative: float | None = -1.5, logprobs: list[dict] | None = None,
                  prompt_text: str = "") -> RequestOutput:
    return RequestOutput(request_id="r", text_delta=text_delta, token_ids_delta=list(range(tokens)),
                         finished=finished, finish_reason=reason, num_prompt_tokens=7,
                         num_output_tokens=num_output_tokens, prompt_text=prompt_text,
                         cumulative_logprob=cumulative, logprobs_delta=logprobs)


def value(arrays: dict[str, np.ndarray], name: str):
    element = arrays[name].reshape(-1)[0]
    return element.decode("utf-8") if isinstance(element, bytes) else element


def request(stream: bool, prepend: bool = False, outputs=OUTPUT_NAMES) -> ParsedRequest:
    return ParsedRequest(prompt="Say:", sampling={}, stream=stream, prepend_prompt=prepend, outputs=frozenset(outputs))


def test_encode_response_has_every_asked_output_with_its_dtype():
    arrays = encode_response(OUTPUT_NAMES, text="héllo", finish_reason="stop", cumulative_logprob=-2.25,
                             logprobs=[{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}],
                             num_input_tokens=7, num_output_tokens=3)
    assert list(arrays) == list(OUTPUTS)  # the table's order
    for name, array in arrays.items():
        assert array.shape == (1,) and array.dtype == OUTPUTS[name].numpy_dtype, name
    assert arrays[TEXT_OUTPUT][0] == "héllo".encode("utf-8")
    assert value(arrays, FINISH_REASON) == "stop"
    assert value(arrays, CUMULATIVE_LOGPROB) == np.float32(-2.25)
    assert json.loads(value(arrays, LOGPROBS)) == [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}]
    assert (value(arrays, NUM_INPUT_TOKENS), value(arrays, NUM_OUTPUT_TOKENS)) == (7, 3)
    assert value(arrays, TRACE) == "null"  # no trace asked for


def test_encode_response_only_asked_outputs_and_stand_ins():
    arrays = encode_response({TEXT_OUTPUT, FINISH_REASON, LOGPROBS}, text="", finish_reason=None,
                             cumulative_logprob=None, logprobs=None, num_input_tokens=1, num_output_tokens=0)
    assert set(arrays) == {TEXT_OUTPUT, FINISH_REASON, LOGPROBS}
    assert value(arrays, TEXT_OUTPUT) == ""
    assert value(arrays, FINISH_REASON) == "None"  # not the final response
    assert value(arrays, LOGPROBS) == "null"
    assert encode_response((), text="x", finish_reason="stop", cumulative_logprob=0.0, logprobs=None,
                           num_input_tokens=1, num_output_tokens=1) == {}


def test_streamed_responses_carry_deltas_and_counts_since_the_last_response():
    encoder = ResponseEncoder(request(stream=True))
    lp = [{"1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}}]
    first = encoder.encode(engine_output("Hel", tokens=1, num_output_tokens=1, logprobs=lp))
    assert value(first, TEXT_OUTPUT) == "Hel" and value(first, NUM_OUTPUT_TOKENS) == 1
    assert value(first, FINISH_REASON) == "None" and json.loads(value(first, LOGPROBS)) == lp
    # A token that adds no text (half a UTF-8 character) sends nothing; its count and
    # logprob ride on the next response.
    assert encoder.encode(engine_output("", tokens=1, num_output_tokens=2, logprobs=lp)) is None
    second = encoder.encode(engine_output("lo", tokens=1, num_output_tokens=3, logprobs=lp))
    assert value(second, TEXT_OUTPUT) == "lo" and value(second, NUM_OUTPUT_TOKENS) == 2
    assert len(json.loads(value(second, LOGPROBS))) == 2
    # The final response may be empty, and still carries every output.
    final = encoder.encode(engine_output("", finished=True, reason="length", num_output_tokens=3, cumulative=-4.0))
    assert set(final) == OUTPUT_NAMES
    assert value(final, TEXT_OUTPUT) == "" and value(final, FINISH_REASON) == "length"
    assert value(final, NUM_OUTPUT_TOKENS) == 0 and value(final, LOGPROBS) == "null"
    assert value(final, CUMULATIVE_LOGPROB) == np.float32(-4.0) and value(final, NUM_INPUT_TOKENS) == 7
    assert value(final, TRACE) == "null"


def test_after_the_first_text_a_streamed_response_waits_for_stream_interval_tokens():
    encoder = ResponseEncoder(request(stream=True), stream_interval=3)
    first = encoder.encode(engine_output("a", tokens=1, num_output_tokens=1))
    assert value(first, TEXT_OUTPUT) == "a" and value(first, NUM_OUTPUT_TOKENS) == 1  # the first text at once
    assert encoder.encode(engine_output("b", tokens=1, num_output_tokens=2)) is None
    assert encoder.encode(engine_output("c", tokens=1, num_output_tokens=3)) is None
    third = encoder.encode(engine_output("d", tokens=1, num_output_tokens=4))
    assert value(third, TEXT_OUTPUT) == "bcd" and value(third, NUM_OUTPUT_TOKENS) == 3
    assert encoder.encode(engine_output("e", tokens=1, num_output_tokens=5)) is None
    final = encoder.encode(engine_output("", finished=True, reason="length", num_output_tokens=5))
    assert value(final, TEXT_OUTPUT) == "e" and value(final, NUM_OUTPUT_TOKENS) == 1  # the rest, at the end
    assert value(final, FINISH_REASON) == "length"


@pytest.mark.parametrize("bad", [0, -2, True, "two", 2.5])
def test_a_requests_stream_interval_is_a_positive_whole_number(bad):
    with pytest.raises(RequestError) as info:
        parse_sampling_params({"stream_interval": bad})
    assert info.value.param == "stream_interval" and info.value.code == "INVALID_ARG", str(info.value)
    assert parse_sampling_params({"stream_interval": "4"}).stream_interval == 4
    assert parse_sampling_params({}).stream_interval is None  # the model's stream_interval


@settings(max_examples=200, deadline=None)
@given(interval=st.integers(1, 6), texts=st.lists(st.sampled_from(["", "x", "yz"]), min_size=1, max_size=30))
def test_stream_interval_sends_every_token_once_in_fewer_responses(interval, texts):
    """Whatever the interval and wherever text is missing (a token that ends half a
    character), the responses carry every token and all the text once, in order; each one
    between the first and the final carries at least `interval` tokens."""
    encoder = ResponseEncoder(request(stream=True), stream_interval=interval)
    responses = []
    for i, piece in enumerate(texts):
        last = i == len(texts) - 1
        arrays = encoder.encode(engine_output(piece, tokens=1, num_output_tokens=i + 1, finished=last,
                                              reason="length" if last else None))
        if arrays is not None:
            responses.append((value(arrays, TEXT_OUTPUT), int(value(arrays, NUM_OUTPUT_TOKENS))))
    assert "".join(text for text, _ in responses) == "".join(texts)
    assert sum(tokens for _, tokens in responses) == len(texts)
    first_text = next((i for i, piece in enumerate(texts) if piece), None)
    if first_text is not None and first_text < len(texts) - 1:
        assert responses[0] == (texts[first_text], first_text + 1)  # nothing held back before the first text
    assert all(tokens >= interval for _, tokens in responses[1:-1])
    assert len(responses) <= 2 + len(texts) // interval


def test_return_trace_is_a_switch_and_the_trace_rides_on_the_final_response_only():
    assert parse(text_input=text("p")).trace is False
    assert parse(text_input=text("p"), return_trace=flag(True)).trace is True
    assert parse('{"return_trace": "true", "max_tokens": 3}', text_input=text("p")).trace is True
    bad("return_trace must be a boolean", text_input=text("p"), return_trace=text("maybe"))
    encoder = ResponseEncoder(request(stream=True))
    trace = {"events": [{"event": "queued", "step": 1, "t_ms": 0.0}], "decode": None}
    middle = engine_output("a", tokens=1, num_output_tokens=1)
    middle.trace = None
    assert value(encoder.encode(middle), TRACE) == "null"
    final = engine_output("", finished=True, reason="stop", num_output_tokens=1)
    final.trace = trace
    assert json.loads(value(encoder.encode(final), TRACE)) == trace


def test_one_response_with_the_whole_text_when_not_streamed():
    encoder = ResponseEncoder(request(stream=False, prepend=False))
    assert encoder.encode(engine_output("Par", tokens=1, num_output_tokens=1)) is None
    assert encoder.encode(engine_output("is", tokens=1, num_output_tokens=2)) is None
    final = encoder.encode(engine_output(".", tokens=1, finished=True, reason="stop", num_output_tokens=3))
    assert set(final) == OUTPUT_NAMES
    assert value(final, TEXT_OUTPUT) == "Paris." and value(final, NUM_OUTPUT_TOKENS) == 3
    assert value(final, FINISH_REASON) == "stop"


def test_prompt_prepended_unless_excluded():
    encoder = ResponseEncoder(request(stream=False, prepend=True))
    encoder.encode(engine_output(" yes", tokens=1, num_output_tokens=1))
    final = encoder.encode(engine_output("", finished=True, reason="stop", num_output_tokens=1,
                                         prompt_text="<s>Say:"))
    assert value(final, TEXT_OUTPUT) == "<s>Say: yes"  # the engine's prompt text when it has one
    encoder = ResponseEncoder(request(stream=False, prepend=True))
    final = encoder.encode(engine_output(" no", tokens=1, finished=True, reason="stop", num_output_tokens=1))
    assert value(final, TEXT_OUTPUT) == "Say: no"


def test_responses_carry_only_the_asked_outputs():
    encoder = ResponseEncoder(request(stream=True, outputs={TEXT_OUTPUT}))
    assert set(encoder.encode(engine_output("a", tokens=1, num_output_tokens=1, cumulative=None))) == {TEXT_OUTPUT}
    assert set(encoder.encode(engine_output("", finished=True, reason="stop", cumulative=None))) == {TEXT_OUTPUT}


def _stream_of(steps: list[tuple[str, int]]) -> list[RequestOutput]:
    """The engine outputs of one stream: each step's text delta and token count, the last one final."""
    outputs, total = [], 0
    for i, (text_delta, tokens) in enumerate(steps):
        total += tokens
        lp = [{str(total - tokens + k): {"logprob": -0.25 * k, "rank": 1, "decoded_token": "t"}} for k in range(tokens)]
        last = i == len(steps) - 1
        outputs.append(engine_output(text_delta, tokens=tokens, finished=last, reason="length" if last else None,
                                     num_output_tokens=total, cumulative=-0.5 * total, logprobs=lp or None))
    return outputs


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["", "a", "é", " b"]), st.integers(0, 2)), min_size=1, max_size=12),
       absorbed=st.lists(st.booleans(), min_size=12, max_size=12))
def test_absorbed_outputs_ride_on_the_next_response_and_nothing_is_lost(steps, absorbed):
    # The response thread absorbs the outputs of a stream that queued up behind a later one.
    # The client must see the same text, token count and logprobs as from one response per output.
    def responses(absorb_mask):
        encoder, sent = ResponseEncoder(request(stream=True)), []
        for output, absorb in zip(_stream_of(steps), absorb_mask):
            if absorb and not output.finished:
                encoder.absorb(output)
            elif (arrays := encoder.encode(output)) is not None:
                sent.append(arrays)
        return sent

    def seen(sent):
        text = "".join(value(r, TEXT_OUTPUT) for r in sent)
        tokens = sum(int(value(r, NUM_OUTPUT_TOKENS)) for r in sent)
        logprobs = [entry for r in sent for entry in json.loads(value(r, LOGPROBS)) or []]
        return text, tokens, logprobs, value(sent[-1], FINISH_REASON), value(sent[-1], CUMULATIVE_LOGPROB)

    every, merged = responses([False] * len(steps)), responses(absorbed)
    assert seen(merged) == seen(every)
    assert len(merged) <= len(every)
    assert [value(r, FINISH_REASON) for r in merged[:-1]] == ["None"] * (len(merged) - 1)
    # Every response before the final one carries text: a client never gets an empty chunk mid-stream.
    assert all(value(r, TEXT_OUTPUT) for r in merged[:-1])


@given(code=st.sampled_from(["CANCELLED", "UNAVAILABLE", "INVALID_ARG", "INTERNAL"]), message=st.text(max_size=200))
def test_an_error_output_gives_back_its_code_and_message(code, message):
    array = error_output(message, code)
    assert array.shape == (1,) and array.dtype == np.object_ and ERROR_TENSOR not in OUTPUT_NAMES
    assert read_error_output(array) == (code, message)
