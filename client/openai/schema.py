"""The OpenAI API's request models (pydantic; unknown fields are refused) and its error JSON
(``ApiError``). Imports nothing from this project.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field


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
    spaces_between_special_tokens: Optional[bool] = None
    bad_words: Optional[list[str]] = None
    priority: Optional[int] = None

    def check_common(self) -> None:
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


def parse_request(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    """``model_cls`` validated from a JSON body; the first error found becomes a 400 naming its field."""
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {loc}", loc, "unknown_parameter")
    if first["type"] == "missing":
        return ApiError(400, f"Missing required parameter: '{loc}'.", loc, "missing_required_parameter")
    return ApiError(400, f"Invalid value for '{loc}': {first['msg']} (got {first.get('input')!r})", loc,
                    "invalid_value")
