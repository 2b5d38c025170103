"""Disaggregated serving with the KV transfer over TCP (backend/disagg_tcp.py): a role-prefill
engine with `kv_transfer: tcp` serves each transfer from its own socket, a decode engine pulls
it by its handle, off its step loop.

The same promises as the shared-memory transfer (tests/engine/test_disagg.py): greedy tokens
of the aggregated engine (and transformers), batch_invariant logprobs bitwise the aggregated
engine's, int8 KV included; nothing left on either side (blocks, transfers held or pulling).
Then what only TCP has: the decode loop steps on while a pull waits on the network, a
transfer nobody pulls is freed after kv_transfer_timeout_s, and the transfer crosses a real
link between two network namespaces (tools/netns.py; needs root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import zmq

from backend.config import EngineConfig
from backend.disagg import SHM_PREFIX, Transfer, discard_transfer
from backend.disagg_tcp import drop_transfer, pull_transfer
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.paths import REPO_ROOT
from backend.request import FinishReason, RequestError, SamplingParams
from tests.engine.test_disagg import (
    MAX_NEW,
    PROMPTS,
    _engine,
    _tokens_and_logprobs,
    assert_no_blocks_held,
    oracle,  # noqa: F401 (a fixture)
    run_aggregated,
    run_disaggregated,
)
from tests.engine.test_engine_loop import Collector, wait_until
from tools import netns

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PULL_TIMEOUT_S = 30.0


def _tcp_prefill(model: str, **config) -> LLMEngine:
    return _engine(model, "prefill", kv_transfer="tcp", **config)


def run_over_tcp(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]],
                 params: SamplingParams) -> tuple[dict, dict]:
    """test_disagg's run_disaggregated, each transfer pulled over TCP before its import."""
    def pull(handle: str):
        assert handle.startswith(f"tcp://{prefill.transfer_server.endpoint}/inflight-kv-")
        return pull_transfer(handle, PULL_TIMEOUT_S)

    return run_disaggregated(prefill, decode, prompts, params, fetch=pull)


def assert_nothing_pending(*engines: LLMEngine) -> None:
    assert_no_blocks_held(*engines)
    for engine in engines:
        assert engine.num_pending_transfers == 0


# ---- the two engines, one process -------------------------------------------------------


