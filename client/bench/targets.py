"""Benchmark clients for running servers: the systems `--target` adds to `python -m client.bench`.

    grpc://HOST:PORT    Triton gRPC streaming (ModelStreamInfer), system "triton-grpc"
    http://HOST:PORT    Triton HTTP /v2/models/<model>/generate_stream (SSE), "triton-http"
    openai://HOST:PORT  any OpenAI-compatible /v1/completions with stream (our
                        client/openai/, vLLM's api_server, llama.cpp's llama-server), "openai"

`NAME=SCHEME://...` names the system otherwise (two OpenAI servers in one run).

Every request carries the workload's prompt as text (workloads.attach_text makes
it encode to exactly the workload's tokens), `max_tokens`, `temperature`, `seed` and
`ignore_eos`, so each request generates exactly its drawn output length. Token counts
come from the server, never from re-tokenizing text: Triton's `num_output_tokens` output
per response, OpenAI's `usage` (`stream_options.include_usage`).

All requests run on one asyncio loop. Open loop: each request is sent at its arrival
time whatever the others do, so a slow server builds a queue instead of slowing the
load, as `vllm bench serve` does. Closed loop (`concurrency`): that many requests in
flight, the next one sent as one ends. One gRPC stream per request, as our OpenAI
frontend uses Triton, so triton-grpc and openai differ only by the HTTP layer.

Times are taken when the event loop gets a response: TTFT is the first piece of
output, ITL the gaps between pieces (a piece may hold several tokens), E2EL the final
response, TPOT (E2EL - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from backend.protocol import (
    FINISH_REASON,
    NUM_OUTPUT_TOKENS,
    RETURN_FINISH_REASON,
    RETURN_NUM_OUTPUT_TOKENS,
    TEXT_OUTPUT,
)
from client.bench.records import RequestRecord, SystemRun
from client.bench.workloads import BenchRequest, Workload
from client.triton import is_final, make_inputs, output_value, request_values

SCHEMES = {"grpc": "triton-grpc", "http": "triton-http", "openai": "openai"}
TRITON_RETURNS = (RETURN_FINISH_REASON, RETURN_NUM_OUTPUT_TOKENS)


@dataclass(frozen=True)
class Target:
    name: str  # the system name in the report
    scheme: str
    address: str  # host:port (openai: may end with a path, e.g. host:port/v1)
    model_name: str = "llm"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


def parse_target(spec: str, model_name: str = "llm") -> Target:
    """`[NAME=]SCHEME://HOST:PORT` -> Target; ValueError names what is wrong."""
    name = None
    head = spec.split("://", 1)[0]
    if "=" in head:
        name, spec = spec.split("=", 1)
    scheme, sep, address = spec.partition("://")
    address = address.rstrip("/")
    if not sep or scheme not in SCHEMES or not address:
        raise ValueError(f"--target {spec!r}: expected [NAME=]SCHEME://HOST:PORT with SCHEME one of "
                         + ", ".join(SCHEMES))
    return Target(name or SCHEMES[scheme], scheme, address, model_name)


def sampling_of(spec: BenchRequest, seed: int) -> dict[str, Any]:
    sampling = {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "seed": seed, "ignore_eos": True}
    if spec.priority:
        sampling["priority"] = spec.priority
    if spec.tenant != "default":
        sampling["tenant"] = spec.tenant
    return sampling


# ---------------------------------------------------------------------------- clients
# Each `send` fills one RequestRecord: arrival when sent, a time per piece of output,
# the token count, end_time and finish_reason at the final response, or `error`.


def _scalar(value):
    return value[0] if isinstance(value, list) and value else value


class _TritonGrpc:
    def __init__(self, target: Target, timeout_s: float):
        self.target = target
        self.timeout_s = timeout_s

    async def __aenter__(self):
        import tritonclient.grpc.aio as grpcaio

        self.client = grpcaio.InferenceServerClient(self.target.address)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()

    async def send(self, request_id: str, prompt: str, sampling: dict, record: RequestRecord) -> None:
        inputs = make_inputs(prompt, sampling, stream=True, exclude_input=True, returns=TRITON_RETURNS)

        async def one_request():
            yield {"model_name": self.target.model_name, "inputs": inputs, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}

        record.arrival = time.perf_counter()
        call = self.client.stream_infer(one_request(), stream_timeout=self.timeout_s)
        finished = False
        try:
            async for result, error in call:
                now = time.perf_counter()
                if error is not None:
                    record.error = error.message() or str(error)
                    return
                tokens = int(output_value(result, NUM_OUTPUT_TOKENS) or 0)
                text = output_value(result, TEXT_OUTPUT)
                if text or tokens:
                    record.token_times.append(now)
                    record.text += text or ""
                    record.num_output_tokens += tokens
                if is_final(result):
                    finished = True
                    reason = output_value(result, FINISH_REASON)
                    record.end_time = now
                    record.finish_reason = reason if reason not in (None, "", "None") else "unknown"
                    return
            record.error = "the stream ended before the final response"
        finally:
            if not finished:
                call.cancel()


class _Http:
    """aiohttp (a tritonclient[all] dependency): one session for every request, its
    connections kept alive, and one that opens a connection per request for the retries."""

    def __init__(self, target: Target, timeout_s: float):
        self.target = target
        self.timeout_s = timeout_s

    async def __aenter__(self):
        import aiohttp

        def session(**connector):
            # No connection limit: an open-loop client must not queue requests itself.
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, **connector),
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s), read_bufsize=1 << 20)

        self.session, self.fresh = session(), session(force_close=True)
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.fresh.close()

    async def post(self, url: str, body: dict):
        """The response to `body`, its headers read. llama-server ends every streamed response
        by closing the connection, though its headers say keep-alive, so a request can go out
        on a pooled connection that the server has already closed: the server never reads it
        and the client sees the connection drop before any response. Such a request is sent
        once more, on a connection of its own; a response cut off later is an error."""
        import aiohttp

        try:
            return await self.session.post(url, json=body)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return await self.fresh.post(url, json=body)

    async def events(self, url: str, body: dict, record: RequestRecord):
        """Yield (time, JSON event) for each SSE `data:` line; an HTTP error becomes record.error."""
        record.arrival = time.perf_counter()
        async with await self.post(url, body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                yield time.perf_counter(), (None if data == b"[DONE]" else json.loads(data))


class _TritonHttp(_Http):
    async def send(self, request_id: str, prompt: str, sampling: dict, record: RequestRecord) -> None:
        url = f"http://{self.target.address}/v2/models/{self.target.model_name}/generate_stream"
        body = request_values(prompt, sampling, stream=True, exclude_input=True, returns=TRITON_RETURNS)
        reason = None
        async with aclosing(self.events(url, body, record)) as events:
            async for now, event in events:
                if event is None:
                    continue
                if "error" in event:
                    record.error = str(event["error"])
                    return
                tokens = int(_scalar(event.get(NUM_OUTPUT_TOKENS, 0)) or 0)
                text = _scalar(event.get(TEXT_OUTPUT))
                if text or tokens:
                    record.token_times.append(now)
                    record.text += text or ""
                    record.num_output_tokens += tokens
                value = _scalar(event.get(FINISH_REASON))
                if value not in (None, "", "None"):
                    reason = value
                record.end_time = now
        if record.error is None:
            # Triton's SSE carries no final flag: the stream's end is the final response.
            record.finish_reason = reason or "unknown"


class _OpenAI(_Http):
    async def send(self, request_id: str, prompt: str, sampling: dict, record: RequestRecord) -> None:
        base = f"http://{self.target.address}"
        url = (base if base.endswith("/v1") else base + "/v1") + "/completions"
        sampling = dict(sampling)
        if "tenant" in sampling:  # OpenAI's name for who a request is for
            sampling["user"] = sampling.pop("tenant")
        body = {"model": self.target.model_name, "prompt": prompt, "stream": True,
                "stream_options": {"include_usage": True}, **sampling}
        reason, usage = None, None
        async with aclosing(self.events(url, body, record)) as events:
            async for now, event in events:
                record.end_time = now
                if event is None:  # data: [DONE]
                    continue
                if "error" in event:
                    error = event["error"]
                    record.error = str(error.get("message", error) if isinstance(error, dict) else error)
                    return
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        record.token_times.append(now)
                        record.text += choice["text"]
                    reason = choice.get("finish_reason") or reason
        if record.error is None:
            # Without usage (a server that ignores include_usage) a chunk counts as a token, as vLLM's bench does.
            record.num_output_tokens = usage if usage is not None else len(record.token_times)
            record.finish_reason = reason or "unknown"


CLIENTS = {"grpc": _TritonGrpc, "http": _TritonHttp, "openai": _OpenAI}


# ---------------------------------------------------------------------------- runs


def _describe(exc: Exception) -> str:
    # gRPC errors print a multi-line debug string; their details() is the one line that matters.
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{type(exc).__name__}: {text if text else repr(exc)}"


async def _run(target: Target, workload: Workload, concurrency: int | None, progress: bool,
               timeout_s: float) -> SystemRun:
    specs = workload.requests
    if workload.tenant_concurrency:
        raise ValueError(f"{workload.name} keeps a tenant's requests in flight (a closed loop per tenant), "
                         "which only the in-process engine runner does")
    if any(spec.prompt_text is None for spec in specs):
        raise ValueError("the workload has no prompt text: call client.bench.workloads.attach_text first")
    records = [RequestRecord(arrival=0.0, expected_output_tokens=r.max_tokens, label=r.label) for r in specs]
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    async with CLIENTS[target.scheme](target, timeout_s) as client:
        # A first request outside the timing: connections, and the server's first forward pass.
        warm = RequestRecord(arrival=0.0)
        try:
            await client.send("warmup", "Hello", {"max_tokens": 4, "temperature": 0, "ignore_eos": True}, warm)
        except Exception as exc:  # unreachable server, refused connection, ...
            warm.error = _describe(exc)
        if warm.error or warm.finish_reason is None:
            raise RuntimeError(f"warm-up request to {target.url} (model {target.model_name!r}) failed: "
                               f"{warm.error or 'no final response'}")
        bar = tqdm(total=len(order), desc=f"{workload.name} {target.name}", unit="req", disable=not progress,
                   leave=False)

        async def one(position: int, index: int) -> None:
            spec = specs[index]
            try:
                # Seeds as the in-process engine numbers them: by position in arrival order.
                await client.send(str(index), spec.prompt_text, sampling_of(spec, position + 1), records[index])
            except Exception as exc:  # recorded: one failed request does not end the run
                records[index].error = _describe(exc)
                records[index].finish_reason = None
            bar.update(1)

        start = time.perf_counter()
        if concurrency:
            queue = iter(enumerate(order))

            async def worker() -> None:
                for position, index in queue:  # shared: each worker takes the next request
                    await one(position, index)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(order)))))
        else:
            tasks = []
            for position, index in enumerate(order):
                delay = start + specs[index].arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(position, index)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return SystemRun(target.name, records, duration, {"target": target.url, "model_name": target.model_name},
                     concurrency=concurrency)


def run_target(target: Target, workload: Workload, concurrency: int | None = None, progress: bool = True,
               timeout_s: float = 600.0) -> SystemRun:
    """The workload against a running server; RuntimeError when its warm-up request fails."""
    return asyncio.run(_run(target, workload, concurrency, progress, timeout_s))
