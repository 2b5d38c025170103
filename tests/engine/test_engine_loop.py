"""The engine loop thread: one final output per request on every path, cancellation
within one iteration, fault isolation, and draining on shutdown."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.request import RequestError, SamplingParams


class Collector:
    """Records every output per request and signals when each has its final one."""

    def __init__(self):
        self.outputs: dict[str, list] = {}
        self.done: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def callback(self, request_id: str):
        self.outputs[request_id] = []
        self.done[request_id] = threading.Event()

        def on_output(output):
            with self.lock:
                assert not self.done[request_id].is_set(), f"{request_id}: output after the final one"
                self.outputs[request_id].append(output)
                if output.finished:
                    self.done[request_id].set()

        return on_output

    def wait(self, timeout: float = 60.0) -> None:
        for request_id, event in self.done.items():
            assert event.wait(timeout), f"{request_id} never finished"

    def finals(self, request_id: str) -> list:
        return [o for o in self.outputs[request_id] if o.finished]


def make_loop(model_path: str, **overrides) -> EngineLoop:
    config = EngineConfig(model_path=model_path, **{"max_num_seqs": 4, "num_kv_blocks": 64, **overrides})
    return EngineLoop(lambda: LLMEngine(config))


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_the_engine_is_built_and_stepped_on_the_loop_thread(tiny_checkpoint):
    """One thread owns the engine (OpenMP gives each thread that runs torch kernels its own team)."""
    config = EngineConfig(model_path=tiny_checkpoint, max_num_seqs=4, num_kv_blocks=64)
    threads: dict[str, threading.Thread] = {}

    def build() -> LLMEngine:
        threads["build"] = threading.current_thread()
        engine = LLMEngine(config)
        step = engine.step

        def recorded_step(interrupt=None):
            threads["step"] = threading.current_thread()
            return step(interrupt)

        engine.step = recorded_step
        return engine

    loop = EngineLoop(build)
    collector = Collector()
    try:
        loop.submit("r", "hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), collector.callback("r"))
        collector.wait()
        assert threads["build"] is threads["step"] is loop._thread is not threading.current_thread()
    finally:
        loop.shutdown()


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for the test (a new thread's OpenMP team takes it), then restores it."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_loop_thread_pins_its_openmp_team_and_no_other_thread(tiny_checkpoint, torch_threads):
    """omp_threads_bind: the loop thread and its OpenMP team run one per CPU listed; the
    caller's thread keeps every CPU it had (a process it starts later keeps them too)."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = list(reversed(allowed[:2]))  # a team of 2 where the machine has 2 CPUs, in an order of our own
    torch_threads(len(cpus))
    loop = make_loop(tiny_checkpoint, omp_threads_bind=",".join(map(str, cpus)))
    collector = Collector()
    try:
        assert loop.binding.cpus == cpus and len(set(loop.binding.thread_ids)) == len(cpus)
        assert os.sched_getaffinity(loop._thread.native_id) == {cpus[0]}
        assert sorted(os.sched_getaffinity(0)) == allowed
        loop.submit("r", "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), collector.callback("r"))
        collector.wait()
        assert collector.finals("r")[0].num_output_tokens == 4
    finally:
        loop.shutdown()


def test_auto_binds_nothing_for_a_team_of_one_thread(tiny_checkpoint, torch_threads):
    """The default: a one-thread engine (OMP_NUM_THREADS=1) may share its machine with others,
    and binding every such engine would stack them all on the first CPU."""
    torch_threads(1)
    loop = make_loop(tiny_checkpoint)
    try:
        assert loop.binding is None
        assert os.sched_getaffinity(loop._thread.native_id) == os.sched_getaffinity(0)
    finally:
        loop.shutdown()


def test_a_binding_that_does_not_fit_fails_the_build(tiny_checkpoint, torch_threads):
    torch_threads(1)
    with pytest.raises(ValueError, match=r"omp_threads_bind='0,1' names 2 CPU\(s\), but the engine runs 1 OpenMP"):
        make_loop(tiny_checkpoint, omp_threads_bind="0,1")


def test_a_failed_build_raises_in_the_caller_and_leaves_no_thread(tiny_checkpoint):
    def build() -> LLMEngine:
        raise ValueError("no such checkpoint")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no such checkpoint"):
        EngineLoop(build)
    wait_until(lambda: threading.active_count() == before)


def test_every_request_gets_exactly_one_final_output(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint)
    collector = Collector()
    try:
        for i in range(10):
            rid = f"r{i}"
            loop.submit(rid, f"prompt number {i} " * (i + 1), SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True),
                             collector.callback(rid))
        collector.wait()
        for i in range(10):
            finals = collector.finals(f"r{i}")
            assert len(finals) == 1 and finals[0].finish_reason == "length"
            assert finals[0].num_output_tokens == 5 + i
            assert sum(len(o.token_ids_delta) for o in collector.outputs[f"r{i}"]) == 5 + i
    finally:
        loop.shutdown()
    assert loop.engine.kv.pool.num_used == 0


