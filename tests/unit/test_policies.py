"""Each scheduling policy through the one interface the scheduler uses (backend/policies.py):
admission order, where a preempted request goes back, victim order and the rules in which
the policies differ. How the scheduler applies them is tests/unit/test_scheduler.py's."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig, SchedulingPolicy
from backend.policies import Policy
from backend.request import Request, SamplingParams

# (arrival order, priority) of five requests, pushed in arrival order.
ARRIVALS = [(0, 2), (1, 0), (2, 1), (3, 0), (4, 2)]


def request(seq: int, priority: int = 0) -> Request:
    return Request(request_id=f"r{seq}", prompt_token_ids=[1], params=SamplingParams(priority=priority),
                   max_tokens=1, arrival_time=0.0, arrival_seq=seq)


def filled(kind: str) -> tuple[Policy, list[Request]]:
    policy = Policy.create(kind)
    requests = [request(seq, priority) for seq, priority in ARRIVALS]
    for r in requests:
        policy.push(r)
    return policy, requests


def seqs(requests) -> list[int]:
    return [r.arrival_seq for r in requests]


def test_every_policy_name_has_its_class_and_parses_from_config():
    for kind in SchedulingPolicy:
        assert Policy.create(kind.value).kind is kind
        assert EngineConfig(model_path="m", scheduling_policy=kind.value).scheduling_policy is kind
        assert EngineConfig.from_parameters({"scheduling_policy": kind.value}, "/m").scheduling_policy is kind
    with pytest.raises(ValueError, match=r"scheduling_policy='lottery', expected one of \('fcfs', 'priority', 'static', 'fair'\)"):
        EngineConfig(model_path="m", scheduling_policy="lottery")


@pytest.mark.parametrize("kind, admission, victims", [
    ("fcfs", [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]),
    ("static", [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]),
    # Smaller number first, FCFS within a priority; victim: least important, then latest.
    ("priority", [1, 3, 2, 0, 4], [4, 0, 2, 3, 1]),
    # One tenant: fairness has nothing to share, so fair orders as priority does.
    ("fair", [1, 3, 2, 0, 4], [4, 0, 2, 3, 1]),
])
def test_admission_and_victim_order(kind, admission, victims):
    policy, requests = filled(kind)
    assert len(policy) == 5 and seqs(policy) == admission
    assert policy.peek() is requests[admission[0]]
    assert seqs(sorted(requests, key=policy.victim_key, reverse=True)) == victims
    assert [policy.pop().arrival_seq for _ in range(5)] == admission
    assert len(policy) == 0


@pytest.mark.parametrize("kind, after", [
    # Victims go back latest first (the scheduler preempts in victim order): FCFS puts
    # each at the front, so they resume in arrival order, before everything else.
    ("fcfs", [1, 3, 2, 4]),
    ("static", [1, 3, 2, 4]),
    # Priority: back where priority and arrival put them.
    ("priority", [1, 3, 2, 4]),
    # Fair: to the front of its tenant's queue at its priority.
    ("fair", [1, 3, 2, 4]),
])
def test_a_preempted_request_goes_back_where_the_policy_says(kind, after):
    policy = Policy.create(kind)
    requests = {seq: request(seq, priority) for seq, priority in ARRIVALS}
    for seq in (2, 4):
        policy.push(requests[seq])
    for seq in (3, 1):  # preempted: the later arrival first
        policy.push_front(requests[seq])
    assert seqs(policy) == after


def test_priority_puts_a_preempted_request_behind_more_important_waiting_ones():
    policy = Policy.create("priority")
    waiting, victim = request(5, priority=0), request(1, priority=1)
    policy.push(waiting)
    policy.push_front(victim)
    assert seqs(policy) == [5, 1]
    fcfs = Policy.create("fcfs")
    fcfs.push(waiting)
    fcfs.push_front(victim)
    assert seqs(fcfs) == [1, 5]


@pytest.mark.parametrize("kind", ["fcfs", "static", "priority", "fair"])
def test_remove_keeps_the_others_in_order(kind):
    policy, requests = filled(kind)
    order = seqs(policy)
    policy.remove(requests[2])
    assert seqs(policy) == [s for s in order if s != 2] and len(policy) == 4


def test_the_rules_in_which_policies_differ():
    fcfs, static, priority = (Policy.create(kind) for kind in ("fcfs", "static", "priority"))
    # Static admits only into an empty running set, and fills every seat whatever the budget.
    assert fcfs.may_admit(True) and fcfs.may_admit(False) and priority.may_admit(True)
    assert not static.may_admit(True) and static.may_admit(False)
    assert static.admits_beyond_budget and not fcfs.admits_beyond_budget and not priority.admits_beyond_budget
    # Only priority lets a waiting request push out a running one, and only a less important one.
    assert priority.preempts_for_waiting and not fcfs.preempts_for_waiting and not static.preempts_for_waiting
    assert priority.outranks(request(9, priority=0), request(1, priority=1))
    assert not priority.outranks(request(9, priority=1), request(1, priority=1))
    assert not priority.outranks(request(9, priority=2), request(1, priority=1))
    # The running set is served most important first under priority, as it stands otherwise.
    running = [request(seq, priority) for seq, priority in ARRIVALS]
    for policy in (fcfs, static):
        served = list(running)
        policy.order_running(served)
        assert served == running
    priority.order_running(running)
    assert seqs(running) == [1, 3, 2, 0, 4]


@pytest.mark.parametrize("kind", [kind.value for kind in SchedulingPolicy])
def test_a_preempted_groups_sequences_wait_together(kind):
    """A parallel-sampling group's sequences share priority and arrival: every queue takes them
    all back (the priority heap once compared the Requests themselves) and admits them in order."""
    policy = Policy.create(kind)
    group = [request(7, priority=1) for _ in range(4)]
    for i, r in enumerate(group):
        r.seq_index = i
    for r in reversed(group):
        policy.push_front(r)
    assert len(policy) == 4 and set(policy) == set(group)
    assert [policy.pop().seq_index for _ in range(4)] == [0, 1, 2, 3]
