"""The request interface end to end, through the real tritonserver (the session's
`triton_server`: the default SmolLM2 checkpoint, max_num_seqs 8, a 128 MiB KV pool).

- values as strings (genai-perf style) and sampling values in Triton request parameters;
- stop strings inside a token, across tokens and ending mid-token, streamed and not;
- multi-byte UTF-8 streamed with no U+FFFD;
- the return_* outputs, logprobs in vLLM's JSON shape, seeded sampling under load;
- metrics that move with the traffic and come back to idle.

Bad requests are test_e2e_validation.py's.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass

import pytest
import requests

from backend.paths import DEFAULT_CHECKPOINT
from backend.protocol import RETURN_FLAGS, RETURN_TRACE
from tests.e2e.e2e_util import (
    Stream,
    generate,
    inputs_for,
    output,
    scrape,
    wait_for,
    wait_idle,
    wait_until,
)
from tests.e2e.server import E2E_PARAMETERS

pytestmark = pytest.mark.e2e

PROMPT = "The three primary colors are"
VOCAB = 49152  # SmolLM2's vocabulary
MAX_MODEL_LEN = 8192  # SmolLM2's 8192 positions (the engine's cap)


@pytest.fixture(scope="module")
def server(triton_server):
    return triton_server


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


@dataclass
class Reference:
    text: str
    tokens: list[str]  # decoded text of each output token (from logprobs)
    token_ids: list[int]


def greedy(server, prompt: str, max_tokens: int, stream: bool = False, **extra) -> object:
    sampling = {"temperature": 0, "max_tokens": max_tokens, **extra}
    return generate(server.grpc_url, server.model, inputs_for(prompt, sampling, stream=stream, exclude_input=True,
                                                              returns=RETURN_FLAGS))


def logprob_entries(outcome) -> list[dict]:
    entries = []
    for r in outcome.responses:
        entries += json.loads(output(r, "logprobs") or "null") or []
    return entries


def sampled(entry: dict) -> tuple[int, dict]:
    """The sampled token of one logprobs entry: the one vLLM lists first."""
    token_id, info = next(iter(entry.items()))
    return int(token_id), info


@pytest.fixture(scope="module")
def reference(server) -> Reference:
    outcome = greedy(server, PROMPT, 40, logprobs=0)
    assert outcome.error is None, outcome.message
    entries = logprob_entries(outcome)
    assert len(entries) == 40
    tokens = [sampled(e)[1]["decoded_token"] for e in entries]
    # The reference text is plain ASCII here, so per-token decoding adds up to the text.
    assert "".join(tokens) == outcome.text
    return Reference(outcome.text, tokens, [sampled(e)[0] for e in entries])


# ---------------------------------------------------------------------------- strings and request parameters

def test_values_as_strings_mean_what_they_say(server, reference):
    url, model = server.grpc_url, server.model
    # genai-perf's style: every value a string.
    got = generate(url, model, inputs_for(PROMPT, {"max_tokens": "8", "temperature": "0", "ignore_eos": "true"},
                                          stream=True, returns=RETURN_FLAGS))
    assert got.error is None, got.message
    assert got.total("num_output_tokens") == 8 and output(got.last, "finish_reason") == "length"
    assert got.text == "".join(reference.tokens[:8])
    got = generate(url, model, inputs_for(PROMPT, '{"max_tokens":"16","min_tokens":"16"}', stream=True,
                                          exclude_input=True, returns=RETURN_FLAGS))
    assert got.error is None, got.message
    assert got.total("num_output_tokens") == 16

    # "false" is false and "true" is true: a chat answer ends at EOS unless ignore_eos.
    from client.generate import apply_chat_template

    chat = apply_chat_template("Answer with one word: is the sky blue?", str(DEFAULT_CHECKPOINT))
    with Stream(url) as stream:
        outcomes = {flag: stream.send(model, inputs_for(chat, {"max_tokens": "48", "temperature": "0", "ignore_eos": flag},
                                                        stream=False, exclude_input=True, returns=RETURN_FLAGS))
                    for flag in ("false", "true", "0", "1")}
        for got in outcomes.values():
            wait_for(got, 300)
    for flag in ("false", "0"):
        got = outcomes[flag]
        assert output(got.last, "finish_reason") == "stop", flag
        assert output(got.last, "num_output_tokens") < 48
    for flag in ("true", "1"):
        got = outcomes[flag]
        assert output(got.last, "finish_reason") == "length", flag
        assert output(got.last, "num_output_tokens") == 48

    stop = reference.tokens[3]
    for flag, expected in (("false", ""), ("true", stop)):
        got = generate(url, model, inputs_for(PROMPT, {"max_tokens": "40", "temperature": "0", "stop": stop,
                                                       "include_stop_str_in_output": flag},
                                              stream=False, exclude_input=True, returns=RETURN_FLAGS))
        assert got.text == "".join(reference.tokens[:3]) + expected, flag


def test_sampling_values_from_triton_request_parameters(server, reference):
    url, model = server.grpc_url, server.model
    # No sampling_parameters tensor: the request's parameters carry the values (and switches).
    got = generate(url, model, inputs_for(PROMPT), parameters={
        "max_tokens": 6, "temperature": 0, "ignore_eos": "true", "exclude_input_in_output": True,
        "return_num_output_tokens": True, "return_finish_reason": "true"})
    assert got.error is None, got.message
    assert len(got.responses) == 1
    assert got.text == "".join(reference.tokens[:6])
    assert output(got.last, "num_output_tokens") == 6 and output(got.last, "finish_reason") == "length"

    got = generate(url, model, inputs_for(PROMPT), parameters={"max_tokens": "6", "temperature": "0", "stream": True})
    assert got.error is None, got.message
    assert len(got.responses) > 1 and got.text == "".join(reference.tokens[:6])

    # Without exclude_input_in_output the whole text (prompt first) comes back, as vLLM's backend does.
    got = generate(url, model, inputs_for(PROMPT), parameters={"max_tokens": "4", "temperature": "0", "stream": "false"})
    assert got.text == PROMPT + "".join(reference.tokens[:4])

    # HTTP generate: "parameters": {...}, every value a string.
    r = requests.post(f"{server.http_url}/v2/models/{model}/generate", timeout=120, json={
        "text_input": PROMPT, "exclude_input_in_output": True,
        "parameters": {"max_tokens": "5", "temperature": "0", "ignore_eos": "true"}})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "".join(reference.tokens[:5])


# ---------------------------------------------------------------------------- stop strings

def _stop_cases(ref: Reference) -> dict[str, tuple[str, int]]:
    """Stop strings cut from the reference's own tokens: name -> (stop, index of the token
    that completes it). Token boundaries come from the reference's per-token text."""
    starts = [0]
    for tok in ref.tokens:
        starts.append(starts[-1] + len(tok))

    def word(i: int) -> bool:
        return ref.tokens[i].strip().isalpha() and len(ref.tokens[i].strip()) >= 4

    cases: dict[str, tuple[str, int]] = {}
    for i in range(2, len(ref.tokens) - 3):
        tok, nxt, after = ref.tokens[i], ref.tokens[i + 1], ref.tokens[i + 2]
        lead = len(tok) - len(tok.lstrip())
        candidates = []  # (name, stop, where it starts in the text, the token completing it)
        if word(i):
            # Starts and ends strictly inside one token.
            candidates.append(("inside one token", tok[lead + 1 : lead + 3], starts[i] + lead + 1, i))
        if len(tok) >= 2 and word(i + 1):
            # Ends exactly where a token ends.
            candidates.append(("across tokens", tok[-2:] + nxt, starts[i + 1] - 2, i + 1))
            # The tail of one token, a whole token, the head of a third one.
            candidates.append(("across three tokens", tok[-1:] + nxt + after[:1], starts[i + 1] - 1, i + 2))
            # Ends two characters into a token that goes on after it.
            candidates.append(("with a suffix in the same token", tok + nxt[:2], starts[i], i + 1))
        for name, stop, at, j in candidates:
            # Only where the stop string's first occurrence is the one aimed at.
            if name not in cases and ref.text.find(stop) == at:
                cases[name] = (stop, j)
    return cases


