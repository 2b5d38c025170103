"""A model's own tool-call format in the OpenAI frontend (client/openai/tool_calls.py and its use by
translation.Job for tool_choice "auto"): which chat templates have it, how a reply splits into
content and calls, and that a streamed reply, split anywhere, gives what the whole reply gives,
never a part of a tag as content.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from backend.paths import DEFAULT_CHECKPOINT
from client.openai.schema import ChatCompletionRequest, parse_request
from client.openai.tool_calls import CLOSE, OPEN, ToolCall, ToolCallSplitter, has_tool_call_format, split_tool_calls
from client.openai.translation import Job, Piece, client_names, sampling_parameters, validate_sampling
from tests.checkpoints import FAMILY_CHAT_TEMPLATES

QWEN25_CHAT_TEMPLATE = FAMILY_CHAT_TEMPLATES["qwen2"].text


def block(name: str, arguments: dict) -> str:
    """A call as Qwen2.5's template writes one (its assistant turns with tool_calls)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n{CLOSE}'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---------------------------------------------------------------------------- which templates


def test_the_qwen25_template_has_a_tool_call_format():
    assert has_tool_call_format(QWEN25_CHAT_TEMPLATE)
    # A tokenizer's named templates: transformers uses the tool_use one when tools are given.
    assert has_tool_call_format({"default": "{{ messages }}", "tool_use": QWEN25_CHAT_TEMPLATE})


def test_templates_without_one_have_none():
    smollm2 = DEFAULT_CHECKPOINT / "chat_template.jinja"
    if not smollm2.exists():
        pytest.skip(f"{smollm2} is missing: run `make setup`")
    assert not has_tool_call_format(smollm2.read_text())
    assert not has_tool_call_format(None) and not has_tool_call_format("")
    # Both marks are needed: a template that renders tools in a format of its own, and one that
    # mentions the tag but takes no tools.
    assert not has_tool_call_format("{% for tool in tools %}{{ tool | tojson }}{% endfor %}")
    assert not has_tool_call_format("{{ messages[0].content }} <tool_call>")


# ---------------------------------------------------------------------------- whole replies


WEATHER = {"city": "Paris", "unit": "celsius"}


@pytest.mark.parametrize("text, content, calls", [
    (block("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("Let me check.\n" + block("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    (block("a", {}) + "\n" + block("b", {"x": [1, 2]}) + "\n", "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("Two:\n" + block("a", {}) + "\nDone.", "Two:Done.", [("a", {})]),
    # A call whose arguments are left out has none; one cut off before its closing tag still counts.
    (f'{OPEN}{{"name": "now"}}{CLOSE}', "", [("now", {})]),
    (f'{OPEN}\n{{"name": "now", "arguments": {{}}}}\n', "", [("now", {})]),
    ('Olá ' + block("traduz", {"texto": "São Paulo"}), "Olá", [("traduz", {"texto": "São Paulo"})]),
])
def test_a_reply_splits_into_content_and_calls(text, content, calls):
    got_content, got_calls = split_tool_calls(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text", [
    "No tools needed.\n",
    "  a < b and c<tool but not a tag <",
    f"Broken:\n{OPEN}\n{{not json}}\n{CLOSE}\nafter",
    f'{OPEN}{{"arguments": {{}}}}{CLOSE}',  # no name
    f'{OPEN}{{"name": "f", "arguments": "x=1"}}{CLOSE}',  # arguments not an object
    f'Cut off:\n{OPEN}\n{{"name": "f", "argu',
    f"ends with {OPEN[:5]}",
])
def test_a_reply_without_calls_is_all_content_as_written(text):
    assert split_tool_calls(text) == (text, [])


def test_a_bad_block_beside_good_ones_stays_as_written():
    bad = f"{OPEN}nope{CLOSE}"
    content, calls = split_tool_calls(f"Hi\n{bad}\n" + block("a", {}))
    assert (content, calls_of(calls)) == (f"Hi\n{bad}", [("a", {})])


# ---------------------------------------------------------------------------- streamed replies


def feed_split(text: str, cuts: list[int]) -> tuple[list[str | ToolCall], list[list[str | ToolCall]]]:
    """The splitter's events for `text` fed in the pieces that `cuts` make, all and per piece."""
    splitter, per_piece, start = ToolCallSplitter(), [], 0
    for cut in sorted(cuts) + [len(text)]:
        per_piece.append(splitter.feed(text[start:cut]))
        start = cut
    per_piece.append(splitter.finish())
    return [e for events in per_piece for e in events], per_piece


def summary(events: list[str | ToolCall]) -> tuple[str, list[tuple[str, str]]]:
    return "".join(e for e in events if isinstance(e, str)), [(e.name, e.arguments) for e in events
                                                              if isinstance(e, ToolCall)]


# Pieces that meet tags, partial tags, whitespace, JSON and whole calls in every order.
ATOMS = st.sampled_from([OPEN, CLOSE, "\n", " ", "  \n", "<", "<tool", "<tool_c", "</tool_call", "tool_call>", "Hi",
                         "a<b", "é", '{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}', '{"bad"', "}",
                         block("f", {"x": 1}), block("g", {}), OPEN + '{"name": "h"}'])


@settings(max_examples=400, deadline=None)
@given(text=st.lists(ATOMS, max_size=14).map("".join), data=st.data())
def test_any_split_gives_what_the_whole_reply_gives(text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    events, _ = feed_split(text, cuts)
    content, calls = split_tool_calls(text)
    assert summary(events) == (content, [(c.name, c.arguments) for c in calls])
    if not calls:
        assert content == text


PLAIN = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=12)
CALLS = st.builds(lambda name, x: (name, {"x": x}), st.sampled_from(["get_weather", "get_time", "f"]),
                  st.one_of(st.integers(), st.text(max_size=6)))
SPACE = st.sampled_from(["", "\n", " ", "\n\n"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.one_of(PLAIN, CALLS), max_size=6), gaps=st.lists(SPACE, min_size=7, max_size=7),
       data=st.data())
def test_streamed_content_never_holds_a_part_of_a_tag(parts, gaps, data):
    """Text around well-formed calls, streamed in any pieces: the calls come out in order, each
    in the piece that closes its block or later, and no content event holds a "<"."""
    text = "".join(gap + (block(*part) if isinstance(part, tuple) else part) for gap, part in zip(gaps, parts))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    events, _ = feed_split(text, cuts)
    assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)] == \
        [p for p in parts if isinstance(p, tuple)]
    assert not any("<" in e for e in events if isinstance(e, str))