def test_tcp_greedy_tokens_are_the_aggregated_engines_and_transformers(tiny_checkpoint, oracle):  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    aggregated, _ = run_aggregated(_engine(tiny_checkpoint), PROMPTS, params)
    prefill, decode = _tcp_prefill(tiny_checkpoint), _engine(tiny_checkpoint, "decode")
    try:
        tokens, _ = run_over_tcp(prefill, decode, PROMPTS, params)
        assert tokens == aggregated
        for i, prompt in enumerate(PROMPTS):
            assert tokens[f"r{i}"] == oracle[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert_nothing_pending(prefill, decode)
        moved = sum(prefill.kv.blocks_needed(len(p)) for p in PROMPTS) * prefill.kv_layout.block_bytes
        for engine in (prefill, decode):
            assert engine.stats.totals.kv_transfers == len(PROMPTS)
            assert engine.stats.totals.kv_transfer_bytes == moved
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tcp_batch_invariant_logprobs_are_bitwise_the_aggregated_engines(tiny_checkpoint, kv_cache_dtype):
    config = dict(batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    for params in (SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
                   SamplingParams(temperature=0.9, top_k=50, seed=2026, max_tokens=MAX_NEW, ignore_eos=True,
                                  logprobs=1)):
        aggregated = run_aggregated(_engine(tiny_checkpoint, **config), PROMPTS, params)
        prefill, decode = _tcp_prefill(tiny_checkpoint, **config), _engine(tiny_checkpoint, "decode", **config)
        try:
            assert run_over_tcp(prefill, decode, PROMPTS, params) == aggregated
            assert_nothing_pending(prefill, decode)
        finally:
            prefill.close()
            decode.close()


def test_a_transfer_is_served_once_and_one_nobody_pulls_is_freed(tiny_checkpoint):
    prefill = _tcp_prefill(tiny_checkpoint, kv_transfer_timeout_s=1.0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prefill.add_request("pulled", PROMPTS[3], params)
        prefill.add_request("forgotten", PROMPTS[4], params)
        handles = {}
        while prefill.has_unfinished():
            handles.update((out.request_id, out.transfer) for out in prefill.step() if out.transfer is not None)
        assert prefill.num_pending_transfers == 2
        transfer = pull_transfer(handles["pulled"], PULL_TIMEOUT_S)
        assert isinstance(transfer, Transfer) and transfer.header["request_id"] == "pulled"
        assert transfer.pull_s > 0
        assert prefill.num_pending_transfers == 1
        with pytest.raises(RequestError) as info:  # pulled once: gone from the prefill side
            pull_transfer(handles["pulled"], PULL_TIMEOUT_S)
        assert info.value.code == RequestError.INVALID_ARG and "no KV transfer named" in str(info.value)
        wait_until(lambda: prefill.num_pending_transfers == 0, timeout=10)
        assert prefill.transfer_server.num_expired == 1
        with pytest.raises(RequestError, match="no KV transfer named .* expired"):
            pull_transfer(handles["forgotten"], PULL_TIMEOUT_S)
        assert_nothing_pending(prefill)
    finally:
        prefill.close()


def test_a_transfer_whose_request_was_cancelled_is_dropped_at_once_not_at_its_expiry(tiny_checkpoint):
    """The orchestrator lets go of a transfer it will not send to a decode engine (its client
    cancelled in between): `discard_transfer` of a TCP handle has the prefill engine free it
    now, long before kv_transfer_timeout_s, and it is not counted as expired."""
    prefill = _tcp_prefill(tiny_checkpoint, kv_transfer_timeout_s=600.0)
    try:
        prefill.add_request("cancelled", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        handles = []
        while prefill.has_unfinished():
            handles.extend(out.transfer for out in prefill.step() if out.transfer is not None)
        assert len(handles) == 1 and prefill.num_pending_transfers == 1
        assert discard_transfer(handles[0])
        assert prefill.num_pending_transfers == 0 and prefill.transfer_server.num_expired == 0
        assert not discard_transfer(handles[0])  # nothing left to drop
        with pytest.raises(RequestError, match="no KV transfer named"):
            pull_transfer(handles[0], PULL_TIMEOUT_S)
        # A handle whose holder is gone: nothing to drop, within the timeout, without raising.
        assert not drop_transfer(f"tcp://127.0.0.1:1/{SHM_PREFIX}{'0' * 24}", timeout_s=0.2)
        assert_nothing_pending(prefill)
    finally:
        prefill.close()


def test_bad_transfer_parameters_are_refused_at_load_by_name(tiny_checkpoint):
    cases = [(dict(kv_transfer="udp"), r"kv_transfer='udp', expected one of \('shm', 'tcp'\)"),
             (dict(kv_transfer="tcp", role="both"), r"kv_transfer='tcp' needs role 'prefill'"),
             (dict(kv_transfer_port=70000), r"kv_transfer_port=70000 must be in \[0, 65535\]"),
             (dict(kv_transfer_address="tcp://h:1"), r"kv_transfer_address='tcp://h:1' must be"),
             (dict(kv_transfer_address="*"), r"kv_transfer_address='\*' must be an IPv4 address or a host name"),
             (dict(kv_transfer_timeout_s=0.0), r"kv_transfer_timeout_s=0.0 must be in \(0, 3600\]")]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model_path=tiny_checkpoint, **{"role": "prefill", **overrides})
    with pytest.raises(ValueError, match="kv_transfer_port='x' is not a valid int"):
        EngineConfig.from_parameters({"role": "prefill", "kv_transfer_port": "x"}, tiny_checkpoint)
    # An address that is not this host's: refused when the engine loads, by name.
    with pytest.raises(ValueError, match="kv_transfer_address='192.0.2.1' kv_transfer_port=0: cannot listen there"):
        _tcp_prefill(tiny_checkpoint, kv_transfer_address="192.0.2.1")


def test_a_malformed_or_unanswered_tcp_handle_is_one_clear_error(tiny_checkpoint):
    with pytest.raises(RequestError, match="^transfer: not a KV transfer handle"):
        pull_transfer("tcp://127.0.0.1:1/etc/passwd", 1.0)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes the request, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(RequestError) as info:
            pull_transfer(f"tcp://127.0.0.1:{port}/inflight-kv-{'0' * 24}", 0.3)
        assert info.value.code == RequestError.UNAVAILABLE and "kv_transfer_timeout_s=0.3" in str(info.value)
    finally:
        silent.close(linger=0)
        context.term()
    decode = _engine(tiny_checkpoint, "decode")
    with pytest.raises(RequestError, match="pulled .* before its import"):
        decode.import_request(f"tcp://127.0.0.1:{port}/inflight-kv-{'0' * 24}")
    decode.close()


# ---- the engine loop: the pull is off the step loop ------------------------------------


def test_the_decode_loop_steps_on_while_a_pull_waits_on_the_network(tiny_checkpoint, oracle):  # noqa: F811
    """A transfer whose prefill instance does not answer (yet) holds up no step: the transfers
    that do arrive meanwhile join the running batch and stream all their tokens, exactly; the
    stalled pull ends its own request with one error when the answer comes."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prefill = _tcp_prefill(tiny_checkpoint)
    handles = {}
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", prompt, params)
    while prefill.has_unfinished():
        handles.update((out.request_id, out.transfer) for out in prefill.step() if out.transfer is not None)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    stalled = f"tcp://127.0.0.1:{port}/inflight-kv-{'0' * 24}"
    loop = EngineLoop(lambda: _engine(tiny_checkpoint, "decode", kv_transfer_timeout_s=20.0))
    collector = Collector()
    try:
        loop.submit_transfer("stalled", stalled, "", collector.callback("stalled"))
        wait_until(lambda: silent.poll(0))  # the pull is on the wire
        started = time.monotonic()
        for request_id, handle in handles.items():
            loop.submit_transfer(request_id, handle, "", collector.callback(request_id))
        for request_id in handles:
            assert collector.done[request_id].wait(60), f"{request_id} never finished"
        assert time.monotonic() - started < 20, "the transfers waited for the stalled pull"
        assert not collector.done["stalled"].is_set()
        assert loop.engine.num_pending_transfers == 1
        for i, prompt in enumerate(PROMPTS):
            outputs = collector.outputs[f"r{i}"]
            assert [t for o in outputs for t in o.token_ids_delta] == oracle[tuple(prompt)]
            assert outputs[-1].error is None and len(collector.finals(f"r{i}")) == 1
        # The prefill instance answers at last: it has no such transfer.
        identity, name = silent.recv_multipart()
        assert name == stalled.rsplit("/", 1)[1].encode()
        silent.send_multipart([identity, b"missing"])
        assert collector.done["stalled"].wait(30)
        (final,) = collector.finals("stalled")
        assert final.error.code == RequestError.INVALID_ARG and "no KV transfer named" in str(final.error)
        wait_until(lambda: loop.engine.num_pending_transfers == 0 and not loop.engine.has_unfinished())
        assert_nothing_pending(loop.engine, prefill)
    finally:
        loop.shutdown()
        prefill.close()
        silent.close(linger=0)
        context.term()


# ---- across two hosts: network namespaces -------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    if not netns.can_create_namespaces():
        pytest.skip("creating network namespaces needs root (ip netns add)")
    with netns.Hosts(1) as h:
        yield h


def _link_tx_bytes(hosts: netns.Hosts) -> int:
    link = f"eth0-{hosts.tag}"
    out = subprocess.run(["ip", "netns", "exec", hosts.replica_ns[0], "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_transfer_crosses_a_real_link_between_two_hosts(hosts, tiny_checkpoint, kv_cache_dtype):
    """The prefill engine runs in a namespace of its own (a host at 10.78.0.2), the decode
    engine here, a veth pair and a forwarding namespace between them: each transfer's bytes
    go out of the prefill host's link, and the tokens and logprobs (batch_invariant) are the
    aggregated engine's bitwise. Afterwards neither side holds a transfer or a block."""
    config = dict(batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.9, top_k=50, seed=2026, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    aggregated = run_aggregated(_engine(tiny_checkpoint, **config), PROMPTS, params)
    prefill_config = dict(model_path=tiny_checkpoint, device="cpu", role="prefill", num_kv_blocks=128,
                          long_prefill_token_threshold=16, kv_transfer="tcp",
                          kv_transfer_address=hosts.replica_host(0), **config)
    worker = subprocess.Popen(
        ["ip", "netns", "exec", hosts.replica_ns[0], sys.executable, "-m", "tests.engine.disagg_prefill_worker",
         json.dumps(prefill_config)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    killer = threading.Timer(300, worker.kill)
    killer.start()
    decode = _engine(tiny_checkpoint, "decode", **config)
    try:
        worker.stdin.write(json.dumps({"prompts": PROMPTS, "params": params.model_dump(mode="json", by_alias=True, exclude_none=True)}) + "\n")
        worker.stdin.flush()
        handed_over = json.loads(worker.stdout.readline())
        assert len(handed_over) == len(PROMPTS)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        sent_before = _link_tx_bytes(hosts)
        moved = 0
        for out in handed_over:
            assert out["finish_reason"] == FinishReason.TRANSFERRED.value
            assert out["transfer"].startswith(f"tcp://{hosts.replica_host(0)}:")
            transfer = pull_transfer(out["transfer"], PULL_TIMEOUT_S)
            moved += transfer.nbytes
            request, first = decode.import_request(transfer)
            assert first.token_ids_delta == out["token_ids"]
            _tokens_and_logprobs([first], tokens, logprobs)
        assert _link_tx_bytes(hosts) - sent_before >= moved
        while decode.has_unfinished():
            _tokens_and_logprobs(decode.step(), tokens, logprobs)
        assert (tokens, logprobs) == aggregated
        worker.stdin.write("stats\n")
        worker.stdin.flush()
        assert json.loads(worker.stdout.readline()) == {"pending": 0, "used_blocks": 0}
        assert worker.wait(60) == 0
        assert_nothing_pending(decode)
    finally:
        killer.cancel()
        worker.kill()
        worker.wait()
        decode.close()


def test_a_request_still_being_pulled_at_shutdown_gets_one_final_error(tiny_checkpoint):
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    # The pull's thread lives on after the shutdown, until this timeout: short, for the session's exit.
    loop = EngineLoop(lambda: _engine(tiny_checkpoint, "decode", kv_transfer_timeout_s=5.0))
    collector = Collector()
    try:
        loop.submit_transfer("stalled", f"tcp://127.0.0.1:{port}/inflight-kv-{'0' * 24}", "",
                             collector.callback("stalled"))
        wait_until(lambda: silent.poll(0))
        started = time.monotonic()
        loop.shutdown()
        assert time.monotonic() - started < 10, "the shutdown waited for the pull"
        assert collector.done["stalled"].is_set()
        (final,) = collector.finals("stalled")
        assert final.error.code == RequestError.UNAVAILABLE and "shutting down" in str(final.error)
        assert len(collector.outputs["stalled"]) == 1
    finally:
        loop.shutdown()
        silent.close(linger=0)
        context.term()
