"""Translation between the two APIs: an OpenAI request becomes a ``Job``, whose Triton
inputs carry the backend's ``sampling_parameters``; the backend's responses and errors
become OpenAI's objects, server-sent events and error JSON.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from backend.protocol import (
    RETURN_FINISH_REASON,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    TRANSFER_TENSOR,
)
from backend.request import RequestError
from backend.validation import parse_sampling_params
from client.openai.schema import ApiError, ChatCompletionRequest, CompletionRequest
from client.openai.tool_calls import ToolCall, ToolCallSplitter, call_id, split_tool_calls
from client.triton import is_final, make_inputs

# The backend outputs that every OpenAI response is built from: finish_reason and usage.
# return_logprobs is added only when the client asks for logprobs.
OPENAI_RETURN_FLAGS = (RETURN_FINISH_REASON, RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS)
# Fields of both endpoints that the backend's sampling_parameters takes under the same name.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
                    "bad_words", "priority", "n", "stream_interval")


# The key of kv_transfer_params that carries a role-prefill model's transfer handle
# (backend/disagg.py) from its answer to the role-decode model. vLLM's own keys (remote_engine_id,
# remote_block_ids, ...) name NIXL's transfers; a router copies the whole object unread.
KV_TRANSFER_HANDLE = "inflight_transfer"


# Messages the backend (backend/model.py, backend/engine.py) and Triton send. Triton's
# gRPC stream carries only an error's message, not its code, so the code is recovered
# from the message: UNAVAILABLE and INTERNAL are recognised; the rest of what the backend
# refuses is request validation (INVALID_ARG: "<param>: <why>").
_UNAVAILABLE = re.compile(r"queue is full|retry later|shutting down|unavailable|not ready", re.I)
_INTERNAL = re.compile(r"^(internal error|engine error|could not send)", re.I)
_UNKNOWN_MODEL = re.compile(r"unknown model|is not found", re.I)
_PARAM = re.compile(r"^([a-z_]+): ")
# Backend parameter names as a client of this API knows them.
_PARAM_ALIASES = {"text_input": "prompt", "sampling_parameters": None}


def classify_backend_error(message: str, model: str) -> ApiError:
    """The ApiError for an error message from a Triton stream response."""
    if _UNKNOWN_MODEL.search(message):
        return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    if _UNAVAILABLE.search(message):
        return ApiError(503, message, code="service_unavailable")
    if _INTERNAL.search(message):
        return ApiError(500, message, code="internal_error")
    match = _PARAM.match(message)
    param = match.group(1) if match else None
    param = _PARAM_ALIASES.get(param, param)
    return ApiError(400, message, param, "invalid_value" if param else None)


def tool_call_constraint(req: ChatCompletionRequest) -> dict[str, Any]:
    """The structured output that makes the reply a call the client can parse: a named
    function's arguments (its parameters' schema), or for "required" a JSON array of
    {"name", "arguments"} objects, each one of the tools (vLLM's form)."""
    parameters = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in req.tools}
    if req.forced_tool != "required":
        return {"json": parameters[req.forced_tool]}
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False} for name, schema in parameters.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return {"json": array}


def tool_calls_of(text: str, forced_tool: str) -> list[dict[str, Any]] | None:
    """OpenAI's tool_calls from a reply generated under `tool_call_constraint`, or None
    when it does not parse (cut short by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [{"name": forced_tool, "arguments": value}] if forced_tool != "required" else value
    return [{"id": call_id(), "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in calls]


def _constraints(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """Each field of the request that asks for structured output -> the backend's
    `structured_outputs` it stands for."""
    found: dict[str, Any] = {}
    if req.structured_outputs is not None:
        found["structured_outputs"] = req.structured_outputs
    if req.guided_json is not None:
        found["guided_json"] = {"json": req.guided_json}
    if req.guided_regex is not None:
        found["guided_regex"] = {"regex": req.guided_regex}
    if req.guided_choice is not None:
        found["guided_choice"] = {"choice": req.guided_choice}
    if isinstance(req, ChatCompletionRequest) and req.forced_tool is not None:
        found["tool_choice"] = tool_call_constraint(req)
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        found["response_format"] = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        # OpenAI's schema is optional: with none, any JSON object.
        schema = response_format.json_schema.json_schema
        found["response_format"] = {"json": schema} if schema is not None else {"json_object": True}
    return found


def sampling_parameters(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The backend's sampling_parameters: only what the client set, under the backend's names."""
    values = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    if req.user is not None:
        values["tenant"] = req.user  # OpenAI's end-user id is who the fair policy shares between
    if req.keeps_stop_str() is not None:
        values["include_stop_str_in_output"] = req.keeps_stop_str()
    constraints = _constraints(req)
    if len(constraints) > 1:
        raise ApiError(400, f"{', '.join(constraints)} each ask for structured output; send one", next(iter(constraints)),
                       "invalid_value")
    if constraints:
        values["structured_outputs"] = next(iter(constraints.values()))
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            values["logprobs"] = req.logprobs
        if req.best_of is not None:
            values["best_of"] = req.best_of
        return values
    if req.max_completion_tokens is not None:
        values["max_tokens"] = req.max_completion_tokens
    if req.add_special_tokens is None:
        values["add_special_tokens"] = False  # the chat template wrote them
    if req.logprobs:
        values["logprobs"] = req.top_logprobs or 0
    return values