def test_stop_strings_inside_across_and_mid_token_streamed_and_not(server, reference):
    cases = _stop_cases(reference)
    assert set(cases) == {"inside one token", "across tokens", "across three tokens", "with a suffix in the same token"}, (
        cases, reference.tokens)
    url, model = server.grpc_url, server.model
    runs = []
    with Stream(url) as stream:  # all at once: they share batches
        for name, (stop, j) in cases.items():
            for include in (False, True):
                for streamed in (False, True):
                    sampling = {"temperature": 0, "max_tokens": 40, "stop": [stop, "never appears"],
                                "include_stop_str_in_output": include}
                    outcome = stream.send(model, inputs_for(PROMPT, sampling, stream=streamed, exclude_input=True,
                                                            returns=RETURN_FLAGS))
                    runs.append((name, stop, j, include, streamed, outcome))
        for run in runs:
            wait_for(run[-1], 300)
    for name, stop, j, include, streamed, got in runs:
        label = f"{name} {stop!r} include={include} stream={streamed}"
        assert got.error is None, (label, got.message)
        assert got.finals == 1, label
        cut = reference.text.find(stop)
        expected = reference.text[: cut + (len(stop) if include else 0)]
        assert got.text == expected, label
        if not include:
            assert stop not in got.text, label  # never streamed, then taken back
        assert output(got.last, "finish_reason") == "stop", label
        # The token that completed the stop string is the last one generated.
        assert got.total("num_output_tokens") == j + 1, label
        if streamed:
            assert all("\ufffd" not in c for c in got.chunks), label


