"""The wire interface of the inflight backend: Triton's vLLM backend's inputs and outputs.

Plain Python + numpy, so that the Triton adapter (``model.py``), the clients and unit
tests share one table and one parser:

- ``INPUTS`` and ``OUTPUTS``: name, Triton data type, dims, optional; clients build their
  requests from them (``client/triton.py``) and ``model.py`` declares them to Triton.
- ``parse_request``: one request's inputs (numpy arrays by name) and request parameters
  into a ``ParsedRequest``, or ``BadRequest`` naming the input and the limit.
- ``ResponseEncoder`` and ``encode_sequences``: one request's engine outputs into the numpy
  arrays of its responses, by output name; per-sequence outputs have shape [n] for a request
  with ``n`` sequences (``encode_response``: the one-sequence case).

Responses: ``stream`` true sends one response per new piece of text, and the last
response (which may carry an empty string) is the final one. ``stream`` false sends
exactly one final response with the whole text, so HTTP ``/generate`` works; unless
``exclude_input_in_output`` is true the prompt is prepended to it (like Triton's vLLM
backend).

Every response carries every output its request asks for: Triton's requested outputs,
which are all seven declared outputs unless the client names some. perf_analyzer 2.51
names all seven, and for an output a response lacks it exports whatever bytes its empty
buffer points at: a float among them that reads as NaN stops its JSON writer before the
first flush and leaves genai-perf a zero-length profile export. The ``return_*`` inputs of
Triton's vLLM backend are accepted and validated but add nothing: an output a client
names or leaves to the default is already there (and Triton drops the ones it did not ask
for).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

if TYPE_CHECKING:
    from backend.output import RequestOutput

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT = "exclude_input_in_output"
# The BOOL inputs with which Triton's vLLM backend adds its optional outputs. This backend
# accepts them, but answers every output a request asks for whatever they say.
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
RETURN_LOGPROBS = "return_logprobs"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_FLAGS = (
    RETURN_FINISH_REASON,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
)
# Disaggregated serving (backend/disagg.py): the handle of a request's KV transfer, an
# output (TYPE_STRING [1]) of a role-prefill model and an input of a role-decode model.
TRANSFER_TENSOR = "transfer"
# Disaggregated serving: an output (TYPE_STRING [1]) of a role-decode model. A request the
# `llm` BLS model sent (it carries `cancel_flag`) that asks for it gets its error, once it was
# taken in, as this output of an ordinary final response, JSON
# {"code": "CANCELLED", "message": "..."}, instead of as the response's error: tritonserver
# 2.51's Python backend loses a BLS model's error response that is not a request's first
# (python_backend r24.10 InferResponse::SaveToSharedMemory writes no response id for an
# error, so the stub files it under no iterator and the BLS model's iterator never ends;
# fixed upstream in r25.05), and a decode model's error mostly comes after its first tokens.
ERROR_TENSOR = "error"
# This backend's own: the final response carries the request's trace (backend/trace.py).
RETURN_TRACE = "return_trace"
# Request-level switches (BOOL[1] inputs). When a client sends no `sampling_parameters`
# input, they may also arrive among the request's parameters (HTTP generate's
# "parameters": {...}), as Triton's vLLM backend accepts them.
REQUEST_SWITCHES = (STREAM, EXCLUDE_INPUT) + RETURN_FLAGS + (RETURN_TRACE,)

TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
LOGPROBS = "logprobs"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
TRACE = "trace"

# Triton's config data type -> (the datatype a client names on the wire, numpy dtype).
_DATA_TYPES: dict[str, tuple[str, Any]] = {
    "TYPE_STRING": ("BYTES", np.object_),
    "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_FP32": ("FP32", np.float32),
    "TYPE_UINT32": ("UINT32", np.uint32),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model, as config.pbtxt declares it."""

    name: str
    data_type: str  # Triton's config type, a key of _DATA_TYPES
    dims: tuple[int, ...]
    optional: bool = False

    def __post_init__(self) -> None:
        assert self.data_type in _DATA_TYPES, self.data_type

    @property
    def datatype(self) -> str:
        """The datatype clients name for this tensor ("BYTES" for TYPE_STRING)."""
        return _DATA_TYPES[self.data_type][0]

    @property
    def numpy_dtype(self) -> Any:
        return _DATA_TYPES[self.data_type][1]

    def config(self) -> dict[str, Any]:
        """The entry of `input` or `output` in a model config (auto_complete_config)."""
        entry: dict[str, Any] = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if self.optional:
            entry["optional"] = True
        return entry


def _table(*specs: TensorSpec) -> dict[str, TensorSpec]:
    return {spec.name: spec for spec in specs}


