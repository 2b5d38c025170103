"""Two replicas behind the real routers (tools/scaleout.py): haproxy in front of Triton's
HTTP and gRPC, vllm-router in front of the OpenAI frontends, driven by real clients
(tritonclient gRPC streams, curl SSE, the official openai client).

One cluster for the module, on a tiny random-weight checkpoint (the routers are the point,
not the model; it keeps 64 streams short on 2 cores). In order: every request gets exactly
one final response and the same text as from a replica directly; load spreads over both
replicas (each replica's own metrics); failover when one replica's tritonserver is
SIGKILLed during 64 streams; the replica rejoins when restarted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
import requests

from tests.e2e.e2e_util import Stream, generate, inputs_for, wait_for, wait_while_streaming
from tools import scaleout
from tools.launch import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

MODEL = "llm"
# The replicas share the machine's cores: bound, both teams would take the same ones, and each
# stub's other threads, Triton's health thread among them, would share one core with both
# OpenMP workers (under 64 streams a stub then missed Triton's 1 s health deadline, "Stub
# process is not healthy", in 4 runs of 5). 128 MB: room for 48 streams of LONG_REQUEST's
# 3,000 tokens of the tiny model (512 bytes of KV a token).
PARAMETERS = {"max_num_seqs": "48", "kv_cache_memory_mb": "128", "max_num_batched_tokens": "512",
              "omp_threads_bind": "nobind"}
# Long enough that the first stream still runs when the last has started, with the tiny model's
# steps of a few ms and its tokens merged into few responses. Its checkpoint: MAX_POSITIONS.
LONG_REQUEST = {"temperature": 0, "max_tokens": 3000, "ignore_eos": True}
MAX_POSITIONS = 4096
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def free_base_port(replicas: int = 2) -> int:
    """A base port whose replica ports (base + 10 i + 0..5, scaleout's offsets) are free."""
    return free_ports(10 * (replicas - 1) + 6, consecutive=True)[0]


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"max_position_embeddings": MAX_POSITIONS}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    # vllm-router's venv and Debian's haproxy, pinned (a second run is a no-op).
    setup = subprocess.run(["make", "router", "haproxy"], cwd=scaleout.REPO_ROOT, capture_output=True, text=True)
    assert setup.returncode == 0 and shutil.which("haproxy"), setup.stdout[-2000:] + setup.stderr[-2000:]
    root = tmp_path_factory.mktemp("cluster")
    http_port, grpc_port, openai_port, router_metrics_port = free_ports(4)
    replicas = scaleout.local_replicas(2, free_base_port())
    c = scaleout.Cluster(replicas, scaleout.REPO_ROOT / "model_repository", http_port=http_port,
                         grpc_port=grpc_port, openai_port=openai_port, router_metrics_port=router_metrics_port,
                         log_dir=root / "logs",
                         engine_parameters={"model_path": tiny_checkpoint, **PARAMETERS})
    try:
        c.start()
    except Exception as exc:
        c.stop()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "logs").glob("*.log")))
        pytest.fail(f"cluster did not start: {exc}\n{logs}", pytrace=False)
    yield c
    c.stop()