def test_a_call_comes_out_with_the_piece_that_closes_its_block():
    text = "Sure." + "\n" + block("get_weather", WEATHER)
    cut = text.index(CLOSE) + 3  # the close tag split
    _, per_piece = feed_split(text, [2, text.index(OPEN) + 4, cut])
    assert per_piece[0] == ["Su"] and per_piece[1] == ["re."]  # "\n<too" held back
    assert per_piece[2] == [] and [type(e) for e in per_piece[3]] == [ToolCall] and per_piece[4] == []


# ---------------------------------------------------------------------------- the OpenAI objects


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]


def auto_job(**fields) -> Job:
    req = parse_request(ChatCompletionRequest, {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}],
                                                "tools": TOOLS, **fields})
    req.check()
    sampling = sampling_parameters(req)
    validate_sampling(sampling, client_names(req))
    return Job.of(req, "<prompt>", sampling)


def piece(text: str, reason: str | None = None, index: int = 0, final: bool = False) -> Piece:
    return Piece(text=text, num_input_tokens=3, num_output_tokens=1, finish_reason=reason, logprobs=[],
                 final=final, index=index)


def test_auto_is_the_default_with_tools_and_asks_for_no_constraint():
    for fields in ({}, {"tool_choice": "auto"}):
        job = auto_job(**fields)
        # No constraint: only what every chat sends (its template wrote the special tokens).
        assert job.auto_tools and job.forced_tool is None and job.sampling == {"add_special_tokens": False}
    assert not auto_job(tool_choice="none").auto_tools and not auto_job(tool_choice="required").auto_tools
    # A constraint of the client's own may shape the reply (the e2e tests make a random model call so).
    assert auto_job(structured_outputs={"regex": "x"}).sampling == {"add_special_tokens": False,
                                                                    "structured_outputs": {"regex": "x"}}


def test_a_whole_reply_with_calls_becomes_tool_calls():
    text = "Let me check.\n" + block("get_weather", WEATHER) + "\n" + block("get_time", {})
    body = auto_job().whole([piece(text, "stop", final=True)])
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", WEATHER), ("function", "get_time", {})]
    # Only calls: no content (null); cut short by max_tokens: the reason stays "length".
    only = auto_job().whole([piece(block("get_time", {}), "stop", final=True)])["choices"][0]
    assert only["message"]["content"] is None and only["finish_reason"] == "tool_calls"
    cut = auto_job().whole([piece(f'{OPEN}{{"name": "get_ti', "length", final=True)])["choices"][0]
    assert cut["message"] == {"role": "assistant", "content": f'{OPEN}{{"name": "get_ti'}
    assert cut["finish_reason"] == "length"


