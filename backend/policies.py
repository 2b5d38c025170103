"""Scheduling policies: one class per `SchedulingPolicy`, each the waiting queue in its own
order plus the rules in which policies differ. The scheduler (backend/scheduler.py) owns
everything they share: token budget, seats, chunked prefill, block allocation, preemption
and its bound.

A policy decides
- the order in which waiting requests are admitted (the queue itself);
- whether a waiting request may be admitted this step at all (`may_admit`), and whether
  admission stops when the token budget is spent (`admits_beyond_budget`);
- the order in which the running set is served (`order_running`);
- which running request is preempted first (`victim_key`: the largest key goes first);
- whether a waiting request may preempt a running one for a seat or for blocks
  (`preempts_for_waiting`, `outranks`);
- what it does with the service each tenant receives (`charge`: only `fair` uses it).

A new policy is one new subclass with `kind` set to a new `SchedulingPolicy` member.
"""

from __future__ import annotations

import collections
import heapq
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator, Mapping

from backend.config import EngineConfig, SchedulingPolicy
from backend.request import Request


class Policy(ABC):
    """The waiting queue of one policy and its rules; the rules' defaults are FCFS's.

    The scheduler puts a preempted request back with `push_front`; where it lands is the
    policy's to say (FCFS: the front; priority: its place by priority and arrival).
    """

    kind: ClassVar[SchedulingPolicy]
    _classes: ClassVar[dict[SchedulingPolicy, type[Policy]]] = {}
    admits_beyond_budget: ClassVar[bool] = False
    preempts_for_waiting: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            assert cls.kind not in Policy._classes, f"two policy classes for {cls.kind}"
            Policy._classes[cls.kind] = cls

    @staticmethod
    def create(kind: SchedulingPolicy | str, config: EngineConfig | None = None) -> Policy:
        """The policy `kind`, with its settings from `config` (the defaults' without one)."""
        return Policy._classes[SchedulingPolicy(kind)].from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig | None) -> Policy:
        return cls()

    # ---- the queue ---------------------------------------------------------------------

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in admission order."""

    @abstractmethod
    def push(self, request: Request) -> None: ...

    @abstractmethod
    def push_front(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None:
        """O(n); only aborts use it."""

    # ---- the rules ---------------------------------------------------------------------

    def may_admit(self, running_at_start: bool) -> bool:
        """Whether waiting requests may join this step (`running_at_start`: the running set
        was not empty when the step began)."""
        return True

    def order_running(self, running: list[Request]) -> None:
        """Reorder the running set in place into the order it is served this step."""

    def victim_key(self, request: Request) -> tuple:
        """Preemption order: the running request with the largest key goes first."""
        return (0, request.arrival_seq)

    def outranks(self, waiting: Request, victim: Request) -> bool:
        """Whether `waiting` may preempt `victim` (only asked when `preempts_for_waiting`)."""
        return False

    def charge(self, tenant: str, service: float) -> None:
        """`tenant` received `service` (token-cost weighted; negative: a grant taken back)."""


class FCFSPolicy(Policy):
    """First come, first served: a deque, O(1) at both ends. Victim: the latest arrival."""

    kind = SchedulingPolicy.FCFS

    def __init__(self) -> None:
        self._deque: collections.deque[Request] = collections.deque()

    def __len__(self) -> int:
        return len(self._deque)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._deque)

    def push(self, request: Request) -> None:
        self._deque.append(request)

    def push_front(self, request: Request) -> None:
        self._deque.appendleft(request)

    def peek(self) -> Request:
        return self._deque[0]

    def pop(self) -> Request:
        return self._deque.popleft()

    def remove(self, request: Request) -> None:
        self._deque.remove(request)


class StaticPolicy(FCFSPolicy):
    """Static batching, the baseline continuous batching is measured against: FCFS order,
    but a batch is admitted only into an empty running set (as many as there are seats,
    whatever the token budget) and runs until its longest member finishes."""

    kind = SchedulingPolicy.STATIC
    admits_beyond_budget = True

    def may_admit(self, running_at_start: bool) -> bool:
        return not running_at_start


class PriorityPolicy(Policy):
    """Smaller `priority` first, FCFS within a priority: a heap on (priority, arrival
    order), O(log n) push and pop, which also puts a preempted request back where it was.
    The running set is served most important first; victim: the least important, then the
    latest arrival. A waiting request preempts a strictly less important running one."""

    kind = SchedulingPolicy.PRIORITY
    preempts_for_waiting = True

    def __init__(self) -> None:
        # A group's sequences share priority and arrival: seq_index keeps their entries apart.
        self._heap: list[tuple[int, int, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[3] for entry in sorted(self._heap)])

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request.seq_index, request))

    def push_front(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.victim_key)

    def victim_key(self, request: Request) -> tuple[int, int]:
        return (request.priority, request.arrival_seq)

    def outranks(self, waiting: Request, victim: Request) -> bool:
        return victim.priority > waiting.priority


class FairPolicy(Policy):
    """Fair share between tenants inside each priority level: the Virtual Token Counter
    (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

    Each tenant has a counter: the service it received (input tokens computed times
    `tenant_input_token_cost`, output tokens times `tenant_output_token_cost`, charged by
    the scheduler as it grants them, so prefix-cache hits and swapped-in blocks cost
    nothing) divided by its weight (`tenant_weights`, default 1). Admission goes to the
    most important priority first; within it, to the waiting tenant with the lowest
    counter, FIFO within a tenant (a preempted request goes back to its tenant's front).
    Admission never idles while something waits that fits (work-conserving).

    The floor is the lowest counter among tenants with waiting requests, kept as it rises
    and never lowered. A tenant's counter never reads below the floor: a tenant that
    returns after waiting for nothing is lifted to the lowest active counter, so idling
    earns no credit, and a new tenant starts there too. Memory stays bounded: of the
    tenants waiting for nothing, only the `MAX_IDLE_COUNTERS` furthest above the floor keep
    their counters (a forgotten one reads as the floor, which is all it would be lifted to
    were it close to it).

    Preemption: the victim is the least important running request, then the one of the
    tenant furthest above its fair share (the highest counter), then the latest arrival.
    The request that needs blocks is itself a candidate, so a tenant is never preempted to
    make room for a tenant with a higher counter than its own. Priority still comes first,
    and the scheduler's bound on preemptions (`max_preemptions`, then protected) holds as
    under every policy, so no request starves. A waiting request preempts a running one
    only for a strictly better priority, never for fairness alone (that would thrash).

    Costs: peek and pop are O(priorities + tenants waiting at the best priority); a tenant
    that starts or stops waiting adds O(tenants waiting), to move the floor.
    """

    kind = SchedulingPolicy.FAIR
    preempts_for_waiting = True
    # Counters kept for tenants that wait for nothing: the rest are forgotten (read as the floor).
    MAX_IDLE_COUNTERS = 1024

    def __init__(self, tenant_weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(tenant_weights or {})
        # priority -> tenant -> that tenant's waiting requests at that priority, FIFO.
        self._queues: dict[int, dict[str, collections.deque[Request]]] = {}
        self._num_waiting_by_tenant: collections.Counter[str] = collections.Counter()
        self._len = 0
        self._counters: dict[str, float] = {}
        self.floor = 0.0

    @classmethod
    def from_config(cls, config: EngineConfig | None) -> Policy:
        if config is None:
            return cls()
        return cls(config.tenant_weights)

    def counter(self, tenant: str) -> float:
        """The tenant's weighted service, as admission and preemption read it."""
        return max(self._counters.get(tenant, self.floor), self.floor)

    def charge(self, tenant: str, service: float) -> None:
        self._counters[tenant] = self.counter(tenant) + service / self.weights.get(tenant, 1.0)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Admission order if no service were charged meanwhile: by priority, then by each
        tenant's counter, FIFO within a tenant."""
        entries = []
        for priority, tenants in self._queues.items():
            for tenant, queue in tenants.items():
                entries += [(priority, self.counter(tenant), tenant, i, r) for i, r in enumerate(queue)]
        return iter([entry[-1] for entry in sorted(entries, key=lambda e: e[:4])])

    def _add(self, request: Request, front: bool) -> None:
        tenant = request.tenant
        if self._num_waiting_by_tenant[tenant] == 0:
            self._raise_floor()
        queue = self._queues.setdefault(request.priority, {}).setdefault(tenant, collections.deque())
        queue.appendleft(request) if front else queue.append(request)
        self._num_waiting_by_tenant[tenant] += 1
        self._len += 1

    def push(self, request: Request) -> None:
        self._add(request, front=False)

    def push_front(self, request: Request) -> None:
        self._add(request, front=True)

    def _best(self) -> tuple[int, str]:
        priority = min(self._queues)
        tenants = self._queues[priority]
        tenant = min(tenants, key=lambda t: (self.counter(t), tenants[t][0].arrival_seq))
        return priority, tenant

    def peek(self) -> Request:
        priority, tenant = self._best()
        return self._queues[priority][tenant][0]

    def pop(self) -> Request:
        priority, tenant = self._best()
        request = self._queues[priority][tenant].popleft()
        self._forget(request, priority)
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.priority][request.tenant].remove(request)
        self._forget(request, request.priority)

    def _forget(self, request: Request, priority: int) -> None:
        tenants = self._queues[priority]
        if not tenants[request.tenant]:
            del tenants[request.tenant]
            if not tenants:
                del self._queues[priority]
        self._len -= 1
        self._num_waiting_by_tenant[request.tenant] -= 1
        if self._num_waiting_by_tenant[request.tenant] == 0:
            del self._num_waiting_by_tenant[request.tenant]
            self._raise_floor()

    def _raise_floor(self) -> None:
        """Raise the floor to the lowest waiting counter and drop what the floor now implies.
        Called when a tenant starts or stops waiting: O(tenants waiting)."""
        waiting = self._num_waiting_by_tenant
        if waiting:
            self.floor = max(self.floor, min(self._counters.get(t, self.floor) for t in waiting))
        if len(self._counters) > len(waiting) + 2 * self.MAX_IDLE_COUNTERS:
            # Amortised O(1): the idle tenants closest to the floor lose the least when forgotten.
            idle = sorted((c, t) for t, c in self._counters.items() if t not in waiting and c > self.floor)
            keep = {t for _, t in idle[-self.MAX_IDLE_COUNTERS:]} | set(waiting)
            self._counters = {t: c for t, c in self._counters.items() if t in keep}

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self._order_key)

    def _order_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, self.counter(request.tenant), request.arrival_seq)

    def victim_key(self, request: Request) -> tuple[int, float, int]:
        return self._order_key(request)

    def outranks(self, waiting: Request, victim: Request) -> bool:
        return victim.priority > waiting.priority


assert set(Policy._classes) == set(SchedulingPolicy), "every SchedulingPolicy member needs its policy class"
