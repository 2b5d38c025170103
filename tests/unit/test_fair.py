"""The `fair` policy (VTC) through the real Scheduler and KV manager, with the fake model
runner (tests/unit/fakes.py): service shares between backlogged tenants, weights, the lift
of a returning tenant, victims, and the preemption bound; and the `tenant` parameter.

Service is what the scheduler charges per step (`SchedulerOutput.service_by_tenant`), the
same numbers the per-tenant metric counts; a tenant's weighted service is its service over
its weight.
"""

from __future__ import annotations

import random
import re

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from backend.config import EngineConfig
from backend.policies import FairPolicy, Policy
from backend.request import Request, RequestError, SamplingParams
from backend.validation import parse_sampling_params
from tests.unit.fakes import Harness, assert_all_free

BS = 8


def fair_config(**overrides) -> EngineConfig:
    values = dict(model_path="unused", block_size=BS, scheduling_policy="fair", max_num_seqs=4,
                  max_num_batched_tokens=64, long_prefill_token_threshold=32)
    values.update(overrides)
    return EngineConfig(**values)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 997) for _ in range(n)]


class Backlog:
    """Keeps every tenant's queue at `depth` waiting requests of random sizes, so that each
    stays backlogged for the whole run; counts each tenant's service per step."""

    def __init__(self, h: Harness, tenants: list[str], rng: random.Random, depth: int, max_prompt: int,
                 max_output: int):
        self.h, self.tenants, self.rng, self.depth = h, tenants, rng, depth
        self.max_prompt, self.max_output = max_prompt, max_output
        self.service = {t: 0.0 for t in tenants}
        self.largest_cost = 0.0
        self._n = 0

    def refill(self) -> None:
        waiting = {t: 0 for t in self.tenants}
        for r in self.h.scheduler.waiting:
            waiting[r.tenant] += 1
        cfg = self.h.config
        for tenant in self.tenants:
            for _ in range(self.depth - waiting[tenant]):
                n_in, n_out = self.rng.randint(1, self.max_prompt), self.rng.randint(1, self.max_output)
                self._n += 1
                assert self.h.add(f"{tenant}-{self._n}", tokens(self.rng, n_in), n_out, tenant=tenant) is not None
                cost = (cfg.tenant_input_token_cost * n_in + cfg.tenant_output_token_cost * n_out)
                self.largest_cost = max(self.largest_cost, cost / cfg.tenant_weights.get(tenant, 1.0))

    def step(self) -> None:
        self.refill()
        record = self.h.step()
        for tenant, service in record.plan.service_by_tenant.items():
            self.service[tenant] += service

    def weighted(self, tenant: str) -> float:
        return self.service[tenant] / self.h.config.tenant_weights.get(tenant, 1.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    num_tenants=st.integers(2, 4),
    weights=st.lists(st.sampled_from([1.0, 1.0, 2.0, 3.0, 0.5]), min_size=4, max_size=4),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 128),
    threshold=st.integers(4, 64),
    max_prompt=st.integers(1, 48),
    max_output=st.integers(1, 32),
    costs=st.sampled_from([(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)]),
    num_blocks=st.integers(20, 80),
)
def test_backlogged_tenants_stay_within_the_vtc_bound(seed, num_tenants, weights, max_num_seqs, budget, threshold,
                                                      max_prompt, max_output, costs, num_blocks):
    """At every step, the weighted service of any two continuously backlogged tenants differs
    by at most 2x the largest request's (weighted) cost plus one step's (weighted) budget."""
    tenants = [f"t{i}" for i in range(num_tenants)]
    config = fair_config(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
        tenant_weights=dict(zip(tenants, weights)), tenant_input_token_cost=costs[0], tenant_output_token_cost=costs[1],
    )
    h = Harness(config, num_blocks, max_model_len=128)
    # Deeper than the seats, so that no tenant's queue empties within a step (VTC's backlogged).
    backlog = Backlog(h, tenants, random.Random(seed), depth=max_num_seqs + 1, max_prompt=max_prompt,
                      max_output=max_output)
    min_weight = min(config.tenant_weights.values())
    step_budget = (budget * max(costs) + max_num_seqs * costs[1]) / min_weight
    for _ in range(100):
        backlog.step()
        served = [backlog.weighted(t) for t in tenants]
        bound = 2 * backlog.largest_cost + step_budget
        assert max(served) - min(served) <= bound, (served, bound)