INPUTS = _table(
    TensorSpec(TEXT_INPUT, "TYPE_STRING", (1,)),
    TensorSpec(STREAM, "TYPE_BOOL", (1,), optional=True),
    TensorSpec(SAMPLING_PARAMETERS, "TYPE_STRING", (1,), optional=True),
    TensorSpec(EXCLUDE_INPUT, "TYPE_BOOL", (1,), optional=True),
    *(TensorSpec(name, "TYPE_BOOL", (1,), optional=True) for name in RETURN_FLAGS),
    TensorSpec(RETURN_TRACE, "TYPE_BOOL", (1,), optional=True),
)
OUTPUTS = _table(
    TensorSpec(TEXT_OUTPUT, "TYPE_STRING", (-1,)),
    TensorSpec(FINISH_REASON, "TYPE_STRING", (-1,)),
    TensorSpec(CUMULATIVE_LOGPROB, "TYPE_FP32", (-1,)),
    TensorSpec(LOGPROBS, "TYPE_STRING", (-1,)),
    TensorSpec(NUM_INPUT_TOKENS, "TYPE_UINT32", (1,)),
    TensorSpec(NUM_OUTPUT_TOKENS, "TYPE_UINT32", (-1,)),
    TensorSpec(TRACE, "TYPE_STRING", (-1,)),
)
OUTPUT_NAMES = frozenset(OUTPUTS)


class BadRequest(Exception):
    """A problem with one request's inputs: answered with INVALID_ARG."""


# The largest `sampling_parameters` (or request parameters) text a request may carry: the
# longest valid one (64 stop strings of 256 characters and every other value) is ~20 KB, and
# parsing and validating a bigger one costs the stub time that every request shares.
MAX_SAMPLING_PARAMETERS_BYTES = 64 * 1024


# ---------------------------------------------------------------------------- requests

def _parse_bool(name: str, value: Any) -> bool:
    """A boolean from a tensor element or a JSON value; the string "false" is false."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off", ""):
            return False
    elif isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    raise BadRequest(f"{name} must be a boolean, got {value!r}")


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"{name} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise BadRequest(f"{name} must be a string, got {type(value).__name__}")


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    # The client's sampling values, not validated yet (validation.parse_sampling_params does that).
    sampling: dict[str, Any]
    stream: bool
    prepend_prompt: bool
    # The declared outputs this request asks for (Triton fills in all of them when a
    # client names none); each response carries exactly these.
    outputs: frozenset[str]
    trace: bool = False

    @property
    def needs_logprobs(self) -> bool:
        """Whether the engine must compute every sampled token's logprob for this request."""
        return CUMULATIVE_LOGPROB in self.outputs


def parse_request(get_input: Callable[[str], np.ndarray | None], parameters: str = "",
                  requested_outputs: Iterable[str] = OUTPUT_NAMES) -> ParsedRequest:
    """Read and validate one request (sampling values are checked later, by SamplingParams).

    `get_input(name)` is the numpy array of an input, or None when the request lacks it;
    `parameters` the request's parameters as JSON text (Triton's `request.parameters()`);
    `requested_outputs` the output names Triton asks for."""

    def single(name: str) -> Any | None:
        """The one element of a [1]-shaped input, or None when absent."""
        array = get_input(name)
        if array is None:
            return None
        if array.size != 1:
            raise BadRequest(f"{name} must hold exactly one element, got shape {list(array.shape)}")
        return array.reshape(-1)[0]

    raw_prompt = single(TEXT_INPUT)
    if raw_prompt is None:
        raise BadRequest(f"missing required input '{TEXT_INPUT}' (STRING, shape [1]): the prompt to complete")
    prompt = _text(TEXT_INPUT, raw_prompt)
    if not prompt:
        raise BadRequest(f"input '{TEXT_INPUT}' is empty: send a non-empty prompt")

    raw_params = single(SAMPLING_PARAMETERS)
    from_request_parameters = raw_params is None
    if raw_params is None:
        raw_params = parameters or "{}"
    else:
        _refuse_request_parameters_beside_input(parameters)
    size = len(raw_params.encode() if isinstance(raw_params, str) else raw_params) if isinstance(raw_params, (bytes, str)) else 0
    if size > MAX_SAMPLING_PARAMETERS_BYTES:
        raise BadRequest(f"{SAMPLING_PARAMETERS}: {size} bytes, at most {MAX_SAMPLING_PARAMETERS_BYTES} bytes")
    params_text = _text(SAMPLING_PARAMETERS, raw_params).strip() or "{}"
    try:
        sampling = json.loads(params_text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"{SAMPLING_PARAMETERS} is not valid JSON: {exc}") from None
    except RecursionError:
        # json's C scanner stops at the interpreter's recursion limit (~1,000 levels); no
        # valid value nests beyond two.
        raise BadRequest(f"{SAMPLING_PARAMETERS}: JSON nested too deeply (a flat object is expected)") from None
    if not isinstance(sampling, dict):
        raise BadRequest(f"{SAMPLING_PARAMETERS} must be a JSON object, got {type(sampling).__name__}")

    switches: dict[str, bool] = {}
    if from_request_parameters:
        # HTTP generate's "parameters": {...} carries switches and sampling values together.
        for name in REQUEST_SWITCHES:
            if name in sampling:
                switches[name] = _parse_bool(name, sampling.pop(name))
    for name in REQUEST_SWITCHES:
        value = single(name)
        if value is not None:
            switches[name] = _parse_bool(name, value)

    stream = switches.get(STREAM, False)
    exclude = switches.get(EXCLUDE_INPUT, stream)
    if stream and not exclude:
        # Streamed responses carry only new text, never the prompt. The text is Triton's vLLM
        # backend's, word for word: clients and tests written against it match on it.
        raise BadRequest(f"Error generating stream: When streaming, `{EXCLUDE_INPUT}` = False is not allowed.")
    return ParsedRequest(
        prompt=prompt,
        sampling=sampling,
        stream=stream,
        prepend_prompt=not stream and not exclude,
        outputs=frozenset(requested_outputs) & OUTPUT_NAMES,
        trace=switches.get(RETURN_TRACE, False),
    )