# ---------------------------------------------------------------------------- multi-byte UTF-8

@pytest.mark.parametrize("prompt,sampling", [
    ("日本の首都は", {"temperature": 0, "max_tokens": 16}),
    ("中文：你好，世界。我们", {"temperature": 0.9, "seed": 7, "max_tokens": 16}),
])
def test_multibyte_utf8_streams_without_replacement_characters(server, prompt, sampling):
    # Streamed and whole must run the same computation: the second of two requests for a
    # prompt of a full KV block or more (the sampled one is 18 tokens) reads that block from
    # the prefix cache. With batch_invariant on (the server's default here) a prefill that
    # starts from cached blocks is bitwise the one that computes them; without it the logits
    # can be ~1e-5 apart, enough at temperature 0.9 to flip a sampled token for ~2 seeds in 480.
    # One request first puts the prompt's full blocks in the cache, so that both runs below
    # start from the same blocks either way.
    warm = generate(server.grpc_url, server.model, inputs_for(prompt, {"temperature": 0, "max_tokens": 1}, stream=False))
    assert warm.error is None, warm.message
    sampling = {**sampling, "logprobs": 0}
    streamed = generate(server.grpc_url, server.model, inputs_for(prompt, sampling, stream=True, returns=RETURN_FLAGS))
    whole = generate(server.grpc_url, server.model, inputs_for(prompt, sampling, stream=False, exclude_input=True,
                                                              returns=RETURN_FLAGS))
    assert streamed.error is None and whole.error is None
    # The same tokens (same seed, same computation), so the text must match too.
    assert [sampled(e)[0] for e in logprob_entries(streamed)] == [sampled(e)[0] for e in logprob_entries(whole)]
    # The model really splits characters across tokens here: some tokens alone decode to U+FFFD.
    split = [sampled(e)[1]["decoded_token"] for e in logprob_entries(streamed)]
    assert any("\ufffd" in t for t in split), split
    assert any(ord(ch) > 0x7F for ch in streamed.text)
    assert all("\ufffd" not in chunk for chunk in streamed.chunks), streamed.chunks
    # Seed 7's bytes are valid UTF-8 (about 2% of seeds sample a lead byte followed by ASCII,
    # which rightly decodes to U+FFFD: pick another seed if the sampler's stream changes).
    assert "\ufffd" not in whole.text
    assert streamed.text == whole.text


# ---------------------------------------------------------------------------- return_* outputs