def test_weights_two_to_one_converge_within_five_percent():
    config = fair_config(tenant_weights={"gold": 2.0, "bronze": 1.0}, max_num_seqs=8, num_kv_blocks=0)
    h = Harness(config, 200, max_model_len=256)
    backlog = Backlog(h, ["gold", "bronze"], random.Random(7), depth=9, max_prompt=40, max_output=24)
    for _ in range(3000):
        backlog.step()
    ratio = backlog.service["gold"] / backlog.service["bronze"]
    assert abs(ratio - 2.0) <= 0.05 * 2.0, ratio


def test_fcfs_gives_the_flooding_tenant_everything_and_fair_does_not():
    """The comparison that says the policy matters: tenant A floods first, B arrives after."""
    shares = {}
    for policy in ("fcfs", "fair"):
        h = Harness(fair_config(scheduling_policy=policy, max_num_seqs=4), 200, max_model_len=256)
        rng = random.Random(3)
        for i in range(40):
            h.add(f"a{i}", tokens(rng, 16), 16, tenant="a")
        for i in range(10):
            h.add(f"b{i}", tokens(rng, 16), 16, tenant="b")
        service = {"a": 0.0, "b": 0.0}
        for _ in range(60):
            for tenant, value in h.step().plan.service_by_tenant.items():
                service[tenant] += value
        shares[policy] = service["b"] / (service["a"] + service["b"])
    assert shares["fcfs"] < 0.1
    assert 0.4 <= shares["fair"] <= 0.6, shares


def test_prefix_cache_hits_are_not_charged():
    h = Harness(fair_config(), 64, max_model_len=256)
    prompt = tokens(random.Random(1), 40)
    h.add("first", prompt, 1, tenant="a")
    first = sum(r.plan.service_by_tenant.get("a", 0.0) for r in [h.step() for _ in range(3)])
    h.add("again", prompt, 1, tenant="b")
    again = sum(r.plan.service_by_tenant.get("b", 0.0) for r in [h.step() for _ in range(3)])
    # 40 prompt tokens and one output; the second finds the first 32 (4 full blocks) cached.
    assert first == 40 * 1.0 + 2.0
    assert again == (40 - 32) * 1.0 + 2.0


def fair_request(seq: int, tenant: str, priority: int = 0) -> Request:
    return Request(request_id=f"r{seq}", prompt_token_ids=[1], params=SamplingParams(priority=priority, tenant=tenant),
                   max_tokens=1, arrival_time=0.0, arrival_seq=seq)


def test_admission_goes_to_the_lowest_counter_within_a_priority():
    policy = Policy.create("fair")
    a0, a1, b0, c0 = fair_request(0, "a"), fair_request(1, "a"), fair_request(2, "b"), fair_request(3, "c", priority=-1)
    for r in (a0, a1, b0):
        policy.push(r)
    policy.charge("a", 10.0)
    assert policy.peek() is b0
    policy.push(c0)
    assert policy.pop() is c0, "priority comes first"
    assert [policy.pop() for _ in range(3)] == [b0, a0, a1]


def test_a_returning_tenant_is_lifted_to_the_lowest_active_counter():
    policy = FairPolicy()
    a = [fair_request(i, "a") for i in range(3)]
    for r in a:
        policy.push(r)
    policy.pop()
    policy.charge("a", 500.0)
    # "b" was idle all along and "c" is new: neither gets credit for the time it was away.
    policy.charge("b", 3.0)
    policy.pop()  # "b" is not waiting; the floor stays where "a" keeps it
    policy.push(fair_request(10, "b"))
    policy.push(fair_request(11, "c"))
    assert policy.counter("b") == policy.counter("c") == 500.0
    assert policy.counter("a") == 500.0


def test_counters_stay_bounded_whatever_the_number_of_tenants():
    policy = FairPolicy()
    n = 5 * FairPolicy.MAX_IDLE_COUNTERS
    for i in range(n):
        r = fair_request(i, f"t{i}")
        policy.push(r)
        policy.pop()
        policy.charge(r.tenant, float(i))
    assert len(policy._counters) <= 2 * FairPolicy.MAX_IDLE_COUNTERS + 1
    # The heaviest users are the ones remembered: coming back, they are not lifted for free.
    assert policy.counter(f"t{n - 1}") == n - 1


def test_victim_is_the_tenant_furthest_above_its_share_after_priority():
    policy = FairPolicy({"big": 4.0})
    ahead, behind, big, important = (fair_request(0, "ahead"), fair_request(1, "behind"), fair_request(2, "big"),
                                     fair_request(3, "ahead", priority=-1))
    policy.charge("ahead", 100.0)
    policy.charge("behind", 10.0)
    policy.charge("big", 200.0)  # weight 4: 50 in weighted service, below "ahead"
    running = [important, behind, big, ahead]
    assert max(running, key=policy.victim_key) is ahead
    running.remove(ahead)
    assert max(running, key=policy.victim_key) is big
    policy.order_running(running)
    assert running == [important, behind, big]


