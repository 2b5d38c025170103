"""tool_choice "auto" through the OpenAI-compatible frontend, driven by the official `openai`
client against a real tritonserver serving a tiny random-weight Qwen2 checkpoint whose tokenizer
carries Qwen2.5's real chat template (tests/checkpoints.py: FAMILY_CHAT_TEMPLATES).

The tools are rendered into the prompt by that template. Random weights call no tool of their
own accord, so each request carries a `structured_outputs` regex (vLLM's extra, which the
frontend forwards) that makes the model write the `<tool_call>` blocks the template teaches; what
comes back went through the engine, the detokenizer, Triton's stream and the frontend's parser,
whole and streamed. The 400 for a template without a tool-call format (the default SmolLM2) is
in test_openai_structured_output.py.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
import transformers

from tests.checkpoints import make_tiny_checkpoint
from tests.e2e.openai_frontend import run_frontend

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "qwen"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]

# Some text, then two calls, in the format Qwen2.5's template asks for (a real newline where the
# model writes one; braces escaped for the regex).
CALLS_REGEX = ('Let me look that up\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome|Oslo)"'
               '\\}\\}\n</tool_call>\n<tool_call>\n\\{"name": "get_time", "arguments": \\{"zone": "(CET|UTC)"\\}\\}\n'
               '</tool_call>')


@pytest.fixture(scope="module")
def qwen(tritonserver, tmp_path_factory):
    """(frontend, checkpoint): a tiny Qwen2 with Qwen2.5's chat template, served as `qwen`."""
    root = tmp_path_factory.mktemp("qwen-tools")
    checkpoint = make_tiny_checkpoint(str(root / "qwen2"), family="qwen2")
    parameters = {"model_path": checkpoint, "max_num_seqs": "8", "kv_cache_memory_mb": "64", "max_model_len": "1024"}
    with tritonserver({MODEL: parameters}) as server, run_frontend(server.grpc_url) as frontend:
        yield frontend, checkpoint


@pytest.fixture(scope="module")
def client(qwen) -> openai.OpenAI:
    return qwen[0].openai()


def ask(client, regex: str = CALLS_REGEX, **kwargs):
    # Enough tokens for the regex spelled a character at a time, as sampling may.
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                          extra_body={"structured_outputs": {"regex": regex}},
                                          **{"temperature": 0, **kwargs})


def check_calls(calls: list[tuple[str, str]]) -> None:
    """The two calls the regex asks for, each with arguments that satisfy its tool's schema."""
    assert [name for name, _ in calls] == ["get_weather", "get_time"], calls
    for (name, arguments), tool in zip(calls, TOOLS):
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_the_tools_are_rendered_by_the_checkpoints_template(qwen):
    frontend, checkpoint = qwen
    r = requests.post(f"{frontend.url}/v1/chat/completions/render", timeout=60,
                      json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert r.json()["token_ids"] == tokenizer.encode(prompt)
    assert "<tools>\n" + json.dumps(WEATHER) in prompt and "within <tool_call></tool_call> XML tags" in prompt


def test_auto_returns_the_models_tool_calls(client):
    reply = ask(client)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Let me look that up."
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert reply.usage.completion_tokens > 20


def test_auto_streams_content_then_each_call_and_never_a_tag(client):
    whole = ask(client).choices[0]
    chunks = [c for c in ask(client, stream=True) if c.choices]
    content, calls, order = "", {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert "<" not in (delta.content or ""), delta.content
        if delta.content:
            content += delta.content
            order.append("content")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
            order.append(f"call {call.index}")
    assert content == whole.message.content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # The text streams before the calls, each call once its block has closed, in order.
    assert order[0] == "content" and order.index("call 0") < order.index("call 1"), order
    assert sum(1 for c in chunks if c.choices[0].delta.content) > 1, "the text was not streamed"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_each_of_n_choices_has_its_calls_streamed_and_not(client):
    kwargs = dict(n=2, temperature=1.0, seed=3)
    whole = sorted(ask(client, **kwargs).choices, key=lambda c: c.index)
    streamed = {0: {"content": "", "calls": {}}, 1: {"content": "", "calls": {}}}
    reasons = {}
    for chunk in ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            out = streamed[choice.index]
            out["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, [call.function.name, ""])
                entry[1] += call.function.arguments or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    for choice in whole:
        out = streamed[choice.index]
        assert choice.finish_reason == reasons[choice.index] == "tool_calls"
        assert out["content"] == choice.message.content == "Let me look that up."
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        check_calls(calls)
        assert [tuple(v) for _, v in sorted(out["calls"].items())] == calls


def test_auto_without_a_call_is_text(client):
    for stream in (False, True):
        if stream:
            chunks = [c for c in ask(client, regex="The weather is fine\\.", stream=True) if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = ask(client, regex="The weather is fine\\.").choices[0]
            text, reason = choice.message.content, choice.finish_reason
            assert choice.message.tool_calls is None
        assert (text, reason) == ("The weather is fine.", "stop"), stream


def test_tool_choice_none_renders_no_tools_and_parses_nothing(client, qwen):
    choice = ask(client, regex=CALLS_REGEX, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.message.content.startswith("Let me look that up.\n<tool_call>")
    r = requests.post(f"{qwen[0].url}/v1/chat/completions/render", timeout=60,
                      json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen[1])
    assert "<tools>" not in tokenizer.decode(r.json()["token_ids"])