def test_return_outputs_and_logprobs_in_vllm_shape(server, tokenizer, reference):
    n_top, max_tokens = 3, 12
    whole = greedy(server, PROMPT, max_tokens, logprobs=n_top)
    streamed = greedy(server, PROMPT, max_tokens, stream=True, logprobs=n_top)
    assert whole.error is None and streamed.error is None
    num_prompt = len(tokenizer.encode(PROMPT))

    last = whole.last
    assert len(whole.responses) == 1
    assert output(last, "finish_reason") == "length"
    assert output(last, "num_input_tokens") == num_prompt
    assert output(last, "num_output_tokens") == max_tokens
    entries = logprob_entries(whole)
    assert len(entries) == max_tokens
    for position, entry in enumerate(entries):
        token_id, info = sampled(entry)
        assert token_id == reference.token_ids[position]
        assert set(info) == {"logprob", "rank", "decoded_token"}
        assert info["rank"] == 1  # greedy takes the most likely token
        assert len(entry) == n_top  # the sampled token is one of the top 3
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks == [1, 2, 3]
        assert all(v["logprob"] <= 0 and math.isfinite(v["logprob"]) for v in entry.values())
        assert info["logprob"] == max(v["logprob"] for v in entry.values())
        assert all(str(int(k)) == k for k in entry)  # token ids as JSON object keys
    assert "".join(sampled(e)[1]["decoded_token"] for e in entries) == whole.text
    cumulative = sum(sampled(e)[1]["logprob"] for e in entries)
    assert output(last, "cumulative_logprob") == pytest.approx(cumulative, rel=1e-4, abs=1e-3)

    # Streamed: each response carries its own tokens' counts and logprobs; the last one the sums.
    assert streamed.text == whole.text
    assert streamed.total("num_output_tokens") == max_tokens
    for r in streamed.responses:
        assert output(r, "num_input_tokens") == num_prompt
        assert len(json.loads(output(r, "logprobs") or "null") or []) == output(r, "num_output_tokens")
    assert [sampled(e)[0] for e in logprob_entries(streamed)] == [sampled(e)[0] for e in entries]
    assert output(streamed.last, "finish_reason") == "length"
    assert output(streamed.last, "cumulative_logprob") == pytest.approx(cumulative, rel=1e-4, abs=1e-3)
    assert all(output(r, "finish_reason") not in ("stop", "length") for r in streamed.responses[:-1])

    # return_logprobs without sampling "logprobs": JSON null, like vLLM's backend.
    plain = greedy(server, PROMPT, 3)
    assert json.loads(output(plain.last, "logprobs")) is None
    assert math.isfinite(output(plain.last, "cumulative_logprob"))

    # HTTP generate returns the same outputs as JSON fields.
    r = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", timeout=120, json={
        "text_input": PROMPT, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": max_tokens, "logprobs": n_top}),
        **{name: True for name in RETURN_FLAGS}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text_output"] == whole.text and body["finish_reason"] == "length"
    assert body["num_input_tokens"] == num_prompt and body["num_output_tokens"] == max_tokens
    assert body["cumulative_logprob"] == pytest.approx(cumulative, rel=1e-4, abs=1e-3)
    assert [sampled(e)[0] for e in json.loads(body["logprobs"])] == reference.token_ids[:max_tokens]


def test_return_trace_over_a_grpc_stream_and_http_generate(server):
    max_tokens = 6
    streamed = generate(server.grpc_url, server.model, inputs_for(
        PROMPT, {"temperature": 0, "max_tokens": max_tokens}, stream=True, exclude_input=True,
        returns=(RETURN_TRACE,)))
    assert streamed.error is None and len(streamed.responses) >= 2
    assert all(output(r, "trace") == "null" for r in streamed.responses[:-1])
    trace = json.loads(output(streamed.last, "trace"))
    kinds = [e["event"] for e in trace["events"]]
    assert kinds[:3] == ["queued", "first_scheduled", "prefill_chunk"] and kinds[-2:] == ["first_token", "finished"]
    assert trace["events"][-1] == {**trace["events"][-1], "reason": "length", "output_tokens": max_tokens}
    assert trace["decode"]["steps"] == max_tokens - 1

    body = {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 3, "return_trace": True}}
    answer = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    trace = json.loads(answer.json()["trace"])
    assert trace["events"][-1]["event"] == "finished" and trace["decode"]["steps"] == 2
    body["parameters"].pop("return_trace")
    untraced = requests.post(f"{server.http_url}/v2/models/{server.model}/generate", json=body, timeout=60)
    assert untraced.status_code == 200 and untraced.json()["trace"] == "null"


