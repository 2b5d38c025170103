"""A model's own tool-call format: Hermes-style ``<tool_call>`` blocks, as the chat templates of
Qwen2.5 and Qwen3 (and Hermes 2/3) teach their models to write them::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``has_tool_call_format`` tells from a chat template whether its model writes them;
``ToolCallSplitter`` splits a reply, whole or streamed in pieces, into content and calls. Imports
nothing from this project.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Union

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_USES_TOOLS = re.compile(r"\btools\b")


def has_tool_call_format(chat_template: str | dict[str, str] | None) -> bool:
    """Whether a chat template renders `tools` and shows the model the `<tool_call>` block format.
    A tokenizer may carry several named templates (a dict); transformers picks its `tool_use` one
    when tools are given, so any of them having the format is enough."""
    if not chat_template:
        return False
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and OPEN in t and _USES_TOOLS.search(t) for t in texts)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ToolCall | None:
    """The call a block's body holds (`{"name": ..., "arguments": {...}}`), or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_open_len(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of OPEN ("<", "<tool", ...)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


Event = Union[str, ToolCall]  # content text, or a complete call


class ToolCallSplitter:
    """Splits one reply, fed in pieces of any size, into content and complete tool calls, the
    same whatever the pieces: ``feed`` returns what is certain so far, ``finish`` the rest.

    Content is the text outside the blocks, less the whitespace that touches a block (the newline
    before ``<tool_call>``, the one after ``</tool_call>``), so a reply of calls only has none.
    Text is held back while it could still become that: a trailing run of whitespace, and an end
    that could be the start of ``<tool_call>`` ("<", "<tool_c"); a block is held until it is
    closed. A block that is not a call (not JSON, no name, arguments not an object) is content
    again, exactly as written, whitespace included; so is a block never closed whose body is not
    a call (one whose body is a call, cut off before its ``</tool_call>``, still counts).
    Without valid blocks the content is the whole text, unchanged.

    Cost: O(length of the reply) over a reply, except a held block, which is searched for its
    end once per piece (blocks are short).
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet decided: a possible start of OPEN, or an open block's body
        self._in_block = False
        self._held_ws = ""  # whitespace after the content sent so far: sent only if content follows
        self._ws_before_block = ""  # the whitespace trimmed before the open block, restored if it is no call
        self._after_block = False  # whitespace from here on touches a block: dropped
        self.calls = 0  # calls returned so far

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._pending += text
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return events
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_block = False
                self._close_block(body, OPEN + body + CLOSE, events)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                self._content(self._pending[:start], events, before_block=True)
                self._pending = self._pending[start + len(OPEN):]
                self._in_block = True
                continue
            keep = _partial_open_len(self._pending)
            cut = len(self._pending) - keep
            self._content(self._pending[:cut], events)
            self._pending = self._pending[cut:]
            return events

    def finish(self) -> list[Event]:
        """The rest, at the end of the reply: an unclosed block (a call, or content as written),
        held text, and held whitespace."""
        events: list[Event] = []
        if self._in_block:
            body, self._pending, self._in_block = self._pending, "", False
            self._close_block(body, OPEN + body, events)
        else:
            self._content(self._pending, events)
            self._pending = ""
        if self._held_ws:
            events.append(self._held_ws)
            self._held_ws = ""
        return events

    def _close_block(self, body: str, raw: str, events: list[Event]) -> None:
        call = parse_call(body.strip())
        if call is not None:
            self._ws_before_block = ""
            self._after_block = True
            self.calls += 1
            events.append(call)
            return
        # Not a call: the block and the whitespace before it are content as written.
        self._held_ws = self._ws_before_block
        self._ws_before_block = ""
        self._content(raw, events)

    def _content(self, text: str, events: list[Event], before_block: bool = False) -> None:
        if self._after_block:
            stripped = text.lstrip()
            if not stripped:
                # Whitespace between two blocks touches the first one: dropped, whatever the second is.
                if before_block:
                    self._ws_before_block = ""
                return
            self._after_block = False
            text = stripped
        text = self._held_ws + text
        self._held_ws = ""
        body = text.rstrip()
        if before_block:
            self._ws_before_block = text[len(body):]
        else:
            self._held_ws = text[len(body):]
        if body:
            events.append(body)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls (``ToolCallSplitter`` fed it at once)."""
    splitter = ToolCallSplitter()
    events = splitter.feed(text) + splitter.finish()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]
