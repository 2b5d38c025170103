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
    user: Optional[str] = None  # the backend's `tenant`
    # vLLM extras (extra_body in the openai client)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    # None: vLLM's default, true for completions and false for chat (the template writes them).
    add_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    bad_words: Optional[list[str]] = None
    priority: Optional[int] = None
    stream_interval: Optional[int] = None  # tokens a streamed chunk gathers after the first
    # SGLang's fields, which vllm-router 0.1.17 adds to every request it forwards.
    no_stop_trim: Optional[bool] = None  # SGLang's include_stop_str_in_output
    return_hidden_states: Optional[bool] = None
    # vLLM's structured-output extras: the backend's `structured_outputs` (one constraint),
    # and the older guided_* spellings of three of its constraints
    structured_outputs: Optional[Union[dict[str, Any], str]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    # vLLM's disaggregated prefill/decode handshake, which vllm-router's P/D mode speaks
    # (translation.py's KV_TRANSFER_HANDLE; docs/features.md): {"do_remote_decode": true} asks a
    # role-prefill model to hand the request over after its first token, and the answer's
    # kv_transfer_params, sent on with the request, lets a role-decode model take it over.
    kv_transfer_params: Optional[dict[str, Any]] = None

    def check_common(self) -> None:
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        if self.return_hidden_states:
            raise ApiError(400, "return_hidden_states is not supported (this server returns no hidden states)",
                           "return_hidden_states", "unsupported_value")
        if self.hands_over and self.stream:
            raise ApiError(400, "kv_transfer_params: do_remote_decode answers one JSON response (its handle); "
                                "send stream false", "kv_transfer_params", "invalid_value")
        if self.no_stop_trim and self.include_stop_str_in_output is False:
            raise ApiError(400, "no_stop_trim true and include_stop_str_in_output false disagree; send one",
                           "no_stop_trim", "invalid_value")

    @property
    def hands_over(self) -> bool:
        """The prefill half of a disaggregated request: run the prompt and the first token,
        then answer the handle of the request's KV transfer."""
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))

    def keeps_stop_str(self) -> Optional[bool]:
        """include_stop_str_in_output, or SGLang's no_stop_trim for it; None when neither was set."""
        if self.no_stop_trim:
            return True
        return self.include_stop_str_in_output


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check(self) -> str:
        """Validate what the backend cannot; return the prompt text."""
        self.check_common()
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
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    # An assistant's earlier calls and a tool's answer to one: handed to the chat template as they are.
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

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


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    # accepted, not used
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    modalities: Optional[list[str]] = None
    # vLLM's: continue the last (assistant) message instead of opening a new turn.
    continue_final_message: Optional[bool] = None
    # SGLang's reasoning switches (vllm-router adds them). No reasoning parser runs here, so all
    # generated text is content: there is nothing to separate, stream apart or leave out,
    # whatever their value.
    separate_reasoning: Optional[bool] = None
    stream_reasoning: Optional[bool] = None
    include_reasoning: Optional[bool] = None

    def check(self) -> list[dict[str, str]]:
        """Validate what the backend cannot; return the messages for the chat template."""
        self.check_common()
        self.check_tools()
        if self.response_format is not None and (self.response_format.type == "json_schema") != (
                self.response_format.json_schema is not None):
            raise ApiError(400, "response_format.json_schema is required with type 'json_schema', and only then",
                           "response_format.json_schema", "invalid_value")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise ApiError(400, "only the text modality is supported", "modalities", "unsupported_value")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ApiError(400, "continue_final_message needs the last message to be the assistant's",
                           "continue_final_message", "invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        messages = []
        for i, message in enumerate(self.messages):
            role = "system" if message.role == "developer" else message.role
            rendered: dict[str, Any] = {"role": role, "content": message.text(i)}
            if message.tool_calls is not None:
                rendered["tool_calls"] = message.tool_calls
            if message.tool_call_id is not None:
                rendered["tool_call_id"] = message.tool_call_id
            messages.append(rendered)
        return messages

    @property
    def auto_tools(self) -> bool:
        """Whether the model may call the tools or answer in text, its calls parsed from its own
        tool-call format (tool_choice "auto", the default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def forced_tool(self) -> Literal["required"] | str | None:
        """What the reply must be: "required" (one or more calls of the tools), a function's
        name (a call of that function), or None (text)."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        return "required" if self.tool_choice == "required" else self.tool_choice.function.name

    def check_tools(self) -> None:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
        if not self.tools or self.tool_choice == "none":
            return
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ApiError(400, f"tool names must be distinct (got {names})", "tools", "invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ApiError(400, f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools "
                                f"{names}", "tool_choice", "invalid_value")


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
