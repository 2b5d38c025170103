"""The HTTP app: FastAPI routes, the API key, body limits, and client disconnects, over
upstream.py's Triton streams.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import tritonclient.grpc.aio as grpcaio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.openai.schema import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from client.openai.settings import Settings
from client.openai.translation import (
    Job,
    Piece,
    client_names,
    rendered,
    sampling_parameters,
    sse_event,
    validate_sampling,
)
from client.openai.upstream import Catalog, ClientGone, Generation, ModelInfo

log = logging.getLogger("inflight.openai")

MAX_DRAIN_BYTES = 16 * 1024 * 1024


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
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone()


# tritonclient's message limits, and a reconnect backoff capped at 1 s: gRPC's default backoff
# grows to 120 s while Triton is down, so a frontend whose tritonserver restarted (a crash, a
# rolling update) stayed unhealthy, and out of its router's rotation, for up to two minutes
# after Triton was ready again.
TRITON_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def create_app(settings: Settings) -> FastAPI:
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app):
        client = grpcaio.InferenceServerClient(settings.triton_url, channel_args=TRITON_CHANNEL_ARGS)
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
        by_name = {m.name: m for m in models}
        return {"object": "list", "data": [model_card(m.name, m) for m in models] + [
            model_card(name, by_name[parent]) for name, parent in state["catalog"].adapters().items()]}

    def model_card(name: str, info: ModelInfo) -> dict[str, Any]:
        """Model `info`, or, when `name` is one of its LoRA adapters, that adapter with the
        model as its parent (vLLM's card for an adapter)."""
        card = {"id": name, "object": "model", "created": info.created, "owned_by": "inflight"}
        if name != info.name:
            card["parent"] = info.name
        return card

    @app.get("/v1/models/{name}")
    async def get_model(name: str):
        return model_card(name, await state["catalog"].get(name))

    async def completion_job(request: Request) -> tuple[CompletionRequest, str, dict, ModelInfo]:
        """A completion request read and checked: (request, prompt, sampling_parameters, model)."""
        req = parse_request(CompletionRequest, await read_json(request))
        prompt = req.check()
        sampling = sampling_parameters(req)
        validate_sampling(sampling, client_names(req))
        return req, prompt, sampling, await state["catalog"].get(req.model)

    async def chat_job(request: Request) -> tuple[ChatCompletionRequest, str, dict, ModelInfo]:
        """A chat request read and checked, its messages rendered by the chat template."""
        req = parse_request(ChatCompletionRequest, await read_json(request))
        messages = req.check()
        sampling = sampling_parameters(req)
        validate_sampling(sampling, client_names(req))
        info = await state["catalog"].get(req.model)
        if req.auto_tools:
            await state["catalog"].check_auto_tools(info)
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] \
            if req.forced_tool or req.auto_tools else None
        prompt = await state["catalog"].chat_prompt(info, messages, bool(req.continue_final_message), tools)
        return req, prompt, sampling, info

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompt, sampling, info = await completion_job(request)
        return await run(request, job_for(req, prompt, sampling, info))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, prompt, sampling, info = await chat_job(request)
        return await run(request, job_for(req, prompt, sampling, info))

    def job_for(req, prompt: str, sampling: dict, info: ModelInfo) -> Job:
        job = Job.of(req, prompt, sampling, triton_model=info.name)
        job.check_role(info.parameters.get("role", "both"))
        return job

    # vLLM's render endpoints: the prompt's token ids without generating. vllm-router's kv_aware
    # policy asks a worker for them to match a request against the KV events' token ids.
    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        req, prompt, sampling, info = await completion_job(request)
        return [rendered(req.model, await state["catalog"].token_ids(info, prompt, sampling.get("add_special_tokens", True)), sampling, req.stream)]

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request):
        req, prompt, sampling, info = await chat_job(request)
        return rendered(req.model, await state["catalog"].token_ids(info, prompt, sampling.get("add_special_tokens", True)), sampling, req.stream)

    async def run(request: Request, job: Job):
        generation = Generation(state["client"], settings.triton_url, job, settings.request_timeout_s)
        if not job.stream:
            async def collect() -> list[Piece]:
                return [piece async for pieces in generation for piece in pieces]

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

    async def sse_events(job: Job, generation: Generation, first: list[Piece]) -> AsyncIterator[bytes]:
        prompt_tokens = completion_tokens = 0
        offsets = [len(job.prompt) if job.echo else 0] * job.n  # per choice
        ended: set[int] = set()  # choices whose finish reason was sent
        try:
            for chunk in job.first_chunks():
                yield chunk
            pieces: list[Piece] | None = first
            while pieces is not None:
                for piece in pieces:
                    completion_tokens += piece.num_output_tokens
                    if piece.num_input_tokens is not None:
                        prompt_tokens = piece.num_input_tokens
                    if piece.index in ended:
                        continue
                    chunk = job.chunk(piece, offsets[piece.index])
                    offsets[piece.index] += len(piece.text)
                    if piece.finish_reason is not None:
                        ended.add(piece.index)
                    if chunk is not None:
                        yield chunk
                pieces = None if pieces[0].final else await generation.__anext__()
            if job.include_usage:
                yield job.usage_chunk(prompt_tokens, completion_tokens)
        except ApiError as exc:
            yield sse_event(exc.body())
        except ClientGone:
            return
        finally:
            # Starlette cancels this generator when the client disconnects: cancel upstream.
            generation.cancel()
        yield sse_event("[DONE]")

    return app
