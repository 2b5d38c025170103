"""Disaggregated prefill and decode (backend/disagg.py): a role-prefill engine exports each
request after its first token, a role-decode engine imports it and generates the rest.

The transfer's round trip is checked byte for byte; the two engines together, driven in one
process, must give the aggregated engine's greedy tokens (and so transformers'), and with
batch_invariant on its logprobs bitwise; seeded sampling continues the same random stream.
"""

from __future__ import annotations

import os
import random
import secrets
import time
import types

import pytest
import torch

from backend import disagg
from backend.config import EngineConfig
from backend.disagg import (
    SHM_PREFIX,
    KVLayout,
    Transfer,
    discard_transfer,
    export_request,
    request_header,
    restore_generator,
    sweep_expired_transfers,
)
from backend.engine import LLMEngine
from backend.request import FinishReason, Request, RequestError, SamplingParams
from backend.sampler import Sampler
from tests.checkpoints import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152
MAX_NEW = 12
_rng = random.Random(51)
# Within one block, exactly one, across several (block_size 16), and one that takes several
# prefill chunks (long_prefill_token_threshold 16 below).
LENGTHS = [1, 5, 16, 17, 40, 70]
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def _engine(model: str, role: str = "both", **config) -> LLMEngine:
    config.setdefault("num_kv_blocks", 128)
    config.setdefault("long_prefill_token_threshold", 16)
    return LLMEngine(EngineConfig(model_path=model, device="cpu", role=role, **config))


# This process's transfers carry its pid in their random part, so that the leak checks see their
# own only: other xdist workers' tests make and remove transfers in /dev/shm meanwhile.
_PROCESS_TAG = f"{os.getpid() % 16 ** 8:08x}"


@pytest.fixture(autouse=True)
def _tagged_transfer_names(monkeypatch):
    monkeypatch.setattr(disagg, "secrets",
                        types.SimpleNamespace(token_hex=lambda n: _PROCESS_TAG + secrets.token_hex(n - 4)))


def _shm_transfers() -> set[str]:
    """This process's transfers in /dev/shm."""
    return {name for name in os.listdir("/dev/shm")
            if name.startswith(SHM_PREFIX) and name.rpartition("-")[2].startswith(_PROCESS_TAG)}


def _tokens_and_logprobs(outputs, tokens: dict, logprobs: dict) -> None:
    for out in outputs:
        assert out.error is None, out.error
        tokens.setdefault(out.request_id, []).extend(out.token_ids_delta)
        logprobs.setdefault(out.request_id, []).extend(
            next(iter(entry.values()))["logprob"] for entry in out.logprobs_delta or [])


def run_aggregated(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, dict]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        _tokens_and_logprobs(engine.step(), tokens, logprobs)
    return tokens, logprobs


def run_disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]],
                      params: SamplingParams, fetch=lambda handle: handle) -> tuple[dict, dict]:
    """Every prompt into the prefill engine at once; each transfer into the decode engine as
    soon as the prefill engine hands it over (`fetch`: what the decode engine imports for a
    handle, e.g. the transfer pulled over TCP), the two engines stepping in turn. Each request
    ends with exactly one final output, on one side or the other."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    finals: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    while prefill.has_unfinished() or decode.has_unfinished():
        outputs = []
        for out in prefill.step():
            assert out.error is None, out.error
            if out.finish_reason == FinishReason.TRANSFERRED.value:
                assert out.finished and out.transfer is not None and len(out.token_ids_delta) == 1
                request, first = decode.import_request(fetch(out.transfer))
                assert request.request_id == out.request_id and first.token_ids_delta == out.token_ids_delta
                assert first.logprobs_delta == out.logprobs_delta
                outputs.append(first)
            else:  # its first token ended it: the prefill engine's output is the final one
                assert out.transfer is None
                outputs.append(out)
        outputs.extend(decode.step())
        for out in outputs:
            finals[out.request_id] = finals.get(out.request_id, 0) + out.finished
        _tokens_and_logprobs(outputs, tokens, logprobs)
    assert finals == {f"r{i}": 1 for i in range(len(prompts))}
    return tokens, logprobs


def assert_no_blocks_held(*engines: LLMEngine) -> None:
    for engine in engines:
        assert engine.kv.pool.num_used == 0
        assert not engine.scheduler.requests
        assert not engine.has_unfinished() and engine.num_waiting == 0


def exported(prefill: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    """Each prompt run on the prefill engine and handed over: the transfers' handles, in order."""
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    handles = []
    while prefill.has_unfinished():
        handles.extend(out.transfer for out in prefill.step() if out.transfer is not None)
    assert len(handles) == len(prompts)
    return handles


