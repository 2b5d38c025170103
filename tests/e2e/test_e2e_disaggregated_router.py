"""vllm-router's P/D mode (`--vllm-pd-disaggregation`) in front of two tritonservers: one serves
`llm` of role prefill (its KV handed over by TCP), the other `llm` of role decode, each behind
its own OpenAI frontend. The router sends each request to the prefill frontend with max_tokens 1,
stream false and kv_transfer_params {"do_remote_decode": true}, copies the kv_transfer_params of
its answer (the transfer's handle) into the original request, and streams the decode frontend's
answer back: what it would do in front of vLLM's prefill and decode instances.

Through the router a client gets the aggregated server's greedy text, streamed or not, from
completions and chat; every request's KV crossed once; a request whose first token ends it on
the prefill side comes back without a handle and the decode server serves it whole; and
afterwards neither engine holds a block or a transfer.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from backend.paths import REPO_ROOT
from tests.e2e.e2e_util import greedy_tokens_and_texts, scrape, wait_idle
from tests.e2e.openai_frontend import run_frontend
from tests.e2e.server import E2E_PARAMETERS
from tests.e2e.test_e2e_disaggregated import MAX_TOKENS, PROMPTS
from tools import launch
from tools.launch import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

ROUTER_BIN = REPO_ROOT / ".venv-router" / "bin" / "vllm-router"
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def pd_servers(tritonserver):
    """(prefill server, decode server): model `llm` of each role, from model_repository_disaggregated/."""
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8")
    source = REPO_ROOT / "model_repository_disaggregated"
    prefill = tritonserver({"llm": dict(engine, kv_transfer="tcp")}, source_repository=source,
                           sources={"llm": "llm_prefill"})
    try:
        decode = tritonserver({"llm": engine}, source_repository=source, sources={"llm": "llm_decode"})
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def router(pd_servers):
    """The router's base URL, in front of the two servers' OpenAI frontends."""
    setup = subprocess.run(["make", "router"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert setup.returncode == 0 and ROUTER_BIN.exists(), setup.stdout[-2000:] + setup.stderr[-2000:]
    prefill, decode = pd_servers
    with run_frontend(prefill.grpc_url) as prefill_frontend, run_frontend(decode.grpc_url) as decode_frontend:
        port, metrics_port = free_ports(2)
        log_path = Path(tempfile.mkdtemp(prefix="vllm-router-")) / "router.log"
        cmd = [str(ROUTER_BIN), "--vllm-pd-disaggregation", "--prefill", prefill_frontend.url,
               "--decode", decode_frontend.url, "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--worker-startup-timeout-secs", "120", "--log-level", "warning"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            launch._wait(lambda: launch.http_status("127.0.0.1", port, "/health") == 200, "vllm-router", 120, proc)
            yield f"http://127.0.0.1:{port}"
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"{exc}\n--- vllm-router log ---\n{log_path.read_text(errors='replace')[-3000:]}")
        finally:
            launch.stop(proc)


def _openai(base_url: str):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _transfers(server) -> float:
    return scrape(server.metrics_port).get("inflight_kv_transfers_total", model="llm")


def test_through_the_router_completions_are_the_aggregated_servers_and_each_crosses_once(router, pd_servers,
                                                                                        triton_server):
    prefill, decode = pd_servers
    aggregated = [text for _, text in greedy_tokens_and_texts(triton_server.grpc_url, "llm", PROMPTS, MAX_TOKENS)]
    client = _openai(router)
    whole = [client.completions.create(model="llm", prompt=p, **GREEDY) for p in PROMPTS]
    assert [c.choices[0].text for c in whole] == aggregated
    assert all(c.choices[0].finish_reason == "length" and c.usage.completion_tokens == MAX_TOKENS for c in whole)
    for prompt, want in zip(PROMPTS, aggregated):
        chunks = list(client.completions.create(model="llm", prompt=prompt, stream=True, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    wait_idle(prefill.metrics_port, "llm")
    wait_idle(decode.metrics_port, "llm")
    assert _transfers(prefill) == _transfers(decode) == 2 * len(PROMPTS)
    for server in pd_servers:
        assert scrape(server.metrics_port).get("inflight_kv_transfers_pending", model="llm") == 0


def test_a_streamed_chat_through_the_router_is_the_aggregated_one(router, pd_servers, triton_server):
    messages = [{"role": "user", "content": "Name two rivers of Europe."}]
    with run_frontend(triton_server.grpc_url) as aggregated_frontend:
        want = _openai(aggregated_frontend.url).chat.completions.create(model="llm", messages=messages, **GREEDY)
    chunks = list(_openai(router).chat.completions.create(model="llm", messages=messages, stream=True, **GREEDY))
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == want.choices[0].message.content and got


def test_a_request_ended_by_its_first_token_is_served_whole_by_the_decode_server(router, pd_servers, triton_server):
    """Its first token is a stop token: the prefill half answers it whole, with no handle, and
    the router sends the plain request on, which the decode model serves whole."""
    prefill, decode = pd_servers
    [(tokens, _)] = greedy_tokens_and_texts(triton_server.grpc_url, "llm", PROMPTS[:1], 1)
    before = _transfers(decode)
    answer = _openai(router).completions.create(model="llm", prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
                                                extra_body={"stop_token_ids": tokens})
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 1
    wait_idle(decode.metrics_port, "llm")
    assert _transfers(decode) == before
