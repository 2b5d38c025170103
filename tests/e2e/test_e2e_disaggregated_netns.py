"""Two tritonservers on two hosts (network namespaces, tools/netns.py; needs root), the KV
crossing between them over TCP: `llm_prefill` (kv_transfer tcp) serves on one host,
`llm_decode` on the other, and this test plays the orchestrator a router would be (the BLS
`llm` model calls only models of its own server): the prompt to the prefill server, its
handle with the prompt to the decode server, whose stream is the client's.

The decode server's stream must be the aggregated server's, with one final response; the KV
bytes go out of the prefill host's link; afterwards neither server holds a block, a transfer
or a pull, and both counted the same transfers and bytes.
"""

from __future__ import annotations

import subprocess

import pytest

from backend.paths import REPO_ROOT
from tests.e2e.e2e_util import generate, inputs_for, output, scrape, tensor, wait_idle
from tests.e2e.server import E2E_PARAMETERS, READY_TIMEOUT_S, TritonServer, make_model_repository
from tests.e2e.test_e2e_disaggregated import MAX_TOKENS, PROMPTS
from tools import launch, netns
from tools.launch import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

SAMPLING = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def hosts():
    if not netns.can_create_namespaces():
        pytest.skip("creating network namespaces needs root (ip netns add)")
    with netns.Hosts(2) as h:
        yield h


def _server_on(hosts: netns.Hosts, i: int, models: dict, root) -> tuple[TritonServer, str]:
    """tritonserver serving `models` (from model_repository_disaggregated/) on host i; it and its address."""
    repository = root / "model_repository"
    for name, parameters in models.items():
        make_model_repository(repository, parameters, name=name, source=name,
                              source_repository=REPO_ROOT / "model_repository_disaggregated")
    host = hosts.replica_host(i)
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = root / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = launch.launch_tritonserver(repository, host, http_port, grpc_port, metrics_port, stdout=log,
                                          stderr=subprocess.STDOUT, netns=hosts.replica_ns[i])
    server = TritonServer(http_port, grpc_port, metrics_port, proc, log_path, tuple(models))
    try:
        launch.wait_tritonserver(http_port, READY_TIMEOUT_S, host, proc, metrics_port)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        pytest.fail(f"{exc}\n--- tritonserver log (tail) ---\n{server.log_tail()}", pytrace=False)
    return server, host


@pytest.fixture(scope="module")
def two_servers(hosts, tmp_path_factory):
    engine = dict(E2E_PARAMETERS, long_prefill_token_threshold="8")
    prefill = _server_on(hosts, 0, {"llm_prefill": dict(engine, kv_transfer="tcp",
                                                          kv_transfer_address=hosts.replica_host(0))},
                         tmp_path_factory.mktemp("prefill-host"))
    try:
        decode = _server_on(hosts, 1, {"llm_decode": engine}, tmp_path_factory.mktemp("decode-host"))
    except BaseException:
        prefill[0].stop()
        raise
    yield prefill, decode
    decode[0].stop()
    prefill[0].stop()


def _tx_bytes(hosts: netns.Hosts, i: int) -> int:
    out = subprocess.run(["ip", "netns", "exec", hosts.replica_ns[i], "cat",
                          f"/sys/class/net/eth{i}-{hosts.tag}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


def test_prefill_and_decode_servers_on_two_hosts_give_the_aggregated_stream(hosts, two_servers, triton_server):
    (prefill, prefill_host), (decode, decode_host) = two_servers
    sent_before = _tx_bytes(hosts, 0)
    for prompt in PROMPTS:
        aggregated = generate(triton_server.grpc_url, "llm", inputs_for(prompt, SAMPLING, stream=True))
        handed_over = generate(f"{prefill_host}:{prefill.grpc_port}", "llm_prefill", inputs_for(prompt, SAMPLING))
        assert handed_over.error is None, handed_over.message
        handle = output(handed_over.last, "transfer")
        assert handle.startswith(f"tcp://{prefill_host}:"), handle
        outcome = generate(f"{decode_host}:{decode.grpc_port}", "llm_decode",
                           inputs_for(prompt, SAMPLING, stream=True) + [tensor("transfer", handle, "BYTES")])
        assert outcome.error is None, outcome.message
        assert outcome.finals == 1 and outcome.after_final == 0
        assert outcome.text == aggregated.text
        assert outcome.total("num_output_tokens") == MAX_TOKENS
    wait_idle(prefill.metrics_port, "llm_prefill", host=prefill_host)
    wait_idle(decode.metrics_port, "llm_decode", host=decode_host)
    exported = scrape(prefill.metrics_port, prefill_host)
    imported = scrape(decode.metrics_port, decode_host)
    for name in ("inflight_kv_transfers_total", "inflight_kv_transfer_bytes_total"):
        assert exported.get(name, model="llm_prefill") == imported.get(name, model="llm_decode")
    assert exported.get("inflight_kv_transfers_total", model="llm_prefill") == len(PROMPTS)
    moved = exported.get("inflight_kv_transfer_bytes_total", model="llm_prefill")
    assert _tx_bytes(hosts, 0) - sent_before >= moved > 0
    for metrics, model in ((exported, "llm_prefill"), (imported, "llm_decode")):
        assert metrics.has("inflight_kv_transfers_pending")
        assert metrics.get("inflight_kv_transfers_pending", model=model) == 0
    assert exported.get("inflight_kv_transfers_expired_total", model="llm_prefill") == 0
