"""Triton as the frontend sees it over gRPC: the models it serves, with their chat templates
(``Catalog``), and one generation per gRPC stream (``Generation``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tritonclient.utils import InferenceServerException

from backend.config import MULTI_LORA_FILE, read_multi_lora
from client.openai.schema import ApiError
from client.openai.settings import DEFAULT_MODEL_REPOSITORY, Settings
from client.openai.tool_calls import has_tool_call_format
from client.openai.translation import Job, Piece, pieces_of

log = logging.getLogger("inflight.openai")


class ClientGone(Exception):
    """The HTTP client disconnected; its Triton request has been cancelled."""


def _grpc_error(exc: Exception, url: str) -> ApiError | None:
    """ApiError for a gRPC failure of the stream itself (None: the call was cancelled)."""
    code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.CANCELLED:
        return None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the request did not finish within the server's request timeout", code="timeout")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"cannot reach Triton at {url}: {details}", code="service_unavailable")
    return ApiError(500, f"Triton stream failed: {details}", code="internal_error")


class Generation:
    """One request on its own Triton gRPC stream; ``cancel()`` cancels it on the server.

    Iterate with ``async for pieces in generation``: per response, one Piece per sequence
    (choice); errors surface as ``ApiError``.
    """

    def __init__(self, client, url: str, job: Job, timeout_s: float):
        self.url = url
        self.job = job
        self.finished = False
        self.cancelled = False
        inputs = job.triton_inputs()

        async def requests_iter():
            yield {"model_name": job.triton_model, "inputs": inputs, "request_id": job.request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}

        self._call = client.stream_infer(requests_iter(), stream_timeout=timeout_s)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> list[Piece]:
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
            raise self.job.backend_error(error.message() or str(error))
        pieces = pieces_of(result)
        if pieces[0].final:
            self.finished = True
        return pieces

    def cancel(self) -> None:
        """Cancel the stream unless its final response came (idempotent)."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._call.cancel()
            log.info("cancelled Triton request on model %s (client went away)", self.job.triton_model)


@dataclass
class ModelInfo:
    name: str
    config: dict[str, Any]
    versions: list[str]
    created: int
    # The LoRA adapters the model serves (its multi_lora.json in the model repository).
    lora_names: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> dict[str, str]:
        params = self.config.get("parameters", {}) or {}
        return {k: (v.get("string_value", "") if isinstance(v, dict) else str(v)) for k, v in params.items()}


def is_text_model(config: dict[str, Any]) -> bool:
    """An inflight model (or any with the vLLM-backend text interface)."""
    if config.get("backend") == "inflight":
        return True
    return any(i.get("name") == "text_input" for i in config.get("input", []))


class Catalog:
    """Models Triton serves (filtered by ``--model-name``) and their chat templates."""

    def __init__(self, settings: Settings, client):
        self.settings = settings
        self.client = client
        self._models: dict[str, ModelInfo] = {}
        self._adapters: dict[str, str] = {}
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()
        self._started = int(time.time())

    async def _call(self, coro):
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
                except Exception:
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
        for info in models.values():
            info.lora_names = self._lora_names(info.name)
        self._models = models
        # An adapter is served under its own name, as vLLM lists it; the first model wins a name two share.
        self._adapters = {}
        for info in models.values():
            for lora in info.lora_names:
                if lora not in models:
                    self._adapters.setdefault(lora, info.name)
        return list(models.values())

    def _lora_names(self, model: str) -> list[str]:
        path = Path(self.settings.model_repository or DEFAULT_MODEL_REPOSITORY) / model / MULTI_LORA_FILE
        if not path.is_file():
            return []
        try:
            return list(read_multi_lora(str(path)))
        except ValueError as exc:
            log.warning("ignoring the LoRA adapters of model %s: %s", model, exc)
            return []

    def adapters(self) -> dict[str, str]:
        """LoRA adapter name -> the model that serves it (as of the last refresh)."""
        return dict(self._adapters)

    async def get(self, name: str) -> ModelInfo:
        """The model called `name`, or the model that serves the LoRA adapter called `name`."""
        if name not in self._models and name not in self._adapters:
            await self.refresh()
        info = self._models.get(name) or self._models.get(self._adapters.get(name, ""))
        if info is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return info

    def tokenizer_dir(self, info: ModelInfo) -> Path:
        """The folder of the model's tokenizer (and chat template): --tokenizer, else the model's
        `tokenizer` parameter (a GGUF model's, whose model_path is a file), else its model_path,
        a relative one resolved from the model's version folder as the backend resolves it."""
        if self.settings.tokenizer:
            return Path(self.settings.tokenizer)
        path = info.parameters.get("tokenizer") or info.parameters.get("model_path", "")
        if path and os.path.isabs(path):
            return Path(path)
        repository = Path(self.settings.model_repository or DEFAULT_MODEL_REPOSITORY)
        model_dir = repository / info.name
        versions = [v for v in info.versions if v.isdigit()] or sorted(
            (p.name for p in model_dir.glob("[0-9]*") if p.is_dir()), key=int)
        version_dir = model_dir / (max(versions, key=int) if versions else "1")
        return Path(os.path.normpath(version_dir / path)) if path else version_dir

    def _load_tokenizer(self, info: ModelInfo):
        with self._tokenizer_lock:
            if info.name in self._tokenizers:
                return self._tokenizers[info.name]
            path = self.tokenizer_dir(info)
            if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
                raise ApiError(
                    500, f"no tokenizer for model `{info.name}` at {path}: start the frontend with --tokenizer DIR "
                         "or --model-repository DIR (the repository Triton serves)", code="tokenizer_not_found")
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
            self._tokenizers[info.name] = tokenizer
            return tokenizer

    async def token_ids(self, info: ModelInfo, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids as the backend encodes them (backend/validation.py)."""
        tokenizer = await asyncio.to_thread(self._load_tokenizer, info)
        return await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens=add_special_tokens)

    async def check_auto_tools(self, info: ModelInfo) -> None:
        """Refuse tool_choice "auto" (400 naming it) unless the model's chat template has a
        tool-call format whose calls this frontend parses (tool_calls.py)."""
        tokenizer = await asyncio.to_thread(self._load_tokenizer, info)
        if not has_tool_call_format(getattr(tokenizer, "chat_template", None)):
            raise ApiError(400, f"tool_choice 'auto' (the default with tools) needs a chat template with a tool-call "
                                f"format (<tool_call> blocks, as Qwen2.5's and Qwen3's), and model `{info.name}`'s "
                                "has none: send tool_choice 'required' or {'type': 'function', 'function': "
                                "{'name': ...}}", "tool_choice", "unsupported_value")

    async def chat_prompt(self, info: ModelInfo, messages: list[dict], continue_final_message: bool = False,
                          tools: list[dict] | None = None) -> str:
        """The chat template's prompt: a new assistant turn, or the last (assistant) message
        left open so that generation continues it; `tools` are rendered where the template has
        a place for them."""
        tokenizer = await asyncio.to_thread(self._load_tokenizer, info)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model `{info.name}` has no chat template: use /v1/completions", "messages",
                           "no_chat_template")

        def render() -> str:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=not continue_final_message,
                                                 continue_final_message=continue_final_message)

        try:
            return await asyncio.to_thread(render)
        except Exception as exc:  # jinja2 errors: e.g. a template that forbids a role order
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages", "invalid_value") from None