def drain(engine: LLMEngine, outputs: dict[str, list]) -> None:
    """Step `engine` until it holds nothing, collecting every output by request."""
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): out for p, out in zip(PROMPTS, hf_greedy(tiny_checkpoint, PROMPTS, MAX_NEW))}


# ---- the transfer ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_transfer_round_trip_moves_the_blocks_bytes_and_the_state(dtype):
    """The exported blocks land, byte for byte, in other block ids of another pool; the header
    brings back the request's state, the generator where its draws left off."""
    num_layers, pool_blocks, row = 3, 10, (16, 2, 8)
    source = [(torch.randn(pool_blocks, *row).to(dtype), torch.randn(pool_blocks, *row).to(dtype))
              for _ in range(num_layers)]
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=123, max_tokens=9, logprobs=2, stop=["x"])
    request = Request(request_id="abc", prompt_token_ids=list(range(3, 40)), params=params, max_tokens=9,
                      arrival_time=0.0, arrival_seq=0, needs_logprobs=True)
    request.block_ids = [7, 2, 9]
    request.generator = Sampler.make_request_generator(123)
    torch.rand(5, generator=request.generator)  # the prefill's draws
    request.append_output_token(11)
    request.cumulative_logprob = -1.25
    layout = KVLayout.of(source, 16)
    handle = export_request(request, 3, source, layout, request_header(request, -1.25, [(11, -1.25), (4, -2.5)]))
    assert handle in _shm_transfers()

    destination = [(torch.zeros(pool_blocks, *row, dtype=dtype), torch.zeros(pool_blocks, *row, dtype=dtype))
                   for _ in range(num_layers)]
    transfer = Transfer(handle)
    assert transfer.layout == layout and transfer.num_blocks == 3
    transfer.write_blocks([0, 5, 1], destination)
    transfer.close()
    assert handle not in _shm_transfers()
    for (k, v), (dk, dv) in zip(source, destination):
        for src, dst in ((k, dk), (v, dv)):
            assert torch.equal(dst[[0, 5, 1]].view(torch.uint8), src[[7, 2, 9]].view(torch.uint8))
            assert not dst[[2, 3, 4, 6, 7, 8, 9]].view(torch.uint8).any()

    header = transfer.header
    assert header["prompt_token_ids"] == request.prompt_token_ids and header["output_token_ids"] == [11]
    assert SamplingParams.model_validate(header["params"]) == params
    assert header["cumulative_logprob"] == -1.25 and header["first_logprob"] == -1.25
    assert header["first_top_logprobs"] == [[11, -1.25], [4, -2.5]]
    restored = restore_generator(header["generator_state"])
    assert torch.equal(torch.rand(8, generator=restored), torch.rand(8, generator=request.generator))


def test_a_handle_that_names_no_transfer_is_one_clear_error(tiny_checkpoint):
    decode = _engine(tiny_checkpoint, "decode")
    cases = ((SHM_PREFIX + "0" * 24, "no KV transfer named"), ("/etc/passwd", "not a KV transfer handle"),
             (SHM_PREFIX + "x" * 300, "cannot open KV transfer"))
    for handle, words in cases:
        with pytest.raises(RequestError) as info:
            decode.import_request(handle)
        assert info.value.code == RequestError.INVALID_ARG and words in str(info.value)
        assert str(info.value).startswith("transfer:")
    assert not discard_transfer(SHM_PREFIX + "0" * 24)
    assert_no_blocks_held(decode)


def test_role_is_checked_by_name():
    with pytest.raises(ValueError, match=r"role='mixed', expected one of \('both', 'prefill', 'decode'\)"):
        EngineConfig(model_path="/nonexistent", role="mixed")


@pytest.mark.parametrize("name, value, limits", [("kv_transfer_wait_timeout_s", -1, r"\[0, 3600\]"),
                                                 ("kv_transfer_wait_timeout_s", 4000, r"\[0, 3600\]"),
                                                 ("kv_transfer_timeout_s", 0, r"\(0, 3600\]")])
def test_the_transfer_timeouts_are_checked_by_name(name, value, limits):
    with pytest.raises(ValueError, match=rf"{name}={value} must be in {limits}"):
        EngineConfig(model_path="/nonexistent", **{name: value})


# ---- the two engines together ------------------------------------------------------------