def test_a_whole_reply_without_calls_is_text():
    body = auto_job().whole([piece("Hello there.\n", "stop", final=True)])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello there.\n"}
    assert body["choices"][0]["finish_reason"] == "stop"


def events_of(chunks: list[bytes | None]) -> list[dict]:
    events = []
    for chunk in chunks:
        for line in (chunk or b"").decode().split("\n\n"):
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[len("data: "):]))
    return events


def assemble(events: list[dict], n: int = 1) -> list[dict]:
    """What a streaming client (the openai package's accumulation) makes of the chunks, per choice."""
    choices = [{"content": None, "tool_calls": {}, "finish_reason": None, "deltas": 0} for _ in range(n)]
    for event in events:
        for choice in event["choices"]:
            out, delta = choices[choice["index"]], choice["delta"]
            assert out["finish_reason"] is None, "a chunk after the choice's finish_reason"
            out["deltas"] += 1
            if delta.get("content"):
                out["content"] = (out["content"] or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                have = out["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in call:
                    assert have["id"] is None and call["type"] == "function"
                    have["id"] = call["id"]
                have["name"] = call["function"].get("name") or have["name"]
                have["arguments"] += call["function"].get("arguments", "")
            out["finish_reason"] = choice["finish_reason"]
    return choices


def stream(job: Job, text: str, cuts: list[int], reason: str = "stop", index: int = 0) -> list[bytes | None]:
    """The job's chunks for `text` arriving in the pieces that `cuts` make, the last with `reason`."""
    bounds = [0] + sorted(cuts) + [len(text)]
    pieces = [piece(text[a:b], index=index) for a, b in zip(bounds, bounds[1:])]
    pieces[-1] = piece(pieces[-1].text, reason, index=index, final=True)
    return [job.chunk(p, 0) for p in pieces]


REPLIES = ["Let me check.\n" + block("get_weather", WEATHER) + "\n" + block("get_time", {}) + "\n",
           block("get_time", {}), "Just text, with a < sign.", f"Half a tag: {OPEN[:6]}",
           f"Bad: {OPEN}{{nope}}{CLOSE} then " + block("get_time", {})]


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(REPLIES), data=st.data())
def test_a_streamed_reply_assembles_to_the_whole_reply(text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    [streamed] = assemble(events_of(stream(auto_job(stream=True), text, cuts)))
    [whole] = auto_job().whole([piece(text, "stop", final=True)])["choices"]
    assert streamed["content"] == (whole["message"]["content"] or None)
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["tool_calls"].items())] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls", [])]
    assert all(c["id"].startswith("call_") for c in streamed["tool_calls"].values())
    assert streamed["finish_reason"] == whole["finish_reason"]


def test_a_streamed_call_is_two_deltas_once_its_block_closes():
    text = "Sure.\n" + block("get_weather", WEATHER)
    chunks = stream(auto_job(stream=True), text, [text.index(OPEN) + 3, len(text) - 4])
    per_piece = [[c["choices"][0] for c in events_of([chunk])] for chunk in chunks]
    assert [c["delta"] for c in per_piece[0]] == [{"content": "Sure."}]
    assert per_piece[1] == []  # inside the block: nothing
    head, arguments, *_ = per_piece[2]
    assert head["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert head["delta"]["tool_calls"][0]["id"].startswith("call_")
    assert arguments["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(WEATHER)}}]}
    assert [c["finish_reason"] for c in per_piece[2]] == [None, "tool_calls"]


def test_each_choice_has_its_own_splitter():
    job = auto_job(stream=True, n=2)
    one, two = block("get_time", {}), "Plain."
    chunks = []
    for a, b in zip(range(0, 40, 5), range(5, 45, 5)):  # the two choices' pieces interleaved
        chunks += [job.chunk(piece(one[a:b], index=0), 0), job.chunk(piece(two[a:b], index=1), 0)]
    chunks += [job.chunk(piece(one[40:], "stop", index=0), 0), job.chunk(piece(two[40:], "stop", 1, True), 0)]
    first, second = assemble(events_of(chunks), n=2)
    assert (first["content"], first["finish_reason"]) == (None, "tool_calls")
    assert [c["name"] for c in first["tool_calls"].values()] == ["get_time"]
    assert (second["content"], second["tool_calls"], second["finish_reason"]) == ("Plain.", {}, "stop")
