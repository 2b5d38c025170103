"""The OpenAI-compatible frontend (client/openai/), driven by the official `openai`
package against a real tritonserver (the session's `triton_server`, tests/e2e/conftest.py:
SmolLM2-135M-Instruct behind the inflight backend).

Covers completion, chat (the checkpoint's chat template), streaming (SSE ending with
`data: [DONE]`), usage, stop, seed, logprobs, errors in OpenAI's JSON with their HTTP
status, request size bounds, and a client that goes away: its Triton request is
cancelled and its KV blocks are freed (read from Triton's /metrics).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import openai
import pytest
import requests

from client.generate import apply_chat_template
from client.openai.translation import _chat_logprobs, _completion_logprobs, classify_backend_error
from client.triton import make_inputs, stream_generate, text_of
from tests.e2e.openai_frontend import metric, run_frontend, wait_for

MODEL = "llm"
PROMPT = "The three primary colors are"


# ---------------------------------------------------------------------------- no server


@pytest.mark.parametrize("message, status, param", [
    ("temperature: temperature must be non-negative, got -1.0.", 400, "temperature"),
    ("max_tokens: prompt (5 tokens) + max_tokens (9000) = 9005 exceeds max_model_len 8192", 400, "max_tokens"),
    ("text_input: prompt has 9000 tokens; max_model_len is 8192, leaving no room to generate", 400, "prompt"),
    ("waiting queue is full (1 requests, max_queue_len); retry later", 503, None),
    ("the model is shutting down", 503, None),
    ("engine error in the forward pass: boom", 500, None),
    ("Request for unknown model: 'x' is not found", 404, "model"),
])
def test_backend_errors_map_to_http_status(message, status, param):
    error = classify_backend_error(message, "x")
    assert (error.status, error.param) == (status, param)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


def test_logprobs_conversion():
    # The backend's entry: sampled token first, then the top ones (vLLM's JSON, ids as strings).
    entries = [
        {"5": {"logprob": -0.5, "rank": 2, "decoded_token": " a"}, "7": {"logprob": -0.1, "rank": 1, "decoded_token": " b"},
         "9": {"logprob": -0.9, "rank": 2, "decoded_token": " c"}},
        {"3": {"logprob": -0.2, "rank": 1, "decoded_token": "!"}, "4": {"logprob": -2.0, "rank": 2, "decoded_token": "?"}},
    ]
    legacy = _completion_logprobs(entries, offset=10)
    assert legacy["tokens"] == [" a", "!"] and legacy["token_logprobs"] == [-0.5, -0.2]
    assert legacy["text_offset"] == [10, 12]
    chat = _chat_logprobs(entries, top=1)
    assert [c["token"] for c in chat] == [" a", "!"]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == [" b"]
    assert chat[1]["bytes"] == [33]


def test_relative_model_path_resolves_like_the_backend():
    """model_repository/llm's relative model_path is found from the frontend too (chat templates),
    and a GGUF model's tokenizer parameter (model_repository/llm_q4) before its model_path."""
    from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
    from client.openai.settings import Settings
    from client.openai.upstream import Catalog, ModelInfo

    config = {"parameters": {"model_path": {"string_value": "../../../.models/SmolLM2-135M-Instruct"}}}
    catalog = Catalog(Settings(), client=None)
    assert catalog.tokenizer_dir(ModelInfo("llm", config, ["1"], 0)) == DEFAULT_CHECKPOINT
    other = Catalog(Settings(model_repository="/srv/repo"), client=None)
    assert other.tokenizer_dir(ModelInfo("llm", config, [], 0)) == Path("/srv/.models/SmolLM2-135M-Instruct")
    absolute = {"parameters": {"model_path": {"string_value": "/ckpt/x"}}}
    assert other.tokenizer_dir(ModelInfo("m", absolute, ["1"], 0)) == Path("/ckpt/x")
    assert Catalog(Settings(tokenizer="/tok"), None).tokenizer_dir(ModelInfo("m", absolute, [], 0)) == Path("/tok")
    gguf = {"parameters": {"model_path": {"string_value": "../../../.models/SmolLM2-135M-Instruct.Q4_1.gguf"},
                           "tokenizer": {"string_value": "../../../.models/SmolLM2-135M-Instruct"}}}
    assert catalog.tokenizer_dir(ModelInfo("llm_q4", gguf, ["1"], 0)) == DEFAULT_CHECKPOINT
    assert REPO_ROOT.is_dir()


