"""A request's life in the engine, for the client that asked (`return_trace`).

The trace answers "why was my TTFT what it was" from the engine's side: how long the request
waited and behind how many others, how its prompt was split into prefill chunks and what
batch each chunk shared, how much of the prompt the prefix cache already held, and every
preemption, with its mode and reason. Times are milliseconds since the request arrived, and
a step's work (a prefill chunk, the first token) is timed when its step finished; steps are
the engine's iteration numbers.

Decode steps are many and alike, so they are one summary (count, and the spread of the batch
they shared) rather than an event each. Events stop at `MAX_EVENTS`; what came after is
counted by kind in `dropped`, and the final `finished` event always closes the trace.

Only traced requests pay for this: the engine records into a request's `trace` only when
the request has one, and calls `trace_plan` and `trace_step` (one pass over the step's
batch each) only while some unfinished request has one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend.request import Request
    from backend.scheduler import SchedulerOutput

MAX_EVENTS = 256


@dataclass
class _Spread:
    """min / mean / max of a value seen once per decode step."""

    count: int = 0
    total: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)

    def summary(self, digits: int = 2) -> dict[str, float] | None:
        if not self.count:
            return None
        return {"min": round(self.low, digits), "mean": round(self.total / self.count, digits),
                "max": round(self.high, digits)}


@dataclass(eq=False)
class RequestTrace:
    arrival_time: float  # time.monotonic() of the request's arrival
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    decode_steps: int = 0
    first_decode_step: int | None = None
    last_decode_step: int | None = None
    decode_batch_requests: _Spread = field(default_factory=_Spread)
    decode_batch_tokens: _Spread = field(default_factory=_Spread)
    decode_step_ms: _Spread = field(default_factory=_Spread)
    scheduled_before: bool = False
    first_token_seen: bool = False
    returns: int = 0  # readmissions after preemption recorded so far
    # Speculative decoding: draft tokens verified for this request, and of those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def _ms(self, now: float | None = None) -> float:
        return round(((now if now is not None else time.monotonic()) - self.arrival_time) * 1000.0, 3)

    def _add(self, event: str, step: int, now: float | None = None, **details: Any) -> None:
        # One slot stays free for `finished`, which always closes the trace.
        if len(self.events) >= MAX_EVENTS - (0 if event == "finished" else 1):
            self.dropped[event] = self.dropped.get(event, 0) + 1
            return
        self.events.append({"event": event, "step": step, "t_ms": self._ms(now), **details})

    def queued(self, step: int, *, running: int, waiting_ahead: int) -> None:
        self._add("queued", step, running=running, waiting_ahead=waiting_ahead)

    def scheduled(self, step: int, now: float, *, tokens: int, prefill: bool, prompt_done: int, prompt_tokens: int,
                  batch_requests: int, batch_tokens: int, step_ms: float) -> None:
        """One step that computed `tokens` of this request, in a batch of `batch_requests`
        requests and `batch_tokens` tokens that took `step_ms` to run."""
        if prefill:
            self._add("prefill_chunk", step, now, tokens=tokens, prompt_tokens_done=prompt_done,
                      prompt_tokens=prompt_tokens, batch_requests=batch_requests, batch_tokens=batch_tokens,
                      step_ms=round(step_ms, 3))
            return
        self.decode_steps += 1
        if self.first_decode_step is None:
            self.first_decode_step = step
        self.last_decode_step = step
        self.decode_batch_requests.add(batch_requests)
        self.decode_batch_tokens.add(batch_tokens)
        self.decode_step_ms.add(step_ms)

    def verified(self, *, drafts: int, accepted: int) -> None:
        self.draft_tokens += drafts
        self.accepted_draft_tokens += accepted

    def first_scheduled(self, step: int, now: float, *, waiting_steps: int) -> None:
        self.scheduled_before = True
        self._add("first_scheduled", step, now, waiting_steps=waiting_steps)

    def prefix_cache_hit(self, step: int, *, blocks: int, tokens: int) -> None:
        self._add("prefix_cache_hit", step, blocks=blocks, tokens=tokens)

    def first_token(self, step: int, now: float) -> None:
        self._add("first_token", step, now)

    def preempted(self, step: int, *, mode: str, reason: str, computed_tokens_lost: int) -> None:
        self._add("preempted", step, mode=mode, reason=reason, computed_tokens_lost=computed_tokens_lost)

    def readmitted(self, step: int, *, swapped_in: bool) -> None:
        self._add("swapped_in" if swapped_in else "readmitted", step)

    def finished(self, step: int, *, reason: str, output_tokens: int) -> None:
        self._add("finished", step, reason=reason, output_tokens=output_tokens)

    def to_json(self) -> dict[str, Any]:
        decode = None
        if self.decode_steps:
            decode = {
                "steps": self.decode_steps, "first_step": self.first_decode_step, "last_step": self.last_decode_step,
                "batch_requests": self.decode_batch_requests.summary(),
                "batch_tokens": self.decode_batch_tokens.summary(),
                "step_ms": self.decode_step_ms.summary(3),
            }
            if self.draft_tokens:
                decode.update(draft_tokens=self.draft_tokens, accepted_draft_tokens=self.accepted_draft_tokens)
        return {"events": self.events, "decode": decode, "dropped": self.dropped or None,
                "max_events": MAX_EVENTS}


def trace_plan(plan: SchedulerOutput, step: int, block_size: int) -> None:
    """What step `step`'s plan did to traced requests before it ran: preemptions and returns."""
    for victim, (cause, computed) in zip(plan.preempted, plan.preemption_causes):
        if victim.trace is not None:
            mode = "swap" if victim.swapped_block_ids else "recompute"
            victim.trace.preempted(step, mode=mode, reason=cause,
                                   computed_tokens_lost=0 if mode == "swap" else computed)
    for request, _ in plan.scheduled:
        trace = request.trace
        if trace is None:
            continue
        if not trace.scheduled_before:
            queued_at = trace.events[0]["step"] if trace.events else step
            trace.first_scheduled(step, request.first_scheduled_time, waiting_steps=step - queued_at)
            if request.num_cached_prompt_tokens:
                trace.prefix_cache_hit(step, blocks=request.num_cached_prompt_tokens // block_size,
                                       tokens=request.num_cached_prompt_tokens)
        if request.num_preemptions > trace.returns:
            trace.returns += 1
            trace.readmitted(step, swapped_in=request in plan.swapped_in)


def trace_step(plan: SchedulerOutput, step: int, step_s: float, now: float, sampled: list[Request]) -> None:
    """What step `step` computed for traced requests, in the batch it shared: run once the
    step's tokens are computed, before its samples join their requests (`sampled`)."""
    sampled_now = set(sampled)
    batch_requests, batch_tokens = len(plan.scheduled), plan.num_scheduled_tokens
    for request, num_new in plan.scheduled:
        trace = request.trace
        if trace is None or request.is_finished:
            continue
        # A speculating request (drafts after its last token) computed one token of its own.
        computed_before = request.num_computed_tokens - (1 if request.spec_token_ids else num_new)
        trace.scheduled(step, now, tokens=num_new, prefill=computed_before < request.num_prompt_tokens,
                        prompt_done=min(request.num_computed_tokens, request.num_prompt_tokens),
                        prompt_tokens=request.num_prompt_tokens, batch_requests=batch_requests,
                        batch_tokens=batch_tokens, step_ms=step_s * 1000.0)
        if not trace.first_token_seen and (request.first_token_time is not None or request in sampled_now):
            trace.first_token_seen = True
            trace.first_token(step, now)
