"""Several models and instances in one tritonserver, and the security defaults.

One model repository, generated here, serves the same tiny random-weight checkpoint
(tests/checkpoints.py) twice with different engine settings:

- ``tiny_a``: ``instance_group`` count 2 on CPU (two engines in two stub processes),
  32 KV blocks of 16 tokens, 4 sequences per batch;
- ``tiny_b``: one instance, 160 blocks of 8 tokens, ``max_model_len`` 1024, one sequence
  per batch and a waiting queue of one, so that it is easy to overload (503).

The server runs with ``--log-verbose=1`` (Triton then logs which instance executes each
request) and with ``--http-restricted-api`` / ``--grpc-restricted-protocol`` for the
model-repository and shared-memory APIs, as docker/README.md recommends. The OpenAI
frontend talks to it over gRPC and, as the repository index is restricted, is told the
model names (``--model-name``).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.e2e.openai_frontend import metric, metrics_text, run_frontend, wait_for
from tests.e2e.server import TritonServer

pytestmark = pytest.mark.e2e

ADMIN_HEADER, ADMIN_KEY = "inflight-admin", "s3cret-admin"
RESTRICTED = [f"--http-restricted-api=model-repository,shared-memory:{ADMIN_HEADER}={ADMIN_KEY}",
              f"--grpc-restricted-protocol=model-repository,shared-memory:{ADMIN_HEADER}={ADMIN_KEY}"]
# Triton expects gRPC clients to send the key under this prefixed metadata name.
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
MODELS = {
    "tiny_a": {"num_kv_blocks": "32", "block_size": "16", "max_num_seqs": "4"},
    "tiny_b": {"num_kv_blocks": "160", "block_size": "8", "max_num_seqs": "1", "max_queue_len": "1",
               "max_model_len": "1024"},
}
INSTANCES = {"tiny_a": 2, "tiny_b": 1}
PROMPT = "Hello there, how are"


@pytest.fixture(scope="module")
def server(tritonserver, tiny_checkpoint):
    models = {name: {"model_path": tiny_checkpoint, **params} for name, params in MODELS.items()}
    with tritonserver(models, args=RESTRICTED, instances=INSTANCES, log_verbose=1) as running:
        yield running


@pytest.fixture(scope="module")
def frontend(server):
    names = [arg for name in MODELS for arg in ("--model-name", name)]
    with run_frontend(f"127.0.0.1:{server.grpc_port}", *names) as running:
        yield running


@pytest.fixture(scope="module")
def client(frontend) -> openai.OpenAI:
    return frontend.openai()


def greedy(client, model: str, max_tokens: int = 8, prompt: str = PROMPT) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def metric_sum(server: TritonServer, name: str, **labels: str) -> float:
    """Sum over every series of `name` whose labels include `labels` (instances, reasons...)."""
    total = 0.0
    for line in metrics_text(server.metrics_port).splitlines():
        if line.startswith(name + "{"):
            have = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------- several models


def test_both_models_are_served_and_agree(client):
    assert sorted(m.id for m in client.models.list().data) == ["tiny_a", "tiny_b"]
    # Same weights, different engine settings (block size, batch, pool): same greedy text.
    a, b = greedy(client, "tiny_a", 12), greedy(client, "tiny_b", 12)
    assert a and a == b
    chat = client.chat.completions.create(model="tiny_b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.usage.completion_tokens > 0


def test_two_instances_are_two_engines_and_both_serve(client, server):
    log = server.log()
    assert log.count("[inflight] model 'tiny_a' ready") == 2, "tiny_a should load two engines"
    assert log.count("[inflight] model 'tiny_b' ready") == 1
    expected = greedy(client, "tiny_a")
    seen: set[str] = set()
    for _round in range(5):  # Triton picks the instance; a few rounds of concurrent requests reach both
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda _i: greedy(client, "tiny_a"), range(8)))
        assert texts == [expected] * 8
        seen = set(re.findall(r"model tiny_a, instance (tiny_a_0_\d), executing", server.log()))
        if len(seen) == 2:
            break
    assert seen == {"tiny_a_0_0", "tiny_a_0_1"}, f"instances that executed requests: {seen}"


def test_metrics_carry_each_models_label(client, server):
    for name in MODELS:
        greedy(client, name, 4)
    text = metrics_text(server.metrics_port)
    for name in MODELS:
        # tiny_a runs two engines, one series each: the one that served may come second.
        assert metric_sum(server, "vllm:prompt_tokens_total", model=name) > 0, name
        assert metric_sum(server, "inflight_iterations_total", model=name) > 0, name
    # Each model reports its own engine settings.
    assert metric(server.metrics_port, "nv_trt_llm_kv_cache_block_metrics", text, model="tiny_a",
                  kv_cache_block_type="tokens_per") == 16
    assert metric(server.metrics_port, "nv_trt_llm_kv_cache_block_metrics", text, model="tiny_b",
                  kv_cache_block_type="tokens_per") == 8
    assert metric(server.metrics_port, "nv_trt_llm_request_metrics", text, model="tiny_b", request_type="max") == 1
    # Counters of both tiny_a engines add up under the model's label.
    before = metric_sum(server, "vllm:request_success_total", model="tiny_a")
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _i: greedy(client, "tiny_a", 4), range(6)))
    assert wait_for(lambda: metric_sum(server, "vllm:request_success_total", model="tiny_a") == before + 6)


# ---------------------------------------------------------------------------- overload


def test_overloaded_model_answers_503(frontend, client, server):
    """tiny_b: one running, one waiting, the third is refused at once with 503 (UNAVAILABLE)."""
    long = dict(model="tiny_b", prompt=PROMPT, max_tokens=900, temperature=0, extra_body={"ignore_eos": True})
    waiting = lambda: metric(server.metrics_port, "inflight_requests_waiting", model="tiny_b")
    assert wait_for(lambda: waiting() == 0)
    running = client.completions.create(stream=True, **long)
    chunks = iter(running)
    next(chunks)  # tiny_b's only slot is taken
    second: dict = {}

    def queued():
        try:
            second["text"] = client.completions.create(**{**long, "max_tokens": 4}).choices[0].text
        except Exception as exc:
            second["error"] = exc

    thread = threading.Thread(target=queued)
    thread.start()
    try:
        assert wait_for(lambda: waiting() == 1), "second request did not queue"
        t0 = time.monotonic()
        r = requests.post(f"{frontend.url}/v1/completions", json={"model": "tiny_b", "prompt": PROMPT, "max_tokens": 4},
                          timeout=60)
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 10
        error = r.json()["error"]
        assert "queue is full" in error["message"] and error["type"] == "server_error"
        assert r.headers.get("retry-after") == "1"
        with pytest.raises(openai.InternalServerError) as info:  # the openai client's name for 5xx
            client.completions.create(model="tiny_b", prompt=PROMPT, max_tokens=4, stream=True)
        assert info.value.status_code == 503
    finally:
        running.close()  # cancels the running request; the queued one then runs
        thread.join(timeout=60)
    assert "text" in second, second


# ---------------------------------------------------------------------------- security defaults


def test_request_bounds_through_the_server(frontend):
    url = f"{frontend.url}/v1/completions"
    r = requests.post(url, json={"model": "tiny_b", "prompt": "hello " * 1100, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = requests.post(url, json={"model": "tiny_b", "prompt": PROMPT, "max_tokens": 1024}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "max_model_len 1024" in r.json()["error"]["message"]
    # tiny_a's pool (32 blocks of 16 = 512 tokens, below max_model_len) bounds a request too.
    r = requests.post(url, json={"model": "tiny_a", "prompt": PROMPT, "max_tokens": 600}, timeout=60)
    assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"], r.text


def test_restricted_repository_api_and_no_model_control(server):
    index = f"{server.http_url}/v2/repository/index"
    r = requests.post(index, timeout=10)
    assert r.status_code == 403 and ADMIN_HEADER in r.text
    r = requests.post(index, headers={ADMIN_HEADER: ADMIN_KEY}, timeout=10)
    assert r.status_code == 200 and {m["name"] for m in r.json()} == set(MODELS)
    # --model-control-mode=none: even the admin cannot unload or load models at run time.
    r = requests.post(f"{server.http_url}/v2/repository/models/tiny_a/unload", headers={ADMIN_HEADER: ADMIN_KEY},
                      timeout=10)
    assert r.status_code >= 400 and "not allowed" in r.text
    assert requests.get(f"{server.http_url}/v2/models/tiny_a/ready", timeout=10).status_code == 200
    # Inference stays open.
    r = requests.post(f"{server.http_url}/v2/models/tiny_b/generate", timeout=60,
                      json={"text_input": PROMPT, "parameters": {"max_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text


def test_restricted_grpc_repository_protocol(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        index = client.get_model_repository_index(as_json=True, headers={GRPC_ADMIN_HEADER: ADMIN_KEY})
        assert {m["name"] for m in index["models"]} == set(MODELS)
        assert client.is_model_ready("tiny_a")  # health, metadata and inference stay open
    finally:
        client.close()


def test_frontend_serves_only_named_models(server):
    with run_frontend(f"127.0.0.1:{server.grpc_port}", "--model-name", "tiny_b") as fe:
        client = fe.openai()
        assert [m.id for m in client.models.list().data] == ["tiny_b"]
        assert greedy(client, "tiny_b", 2)
        with pytest.raises(openai.NotFoundError):
            greedy(client, "tiny_a", 2)
    # Without names it needs the (restricted) repository index, and says so.
    with run_frontend(f"127.0.0.1:{server.grpc_port}") as fe:
        r = requests.get(f"{fe.url}/v1/models", timeout=30)
        assert r.status_code == 503 and "--model-name" in r.json()["error"]["message"], r.text


def test_local_defaults_bind_loopback_and_disable_model_control():
    from client.openai.cli import build_parser
    from tools import launch

    cmd = launch.tritonserver_command("model_repository")
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--model-control-mode=none"):
        assert flag in cmd, flag
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.triton_url) == ("127.0.0.1", 9000, "127.0.0.1:8001")