def test_cancellation_is_seen_within_one_iteration_and_frees_blocks(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint)
    engine = loop.engine
    collector = Collector()
    cancelled = threading.Event()
    steps_at_cancel = []
    try:
        loop.submit("long", "a long running request", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
                         collector.callback("long"), is_cancelled=cancelled.is_set)
        loop.submit("short", "a short one", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         collector.callback("short"))
        wait_until(lambda: len(collector.outputs["long"]) >= 3)
        steps_at_cancel.append(engine.stats.totals.steps)
        cancelled.set()
        collector.wait()
        finals = collector.finals("long")
        assert len(finals) == 1 and finals[0].finish_reason == "abort"
        assert finals[0].num_output_tokens < 500
        # Seen at the next iteration boundary: at most the step in flight plus one more.
        assert finals[0].num_output_tokens <= len(collector.outputs["long"]) + 1
        assert collector.finals("short")[0].finish_reason == "length"
        wait_until(lambda: engine.kv.pool.num_used == 0)
        assert engine.stats.totals.aborts == 1
    finally:
        loop.shutdown()


def test_cancel_while_queued_and_twice(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint, max_num_seqs=1)
    collector = Collector()
    try:
        loop.submit("busy", "occupies the only slot", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         collector.callback("busy"))
        loop.submit("queued", "waits behind it", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         collector.callback("queued"))
        wait_until(lambda: len(collector.outputs["busy"]) >= 2)
        loop.abort("queued")
        loop.abort("queued")
        loop.abort("busy")
        loop.abort("busy")
        collector.wait()
        for rid in ("busy", "queued"):
            finals = collector.finals(rid)
            assert len(finals) == 1 and finals[0].finish_reason == "abort"
        assert collector.outputs["queued"][-1].num_output_tokens == 0
        wait_until(lambda: loop.engine.kv.pool.num_used == 0)
    finally:
        loop.shutdown()


def test_admission_errors_are_raised_at_once(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint, max_model_len=64)
    collector = Collector()
    try:
        with pytest.raises(RequestError) as info:
            loop.submit("big", "word " * 10, SamplingParams(max_tokens=100), collector.callback("big"))
        assert info.value.code == RequestError.INVALID_ARG
        assert "max_model_len 64" in str(info.value) and "max_tokens" in str(info.value)
        with pytest.raises(RequestError) as info:
            loop.submit("topk", "hi", SamplingParams(top_k=10**6), collector.callback("topk"))
        assert info.value.param == "top_k" and "49152" in str(info.value)
        with pytest.raises(RequestError) as info:
            loop.submit("stopid", "hi", SamplingParams(stop_token_ids=[10**6]), collector.callback("stopid"))
        assert info.value.param == "stop_token_ids"
    finally:
        loop.shutdown()


def test_kv_pool_too_small_for_a_request_is_rejected_with_numbers(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, num_kv_blocks=4, block_size=16))
    with pytest.raises(RequestError) as info:
        engine.add_request("r", "hello", SamplingParams(max_tokens=100))
    message = str(info.value)
    assert info.value.code == RequestError.INVALID_ARG
    assert "the whole pool has 4" in message and "KV blocks" in message


def test_full_waiting_queue_answers_unavailable(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, max_queue_len=2))
    engine.add_request("a", "one", SamplingParams(max_tokens=2))
    engine.add_request("b", "two", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError) as info:
        engine.add_request("c", "three", SamplingParams(max_tokens=2))
    assert info.value.code == RequestError.UNAVAILABLE and "max_queue_len" in str(info.value)