def test_triton_down_is_503_with_openai_error_json():
    from tools.launch import free_ports

    with run_frontend(f"127.0.0.1:{free_ports(1)[0]}", wait_healthy=False) as fe:
        assert requests.get(f"{fe.url}/health", timeout=30).status_code == 503
        r = requests.post(f"{fe.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
        with pytest.raises(openai.InternalServerError):
            fe.openai().models.list()


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def frontend(triton_server):
    with run_frontend(triton_server.grpc_url) as running:
        yield running
    # (the log is left in a temp dir; run_frontend's error messages include its tail)


@pytest.fixture(scope="module")
def client(frontend) -> openai.OpenAI:
    return frontend.openai()


def direct_greedy(triton_server, prompt: str, max_tokens: int) -> str:
    """The same request straight through Triton gRPC (no frontend)."""
    import tritonclient.grpc as grpcclient

    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        inputs = make_inputs(prompt, {"temperature": 0, "max_tokens": max_tokens}, stream=True)
        return "".join(text_of(r) for r in stream_generate(grpc, MODEL, inputs, timeout_s=120))
    finally:
        grpc.close()


# ---------------------------------------------------------------------------- API


@pytest.mark.e2e
def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.e2e
def test_completion_matches_triton_and_counts_tokens(client, triton_server):
    from transformers import AutoTokenizer

    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text == direct_greedy(triton_server, PROMPT, 12)
    tokenizer = AutoTokenizer.from_pretrained(str(triton_server_checkpoint()))
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert 0 < out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 12
    assert choice.finish_reason in ("stop", "length")


def triton_server_checkpoint():
    from backend.paths import DEFAULT_CHECKPOINT

    return DEFAULT_CHECKPOINT


@pytest.mark.e2e
def test_chat_uses_the_chat_template(client, triton_server):
    question = "What is the capital of France?"
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    # Same text as the templated prompt sent straight to Triton.
    prompt = apply_chat_template(question, str(triton_server_checkpoint()))
    assert choice.message.content == direct_greedy(triton_server, prompt, 24)
    assert out.usage.prompt_tokens > 20  # the template's system prompt and markers count
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.e2e
def test_streaming_chat_equals_non_streamed_and_reports_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "not streamed"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


@pytest.mark.e2e
def test_streaming_completion_is_sse_ending_with_done(frontend):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with requests.post(f"{frontend.url}/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.e2e
def test_stop_sequence_ends_the_text(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[:base.index(stop)]


@pytest.mark.e2e
def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert a == b


@pytest.mark.e2e
def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(top[tok] == max(top.values()) for tok, top in zip(lp.tokens, lp.top_logprobs))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)


# ---------------------------------------------------------------------------- errors and bounds


def error_of(response: requests.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.e2e
def test_bad_parameter_is_400_with_openai_error_json(client, frontend):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature" and info.value.body["type"] == "invalid_request_error"

    cases = [
        ({"prompt": PROMPT, "n": 17}, "n"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 100000}, "max_tokens"),  # refused by the engine (max_model_len)
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "best_of": 3, "stream": True}, "best_of"),  # refused by the backend: ranked at the end
        ({"prompt": [PROMPT, PROMPT]}, "prompt"),
        ({"prompt": PROMPT, "frobnicate": True}, "frobnicate"),
        ({}, "prompt"),
    ]
    for fields, param in cases:
        r = requests.post(f"{frontend.url}/v1/completions", json={"model": MODEL, **fields}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        assert error_of(r)["param"] == param, (fields, r.text)

    r = requests.post(f"{frontend.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0, "stream": True})
    assert r.status_code == 400 and error_of(r)["param"] == "n"
    r = requests.post(f"{frontend.url}/v1/completions", data=b"{not json", timeout=60)
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)


@pytest.mark.e2e
def test_request_sizes_are_bounded(frontend):
    url = f"{frontend.url}/v1/completions"
    # A prompt longer than max_model_len (8192 for SmolLM2): the engine refuses it with the numbers.
    r = requests.post(url, json={"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 4}, timeout=120)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    assert "max_model_len" in error_of(r)["message"]
    # Stop lists and stop strings (backend/request.py: MAX_STOP_ENTRIES, MAX_STOP_STRING_CHARS).
    r = requests.post(url, json={"model": MODEL, "prompt": PROMPT, "stop": [f"s{i}" for i in range(65)]}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    r = requests.post(url, json={"model": MODEL, "prompt": PROMPT, "stop": "x" * 257}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    # Bodies beyond --max-body-bytes (4 MiB by default) never reach Triton.
    r = requests.post(url, data=b'{"model": "llm", "prompt": "' + b"a" * (5 << 20) + b'"}',
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


@pytest.mark.e2e
def test_api_key_and_body_limit_flags(triton_server):
    with run_frontend(triton_server.grpc_url, "--api-key", "s3cret", "--max-body-bytes", "2000") as fe:
        with pytest.raises(openai.AuthenticationError):
            fe.openai(api_key="wrong").models.list()
        assert [m.id for m in fe.openai(api_key="s3cret").models.list().data] == [MODEL]
        r = requests.post(f"{fe.url}/v1/completions", headers={"Authorization": "Bearer s3cret"},
                          json={"model": MODEL, "prompt": "a" * 3000}, timeout=60)
        assert r.status_code == 413


# ---------------------------------------------------------------------------- disconnects


def kv_used(triton_server) -> float | None:
    return metric(triton_server.metrics_port, "nv_trt_llm_kv_cache_block_metrics", model=MODEL,
                  kv_cache_block_type="used")


def cancellations(triton_server) -> float:
    return metric(triton_server.metrics_port, "inflight_cancellations_total", model=MODEL) or 0.0


LONG = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True}


@pytest.mark.e2e
def test_stream_disconnect_cancels_and_frees_kv_blocks(client, triton_server):
    assert wait_for(lambda: kv_used(triton_server) == 0), "KV blocks in use before the test"
    before = cancellations(triton_server)
    stream = client.completions.create(stream=True, extra_body={"ignore_eos": True},
                                       **{k: v for k, v in LONG.items() if k != "ignore_eos"})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert kv_used(triton_server) > 0
    stream.close()  # the HTTP connection goes away mid-stream
    assert wait_for(lambda: kv_used(triton_server) == 0, timeout_s=15), "KV blocks not freed after disconnect"
    assert wait_for(lambda: cancellations(triton_server) > before), "no cancellation counted"


@pytest.mark.e2e
def test_non_streamed_disconnect_cancels_and_frees_kv_blocks(frontend, triton_server):
    assert wait_for(lambda: kv_used(triton_server) == 0), "KV blocks in use before the test"
    before = cancellations(triton_server)
    seen_running = threading.Event()

    def watch():
        if wait_for(lambda: (kv_used(triton_server) or 0) > 0, timeout_s=10):
            seen_running.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{frontend.url}/v1/completions", json=LONG, timeout=(5, 3))  # gives up after 3 s
    watcher.join()
    assert seen_running.is_set(), "the request never ran"
    assert wait_for(lambda: kv_used(triton_server) == 0, timeout_s=15), "KV blocks not freed after disconnect"
    assert wait_for(lambda: cancellations(triton_server) > before), "no cancellation counted"


@pytest.mark.e2e
def test_server_still_serves_after_disconnects(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text


@pytest.mark.e2e
def test_n_returns_n_choices_and_streams_them_by_index(client):
    sampling = {"model": MODEL, "max_tokens": 8, "temperature": 0.8, "seed": 11}
    out = client.completions.create(prompt=PROMPT, n=2, **sampling)
    assert [c.index for c in out.choices] == [0, 1]
    for i, choice in enumerate(out.choices):  # choice i is sampled with seed 11 + i
        alone = client.completions.create(prompt=PROMPT, **{**sampling, "seed": 11 + i})
        assert choice.text == alone.choices[0].text and choice.finish_reason == alone.choices[0].finish_reason
    assert out.usage.completion_tokens == sum(
        client.completions.create(prompt=PROMPT, **{**sampling, "seed": 11 + i}).usage.completion_tokens for i in (0, 1))

    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(messages=messages, n=2, **sampling)
    assert [c.index for c in whole.choices] == [0, 1]
    streamed, reasons = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **sampling):
        for choice in chunk.choices:
            assert choice.index not in reasons, "a choice's chunk after its finish_reason"
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert streamed == {c.index: c.message.content for c in whole.choices}


@pytest.mark.e2e
def test_best_of_returns_the_n_most_likely_of_its_sequences(client):
    """n=2, best_of=3: the two of the three sequences (sequence i sampled with seed s + i, as the
    same request with n=3) with the highest cumulative logprob, best first."""
    sampling = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 21}
    out = client.completions.create(n=2, best_of=3, **sampling)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.prompt_tokens > 0
    three = client.completions.create(n=3, logprobs=0, **sampling).choices
    ranked = sorted(three, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    scores = [sum(c.logprobs.token_logprobs) for c in ranked]
    if scores[1] - scores[2] > 1e-3:  # clear of float noise between the sums here and the engine's
        assert [c.text for c in out.choices] == [c.text for c in ranked[:2]], scores
    assert {c.text for c in out.choices} <= {c.text for c in three}
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