def replica_metric(replica: scaleout.Replica, *names: str) -> float:
    """The sum of the replica's own samples of ``names`` (its /metrics, wherever it lives)."""
    with urllib.request.urlopen(replica.metrics_url, timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("#") and line.split("{", 1)[0].split(" ", 1)[0] in names:
            total += float(line.rsplit(" ", 1)[1])
    return total


def served(replica: scaleout.Replica) -> float:
    """Requests the replica finished."""
    return replica_metric(replica, "vllm:request_success_total")


def in_flight(replica: scaleout.Replica) -> float:
    return replica_metric(replica, "vllm:num_requests_running", "vllm:num_requests_waiting")


def streams_on(victim: scaleout.Replica, survivor: scaleout.Replica, total: int, timeout_s: float = 10.0) -> float:
    """The streams in flight on `victim`, once the two replicas' gauges account for all `total`:
    a replica publishes its gauges after the step whose responses a client already has, so a
    scrape right after the last stream's first response can still read the step before."""
    deadline = time.monotonic() + timeout_s
    while (on_victim := in_flight(victim)) + in_flight(survivor) != total:
        assert time.monotonic() < deadline, "the replicas' gauges never showed every stream"
        time.sleep(0.05)
    return on_victim


def openai_client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{cluster.openai_url}/v1", api_key="unused", max_retries=0, timeout=60)


def curl_sse(url: str, prompt: str) -> list[dict]:
    body = json.dumps({"text_input": prompt, "stream": True, "exclude_input_in_output": True,
                       "sampling_parameters": json.dumps(GREEDY)})
    out = subprocess.run(["curl", "-sN", "--max-time", "60", "-X", "POST", f"http://{url}/v2/models/{MODEL}/generate_stream",
                          "-d", body], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return [json.loads(line[len("data: "):]) for line in out.stdout.splitlines() if line.startswith("data: ")]


def test_each_router_answers_each_request_once_with_what_a_replica_answers(cluster):
    direct = generate(cluster.replicas[0].grpc_url, MODEL, inputs_for("The cat", GREEDY, stream=True))
    assert direct.error is None and direct.finals == 1 and direct.text

    via_haproxy = generate(cluster.grpc_url, MODEL, inputs_for("The cat", GREEDY, stream=True))
    assert via_haproxy.error is None and (via_haproxy.finals, via_haproxy.after_final) == (1, 0)
    assert via_haproxy.text == direct.text

    events = curl_sse(cluster.http_url, "The cat")
    assert events and "error" not in events[-1], events
    assert "".join(e["text_output"] for e in events) == direct.text

    client = openai_client(cluster)
    completion = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == direct.text and completion.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_haproxy_runs_a_valid_config_that_sends_each_piece_at_once(cluster):
    # By default haproxy asks the kernel to hold small writes for more data, which held some
    # streams' first token 200 ms or more (tools/scaleout.py, http-no-delay).
    config = cluster.log_dir / "haproxy.cfg"
    checked = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    defaults = config.read_text().split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "option http-no-delay" in [line.strip() for line in defaults.splitlines()]


def test_render_gives_the_token_ids_the_engine_computes(cluster):
    """vllm-router's kv_aware asks a replica for a prompt's token ids (vLLM's /render) and
    matches them against the token ids of the replicas' KV events, which the engine encodes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cluster.engine_parameters["model_path"])
    url = cluster.replicas[0].openai_url
    (completion,) = requests.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "The cat sat",
                                                                         "max_tokens": 4}, timeout=30).json()
    assert completion["token_ids"] == tokenizer.encode("The cat sat") and completion["model"] == MODEL
    messages = [{"role": "user", "content": "Hi"}]
    chat = requests.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages},
                         timeout=30).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["token_ids"] == tokenizer.encode(text)
    # What generation would refuse, render refuses too, naming the field.
    refused = requests.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "x", "n": 3, "best_of": 2},
                            timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_load_spreads_over_both_replicas(cluster):
    before = [served(r) for r in cluster.replicas]
    streams = [Stream(cluster.grpc_url) for _ in range(8)]  # 8 connections: leastconn spreads them
    try:
        outcomes = [s.send(MODEL, inputs_for(f"Spread {i}", GREEDY, stream=True)) for i, s in enumerate(streams)]
        for o in outcomes:
            assert wait_for(o).error is None
    finally:
        for s in streams:
            s.close()
    client = openai_client(cluster)
    for i in range(6):  # round robin
        client.completions.create(model=MODEL, prompt=f"Spread {i}", max_tokens=4, temperature=0)
    gained = [served(r) - b for r, b in zip(cluster.replicas, before)]
    assert sum(gained) == 14 and min(gained) >= 4, gained


def test_failover_when_a_replica_is_killed_and_its_rejoin(cluster):
    victim, survivor = cluster.replicas
    streams = [Stream(cluster.grpc_url) for _ in range(64)]
    try:
        outcomes = [s.send(MODEL, inputs_for(f"Stream {i}", LONG_REQUEST, stream=True)) for i, s in enumerate(streams)]
        deadline = time.monotonic() + 120
        while not all(o.responses for o in outcomes):
            assert time.monotonic() < deadline, "64 streams never all started"
            assert not any(o.done.is_set() for o in outcomes), \
                [(len(o.responses), o.message) for o in outcomes if o.done.is_set()]
            time.sleep(0.05)
        on_victim = streams_on(victim, survivor, 64)
        assert 0 < on_victim < 64
        killed_at = time.monotonic()
        cluster.kill_triton(victim)

        # Streams on the dead replica end with an error at once; the others run to the end.
        for o in outcomes:
            wait_while_streaming(o)
        lost = [o for o in outcomes if o.error is not None]
        assert len(lost) == on_victim, f"lost {len(lost)} streams, {on_victim} were in flight on the killed replica"
        assert max(o.times[-1] for o in lost) - killed_at < 5, "a stream on the dead replica hung"
        assert all(o.finals == 1 and o.after_final == 0 for o in outcomes)
        print(f"\nfailover: {len(lost)} of 64 streams lost, all on the killed replica")
    finally:
        for s in streams:
            s.close()

    # From 10 s after the kill, every request succeeds through both routers.
    client = assert_survivor_serves(cluster, survivor, failed_at=killed_at, rounds=6)

    # The replica rejoins: once it is ready, each router sends it requests again.
    cluster.restart_triton(victim)
    assert_rejoins(cluster, victim, client)


def assert_survivor_serves(cluster, survivor: scaleout.Replica, failed_at: float, rounds: int):
    """From 10 s after a replica failed at `failed_at`, every request succeeds through both
    routers (a tritonclient stream and curl SSE through haproxy, the openai client through
    vllm-router), and the survivor serves all of them; returns the openai client."""
    time.sleep(max(0.0, failed_at + 10 - time.monotonic()))
    before = served(survivor)
    client = openai_client(cluster)
    for i in range(rounds):
        outcome = generate(cluster.grpc_url, MODEL, inputs_for(f"After {i}", GREEDY, stream=True), grace=0)
        assert outcome.error is None and outcome.finals == 1, outcome.message
        events = curl_sse(cluster.http_url, f"After {i}")
        assert events and "error" not in events[-1], events
        assert client.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=4, temperature=0).choices
    assert served(survivor) - before == 3 * rounds
    return client


def assert_rejoins(cluster, victim: scaleout.Replica, client, timeout_s: float = 30.0) -> None:
    """Each router sends the victim a request again within ``timeout_s`` (its health checks'
    rise, plus however the policy orders the replicas), and every request succeeds."""
    senders = {
        "haproxy": lambda i: generate(cluster.grpc_url, MODEL, inputs_for(f"Back {i}", GREEDY, stream=True), grace=0),
        "vllm-router": lambda i: client.completions.create(model=MODEL, prompt=f"Back {i}", max_tokens=4,
                                                           temperature=0),
    }
    for router, send in senders.items():
        before = served(victim)
        deadline = time.monotonic() + timeout_s
        i = 0
        while served(victim) == before:
            assert time.monotonic() < deadline, f"{router} sent the restored replica nothing in {timeout_s:.0f}s"
            outcome = send(i)
            assert getattr(outcome, "error", None) is None, outcome.message
            i += 1
            time.sleep(0.2)