def test_disaggregated_greedy_tokens_are_the_aggregated_engines_and_transformers(tiny_checkpoint, oracle):
    before = _shm_transfers()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    aggregated, _ = run_aggregated(_engine(tiny_checkpoint), PROMPTS, params)
    prefill, decode = _engine(tiny_checkpoint, "prefill"), _engine(tiny_checkpoint, "decode")
    tokens, _ = run_disaggregated(prefill, decode, PROMPTS, params)
    assert tokens == aggregated
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == oracle[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    assert_no_blocks_held(prefill, decode)
    assert _shm_transfers() == before
    # The prefill engine computed every prompt; the decode engine computed no prompt token.
    assert prefill.stats.totals.prefilled_prompt_tokens == sum(map(len, PROMPTS))
    assert decode.stats.totals.prompt_tokens == decode.stats.totals.prefilled_prompt_tokens == 0
    # Each request's prompt blocks crossed once: exported by one engine, imported by the other.
    block_bytes = prefill.kv_layout.block_bytes
    moved = sum(prefill.kv.blocks_needed(len(p)) for p in PROMPTS) * block_bytes
    for engine in (prefill, decode):
        assert engine.stats.totals.kv_transfers == len(PROMPTS)
        assert engine.stats.totals.kv_transfer_bytes == moved


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_batch_invariant_logprobs_are_bitwise_the_aggregated_engines(tiny_checkpoint, kv_cache_dtype):
    """Greedy with logprobs, and seeded sampling (the generator's state crosses over): the
    same tokens, and logprobs equal as floats, whatever the KV dtype (its bytes cross as they are)."""
    config = dict(batch_invariant=True, kv_cache_dtype=kv_cache_dtype)
    for params in (SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
                   SamplingParams(temperature=0.9, top_k=50, seed=2026, max_tokens=MAX_NEW, ignore_eos=True,
                                  logprobs=1)):
        aggregated = run_aggregated(_engine(tiny_checkpoint, **config), PROMPTS, params)
        prefill, decode = _engine(tiny_checkpoint, "prefill", **config), _engine(tiny_checkpoint, "decode", **config)
        disaggregated = run_disaggregated(prefill, decode, PROMPTS, params)
        assert disaggregated == aggregated
        assert_no_blocks_held(prefill, decode)


def test_a_first_token_that_ends_the_request_ends_it_on_the_prefill_engine(tiny_checkpoint, oracle):
    prefill, decode = _engine(tiny_checkpoint, "prefill"), _engine(tiny_checkpoint, "decode")
    tokens, _ = run_disaggregated(prefill, decode, PROMPTS[:2],
                                  SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert tokens == {f"r{i}": oracle[tuple(p)][:1] for i, p in enumerate(PROMPTS[:2])}
    assert decode.stats.totals.prompt_tokens == 0
    assert_no_blocks_held(prefill, decode)


@pytest.mark.parametrize("max_tokens", [1, 6, MAX_NEW])
def test_the_decode_half_runs_on_with_its_own_sampling_parameters(tiny_checkpoint, oracle, max_tokens):
    """vllm-router's shape: the prefill half carries neither max_tokens nor min_tokens (the
    frontend drops the router's 1s), the decode half the client's. The request runs on with the
    decode half's: exactly max_tokens of transformers' greedy tokens, max_tokens 1 ending at import."""
    prefill, decode = _engine(tiny_checkpoint, "prefill"), _engine(tiny_checkpoint, "decode")
    handles = exported(prefill, PROMPTS[2:4], SamplingParams(temperature=0.0, ignore_eos=True))
    client = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for handle in handles:
        request, first = decode.import_request(handle, params=client)
        assert first.finished == (max_tokens == 1) and request.max_tokens == max_tokens
        tokens[request.request_id] = list(first.token_ids_delta)
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id].extend(out.token_ids_delta)
            assert not out.finished or out.finish_reason == "length"
    assert tokens == {f"r{i}": oracle[tuple(p)][:max_tokens] for i, p in enumerate(PROMPTS[2:4])}
    assert_no_blocks_held(prefill, decode)


def test_a_decode_engine_serves_a_request_that_was_never_handed_over_whole(tiny_checkpoint, oracle):
    decode = _engine(tiny_checkpoint, "decode")
    tokens, _ = run_aggregated(decode, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    assert tokens == {f"r{i}": oracle[tuple(p)] for i, p in enumerate(PROMPTS[:3])}
    assert_no_blocks_held(decode)


def test_a_full_decode_instance_refuses_with_unavailable_when_it_may_not_wait(tiny_checkpoint):
    before = _shm_transfers()
    prefill = _engine(tiny_checkpoint, "prefill")
    decode = _engine(tiny_checkpoint, "decode", max_num_seqs=1, kv_transfer_wait_timeout_s=0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prefill.add_request("a", PROMPTS[1], params)
    prefill.add_request("b", PROMPTS[2], params)
    handles = []
    while prefill.has_unfinished():
        handles.extend(out.transfer for out in prefill.step() if out.transfer is not None)
    assert len(handles) == 2
    decode.import_request(handles[0])
    with pytest.raises(RequestError) as info:
        decode.import_request(handles[1])
    assert info.value.code == RequestError.UNAVAILABLE and "max_num_seqs=1" in str(info.value)
    assert str(info.value).endswith("retry later")
    assert handles[1] not in _shm_transfers()  # consumed though refused
    while decode.has_unfinished():
        decode.step()
    assert_no_blocks_held(prefill, decode)
    assert _shm_transfers() == before


def test_a_full_decode_instance_makes_the_request_wait_holding_its_transfer(tiny_checkpoint, oracle):
    """Room for one request: the second waits (counted among the waiting), its transfer
    claimed (gone from /dev/shm) but held, and runs once the first ends; both give the
    aggregated engine's greedy tokens, each with one final output."""
    before = _shm_transfers()
    prefill, decode = _engine(tiny_checkpoint, "prefill"), _engine(tiny_checkpoint, "decode", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[3]]
    handles = exported(prefill, prompts, params)
    outputs: dict[str, list] = {}
    request, first = decode.import_request(handles[0])
    outputs[request.request_id] = [first]
    for handle in handles[1:]:
        request, first = decode.import_request(handle)
        assert first is None and handle not in _shm_transfers()
    assert decode.num_running == 1 and decode.num_waiting == 2
    for out in decode.step():  # the first request runs; the others still wait, in arrival order
        outputs[out.request_id].append(out)
    assert decode.stats.num_waiting == 2
    drain(decode, outputs)
    for i, prompt in enumerate(prompts):
        outs = outputs[f"r{i}"]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert all(o.error is None for o in outs)
        assert [t for o in outs for t in o.token_ids_delta] == oracle[tuple(prompt)]
    assert decode.stats.totals.kv_transfers == 3
    assert_no_blocks_held(prefill, decode)
    assert _shm_transfers() == before


def test_a_request_that_waits_past_kv_transfer_wait_timeout_s_is_refused_naming_it(tiny_checkpoint):
    before = _shm_transfers()
    prefill = _engine(tiny_checkpoint, "prefill")
    decode = _engine(tiny_checkpoint, "decode", max_num_seqs=1, kv_transfer_wait_timeout_s=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    handles = exported(prefill, PROMPTS[1:3], params)
    decode.import_request(handles[0])
    _, first = decode.import_request(handles[1])
    assert first is None
    outputs: dict[str, list] = {}
    for out in decode.step():  # still in time: it waits on
        outputs.setdefault(out.request_id, []).append(out)
    assert "r1" not in outputs and decode.num_waiting == 1
    time.sleep(0.25)  # the first request still runs (it has 200 tokens to go)
    for out in decode.step():
        outputs.setdefault(out.request_id, []).append(out)
    [refused] = outputs["r1"]
    assert refused.finished and refused.error is not None and refused.error.code == RequestError.UNAVAILABLE
    assert "kv_transfer_wait_timeout_s=0.2s" in str(refused.error) and "max_num_seqs=1" in str(refused.error)
    assert str(refused.error).endswith("retry later") and not refused.token_ids_delta
    assert decode.num_running == 1 and decode.num_waiting == 0  # the first goes on
    drain(decode, outputs)
    assert [o.finished for o in outputs["r0"]].count(True) == 1 and outputs["r0"][-1].error is None
    assert outputs["r0"][-1].num_output_tokens == 200
    assert_no_blocks_held(prefill, decode)
    assert _shm_transfers() == before


def test_through_the_engine_loop_a_waiting_request_gets_its_stream_and_one_final_output(tiny_checkpoint, oracle):
    """The loop's side of waiting (EngineLoop.submit_transfer): a request that waits for room
    has its handler from the start, and its first token, its others and its one final
    output reach its callback once it runs; a cancelled waiting one gets one final output."""
    import threading

    from backend.engine_loop import EngineLoop

    prefill = _engine(tiny_checkpoint, "prefill")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = PROMPTS[1:4]
    handles = exported(prefill, prompts, params)
    loop = EngineLoop(lambda: _engine(tiny_checkpoint, "decode", max_num_seqs=1))
    outputs: dict[str, list] = {}
    done = threading.Event()
    cancelled = threading.Event()

    def collect(out):
        outputs.setdefault(out.request_id, []).append(out)
        if sum(o.finished for outs in outputs.values() for o in outs) == len(prompts):
            done.set()

    try:
        for i, handle in enumerate(handles):
            loop.submit_transfer(f"r{i}", handle, "", collect, is_cancelled=cancelled.is_set if i == 2 else None)
        cancelled.set()  # r2 is cancelled while r0 runs and r1 waits ahead of it
        assert done.wait(60)
        time.sleep(0.1)  # anything after a final output would show by now
    finally:
        loop.shutdown()
    for i, prompt in enumerate(prompts[:2]):
        outs = outputs[f"r{i}"]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished and outs[-1].error is None
        assert [t for o in outs for t in o.token_ids_delta] == oracle[tuple(prompt)]
    [r2] = outputs["r2"]
    assert r2.finished and r2.finish_reason == FinishReason.ABORT.value
    assert_no_blocks_held(prefill, loop.engine)


def test_a_waiting_request_aborted_lets_its_transfer_go(tiny_checkpoint):
    prefill = _engine(tiny_checkpoint, "prefill")
    decode = _engine(tiny_checkpoint, "decode", max_num_seqs=1)
    handles = exported(prefill, PROMPTS[1:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    decode.import_request(handles[0])
    decode.import_request(handles[1])
    assert decode.abort("r1") and decode.num_waiting == 0
    outputs: dict[str, list] = {}
    drain(decode, outputs)
    [aborted] = outputs["r1"]
    assert aborted.finished and aborted.finish_reason == FinishReason.ABORT.value and aborted.error is None
    assert outputs["r0"][-1].num_output_tokens == 8
    assert_no_blocks_held(prefill, decode)


def test_a_transfer_never_claimed_expires_and_any_engine_sweeps_it(tiny_checkpoint):
    """The exporter names the lifetime (kv_transfer_timeout_s); an unclaimed transfer past it
    is removed by the next sweep, at an engine's startup (what a dead process left) or between
    its steps. A claimed one has no name left to sweep, and a live one stays."""
    prefill = _engine(tiny_checkpoint, "prefill", kv_transfer_timeout_s=1.0)
    decode = _engine(tiny_checkpoint, "decode")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    started = time.monotonic()
    [expiring, claimed] = exported(prefill, PROMPTS[1:3], params)
    exported_by = time.monotonic()
    live = export_request(  # a transfer of the default lifetime, as another prefill engine's
        Request(request_id="live", prompt_token_ids=[5], params=params, max_tokens=4, arrival_time=0.0,
                arrival_seq=0), 0, prefill.runner.kv_blocks, prefill.kv_layout, {})
    request, first = decode.import_request(claimed)  # claimed before its expiry
    assert first is not None and {expiring, live} <= _shm_transfers()
    assert time.monotonic() - started < 1.0, "too slow to claim the transfer in its lifetime"
    time.sleep(max(0.0, exported_by + 1.05 - time.monotonic()))
    assert claimed not in sweep_expired_transfers()
    assert expiring not in _shm_transfers() and live in _shm_transfers()
    with pytest.raises(RequestError, match="no KV transfer named .*expired"):
        decode.import_request(expiring)
    outputs: dict[str, list] = {}
    drain(decode, outputs)
    assert outputs["r1"][-1].num_output_tokens == 4
    assert discard_transfer(live)
    assert_no_blocks_held(prefill, decode)

    # Startup: what a dead exporter left past its lifetime goes at once.
    stale = export_request(Request(request_id="stale", prompt_token_ids=[5], params=params, max_tokens=4,
                                   arrival_time=0.0, arrival_seq=0), 0, prefill.runner.kv_blocks, prefill.kv_layout,
                           {}, lifetime_s=0.0)
    assert stale in _shm_transfers()
    _engine(tiny_checkpoint, "decode")
    assert stale not in _shm_transfers()


def test_requests_a_transfer_cannot_carry_yet_are_refused_by_name(tiny_checkpoint):
    prefill = _engine(tiny_checkpoint, "prefill")
    with pytest.raises(RequestError, match="^n: at most 1 sequence"):
        prefill.add_request("g", PROMPTS[1], SamplingParams(n=2))
    with pytest.raises(RequestError, match="^structured_outputs: not supported"):
        prefill.add_request("s", PROMPTS[1], SamplingParams(structured_outputs={"regex": "a+"}))


def test_only_a_decode_engine_imports(tiny_checkpoint):
    with pytest.raises(RequestError, match="only role 'decode' imports"):
        _engine(tiny_checkpoint).import_request(SHM_PREFIX + "0" * 24)
