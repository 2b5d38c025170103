"""Test helpers: run the OpenAI frontend (client/openai/) as a real process.

    with run_frontend(triton_server.grpc_url) as frontend:
        client = frontend.openai()          # the official `openai` client, no retries
        client.completions.create(model="llm", prompt="Hi", max_tokens=8)

Also `metric(port, name, **labels)`: one sample from Triton's Prometheus /metrics, and
`with_chat_template(checkpoint, QWEN25_CHAT_TEMPLATE)`: a checkpoint that renders chats (and tools)
as Qwen2.5 does.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import requests

from tools import launch
from tools.launch import free_ports

READY_TIMEOUT_S = 60


@dataclass
class Frontend:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def run_frontend(triton_grpc_url: str, *args: str, wait_healthy: bool = True) -> Iterator[Frontend]:
    """Start the frontend (`tools.launch.launch_frontend`) on a free port; stop it afterwards.

    Waits until `/health` answers 200 (Triton reachable), or any answer with `wait_healthy` false.
    """
    (port,) = free_ports(1)
    log_path = Path(tempfile.mkdtemp(prefix="openai-frontend-")) / "frontend.log"
    with open(log_path, "wb") as log:
        proc = launch.launch_frontend(triton_grpc_url, "127.0.0.1", port, extra_args=args, stdout=log,
                                      stderr=subprocess.STDOUT)
    frontend = Frontend(port, proc, log_path)
    try:
        try:
            launch.wait_frontend(port, READY_TIMEOUT_S, proc=proc, healthy=wait_healthy)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}:\n{frontend.log_tail()}") from None
        yield frontend
    finally:
        launch.stop(proc, timeout=15)


def metrics_text(metrics_port: int) -> str:
    return requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text


def metric(metrics_port: int, name: str, text: str | None = None, **labels: str) -> float | None:
    """The value of the sample `name{labels...}` (labels matched as a subset), or None."""
    text = metrics_text(metrics_port) if text is None else text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body = line[len(name) + 1:line.rindex("}")]
        have = dict(re.findall(r'(\w+)="([^"]*)"', body))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.2):
    """Poll `predicate()` until it returns a truthy value; return it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# The chat template of Qwen2.5's instruct checkpoints (the `chat_template` of
# Qwen/Qwen2.5-*-Instruct's tokenizer_config.json, Apache-2.0), with its tools section and
# <tool_call> format: the frontend finds the format in it, renders tools with it, and parses the
# replies it teaches. Copied from axolotl-ai-cloud/axolotl,
# src/axolotl/utils/chat_templates/templates/qwen_25.jinja (commit 63f3186938d1), which keeps
# Qwen's text with a few lines joined (every join sits next to a whitespace-trimming `{%-`/`{{-`,
# so it renders the same).
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def with_chat_template(checkpoint: str, template: str) -> str:
    """Make `template` the chat template of the checkpoint's tokenizer (tokenizer_config.json's
    `chat_template`; a chat_template.jinja beside it would win over it, so it goes); returns the
    checkpoint."""
    folder = Path(checkpoint)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return checkpoint
