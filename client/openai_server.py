"""OpenAI-compatible HTTP frontend for the inflight backend, over Triton gRPC streaming.

    .venv/bin/python -m client.openai_server --triton-url 127.0.0.1:8001 --port 9000
    curl -s localhost:9000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (200 when Triton is live). Each generation is one Triton gRPC stream
(``ModelStreamInfer``) carrying one request with ``stream`` true; the backend's responses
become server-sent events (``stream`` true, ending with ``data: [DONE]``) or are
collected into one JSON body. ``usage`` comes from the backend's ``num_input_tokens`` /
``num_output_tokens`` outputs, ``logprobs`` from its ``logprobs`` output.

Chat prompts are rendered with the checkpoint's chat template (``transformers``
``AutoTokenizer``, local files only, no remote code). The checkpoint is ``--tokenizer``
when given, else the served model's ``model_path`` parameter: absolute, or relative to
``<model repository>/<model>/<version>`` (``--model-repository``; default: this
repository's ``model_repository/``).

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: 400
for a bad request (checked here with the backend's own ``SamplingParams`` table, or
refused by the backend with INVALID_ARG, e.g. a prompt longer than ``max_model_len``),
401 without the API key when ``--api-key`` is set, 404 for an unknown model, 413 for a
body over ``--max-body-bytes``, 503 when the backend is overloaded (UNAVAILABLE: its
waiting queue is full) or Triton cannot be reached, 504 past ``--request-timeout``.

A client that goes away cancels the Triton request (the gRPC stream is cancelled;
the backend sees it within one poll interval and frees the request's KV blocks).

Security defaults: binds 127.0.0.1 unless ``--host`` says otherwise; bodies are bounded;
unknown request fields are refused rather than silently ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Optional, Union

import pydantic
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from backend.paths import REPO_ROOT
from backend.request import RequestError, SamplingParams
from client.generate import make_inputs

log = logging.getLogger("inflight.openai")

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_DRAIN_BYTES = 16 * 1024 * 1024
# OpenAI's own limits are lower (4 stop sequences, 5/20 logprobs); the backend's are the
# ones enforced (backend/request.py), so a client gets the same answer here and there.
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


# ---------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered with OpenAI's error JSON and an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 503: "server_error", 504: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or self.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": "1"} if self.status == 503 else None


class ClientGone(Exception):
    """The HTTP client disconnected; its Triton request has been cancelled."""


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


def _grpc_error(exc: Exception, url: str) -> ApiError | None:
    """ApiError for a gRPC failure of the stream itself (None: the call was cancelled)."""
    import grpc

    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.CANCELLED:
        return None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the request did not finish within the server's request timeout", code="timeout")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"cannot reach Triton at {url}: {details}", code="service_unavailable")
    return ApiError(500, f"Triton stream failed: {details}", code="internal_error")


# ---------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's extras the backend supports."""

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # accepted, not used
    # vLLM extras (extra_body in the openai client)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    priority: Optional[int] = None

    def sampling(self) -> dict[str, Any]:
        """The backend's sampling_parameters (only what the client set)."""
        names = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output", "priority")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def check_common(self) -> None:
        if self.n is not None and self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: this server returns exactly one choice (n=1)", "n",
                           "unsupported_value")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check(self) -> str:
        """Validate what the backend cannot; return the prompt text."""
        self.check_common()
        if self.best_of is not None and self.best_of != 1:
            raise ApiError(400, f"best_of={self.best_of} is not supported (only 1)", "best_of", "unsupported_value")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix", "unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo",
                           "unsupported_value")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ApiError(400, "prompt must be one string (batches of prompts and token ids are not supported)",
                               "prompt", "unsupported_value")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        return prompt

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
        return values


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported (text only)",
                               f"messages[{index}].content[{j}]", "unsupported_value")
            try:
                parts.append(TextPart.model_validate(part).text)
            except pydantic.ValidationError as exc:
                raise ApiError(400, f"invalid text part: {exc.errors()[0]['msg']}",
                               f"messages[{index}].content[{j}]", "invalid_value") from None
        return "".join(parts)


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    # accepted, not used
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    modalities: Optional[list[str]] = None

    def check(self) -> list[dict[str, str]]:
        """Validate what the backend cannot; return the messages for the chat template."""
        self.check_common()
        if self.tools or (self.tool_choice not in (None, "none")):
            raise ApiError(400, "tools and tool_choice are not supported", "tools", "unsupported_parameter")
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(400, f"response_format {self.response_format.type!r} is not supported (only 'text')",
                           "response_format", "unsupported_value")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise ApiError(400, "only the text modality is supported", "modalities", "unsupported_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        messages = []
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": message.text(i)})
        return messages

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        return values


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {loc}", loc, "unknown_parameter")
    if first["type"] == "missing":
        return ApiError(400, f"Missing required parameter: '{loc}'.", loc, "missing_required_parameter")
    return ApiError(400, f"Invalid value for '{loc}': {first['msg']} (got {first.get('input')!r})", loc,
                    "invalid_value")


def validate_sampling(sampling: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
    """Check sampling values with the backend's own table (backend/request.py) before sending."""
    try:
        SamplingParams.from_dict(sampling)
    except RequestError as exc:
        param = (aliases or {}).get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param and exc.param and message.startswith(f"{exc.param}:"):
            message = f"{param}:{message[len(exc.param) + 1:]}"
        raise ApiError(400, message, param, "invalid_value") from None


# ---------------------------------------------------------------------------- Triton side


@dataclass
class Piece:
    """One backend response."""

    text: str
    num_input_tokens: int | None
    num_output_tokens: int
    finish_reason: str | None
    logprobs: list[dict[str, dict[str, Any]]]
    final: bool


def _first(result, name: str):
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    return array.reshape(-1)[0]


def _piece(result) -> Piece:
    text = _first(result, "text_output")
    reason = _first(result, "finish_reason")
    reason = reason.decode() if isinstance(reason, bytes) else reason
    n_in = _first(result, "num_input_tokens")
    n_out = _first(result, "num_output_tokens")
    raw_logprobs = _first(result, "logprobs")
    logprobs = json.loads(raw_logprobs) if raw_logprobs is not None else None
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    return Piece(
        text=text.decode("utf-8") if isinstance(text, bytes) else (text or ""),
        num_input_tokens=int(n_in) if n_in is not None else None,
        num_output_tokens=int(n_out) if n_out is not None else 0,
        finish_reason=None if reason in (None, "None") else reason,
        logprobs=logprobs or [],
        final=final,
    )


class Generation:
    """One request on its own Triton gRPC stream; ``cancel()`` cancels it on the server.

    Iterate with ``async for piece in generation``; errors surface as ``ApiError``.
    """

    def __init__(self, client, url: str, model: str, prompt: str, sampling: dict[str, Any], want_logprobs: bool,
                 request_id: str, timeout_s: float, aliases: dict[str, str] | None = None):
        self.url = url
        self.aliases = aliases or {}
        self.model = model
        self.finished = False
        self.cancelled = False
        flags = RETURN_FLAGS + (("return_logprobs",) if want_logprobs else ())
        inputs = make_inputs(prompt, sampling, stream=True, exclude_input=True, returns=flags)

        async def requests_iter():
            yield {"model_name": model, "inputs": inputs, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}

        self._call = client.stream_infer(requests_iter(), stream_timeout=timeout_s)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Piece:
        if self.finished:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise ApiError(500, "Triton closed the stream before the final response", code="internal_error") from None
        except Exception as exc:  # grpc.aio.AioRpcError and friends
            self.finished = True
            api = _grpc_error(exc, self.url)
            if api is None:
                raise ClientGone() from None
            raise api from None
        if error is not None:
            self.finished = True
            api = classify_backend_error(error.message() or str(error), self.model)
            api.param = self.aliases.get(api.param, api.param)
            raise api
        piece = _piece(result)
        if piece.final:
            self.finished = True
        return piece

    def cancel(self) -> None:
        """Cancel the stream unless its final response came (idempotent)."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._call.cancel()
            log.info("cancelled Triton request on model %s (client went away)", self.model)


@dataclass
class ModelInfo:
    name: str
    config: dict[str, Any]
    versions: list[str]
    created: int

    @property
    def parameters(self) -> dict[str, str]:
        params = self.config.get("parameters", {}) or {}
        return {k: (v.get("string_value", "") if isinstance(v, dict) else str(v)) for k, v in params.items()}


def is_text_model(config: dict[str, Any]) -> bool:
    """An inflight model (or any with the vLLM-backend text interface)."""
    if config.get("backend") == "inflight":
        return True
    return any(i.get("name") == "text_input" for i in config.get("input", []))


@dataclass
class Settings:
    triton_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    model_names: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    model_repository: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    api_key: str | None = None


class Catalog:
    """Models Triton serves (filtered by ``--model-name``) and their chat templates."""

    def __init__(self, settings: Settings, client):
        self.settings = settings
        self.client = client
        self._models: dict[str, ModelInfo] = {}
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()
        self._started = int(time.time())

    async def _call(self, coro):
        from tritonclient.utils import InferenceServerException

        try:
            return await coro
        except InferenceServerException as exc:
            message = exc.message() or str(exc)
            if "restricted" in message:  # --grpc-restricted-protocol=model-repository,...
                raise ApiError(503, f"Triton at {self.settings.triton_url} restricts this API ({message}); "
                                    "start the frontend with --model-name NAME for each model to serve",
                               code="service_unavailable") from None
            raise ApiError(503, f"cannot reach Triton at {self.settings.triton_url}: {message}",
                           code="service_unavailable") from None
        except Exception as exc:  # grpc errors
            api = _grpc_error(exc, self.settings.triton_url)
            raise api or ApiError(503, "Triton request cancelled", code="service_unavailable") from None

    async def refresh(self) -> list[ModelInfo]:
        ready: dict[str, list[str]] = {}
        if self.settings.model_names:
            # Named models need only the model-config and health protocols, so this works
            # when Triton restricts its model-repository API (--grpc-restricted-protocol).
            await self._call(self.client.is_server_live())
            for name in self.settings.model_names:
                try:
                    if await self.client.is_model_ready(name):
                        ready[name] = []
                except Exception:  # unknown to Triton: not served
                    pass
        else:
            index = await self._call(self.client.get_model_repository_index(as_json=True))
            for entry in index.get("models", []):
                if entry.get("state") == "READY":
                    ready.setdefault(entry["name"], []).append(str(entry.get("version", "")))
        models = {}
        for name, versions in sorted(ready.items()):
            info = self._models.get(name)
            if info is None:
                config = (await self._call(self.client.get_model_config(name, as_json=True))).get("config", {})
                if not is_text_model(config):
                    continue
                info = ModelInfo(name, config, versions, self._started)
            info.versions = versions
            models[name] = info
        self._models = models
        return list(models.values())

    async def get(self, name: str) -> ModelInfo:
        if name not in self._models:
            await self.refresh()
        info = self._models.get(name)
        if info is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return info

    def checkpoint_dir(self, info: ModelInfo) -> Path:
        if self.settings.tokenizer:
            return Path(self.settings.tokenizer)
        model_path = info.parameters.get("model_path", "")
        if model_path and os.path.isabs(model_path):
            return Path(model_path)
        repository = Path(self.settings.model_repository or DEFAULT_MODEL_REPOSITORY)
        model_dir = repository / info.name
        versions = [v for v in info.versions if v.isdigit()] or sorted(
            (p.name for p in model_dir.glob("[0-9]*") if p.is_dir()), key=int)
        version_dir = model_dir / (max(versions, key=int) if versions else "1")
        return Path(os.path.normpath(version_dir / model_path)) if model_path else version_dir

    def _load_tokenizer(self, info: ModelInfo):
        with self._tokenizer_lock:
            if info.name in self._tokenizers:
                return self._tokenizers[info.name]
            path = self.checkpoint_dir(info)
            if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
                raise ApiError(
                    500, f"no tokenizer for model `{info.name}` at {path}: start the frontend with --tokenizer DIR "
                         "or --model-repository DIR (the repository Triton serves)", code="tokenizer_not_found")
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
            if not getattr(tokenizer, "chat_template", None):
                raise ApiError(400, f"model `{info.name}` has no chat template: use /v1/completions", "messages",
                               "no_chat_template")
            self._tokenizers[info.name] = tokenizer
            return tokenizer

    async def chat_prompt(self, info: ModelInfo, messages: list[dict[str, str]]) -> str:
        tokenizer = await asyncio.to_thread(self._load_tokenizer, info)

        def render() -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        try:
            return await asyncio.to_thread(render)
        except Exception as exc:  # jinja2 errors: e.g. a template that forbids a role order
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages", "invalid_value") from None


# ---------------------------------------------------------------------------- responses


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
    return {"abort": "stop"}.get(reason, reason) if reason else None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict[str, Any] | str) -> bytes:
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
    # backend parameter name -> the name this endpoint's client used
    aliases: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = "cmpl" if self.kind == "completion" else "chatcmpl"
        self.request_id = self.request_id or f"{prefix}-{uuid.uuid4().hex}"

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
        text = "".join(p.text for p in pieces)
        entries = [e for p in pieces for e in p.logprobs]
        reason = _finish_reason(pieces[-1].finish_reason)
        prompt_tokens = next((p.num_input_tokens for p in pieces if p.num_input_tokens is not None), 0)
        usage = _usage(prompt_tokens, sum(p.num_output_tokens for p in pieces))
        if self.kind == "completion":
            offset = len(self.prompt) if self.echo else 0
            choice = {"index": 0, "text": (self.prompt if self.echo else "") + text,
                      "logprobs": self._logprobs(entries, offset), "finish_reason": reason}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(entries, 0), "finish_reason": reason}
        return self._envelope([choice], usage)

    # streamed
    def first_chunks(self) -> list[bytes]:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [_sse(self._envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]))]
        if self.echo:
            return [_sse(self._envelope([{"index": 0, "text": self.prompt, "logprobs": None, "finish_reason": None}]))]
        return []

    def chunk(self, piece: Piece, offset: int) -> bytes | None:
        reason = _finish_reason(piece.finish_reason) if piece.final else None
        if not piece.text and reason is None:
            return None
        logprobs = self._logprobs(piece.logprobs, offset) if piece.logprobs or self.logprobs is not None else None
        if self.kind == "completion":
            choice = {"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": reason}
        else:
            delta = {"content": piece.text} if piece.text else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return _sse(self._envelope([choice]))

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return _sse(self._envelope([], _usage(prompt_tokens, completion_tokens)))


# ---------------------------------------------------------------------------- the app


async def _until_disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request, coro, generation: Generation):
    """Await `coro`; if the HTTP client disconnects first, cancel `generation` and raise ClientGone."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        generation.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    generation.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # the client is gone either way
        pass
    raise ClientGone()


def create_app(settings: Settings):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app):
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(settings.triton_url)
        state["client"] = client
        state["catalog"] = Catalog(settings, client)
        log.info("OpenAI frontend on http://%s:%d, Triton gRPC at %s", settings.host, settings.port, settings.triton_url)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="inflight OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error_response(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("unhandled error")
        return error_response(ApiError(500, f"internal error: {exc}", code="internal_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return error_response(ApiError(401, "Incorrect or missing API key (Authorization: Bearer ...).",
                                               code="invalid_api_key"))
        return await call_next(request)

    async def read_json(request: Request) -> dict[str, Any]:
        limit = settings.max_body_bytes
        too_big = ApiError(413, f"request body exceeds {limit} bytes (--max-body-bytes)", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                # Read (and drop) a moderate excess so that the client gets to read the 413
                # instead of a reset connection; beyond that the connection is dropped.
                if size > limit + MAX_DRAIN_BYTES:
                    raise too_big
                chunks = []
                continue
            chunks.append(chunk)
        if size > limit:
            raise too_big
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def parse(model_cls, body: dict[str, Any]):
        try:
            return model_cls.model_validate(body)
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from None

    @app.get("/health")
    async def health():
        try:
            live = await state["client"].is_server_live(client_timeout=5)
        except Exception:
            live = False
        if not live:
            return error_response(ApiError(503, f"Triton at {settings.triton_url} is not live",
                                           code="service_unavailable"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        models = await state["catalog"].refresh()
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": "inflight"} for m in models]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str):
        m = await state["catalog"].get(name)
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "inflight"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request))
        prompt = req.check()
        sampling = req.sampling()
        validate_sampling(sampling)
        await state["catalog"].get(req.model)
        job = Job("completion", req.model, prompt, sampling, req.stream,
                  bool(req.stream_options and req.stream_options.include_usage), req.logprobs, echo=req.echo)
        return await run(request, job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await read_json(request))
        messages = req.check()
        sampling = req.sampling()
        aliases = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else {}
        aliases["logprobs"] = "top_logprobs"
        validate_sampling(sampling, aliases)
        info = await state["catalog"].get(req.model)
        prompt = await state["catalog"].chat_prompt(info, messages)
        top = (req.top_logprobs or 0) if req.logprobs else None
        job = Job("chat", req.model, prompt, sampling, req.stream,
                  bool(req.stream_options and req.stream_options.include_usage), top,
                  aliases={**aliases, "prompt": "messages"})
        return await run(request, job)

    async def run(request: Request, job: Job):
        generation = Generation(state["client"], settings.triton_url, job.model, job.prompt, job.sampling,
                                job.logprobs is not None, job.request_id, settings.request_timeout_s, job.aliases)
        if not job.stream:
            async def collect() -> list[Piece]:
                return [piece async for piece in generation]

            try:
                pieces = await _unless_disconnected(request, collect(), generation)
            except ClientGone:
                return JSONResponse({}, status_code=499)
            return JSONResponse(job.whole(pieces))

        # Streamed: wait for the first response so that a refusal (400, 503) is a real HTTP
        # status, not an event inside a 200 stream.
        try:
            first = await _unless_disconnected(request, generation.__anext__(), generation)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        async def cancel_upstream() -> None:  # runs after the response, also when the client went away
            generation.cancel()

        return StreamingResponse(sse_events(job, generation, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(cancel_upstream))

    async def sse_events(job: Job, generation: Generation, first: Piece) -> AsyncIterator[bytes]:
        prompt_tokens = first.num_input_tokens or 0
        completion_tokens = 0
        offset = len(job.prompt) if job.echo else 0
        try:
            for chunk in job.first_chunks():
                yield chunk
            piece: Piece | None = first
            while piece is not None:
                completion_tokens += piece.num_output_tokens
                if piece.num_input_tokens is not None:
                    prompt_tokens = piece.num_input_tokens
                chunk = job.chunk(piece, offset)
                offset += len(piece.text)
                if chunk is not None:
                    yield chunk
                piece = None if piece.final else await generation.__anext__()
            if job.include_usage:
                yield job.usage_chunk(prompt_tokens, completion_tokens)
        except ApiError as exc:
            yield _sse(exc.body())
        except ClientGone:
            return
        finally:
            # Starlette cancels this generator when the client disconnects: cancel upstream.
            generation.cancel()
        yield _sse("[DONE]")

    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.openai_server", description=__doc__.splitlines()[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton gRPC address (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=9000, help="port to bind (default %(default)s)")
    parser.add_argument("--model-name", action="append", default=[], metavar="NAME",
                        help="serve only this Triton model (repeatable; default: every ready inflight model)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="checkpoint folder with the chat template (default: the model's model_path)")
    parser.add_argument("--model-repository", default=None, metavar="DIR",
                        help="the repository Triton serves, to resolve relative model_path values "
                             f"(default {DEFAULT_MODEL_REPOSITORY.relative_to(REPO_ROOT)}/)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (default %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds one generation may take (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("INFLIGHT_OPENAI_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $INFLIGHT_OPENAI_API_KEY; none)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        triton_url=args.triton_url, host=args.host, port=args.port, model_names=args.model_name,
        tokenizer=args.tokenizer, model_repository=args.model_repository, max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout, api_key=args.api_key or None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    import uvicorn

    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, access_log=args.log_level == "debug")
    return 0


if __name__ == "__main__":
    sys.exit(main())