def test_seeded_sampling_is_reproducible_under_concurrent_load(server):
    url, model = server.grpc_url, server.model
    seeded = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_tokens": 20, "ignore_eos": True}
    alone = generate(url, model, inputs_for(PROMPT, seeded, stream=False, exclude_input=True))
    assert alone.error is None, alone.message

    results: dict[str, object] = {}
    with Stream(url) as stream:
        load = [stream.send(model, inputs_for(f"Load {i}: tell me about the sea.", {
            "temperature": 0.8 + 0.1 * i, "top_k": 50, "max_tokens": 24, "ignore_eos": True,
            **({"seed": i} if i % 2 else {})}, stream=True)) for i in range(4)]
        wait_until(lambda: all(o.responses for o in load), 120, 0.02, "load streaming")
        results["whole"] = stream.send(model, inputs_for(PROMPT, seeded, stream=False, exclude_input=True))
        results["streamed"] = stream.send(model, inputs_for(PROMPT, seeded, stream=True))
        results["other seed"] = stream.send(model, inputs_for(PROMPT, {**seeded, "seed": 4321}, stream=False,
                                                              exclude_input=True))
        for outcome in [*load, *results.values()]:
            wait_for(outcome, 300)
    assert all(o.error is None for o in [*load, *results.values()])
    assert results["whole"].text == alone.text
    assert results["streamed"].text == alone.text
    assert results["other seed"].text != alone.text


# ---------------------------------------------------------------------------- metrics

def _histogram_count(m, name: str, model: str) -> float:
    return m.get(f"{name}_count", model=model)


def test_metrics_move_with_traffic_and_return_to_idle(server, kv_blocks):
    model, port = server.model, server.metrics_port
    before = wait_idle(port, model)
    lengths = [12, 7, 3]
    seen_busy = threading.Event()

    def watch():
        while not seen_busy.is_set() and not done.is_set():
            m = scrape(port)
            if (m.get("inflight_requests_running", model=model) >= 1
                    and m.get("nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="used") >= 1
                    and m.get("nv_trt_llm_request_metrics", model=model, request_type="active") >= 1):
                seen_busy.set()
            time.sleep(0.02)

    done = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with Stream(server.grpc_url) as stream:
        outcomes = [stream.send(model, inputs_for(f"Metrics request {i}: count to ten.", {
            "temperature": 0, "max_tokens": n, "ignore_eos": True}, stream=True,
            returns=("return_num_input_tokens", "return_num_output_tokens"))) for i, n in enumerate(lengths)]
        for o in outcomes:
            wait_for(o, 300)
    done.set()
    watcher.join(10)
    assert all(o.error is None for o in outcomes)
    assert seen_busy.is_set(), "never saw a running request and used KV blocks on /metrics"
    after = wait_idle(port, model)

    def delta(name: str, **labels) -> float:
        return after.get(name, model=model, **labels) - before.get(name, model=model, **labels)

    prompt_tokens = sum(output(o.responses[0], "num_input_tokens") for o in outcomes)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == sum(lengths)
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    for reason in ("stop", "abort", "error"):
        assert delta("vllm:request_success_total", finished_reason=reason) == 0, reason
    assert delta("inflight_requests_finished_total", finish_reason="length") == 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "inflight_queue_time_seconds"):
        assert delta(f"{name}_count") == 3, name
    # vLLM's time per output token: one sample per token after each request's first, the
    # time since that request's previous token.
    assert delta("vllm:time_per_output_token_seconds_count") == sum(n - 1 for n in lengths)
    assert delta("vllm:request_generation_tokens_sum") == sum(lengths)
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    # Per request, its first token's latency plus its intervals reach its last token, which
    # comes no later than its end.
    ttft_and_intervals = delta("vllm:time_to_first_token_seconds_sum") + delta("vllm:time_per_output_token_seconds_sum")
    assert 0 < ttft_and_intervals <= delta("vllm:e2e_request_latency_seconds_sum") + 1e-6
    # At least one step per generated token of the longest request.
    assert delta("inflight_iterations_total") >= max(lengths)
    assert delta("inflight_cancellations_total") == 0 and delta("inflight_preemptions_total") == 0

    # Idle values.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "inflight_requests_running", "inflight_requests_waiting", "inflight_kv_cache_usage_ratio"):
        assert after.get(name, model=model) == 0, name
    for kind in ("active", "scheduled", "context", "waiting"):
        assert after.get("nv_trt_llm_request_metrics", model=model, request_type=kind) == 0, kind
    assert after.get("nv_trt_llm_request_metrics", model=model, request_type="max") == int(E2E_PARAMETERS["max_num_seqs"])
    blocks = {kind: after.get("nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type=kind)
              for kind in ("max", "free", "used", "tokens_per", "fraction")}
    assert blocks == {"max": kv_blocks, "free": kv_blocks, "used": 0, "tokens_per": 16, "fraction": 0}
    assert 0 <= after.get("inflight_prefix_cache_hit_rate", model=model) <= 1
