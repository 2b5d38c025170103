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
  (`preempts_for_waiting`, `outranks`).

A new policy is one new subclass with `kind` set to a new `SchedulingPolicy` member.
"""

from __future__ import annotations

import collections
import heapq
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator

from backend.config import SchedulingPolicy
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
    def create(kind: SchedulingPolicy | str) -> Policy:
        return Policy._classes[SchedulingPolicy(kind)]()

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

    def victim_key(self, request: Request) -> tuple[int, int]:
        """Preemption order: the running request with the largest key goes first."""
        return (0, request.arrival_seq)

    def outranks(self, waiting: Request, victim: Request) -> bool:
        """Whether `waiting` may preempt `victim` (only asked when `preempts_for_waiting`)."""
        return False


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
        self._heap: list[tuple[int, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[2] for entry in sorted(self._heap)])

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request))

    def push_front(self, request: Request) -> None:
        self.push(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.victim_key)

    def victim_key(self, request: Request) -> tuple[int, int]:
        return (request.priority, request.arrival_seq)

    def outranks(self, waiting: Request, victim: Request) -> bool:
        return victim.priority > waiting.priority


assert set(Policy._classes) == set(SchedulingPolicy), "every SchedulingPolicy member needs its policy class"