def client_names(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """Backend parameter name -> the field this request set it with, for the ``param`` of errors."""
    names = {"structured_outputs": field for field in _constraints(req)}
    if isinstance(req, CompletionRequest):
        names["tenant"] = "user"
        return names
    names |= {"logprobs": "top_logprobs", "prompt": "messages", "tenant": "user"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def validate_sampling(sampling: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
    """Check sampling values with the backend's own checks (backend/validation.py) before sending.

    OpenAI's own limits are lower (4 stop sequences, 5/20 logprobs); the backend's are the
    ones enforced, so a client gets the same answer here and from Triton directly.
    """
    try:
        parse_sampling_params(sampling)
    except RequestError as exc:
        param = (aliases or {}).get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param and exc.param and message.startswith(f"{exc.param}:"):
            message = f"{param}:{message[len(exc.param) + 1:]}"
        raise ApiError(400, message, param, "invalid_value") from None


def rendered(model: str, token_ids: list[int], sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    """vLLM's GenerateRequest, the answer of its /render endpoints, with the backend's sampling values."""
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": token_ids, "model": model,
            "sampling_params": sampling, "stream": stream}


@dataclass
class Piece:
    """What one backend response carries for one sequence (choice `index`)."""

    text: str
    num_input_tokens: int | None
    num_output_tokens: int
    # The sequence's finish reason, once it has ended (then in every later response too).
    finish_reason: str | None
    logprobs: list[dict[str, dict[str, Any]]]
    final: bool  # the request's last response
    index: int = 0
    # A role-prefill model's answer: the handle of the request's KV transfer (backend/disagg.py).
    transfer: str | None = None


def _element(result, name: str, index: int):
    """Element `index` of a response's output `name` (str for BYTES), or None when it lacks it."""
    array = result.as_numpy(name)
    if array is None or array.size <= index:
        return None
    value = array.reshape(-1)[index]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def piece_of(result, index: int = 0) -> Piece:
    """The Piece of sequence `index` in a Triton stream response (tritonclient's InferResult).
    A request with n sequences gets outputs of shape [n] (num_input_tokens stays [1])."""
    reason = _element(result, "finish_reason", index)
    n_in = _element(result, "num_input_tokens", 0)
    n_out = _element(result, "num_output_tokens", index)
    raw_logprobs = _element(result, "logprobs", index)
    logprobs = json.loads(raw_logprobs) if raw_logprobs is not None else None
    return Piece(
        text=_element(result, "text_output", index) or "",
        num_input_tokens=int(n_in) if n_in is not None else None,
        num_output_tokens=int(n_out) if n_out is not None else 0,
        finish_reason=None if reason in (None, "None") else reason,
        logprobs=logprobs or [],
        final=is_final(result),
        index=index,
        transfer=_element(result, TRANSFER_TENSOR, 0),
    )


def pieces_of(result) -> list[Piece]:
    """One Piece per sequence of a Triton stream response."""
    texts = result.as_numpy("text_output")
    return [piece_of(result, i) for i in range(max(1, texts.size if texts is not None else 0))]


def _completion_logprobs(entries: list[dict], offset: int) -> dict[str, list]:
    """OpenAI's legacy completions logprobs from the backend's per-token dicts."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        items = list(entry.values())
        sampled = items[0]  # the backend puts the sampled token first
        out["tokens"].append(sampled["decoded_token"])
        out["token_logprobs"].append(sampled["logprob"])
        out["top_logprobs"].append({v["decoded_token"]: v["logprob"] for v in items})
        out["text_offset"].append(offset)
        offset += len(sampled["decoded_token"])
    return out


def _chat_logprobs(entries: list[dict], top: int) -> list[dict[str, Any]]:
    content = []
    for entry in entries:
        items = list(entry.values())
        sampled = items[0]
        ranked = sorted((v for v in items if v.get("rank") is not None and v["rank"] <= top), key=lambda v: v["rank"])
        content.append({
            "token": sampled["decoded_token"],
            "logprob": sampled["logprob"],
            "bytes": list(sampled["decoded_token"].encode("utf-8")),
            "top_logprobs": [
                {"token": v["decoded_token"], "logprob": v["logprob"], "bytes": list(v["decoded_token"].encode("utf-8"))}
                for v in ranked
            ],
        })
    return content


def _finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason; it has no "abort" (cancelled, or the server shutting down)."""
    return {"abort": "stop"}.get(reason, reason) if reason else None


def _auto_reason(reason: str | None, called: bool) -> str | None:
    """A choice that stopped after calling tools ends with "tool_calls", as OpenAI's; one cut short
    (length) keeps its reason, which a client needs to know."""
    return "tool_calls" if called and reason == "stop" else reason


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


@dataclass
class Job:
    """What one endpoint call generates, and how its pieces become OpenAI objects."""

    kind: Literal["completion", "chat"]
    model: str
    prompt: str
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: k; chat: top_logprobs (0 when only logprobs)
    echo: bool = False
    # chat with tools: "required" or the function's name (ChatCompletionRequest.forced_tool)
    forced_tool: str | None = None
    # chat with tool_choice "auto": the model's <tool_call> blocks become tool_calls (tool_calls.py)
    auto_tools: bool = False
    # Per choice, streamed: a forced tool call's text so far; the auto tool-call splitter.
    _tool_texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _splitters: dict[int, ToolCallSplitter] = field(default_factory=dict, init=False, repr=False)
    # backend parameter name -> the name this endpoint's client used
    aliases: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # The Triton model that runs the job: `model` itself, or the model serving the LoRA
    # adapter that `model` names (then `sampling` carries its lora_name).
    triton_model: str = ""
    # Disaggregated serving through a router (kv_transfer_params): `hand_over`, the prefill half,
    # answers the request's transfer handle; `transfer`, the decode half, takes that handle over.
    hand_over: bool = False
    transfer: str | None = None

    @property
    def n(self) -> int:
        """Choices to return."""
        return int(self.sampling.get("n", 1))

    @property
    def ranks_at_end(self) -> bool:
        """best_of > n: which sequences are returned is known only when all have ended."""
        return int(self.sampling.get("best_of") or self.n) > self.n

    def __post_init__(self) -> None:
        prefix = "cmpl" if self.kind == "completion" else "chatcmpl"
        self.request_id = self.request_id or f"{prefix}-{uuid.uuid4().hex}"
        self.triton_model = self.triton_model or self.model

    @classmethod
    def of(cls, req: CompletionRequest | ChatCompletionRequest, prompt: str, sampling: dict[str, Any],
           triton_model: str = "") -> "Job":
        """The job for a checked request, its prompt text and its sampling_parameters; a
        `triton_model` other than the request's model means the request's model is a LoRA
        adapter of it."""
        if triton_model and triton_model != req.model:
            sampling = {**sampling, "lora_name": req.model}
        if req.hands_over:
            # vllm-router sends the prefill half with max_tokens and min_tokens 1 (vLLM's prefill
            # instance stops there, and its decode instance samples the first token again). Here
            # the first token is the prefill model's, handed over with the request: neither may
            # change it. The decode half brings the client's values, which the request runs on
            # with; a first token that is a stop token ends the request here, without a handle,
            # and the decode model then serves the plain request whole.
            sampling = {k: v for k, v in sampling.items() if k not in ("max_tokens", "min_tokens")}
        handle = (req.kv_transfer_params or {}).get(KV_TRANSFER_HANDLE)
        if handle is not None and not isinstance(handle, str):
            raise ApiError(400, f"kv_transfer_params: {KV_TRANSFER_HANDLE} must be the string a prefill answer "
                                "carried", "kv_transfer_params", "invalid_value")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        handover = {"hand_over": req.hands_over, "transfer": handle}
        if isinstance(req, CompletionRequest):
            return cls("completion", req.model, prompt, sampling, req.stream, include_usage, req.logprobs,
                       echo=req.echo, aliases=client_names(req), triton_model=triton_model, **handover)
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return cls("chat", req.model, prompt, sampling, req.stream, include_usage, top_logprobs,
                   forced_tool=req.forced_tool, auto_tools=req.auto_tools, aliases=client_names(req),
                   triton_model=triton_model, **handover)

    def check_role(self, role: str) -> None:
        """Refuse a kv_transfer_params half that the model's `role` cannot serve (400 naming it):
        without its max_tokens, a model that does not hand over would run to its default."""
        wanted = "prefill" if self.hand_over else "decode" if self.transfer is not None else None
        if wanted is not None and role != wanted:
            field = "do_remote_decode" if self.hand_over else KV_TRANSFER_HANDLE
            raise ApiError(400, f"kv_transfer_params: {field} needs a model of role '{wanted}', and model "
                                f"`{self.triton_model}` has role '{role}'", "kv_transfer_params", "invalid_value")

    def triton_inputs(self) -> list:
        """The inputs of the job's one Triton request, without the prompt in its text: streamed
        (the backend's responses become events or are collected), except a best_of > n request that
        the client does not stream, whose one response the backend sends when the ranking is known
        (the backend streams no such request; a client that asks gets the backend's refusal)."""
        flags = OPENAI_RETURN_FLAGS + ((RETURN_LOGPROBS,) if self.logprobs is not None else ())
        stream = self.stream or not self.ranks_at_end
        inputs = make_inputs(self.prompt, self.sampling, stream=stream, exclude_input=True, returns=flags)
        if self.transfer is not None:
            import tritonclient.grpc as grpcclient

            handle = grpcclient.InferInput(TRANSFER_TENSOR, [1], "BYTES")
            handle.set_data_from_numpy(np.array([self.transfer.encode()], dtype=np.object_))
            inputs.append(handle)
        return inputs

    def backend_error(self, message: str) -> ApiError:
        """The ApiError for an error the backend answered this job with, naming the client's field."""
        error = classify_backend_error(message, self.model)
        error.param = self.aliases.get(error.param, error.param)
        return error

    @property
    def object_name(self) -> str:
        if self.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if self.stream else "chat.completion"

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.request_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if self.kind == "chat":
            body["system_fingerprint"] = None
        if usage is not None or not self.stream:
            body["usage"] = usage
        return body

    def _logprobs(self, entries: list[dict], offset: int) -> Any:
        if self.logprobs is None:
            return None
        if self.kind == "completion":
            return _completion_logprobs(entries, offset)
        return {"content": _chat_logprobs(entries, self.logprobs)}

    # non-streamed
    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        """The completion from every piece of every response (each choice's pieces in order)."""
        by_index: dict[int, list[Piece]] = defaultdict(list)
        for p in pieces:
            by_index[p.index].append(p)
        prompt_tokens = next((p.num_input_tokens for p in pieces if p.num_input_tokens is not None), 0)
        usage = _usage(prompt_tokens, sum(p.num_output_tokens for p in pieces))
        body = self._envelope([self._choice(i, by_index[i]) for i in sorted(by_index)], usage)
        handle = next((p.transfer for p in pieces if p.transfer is not None), None)
        if handle is not None:  # the decode half's tokens, the first one included, come from the decode model
            body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                          KV_TRANSFER_HANDLE: handle}
        return body

    def _choice(self, index: int, pieces: list[Piece]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        entries = [e for p in pieces for e in p.logprobs]
        reason = _finish_reason(pieces[-1].finish_reason)
        if self.kind == "completion":
            offset = len(self.prompt) if self.echo else 0
            return {"index": index, "text": (self.prompt if self.echo else "") + text,
                    "logprobs": self._logprobs(entries, offset), "finish_reason": reason}
        message, reason = self._message(text, reason)
        return {"index": index, "message": message, "logprobs": self._logprobs(entries, 0), "finish_reason": reason}

    def _message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish_reason: text, or the calls a forced tool choice made
        (finish_reason "tool_calls" for "required", "stop" for a named function, as OpenAI), or
        with tool_choice "auto" the text outside the model's tool-call blocks (null when none) and
        the calls they hold (finish_reason "tool_calls" when there are some and it stopped)."""
        if self.auto_tools:
            content, auto_calls = split_tool_calls(text)
            if not auto_calls:
                return {"role": "assistant", "content": text}, reason
            return {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in auto_calls]}, \
                _auto_reason(reason, True)
        calls = tool_calls_of(text, self.forced_tool) if self.forced_tool and reason == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, \
            "tool_calls" if self.forced_tool == "required" else "stop"

    # streamed
    def first_chunks(self) -> list[bytes]:
        if self.kind == "chat":
            def choice(i: int) -> dict[str, Any]:
                return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
        elif self.echo:
            def choice(i: int) -> dict[str, Any]:
                return {"index": i, "text": self.prompt, "logprobs": None, "finish_reason": None}
        else:
            return []
        return [sse_event(self._envelope([choice(i)])) for i in range(self.n)]

    def chunk(self, piece: Piece, offset: int) -> bytes | None:
        """The event of one choice's piece: its new text, and its finish reason once it has
        one (a choice's later pieces repeat that reason: the caller sends them no more)."""
        if self.forced_tool:
            return self._tool_chunk(piece)
        if self.auto_tools:
            return self._auto_tool_chunk(piece)
        reason = _finish_reason(piece.finish_reason)
        if not piece.text and reason is None:
            return None
        logprobs = self._logprobs(piece.logprobs, offset)
        if self.kind == "completion":
            choice = {"index": piece.index, "text": piece.text, "logprobs": logprobs, "finish_reason": reason}
        else:
            delta = {"content": piece.text} if piece.text else {}
            choice = {"index": piece.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse_event(self._envelope([choice]))

    def _tool_chunk(self, piece: Piece) -> bytes | None:
        """A forced tool call streams as one delta holding the choice's whole calls once it has
        ended (arguments that are not yet JSON are no use to a client)."""
        text = self._tool_texts[piece.index] = self._tool_texts.get(piece.index, "") + piece.text
        # A choice ends with its finish reason; with n > 1 that may come before the request's final response.
        if piece.finish_reason is None and not piece.final:
            return None
        message, reason = self._message(text, _finish_reason(piece.finish_reason))
        if "tool_calls" in message:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
        else:
            delta = {"content": text} if text else {}
        return sse_event(self._envelope([{"index": piece.index, "delta": delta, "logprobs": None,
                                          "finish_reason": reason}]))

    def _auto_tool_chunk(self, piece: Piece) -> bytes | None:
        """The events of a choice's piece under tool_choice "auto": content deltas for the text
        outside the tool-call blocks, never a part of a tag (ToolCallSplitter holds it back), and
        for each block once it is closed, two tool_call deltas (id, type and name; then arguments).
        The piece's logprobs ride on its first event (an empty delta when it has none)."""
        splitter = self._splitters.setdefault(piece.index, ToolCallSplitter())
        ended = piece.finish_reason is not None or piece.final
        events = splitter.feed(piece.text) + (splitter.finish() if ended else [])
        deltas: list[dict[str, Any]] = []
        call_index = splitter.calls - sum(isinstance(e, ToolCall) for e in events)  # the choice's calls so far
        for event in events:
            if isinstance(event, ToolCall):
                head = {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
                deltas += [{"tool_calls": [{"index": call_index, **head}]},
                           {"tool_calls": [{"index": call_index, "function": {"arguments": event.arguments}}]}]
                call_index += 1
            elif deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += event
            else:
                deltas.append({"content": event})
        logprobs = self._logprobs(piece.logprobs, 0) if piece.logprobs else None
        if not deltas and (ended or logprobs is not None):
            deltas.append({})
        reason = _auto_reason(_finish_reason(piece.finish_reason), splitter.calls > 0)
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(sse_event(self._envelope([{
                "index": piece.index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                "finish_reason": reason if last else None}])))
        return b"".join(chunks) or None

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse_event(self._envelope([], _usage(prompt_tokens, completion_tokens)))