def test_a_long_job_among_a_flood_is_never_starved_under_fair():
    """A small pool and a flood of short requests from other tenants: the long job is
    preempted at most max_preemptions times, then protected, and finishes."""
    config = fair_config(max_num_seqs=6, max_preemptions=2, max_num_batched_tokens=48)
    h = Harness(config, 24, max_model_len=256)
    rng = random.Random(5)
    long_job = h.add("long", tokens(rng, 40), 120, tenant="novelist")
    for i in range(60):
        h.add(f"chat{i}", tokens(rng, rng.randint(4, 24)), rng.randint(4, 16), tenant=f"chatter{i % 3}")
    h.run(h.step_bound())
    assert long_job in h.finished and long_job.num_output_tokens == 120
    assert h.num_preemptions > 0
    assert long_job.num_preemptions <= config.max_preemptions
    assert_all_free(h)


@pytest.mark.parametrize("value", ["a b", "", "x" * 65, 7, "tenant\n", "é"])
def test_a_bad_tenant_is_refused_naming_the_parameter(value):
    message = "tenant: Value error, must be a string of 1 to 64 characters among A-Z a-z 0-9 _ . : @ -"
    with pytest.raises(RequestError, match=re.escape(message)) as info:
        parse_sampling_params({"tenant": value})
    assert info.value.code == RequestError.INVALID_ARG and info.value.param == "tenant"


def test_tenant_defaults_and_is_accepted_under_every_policy():
    assert SamplingParams().tenant == "default"
    assert parse_sampling_params({"tenant": "team-a@example.com"}).tenant == "team-a@example.com"
    for policy in ("fcfs", "priority", "static", "fair"):
        h = Harness(fair_config(scheduling_policy=policy), 32)
        h.add("x", [5, 6, 7], 2, tenant="team-a")
        h.run(100)
        assert h.finished[0].tenant == "team-a"


@pytest.mark.parametrize("params, message", [
    ({"tenant_weights": "[1, 2]"}, "tenant_weights='\\[1, 2\\]' is not a valid dict"),
    ({"tenant_weights": "{nope"}, "tenant_weights='{nope' is not a valid dict"),
    ({"tenant_weights": '{"a": 0}'}, "tenant_weights: weight of 'a' is 0, must be a number in \\(0, 1e6\\]"),
    ({"tenant_weights": '{"a": "x"}'}, "tenant_weights: weight of 'a' is 'x'"),
    ({"tenant_weights": '{"a b": 1}'}, "tenant_weights: tenant 'a b' must be a string of 1 to 64 characters"),
    ({"tenant_input_token_cost": "0"}, "tenant_input_token_cost=0.0 must be in \\(0, 1e6\\]"),
    ({"tenant_output_token_cost": "-2"}, "tenant_output_token_cost=-2.0 must be in \\(0, 1e6\\]"),
])
def test_fair_parameters_are_validated_naming_the_parameter(params, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_parameters(params, "/m")


def test_fair_parameters_parse_from_config_pbtxt():
    config = EngineConfig.from_parameters({"scheduling_policy": "fair", "tenant_weights": '{"gold": 2, "free": 0.5}',
                                           "tenant_output_token_cost": "3"}, "/m")
    policy = Policy.create(config.scheduling_policy, config)
    assert isinstance(policy, FairPolicy)
    assert policy.weights == {"gold": 2, "free": 0.5} and config.tenant_output_token_cost == 3.0


@pytest.mark.parametrize("policy, victim_tenant", [("fcfs", "light"), ("fair", "hog")])
def test_blocks_run_out_and_the_victim_is_the_tenant_furthest_above_its_share(policy, victim_tenant):
    """Two requests of "hog" arrive before one of "light"; the pool runs out as they decode.
    fcfs preempts the latest arrival (light's); fair preempts from hog, which has had twice
    the service."""
    h = Harness(fair_config(scheduling_policy=policy, max_num_seqs=4), 8, max_model_len=256)
    rng = random.Random(2)
    for i in range(2):
        h.add(f"hog{i}", tokens(rng, 8), 40, tenant="hog")
    h.add("light0", tokens(rng, 8), 40, tenant="light")
    while not h.num_preemptions:
        h.step()
    first = next(r for r in h.records if r.plan.preempted).plan.preempted[0]
    assert first.tenant == victim_tenant
    h.run(h.step_bound())
    assert len(h.finished) == 3
    assert_all_free(h)