def _refuse_request_parameters_beside_input(parameters: str) -> None:
    """Request parameters are read only when the request has no `sampling_parameters` input.

    HTTP generate turns every top-level field of its body that is not an input's name into a
    request parameter, so a typo such as "sampling_parameter" beside `sampling_parameters`
    arrives here, and would otherwise be ignored without a word."""
    if not parameters:
        return
    try:
        given = json.loads(parameters)
    except (json.JSONDecodeError, RecursionError):
        raise BadRequest("parameters: not valid JSON") from None
    if isinstance(given, dict) and given:
        name = sorted(given)[0]
        raise BadRequest(
            f"{name}: unknown field {sorted(given)} beside the {SAMPLING_PARAMETERS} input; the inputs are "
            f"{list(INPUTS)}, and sampling values belong inside {SAMPLING_PARAMETERS}"
        )


# ---------------------------------------------------------------------------- responses

def encode_response(outputs: Iterable[str], *, text: str, finish_reason: str | None,
                    cumulative_logprob: float | None, logprobs: list[dict] | None,
                    num_input_tokens: int, num_output_tokens: int, trace: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays of one response of a one-sequence request (each of shape [1])."""
    return encode_sequences(outputs, texts=[text], finish_reasons=[finish_reason],
                            cumulative_logprobs=[cumulative_logprob], logprobs=[logprobs],
                            num_input_tokens=num_input_tokens, num_output_tokens=[num_output_tokens], trace=trace)


def encode_sequences(outputs: Iterable[str], *, texts: list[str], finish_reasons: list[str | None],
                     cumulative_logprobs: list[float | None], logprobs: list[list[dict] | None],
                     num_input_tokens: int, num_output_tokens: list[int],
                     trace: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays of one response, by output name, for each of `outputs`: per sequence
    (`n` of them, as Triton's vLLM backend: shape [n]) text, finish reason, cumulative
    logprob, logprobs and output token count; `num_input_tokens` and `trace` once.

    A `finish_reason` None (a sequence not finished yet) is sent as "None"; `logprobs` and
    `trace` None as JSON null; a `cumulative_logprob` must be a number when asked for."""
    outputs = frozenset(outputs)
    arrays: dict[str, np.ndarray] = {}
    if TEXT_OUTPUT in outputs:
        arrays[TEXT_OUTPUT] = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
    if FINISH_REASON in outputs:
        arrays[FINISH_REASON] = np.array([str(r).encode() for r in finish_reasons], dtype=np.object_)
    if CUMULATIVE_LOGPROB in outputs:
        # Never None here: asking for this output makes the engine compute every token's
        # logprob (ParsedRequest.needs_logprobs), and a NaN stand-in would break
        # perf_analyzer's export.
        arrays[CUMULATIVE_LOGPROB] = np.array([float(c) for c in cumulative_logprobs], dtype=np.float32)
    if LOGPROBS in outputs:
        # vLLM's JSON: per token {token id: {"logprob", "rank", "decoded_token"}}; null
        # unless sampling_parameters asked for "logprobs".
        arrays[LOGPROBS] = np.array([json.dumps(lp).encode() for lp in logprobs], dtype=np.object_)
    if NUM_INPUT_TOKENS in outputs:
        arrays[NUM_INPUT_TOKENS] = np.array([num_input_tokens], dtype=np.uint32)
    if NUM_OUTPUT_TOKENS in outputs:
        arrays[NUM_OUTPUT_TOKENS] = np.array(num_output_tokens, dtype=np.uint32)
    if TRACE in outputs:
        # JSON null unless the request sent return_trace, and then on its final response only.
        arrays[TRACE] = np.array([json.dumps(trace).encode()], dtype=np.object_)
    return arrays


@dataclass(eq=False)
class _Sequence:
    """What a response encoder keeps of one sequence between responses."""

    text: list[str] = field(default_factory=list)  # not streamed: the text so far; streamed: since the last response
    pending_tokens: int = 0
    pending_logprobs: list[dict] = field(default_factory=list)
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None

    def add(self, output: RequestOutput) -> None:
        self.text.append(output.text_delta)
        self.pending_tokens += len(output.token_ids_delta)
        if output.logprobs_delta:
            self.pending_logprobs.extend(output.logprobs_delta)
        self.num_output_tokens = output.num_output_tokens
        if output.cumulative_logprob is not None:
            self.cumulative_logprob = output.cumulative_logprob
        if output.finished:
            self.finish_reason = output.finish_reason


@dataclass(eq=False)
class ResponseEncoder:
    """Turns one request's engine outputs, fed in order, into the arrays of its responses.

    A streamed response reports, per sequence, the text, tokens and logprobs since the
    previous response (an output that adds no text adds its tokens to the next response);
    the one response of a request that is not streamed reports them all. A request with
    `n` > 1 gets arrays of shape [n] (RequestOutput.sequences and .returned say which).

    `stream_interval` (vLLM's): after a stream's first text, a response waits until some
    sequence has that many tokens since the previous one, or the request ends. Every response
    is a round trip through tritonserver, so fewer of them leave more CPU to the engine; the
    client sees the same text in fewer, larger pieces."""

    request: ParsedRequest
    stream_interval: int = 1
    sequences: list[_Sequence] = field(default_factory=list)
    text_sent: bool = False

    def encode(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        """The arrays of the response `output` calls for, or None when it calls for none
        (not final, and either not streamed, without new text since the last response, or
        short of `stream_interval` tokens since then)."""
        self.absorb(output)
        if not output.finished:
            if not (self.request.stream and any(text for s in self.sequences for text in s.text)):
                return None
            if self.text_sent and max(s.pending_tokens for s in self.sequences) < self.stream_interval:
                return None
            self.text_sent = True
        returned = output.returned if output.returned is not None else [0]
        chosen = [self.sequences[i] for i in returned]
        texts = ["".join(s.text) for s in chosen]
        if not self.request.stream and self.request.prepend_prompt:
            prompt = output.prompt_text or self.request.prompt
            texts = [prompt + t for t in texts]
        # A sequence that never ran (its group ended before the fork) ends with its group.
        group_reason = output.finish_reason if output.finished else None
        arrays = encode_sequences(
            self.request.outputs,
            texts=texts,
            finish_reasons=[s.finish_reason or group_reason for s in chosen],
            cumulative_logprobs=[s.cumulative_logprob for s in chosen],
            logprobs=[s.pending_logprobs or None for s in chosen],
            num_input_tokens=output.num_prompt_tokens,
            num_output_tokens=[s.pending_tokens if self.request.stream else s.num_output_tokens for s in chosen],
            trace=output.trace,
        )
        for s in self.sequences:
            if self.request.stream:
                s.text.clear()
            s.pending_tokens = 0
            s.pending_logprobs = []
        return arrays

    def absorb(self, output: RequestOutput) -> None:
        """Keeps what `output` adds for the next response, and makes no response of its own."""
        per_sequence = output.sequences if output.sequences is not None else [output]
        returned = output.returned if output.returned is not None else [0]
        while len(self.sequences) < max(len(per_sequence), max(returned) + 1):
            self.sequences.append(_Sequence())
        for state, seq_output in zip(self.sequences, per_sequence):
            if seq_output is not None:
                state.add(seq_output)


def error_output(message: str, code: str) -> np.ndarray:
    """The ERROR_TENSOR output that carries an error `code` (a pb_utils.TritonError name) and
    its `message`."""
    return np.array([json.dumps({"code": code, "message": message}).encode()], dtype=np.object_)


def read_error_output(array: np.ndarray) -> tuple[str, str]:
    """(code, message) of an ERROR_TENSOR output."""
    value = array.reshape(-1)[0]
    error = json.loads(value.decode() if isinstance(value, bytes) else str(value))
    return str(error["code"]), str(error["message"])
