"""Scheduler invariants over random workloads, and its policies case by case.

No model: `tests/unit/fakes.py` plays the model runner, checks that every request reads the
right KV at every computed position (through prefix hits, preemption and swap) and
"samples" a deterministic token per request and position, so the exact output of every
request is known in advance.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from backend.config import EngineConfig
from backend.request import FinishReason, RequestStatus
from tests.unit.fakes import EOS, Harness, assert_all_free, fake_token

BS = 8  # the smallest block size EngineConfig allows: more block boundaries per token


def make_config(**overrides) -> EngineConfig:
    values = dict(model_path="unused", block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
                  long_prefill_token_threshold=512, max_preemptions=4)
    values.update(overrides)
    return EngineConfig(**values)


def prompt(seed: int, length: int, prefix: list[int] = ()) -> list[int]:
    """`length` token ids (no EOS among them), starting with as much of `prefix` as fits."""
    body = [3 + (seed * 7919 + i * 104729) % 997 for i in range(max(0, length - len(prefix)))]
    return (list(prefix) + body)[:length]


def expected_output(request_id: str, n: int) -> list[int]:
    return [fake_token(request_id, i) for i in range(n)]


# --------------------------------------------------------------------------------------
# Random workloads
# --------------------------------------------------------------------------------------

SHARED = [prompt(1000, 24), prompt(2000, 13)]

request_spec = st.fixed_dictionaries(
    dict(
        arrival=st.integers(0, 12),
        length=st.integers(1, 70),
        shared=st.sampled_from([None, 0, 1]),
        max_tokens=st.integers(1, 20),
        priority=st.integers(0, 3),
        eos_at=st.one_of(st.none(), st.integers(0, 20)),
        min_tokens=st.sampled_from([0, 0, 0, 3]),
        tenant=st.sampled_from(["default", "a", "b"]),
    )
)

workload = st.fixed_dictionaries(
    dict(
        policy=st.sampled_from(["fcfs", "priority", "static", "fair"]),
        mode=st.sampled_from(["recompute", "swap"]),
        num_blocks=st.integers(4, 30),
        num_host_blocks=st.integers(1, 40),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 80),
        threshold=st.integers(1, 40),
        max_preemptions=st.integers(0, 3),
        prefix_caching=st.booleans(),
        requests=st.lists(request_spec, min_size=1, max_size=14),
    )
)


def run_workload(w: dict) -> Harness:
    config = make_config(
        scheduling_policy=w["policy"], preemption_mode=w["mode"], max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=w["max_num_batched_tokens"], long_prefill_token_threshold=w["threshold"],
        max_preemptions=w["max_preemptions"], enable_prefix_caching=w["prefix_caching"],
    )
    h = Harness(config, w["num_blocks"], w["num_host_blocks"] if w["mode"] == "swap" else 0, max_model_len=90)
    specs = sorted(enumerate(w["requests"]), key=lambda item: item[1]["arrival"])
    pending = list(specs)
    expected: dict[str, tuple[int, FinishReason]] = {}
    step = 0
    while pending or h.scheduler.has_work():
        while pending and pending[0][1]["arrival"] <= step:
            i, spec = pending.pop(0)
            shared = spec["shared"]
            tokens = prompt(i, spec["length"], SHARED[shared] if shared is not None else ())
            rid = f"req{i}"
            request = h.add(rid, tokens, spec["max_tokens"], spec["priority"], spec["eos_at"], spec["min_tokens"],
                            spec.get("tenant", "default"))
            if request is not None:
                eos_at, max_tokens = spec["eos_at"], spec["max_tokens"]
                # EOS cannot be sampled before min_tokens outputs exist.
                if eos_at is not None and eos_at < max_tokens and eos_at >= request.params.min_tokens:
                    expected[rid] = (eos_at + 1, FinishReason.STOP)
                else:
                    expected[rid] = (max_tokens, FinishReason.LENGTH)
        if h.scheduler.has_work():
            record = h.step()
            check_step(h, record)
        step += 1
        assert step < h.step_bound() + 20, "scheduler made no progress (deadlock or livelock)"

    # Every admitted request finished, with exactly the tokens the fake model sampled.
    assert len(h.finished) == len(h.all_requests)
    for request in h.all_requests:
        assert request.status is RequestStatus.FINISHED
        n, reason = expected[request.request_id]
        want = expected_output(request.request_id, n)
        if reason is FinishReason.STOP:
            want[-1] = EOS
        assert request.output_token_ids == want, request.request_id
        assert request.finish_reason is reason
        assert request.num_preemptions <= config.max_preemptions, "a protected request was preempted"
    assert not h.scheduler.requests and not h.scheduler.running and not len(h.scheduler.waiting)
    assert_all_free(h)
    return h


def check_step(h: Harness, record) -> None:
    cfg = h.config
    plan = record.plan
    granted = [n for _, n in plan.scheduled]
    requests = [r for r, _ in plan.scheduled]
    assert sum(granted) <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert len(set(map(id, requests))) == len(requests), "a request scheduled twice in one step"
    assert all(0 < n <= cfg.long_prefill_token_threshold for n in granted), "chunk cap exceeded"
    assert len(record.running_after) <= cfg.max_num_seqs
    assert len(plan.scheduled) <= cfg.max_num_seqs
    # Every step moves something: tokens scheduled, or a request preempted.
    assert plan.scheduled or plan.preempted, "a step with work did nothing"
    for victim in plan.preempted:
        assert victim.num_preemptions <= cfg.max_preemptions, "a protected request was preempted"
        assert victim not in requests
    if cfg.scheduling_policy == "static" and record.admitted:
        assert not record.running_before, "static policy admitted into a non-empty running set"
    if cfg.scheduling_policy not in ("priority", "fair"):
        # Without priorities, nothing is preempted to admit: a step that preempts admits nothing.
        if plan.preempted:
            assert not record.admitted


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workloads_keep_every_invariant(w):
    run_workload(w)


tight_workload = st.fixed_dictionaries(
    dict(
        policy=st.sampled_from(["fcfs", "priority", "static", "fair"]),
        mode=st.sampled_from(["recompute", "swap", "swap"]),
        num_blocks=st.integers(6, 12),
        num_host_blocks=st.integers(1, 40),
        max_num_seqs=st.integers(2, 6),
        max_num_batched_tokens=st.integers(8, 80),
        threshold=st.integers(1, 40),
        max_preemptions=st.integers(1, 3),
        prefix_caching=st.booleans(),
        requests=st.lists(
            st.fixed_dictionaries(dict(
                arrival=st.integers(0, 6), length=st.integers(8, 40), shared=st.sampled_from([None, 0, 1]),
                max_tokens=st.integers(8, 20), priority=st.integers(0, 3),
                eos_at=st.one_of(st.none(), st.integers(0, 20)), min_tokens=st.sampled_from([0, 3]),
                tenant=st.sampled_from(["a", "b"]),
            )),
            min_size=3, max_size=10,
        ),
    )
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_workload)
def test_random_workloads_on_pools_that_force_preemption(w):
    run_workload(w)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static", "fair"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_forces_preemption_and_everything_still_finishes(policy, mode):
    """Each policy x mode under a pool that fits ~2 requests: preemption must happen."""
    w = dict(
        policy=policy, mode=mode, num_blocks=8, num_host_blocks=30, max_num_seqs=5,
        max_num_batched_tokens=64, threshold=16, max_preemptions=2, prefix_caching=True,
        requests=[
            dict(arrival=i % 3, length=10 + 7 * i, shared=(0 if i % 2 else None), max_tokens=12 + i,
                 priority=i % 3, eos_at=None, min_tokens=0, tenant=("a", "b")[i // 3 % 2])
            for i in range(9)
        ],
    )
    h = run_workload(w)
    assert h.num_preemptions > 0
    if mode == "swap":
        assert h.runner.num_swapped_out_blocks > 0 and h.runner.num_swapped_in_blocks > 0


def test_swap_space_too_small_falls_back_to_recompute():
    w = dict(
        policy="fcfs", mode="swap", num_blocks=8, num_host_blocks=1, max_num_seqs=5,
        max_num_batched_tokens=64, threshold=16, max_preemptions=3, prefix_caching=False,
        requests=[dict(arrival=0, length=20 + i, shared=None, max_tokens=20, priority=0, eos_at=None, min_tokens=0)
                  for i in range(5)],
    )
    h = run_workload(w)
    assert h.num_preemptions > 0
    # A victim holding more blocks than the swap space has is recomputed instead.
    assert h.runner.num_swapped_out_blocks <= h.num_preemptions


# --------------------------------------------------------------------------------------
# Targeted behaviour
# --------------------------------------------------------------------------------------


def test_running_requests_are_served_before_waiting_ones():
    h = Harness(make_config(max_num_batched_tokens=10), num_blocks=32)
    a = h.add("a", prompt(1, 5), max_tokens=10)
    h.step()  # a prefilled, now decoding
    b = h.add("b", prompt(2, 30), max_tokens=4)
    record = h.step()
    assert record.plan.scheduled[0] == (a, 1)
    assert record.plan.scheduled[1] == (b, 9), "the waiting request gets what the running one left"
    assert record.plan.num_scheduled_tokens == 10


def test_static_policy_admits_only_into_an_empty_running_set():
    h = Harness(make_config(scheduling_policy="static", max_num_seqs=3), num_blocks=64)
    lengths = [2, 9, 4, 3, 7, 1, 5]
    reqs = [h.add(f"s{i}", prompt(i, 6 + i), max_tokens=n) for i, n in enumerate(lengths)]
    batches = []
    while h.scheduler.has_work():
        record = h.step()
        if record.admitted:
            assert not record.running_before
            batches.append([r.request_id for r in record.admitted])
        else:
            # Freed slots stay empty: the running set only shrinks inside a batch.
            assert set(map(id, record.running_after)) <= set(map(id, record.running_before))
    assert batches == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]
    for r, n in zip(reqs, lengths):
        assert r.output_token_ids == expected_output(r.request_id, n)
    assert_all_free(h)


def test_static_batch_runs_until_its_longest_member_finishes():
    h = Harness(make_config(scheduling_policy="static", max_num_seqs=2), num_blocks=64)
    short = h.add("short", prompt(1, 4), max_tokens=1)
    long = h.add("long", prompt(2, 4), max_tokens=6)
    nxt = h.add("next", prompt(3, 4), max_tokens=1)
    h.run(h.step_bound())
    admitted_at = {r.request_id: i for i, rec in enumerate(h.records) for r in rec.admitted}
    assert admitted_at == {"short": 0, "long": 0, "next": 6}
    # short finished in step 0; its slot stayed empty while long ran its 5 more steps.
    for rec in h.records[1:6]:
        assert rec.running_before == [long]
    assert short.num_output_tokens == 1 and long.num_output_tokens == 6 and nxt.num_output_tokens == 1
    assert_all_free(h)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_admission_order(policy):
    h = Harness(make_config(scheduling_policy=policy, max_num_seqs=1), num_blocks=64)
    priorities = [2, 0, 1, 0, 2, 1]
    for i, p in enumerate(priorities):
        h.add(f"p{i}", prompt(i, 5), max_tokens=2, priority=p)
    order = []
    while h.scheduler.has_work():
        for r in h.step().admitted:
            order.append(r.request_id)
    if policy == "priority":
        # Smaller number first; FCFS within a priority.
        assert order == ["p1", "p3", "p2", "p5", "p0", "p4"]
    else:
        assert order == [f"p{i}" for i in range(6)]


def test_priority_request_preempts_a_less_important_one_for_a_seat():
    h = Harness(make_config(scheduling_policy="priority", max_num_seqs=2), num_blocks=64)
    low_old = h.add("low_old", prompt(1, 5), max_tokens=20, priority=5)
    low_new = h.add("low_new", prompt(2, 5), max_tokens=20, priority=5)
    h.step()
    assert len(h.scheduler.running) == 2
    high = h.add("high", prompt(3, 5), max_tokens=3, priority=0)
    record = h.step()
    assert record.plan.preempted == [low_new], "victim: lowest priority, then latest arrival"
    assert high in record.admitted and high in [r for r, _ in record.plan.scheduled]
    assert low_old in h.scheduler.running
    # An equally important request does not preempt.
    same = h.add("same", prompt(4, 5), max_tokens=3, priority=5)
    record = h.step()
    assert not record.plan.preempted and same not in h.scheduler.running
    h.run(h.step_bound())
    assert_all_free(h)
    assert low_new.output_token_ids == expected_output("low_new", 20)


def test_a_victim_is_not_readmitted_in_the_step_that_preempted_it():
    """Priority preemption for blocks frees more than the newcomer needs; the victim must
    not be re-admitted (from scratch) in the same step: that is thrash, and it burns one of
    its bounded preemptions for nothing."""
    cfg = make_config(scheduling_policy="priority", max_num_seqs=3, long_prefill_token_threshold=8, enable_prefix_caching=False)
    h = Harness(cfg, num_blocks=4)
    low = h.add("low", prompt(1, 20), max_tokens=4, priority=1)
    filler = h.add("filler", prompt(2, 4), max_tokens=10, priority=0)
    while low.num_output_tokens == 0:
        h.step()
    assert h.kv.pool.num_free == 0
    high = h.add("high", prompt(3, 5), max_tokens=2, priority=0)
    record = h.step()
    assert record.plan.preempted == [low]
    assert high in record.admitted
    assert low not in [r for r, _ in record.plan.scheduled], "victim re-admitted in the step that preempted it"
    assert low.status is RequestStatus.WAITING and low.num_preemptions == 1
    h.run(h.step_bound())
    assert low.output_token_ids == expected_output("low", 4)
    assert filler.is_finished
    assert_all_free(h)


def _fill_block_boundaries(policy: str, priorities: list[int], max_preemptions: int = 4):
    """Each request holds exactly one full block and needs a second one at its next decode;
    the pool is exactly full, so that step must preempt."""
    h = Harness(make_config(scheduling_policy=policy, max_preemptions=max_preemptions), num_blocks=len(priorities))
    reqs = [h.add(f"r{i}", prompt(i, BS), max_tokens=4, priority=p) for i, p in enumerate(priorities)]
    record = h.step()
    assert not record.plan.preempted and h.kv.pool.num_free == 0
    return h, reqs


def test_block_pressure_victim_is_lowest_priority_then_latest_arrival():
    h, (a, b, c, d) = _fill_block_boundaries("priority", [0, 1, 1, 0])
    record = h.step()
    # The running set is served most important first: a and d take the blocks c and b give up.
    assert record.plan.preempted == [c, b]
    assert [r for r, _ in record.plan.scheduled] == [a, d]
    assert h.scheduler.waiting.peek() is b, "FCFS within a priority after preemption"
    h.run(h.step_bound())
    assert_all_free(h)


def test_block_pressure_victim_under_fcfs_is_latest_arrival():
    h, (a, b, c, d) = _fill_block_boundaries("fcfs", [3, 0, 0, 3])
    record = h.step()
    assert record.plan.preempted == [d, c]
    assert [r for r, _ in record.plan.scheduled] == [a, b]
    # Preempted requests go back to the front of the queue, in arrival order.
    assert list(h.scheduler.waiting)[:2] == [c, d]
    h.run(h.step_bound())
    for r in (a, b, c, d):
        assert r.output_token_ids == expected_output(r.request_id, 4)
    assert_all_free(h)


def test_protected_requests_are_never_victims():
    h, (a, b, c, d) = _fill_block_boundaries("priority", [0, 1, 1, 0])
    c.num_preemptions = h.config.max_preemptions  # c is protected now
    assert h.scheduler.is_protected(c)
    assert h.scheduler._pick_victim() is b
    b.num_preemptions = h.config.max_preemptions
    d.num_preemptions = h.config.max_preemptions
    assert h.scheduler._pick_victim() is a, "the only unprotected request is the victim, however important"
    a.num_preemptions = h.config.max_preemptions
    assert h.scheduler._pick_victim() is None


@pytest.mark.parametrize("max_preemptions", [2, 10])
def test_bounded_preemptions_protect_a_request_that_keeps_losing(max_preemptions):
    """A long request of the worst priority in a tight pool, with bursts of important
    short ones: it is preempted at most max_preemptions times, then runs to the end."""
    cfg = make_config(scheduling_policy="priority", max_preemptions=max_preemptions, max_num_seqs=3)
    h = Harness(cfg, num_blocks=6)
    loser = h.add("loser", prompt(0, 20), max_tokens=20, priority=9)
    for step in range(80):
        if step % 8 == 0:
            for j in range(2):
                h.add(f"vip{step}_{j}", prompt(step + j + 1, 15), max_tokens=6, priority=0)
        if h.scheduler.has_work():
            h.step()
    h.run(h.step_bound())
    if max_preemptions == 2:
        assert loser.num_preemptions == 2
    else:
        assert 2 < loser.num_preemptions <= max_preemptions  # the bursts alone would preempt it more often
    assert loser.output_token_ids == expected_output("loser", 20)
    assert_all_free(h)


def test_zero_max_preemptions_never_preempts():
    w = dict(
        policy="fcfs", mode="recompute", num_blocks=8, num_host_blocks=0, max_num_seqs=5,
        max_num_batched_tokens=64, threshold=16, max_preemptions=0, prefix_caching=True,
        requests=[dict(arrival=0, length=10 + 5 * i, shared=None, max_tokens=15, priority=0, eos_at=None, min_tokens=0)
                  for i in range(6)],
    )
    h = run_workload(w)
    assert h.num_preemptions == 0


@pytest.mark.parametrize("threshold", [512, 4096])
def test_chunked_prefill_of_a_4k_prompt_does_not_stall_decodes(threshold):
    cfg = make_config(block_size=16, max_num_batched_tokens=2048, long_prefill_token_threshold=threshold, max_num_seqs=8)
    h = Harness(cfg, num_blocks=300, max_model_len=8192)
    decoders = [h.add(f"d{i}", prompt(i, 10), max_tokens=40) for i in range(3)]
    h.step()
    long = h.add("long", prompt(99, 4096), max_tokens=2)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        record = h.step()
        granted = dict((r.request_id, n) for r, n in record.plan.scheduled)
        for d in decoders:
            assert granted.get(d.request_id) == 1, "a running stream stalled during a long prefill"
        assert granted["long"] <= min(threshold, 2048 - len(decoders))
        prefill_steps += 1
    assert prefill_steps >= 4096 // min(threshold, 2048)
    assert long.num_computed_tokens == 4096
    h.run(h.step_bound())
    assert_all_free(h)


def test_prefix_hits_are_recorded_and_shared_blocks_read_correctly():
    h = Harness(make_config(max_num_seqs=4), num_blocks=40)
    system = prompt(7, 3 * BS)
    first = h.add("first", system + prompt(1, 5), max_tokens=3)
    h.run(h.step_bound())
    others = [h.add(f"o{i}", system + prompt(10 + i, 4 + i), max_tokens=5) for i in range(4)]
    h.run(h.step_bound())
    for r in others:
        assert r.num_cached_prompt_tokens == 3 * BS
        assert r.output_token_ids == expected_output(r.request_id, 5)
    assert first.num_cached_prompt_tokens == 0
    assert h.prefix_hit_rate > 0
    assert_all_free(h)


def test_eos_and_min_tokens_and_length_finish_reasons():
    h = Harness(make_config(), num_blocks=40)
    eos = h.add("eos", prompt(1, 5), max_tokens=10, eos_at=3)
    length = h.add("length", prompt(2, 5), max_tokens=4)
    h.run(h.step_bound())
    assert eos.finish_reason is FinishReason.STOP and eos.output_token_ids[-1] == EOS and eos.num_output_tokens == 4
    assert length.finish_reason is FinishReason.LENGTH and length.num_output_tokens == 4
    assert_all_free(h)


def test_abort_frees_blocks_wherever_the_request_is():
    h = Harness(make_config(max_num_seqs=1), num_blocks=40)
    running = h.add("running", prompt(1, 20), max_tokens=10)
    waiting = h.add("waiting", prompt(2, 20), max_tokens=10)
    h.step()
    assert running.block_ids and not waiting.block_ids
    h.scheduler.finish_request(waiting, FinishReason.ABORT)
    h.scheduler.finish_request(running, FinishReason.ABORT)
    assert not h.scheduler.has_work()
    assert running.finish_reason is FinishReason.ABORT
    assert_all_free(h)


def test_check_stop_decides_in_one_order():
    """Stop token (once min_tokens are out) before stop string before length; the stop-string
    matcher never sees a stop token's text."""
    from backend.request import Request, SamplingParams
    from backend.scheduler import check_stop

    def after(outputs: list[int], max_tokens: int = 4, **params) -> Request:
        r = Request(request_id="r", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=max_tokens, **params),
                    max_tokens=max_tokens, arrival_time=0.0, arrival_seq=0, eos_token_ids=frozenset({EOS}))
        for t in outputs:
            r.append_output_token(t)
        return r

    seen = []

    def matcher(found: str | None):
        def match(token_id: int) -> str | None:
            seen.append(token_id)
            return found
        return match

    assert check_stop(after([7, EOS]), EOS, matcher("x")) == (FinishReason.STOP, None) and seen == []
    assert check_stop(after([7, 9], stop_token_ids=[9]), 9, matcher("x")) == (FinishReason.STOP, 9) and seen == []
    # EOS before min_tokens is an ordinary token: its text is taken, then the other rules apply.
    assert check_stop(after([EOS], min_tokens=2), EOS, matcher(None)) is None and seen == [EOS]
    assert check_stop(after([7, EOS], ignore_eos=True), EOS) is None
    assert check_stop(after([7, 8]), 8, matcher("stop")) == (FinishReason.STOP, "stop")
    # A stop string completed by the last allowed token is a stop, not a length.
    assert check_stop(after([7, 8, 9, 10]), 10, matcher("stop")) == (FinishReason.STOP, "stop")
    assert check_stop(after([7, 8, 9, 10]), 10, matcher(None)) == (FinishReason.LENGTH, None)
    assert check_stop(after([7, 8, 9, EOS], min_tokens=4), EOS) == (FinishReason.STOP, None)