def test_forward_failure_fails_in_flight_requests_and_engine_recovers(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("INFLIGHT_FAULT_INJECT_AT_BATCH", "3")
    loop = make_loop(tiny_checkpoint)
    engine = loop.engine
    collector = Collector()
    try:
        for i in range(3):
            # Long enough that none ends before the third joins the batch, which fails.
            loop.submit(f"r{i}", f"request {i}", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
                             collector.callback(f"r{i}"))
        collector.wait()
        for i in range(3):
            finals = collector.finals(f"r{i}")
            assert len(finals) == 1 and finals[0].finish_reason == "error"
            assert finals[0].error is not None and finals[0].error.code == RequestError.INTERNAL
            assert "injected fault" in str(finals[0].error)
        assert engine.kv.pool.num_used == 0
        # The fault switch off again: new requests are served normally.
        engine._fail_at_batch = 0
        loop.submit("after", "works again", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         collector.callback("after"))
        collector.wait()
        assert collector.finals("after")[0].finish_reason == "length"
    finally:
        loop.shutdown()


@pytest.mark.parametrize("fault, fatal", [
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
], ids=["device-fault", "out-of-memory"])
def test_a_device_fault_makes_the_loop_unhealthy_and_running_out_of_memory_does_not(tiny_checkpoint, fault, fatal):
    """After a CUDA error the context is lost and every later step would fail: the health
    check must say so, so that the model is unloaded rather than kept failing requests."""
    loop = make_loop(tiny_checkpoint)
    collector = Collector()
    try:
        execute = loop.engine.runner.run
        raised = []

        def fail_once(*args, **kwargs):
            if not raised:
                raised.append(fault)
                raise fault
            return execute(*args, **kwargs)

        loop.engine.runner.run = fail_once
        loop.submit("r", "meets the fault", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         collector.callback("r"))
        collector.wait()
        final = collector.finals("r")[0]
        assert final.finish_reason == "error" and final.error.code == RequestError.INTERNAL
        if fatal:
            assert loop.health(stall_s=60) == ("the device failed and cannot run another step: "
                                               "AcceleratorError: CUDA error: an illegal memory access was encountered")
        else:
            assert loop.health(stall_s=60) is None and loop.engine.device_fault is None
    finally:
        loop.shutdown()


def test_shutdown_drains_live_requests(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint)
    collector = Collector()
    for i in range(6):
        loop.submit(f"r{i}", "keeps going", SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
                         collector.callback(f"r{i}"))
    wait_until(lambda: any(collector.outputs[f"r{i}"] for i in range(6)))
    loop.shutdown(timeout_s=30)
    collector.wait(timeout=1)
    for i in range(6):
        assert len(collector.finals(f"r{i}")) == 1
    assert loop.engine.kv.pool.num_used == 0
    with pytest.raises(RequestError) as info:
        loop.submit("late", "too late", SamplingParams(), collector.callback("late"))
    assert info.value.code == RequestError.UNAVAILABLE


def test_a_request_refused_at_the_door_ends_without_touching_its_namesake(tiny_checkpoint):
    """A refusal (here a duplicate id) ends through the one finish path, as an error output,
    and leaves the in-flight request of the same id as it was."""
    from backend.request import FinishReason

    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, num_kv_blocks=64))
    first = engine.add_request("same", "one", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    twin = engine.make_request("same", "two", SamplingParams(max_tokens=3))
    with pytest.raises(RequestError) as info:
        engine.accept(twin)
    output = engine.finish(twin, FinishReason.ERROR, error=info.value)
    assert output.finished and output.finish_reason == "error" and output.error is info.value
    assert output.text_delta == "" and output.num_output_tokens == 0
    assert not first.is_finished and engine.scheduler.requests["same"] is first
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert sum(len(o.token_ids_delta) for o in outputs) == 3


def test_an_aborted_request_ends_before_the_next_step(tiny_checkpoint):
    """A cancel must not wait behind the next step (a long prefill can take a second): the
    loop hands out the aborted request's final output, and a snapshot with its blocks freed,
    before it steps again."""
    loop = make_loop(tiny_checkpoint)
    engine = loop.engine
    collector = Collector()
    cancelled = threading.Event()
    step = engine.step
    # At the start of each step: is "long" still the scheduler's, has it had its final output,
    # and the blocks in use that the latest snapshot shows.
    seen: list[tuple[bool, bool, int]] = []

    def recorded_step(interrupt=None):
        seen.append(("long" in engine.scheduler.requests, collector.done["long"].is_set(),
                     engine.stats.num_used_kv_blocks))
        return step(interrupt)

    engine.step = recorded_step
    try:
        loop.submit("long", "a long running request", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
                         collector.callback("long"), is_cancelled=cancelled.is_set)
        loop.submit("other", "keeps the loop stepping", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                         collector.callback("other"))
        wait_until(lambda: len(collector.outputs["long"]) >= 3)
        cancelled.set()
        collector.wait()
        assert collector.finals("long")[0].finish_reason == "abort"
        after_abort = [(done, used) for held, done, used in seen if not held]
        assert after_abort, "no step after the abort"
        assert all(done for done, _ in after_abort), "a step began before the aborted request had its final output"
        # ... and the snapshot it read already counted only the other request's blocks.
        last_held = max(i for i, (held, _, _) in enumerate(seen) if held)
        assert after_abort[0][1] < seen[last_held][2]
    finally:
        loop.shutdown()


def test_health_reports_a_hung_step_only_while_requests_wait(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("INFLIGHT_FAULT_STALL_AT_BATCH", "2")
    loop = make_loop(tiny_checkpoint)
    collector = Collector()
    try:
        loop.submit("one", "alone in its batch", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         collector.callback("one"))
        collector.wait()
        time.sleep(0.3)
        assert loop.health(stall_s=0.2) is None  # idle, not stuck
        for i in range(2):
            loop.submit(f"r{i}", f"request {i}", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                             collector.callback(f"r{i}"))
        wait_until(lambda: loop.health(stall_s=0.2) is not None, timeout=10)
        assert "no engine step has finished" in loop.health(stall_s=0.2)
        assert loop.health(stall_s=60) is None
    finally:
        loop.shutdown(timeout_s=0.1)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_health_reports_a_dead_loop(tiny_checkpoint):
    loop = make_loop(tiny_checkpoint)
    try:
        assert loop.health(stall_s=1) is None

        def die(interrupt=None):
            raise SystemExit("the loop thread ends")

        loop.engine.step = die
        loop.submit("x", "wakes the loop", SamplingParams(max_tokens=2), Collector().callback("x"))
        wait_until(lambda: loop.health(stall_s=60) is not None, timeout=10)
        assert loop.health(stall_s=60) == "the engine loop has died"
    finally:
        loop.shutdown(timeout_s=0.1)


def test_an_interrupted_step_advances_nothing_and_the_output_is_unchanged(tiny_checkpoint):
    """A step abandoned between layers (for a cancel) is computed again by the next one:
    greedy tokens are those of a run never interrupted."""
    config = EngineConfig(model_path=tiny_checkpoint, max_num_seqs=4, num_kv_blocks=64, long_prefill_token_threshold=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["an interrupted prefill of some length " * 3, "and a second request beside it"]

    def run(interrupt_steps: set[int]) -> tuple[list[list[int]], float]:
        engine = LLMEngine(config)
        requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        step, charged = 0, 0.0
        while engine.has_unfinished():
            if step in interrupt_steps:
                layers = []
                computed = [r.num_computed_tokens for r in requests]
                outputs = engine.step(interrupt=lambda: layers.append(1) or len(layers) > 1)
                assert outputs == [] and not engine.stats.step.ran
                assert [r.num_computed_tokens for r in requests] == computed
                assert sum(s for _, s in engine.stats.step.service_by_tenant) == 0  # charged, then refunded
            else:
                engine.step()
            charged += sum(s for _, s in engine.stats.step.service_by_tenant)
            step += 1
        return [r.output_token_ids for r in requests], charged

    interrupted, plain = run({0, 2, 3, 7}), run(set())
    # The same tokens, and each tenant charged once for them (no step's grant paid twice).
    assert interrupted == plain



def test_a_steps_metrics_come_between_its_tokens_and_its_final_outputs(tiny_checkpoint):
    """The observer sees each step once its tokens have gone out and before its final outputs
    do, and a request's end just before its final output: a client that has its final
    response finds its last step on /metrics (the Triton adapter sends and applies in this
    order), and no token waits for the metrics."""
    events: list = []
    config = EngineConfig(model_path=tiny_checkpoint, max_num_seqs=4, num_kv_blocks=64)
    loop: EngineLoop

    class Observer:
        def on_step(self):
            events.append(("step", loop.engine.stats.totals.steps))

        def on_finished(self, output):
            events.append(("finished", output.request_id))

    loop = EngineLoop(lambda: LLMEngine(config), observer=Observer())
    collector = Collector()
    try:
        for rid, max_tokens in (("a", 3), ("b", 5)):
            on_output = collector.callback(rid)

            def record(output, rid=rid, on_output=on_output):
                events.append(("output", rid, output.finished, loop.engine.stats.totals.steps))
                on_output(output)

            loop.submit(rid, f"prompt {rid}", SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             record)
        collector.wait()
    finally:
        loop.shutdown()
    outputs = [i for i, event in enumerate(events) if event[0] == "output"]
    assert len(outputs) == 3 + 5
    for i in outputs:
        _, rid, finished, steps = events[i]
        observed = ([0] + [e[1] for e in events[:i] if e[0] == "step"])[-1]  # steps on /metrics
        # A final output's step is on /metrics before it goes; a token goes before its step is.
        assert observed == (steps if finished else steps - 1), (rid, finished, steps, observed)
        if finished:
            assert events[i - 1] == ("finished", rid)
