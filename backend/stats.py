"""The engine's stats: one immutable snapshot per step, `LLMEngine.stats`.

Everything that watches the engine (Triton metrics, the benchmark, the host-overhead tool,
per-request traces) reads the snapshot and never reaches into the scheduler or the KV
manager; the engine is the one writer. A snapshot is never changed once published, so a
reader on another thread sees one consistent step. To report something new, add a field
here and fill it in `step_stats` or `snapshot`, which the engine calls once per step.

No local imports (the engine's types only under TYPE_CHECKING): readers use these types
without loading the engine (torch, transformers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did. `ran` is False for a step without a completed forward pass
    (nothing to schedule, or the pass failed); its times after scheduling are then 0."""

    ran: bool = False
    # The running set and the queue as the step was scheduled (the seats this step held).
    num_running: int = 0
    num_waiting: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_preempted: int = 0
    # Prefix-cache lookups of the requests admitted this step (first admissions): prompt
    # tokens looked up, and of those, tokens found cached.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # The requests that received their first token this step: their prompt tokens (prefix-cache
    # hits included) and, one each, the time from arrival to that token. One interval per
    # later token: the time since the same request's previous token (a step samples at most
    # one token per request). vLLM's prompt_tokens_total, time_to_first_token_seconds and
    # time_per_output_token_seconds count the same things.
    prefilled_prompt_tokens: int = 0
    first_token_latencies_s: tuple[float, ...] = ()
    inter_token_latencies_s: tuple[float, ...] = ()
    # (tenant, service) per tenant granted tokens this step: input tokens computed times
    # tenant_input_token_cost plus output tokens times tenant_output_token_cost.
    service_by_tenant: tuple[tuple[str, float], ...] = ()
    # Host time per phase: scheduling, input preparation (metadata and copies to the
    # device), forward pass plus sampling, and the update after it (scheduler state,
    # stop checks, detokenization, outputs).
    schedule_time_s: float = 0.0
    prepare_time_s: float = 0.0
    forward_time_s: float = 0.0
    update_time_s: float = 0.0
    # Speculative decoding: requests that verified drafts this step, the draft tokens
    # verified and accepted, and the accepted ones per draft position (vLLM's spec_decode_*).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    # Disaggregated serving (backend/disagg.py): (KV bytes, seconds) of each request exported
    # (role prefill) or imported (role decode) since the previous step.
    kv_transfers: tuple[tuple[int, float], ...] = ()


def _add_per_position(a: tuple[int, ...], b: tuple[int, ...], sign: int = 1) -> tuple[int, ...]:
    longest = max(len(a), len(b))
    a, b = a + (0,) * (longest - len(a)), b + (0,) * (longest - len(b))
    return tuple(x + sign * y for x, y in zip(a, b))


@dataclass(frozen=True, slots=True)
class Totals:
    """Running totals since the engine started. `steps` and the `sum_*` fields count steps
    that ran a forward pass (averages per iteration divide by `steps`); preemptions and
    prefix lookups count wherever they happened. `since(earlier)` is what happened between
    two snapshots (a benchmark's own window)."""

    steps: int = 0
    prompt_tokens: int = 0  # of the requests enqueued
    prefilled_prompt_tokens: int = 0  # of the requests that received their first token
    generation_tokens: int = 0
    preemptions: int = 0
    aborts: int = 0  # cancelled by a client or ended by shutdown
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    sum_running: int = 0
    sum_scheduled_tokens: int = 0
    sum_schedule_time_s: float = 0.0
    sum_prepare_time_s: float = 0.0
    sum_forward_time_s: float = 0.0
    sum_update_time_s: float = 0.0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Drafts proposed but not verified: the adaptive budget judged they would not pay.
    spec_trimmed_draft_tokens: int = 0
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def plus(self, **increments: int) -> Totals:
        return dataclasses.replace(self, **{name: getattr(self, name) + n for name, n in increments.items()})

    def with_step(self, step: StepStats) -> Totals:
        """These totals with one more step counted."""
        increments = dict(preemptions=step.num_preempted, prefix_query_tokens=step.prefix_query_tokens,
                          prefix_hit_tokens=step.prefix_hit_tokens, kv_transfers=len(step.kv_transfers),
                          kv_transfer_bytes=sum(n for n, _ in step.kv_transfers))
        if step.ran:
            increments.update(
                steps=1, generation_tokens=step.num_generated_tokens,
                prefilled_prompt_tokens=step.prefilled_prompt_tokens, sum_running=step.num_running,
                sum_scheduled_tokens=step.num_scheduled_tokens, sum_schedule_time_s=step.schedule_time_s,
                sum_prepare_time_s=step.prepare_time_s, sum_forward_time_s=step.forward_time_s,
                sum_update_time_s=step.update_time_s, spec_drafts=step.num_drafts,
                spec_draft_tokens=step.num_draft_tokens, spec_accepted_tokens=step.num_accepted_tokens,
            )
        totals = self.plus(**increments)
        if step.accepted_per_position:
            totals = dataclasses.replace(totals, spec_accepted_per_position=_add_per_position(
                self.spec_accepted_per_position, step.accepted_per_position))
        return totals

    def since(self, earlier: Totals) -> Totals:
        return Totals(**{f.name: _add_per_position(getattr(self, f.name), getattr(earlier, f.name), -1)
                         if f.name == "spec_accepted_per_position" else getattr(self, f.name) - getattr(earlier, f.name)
                         for f in dataclasses.fields(self)})


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine after one step: where it stands, what the step did, the totals so far."""

    num_running: int = 0
    num_waiting: int = 0
    # Running requests whose prompt is not all computed yet (TensorRT-LLM's context phase).
    num_prefilling: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0  # free ones, cached or not: what can be handed out now
    # (tenant, running, waiting) per tenant with a request in the engine, by tenant name.
    requests_by_tenant: tuple[tuple[str, int, int], ...] = ()
    step: StepStats = StepStats()
    totals: Totals = Totals()
    # LoRA adapters (names, sorted) of the running and of the waiting requests, and how many
    # may run in one step: vLLM's lora_requests_info labels, which routers read for adapter
    # affinity. Empty when the model serves no adapters.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def num_used_kv_blocks(self) -> int:
        return self.num_kv_blocks - self.num_free_kv_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def step_stats(plan: SchedulerOutput, *, ran: bool, num_running: int, num_waiting: int, num_generated_tokens: int,
               prepare_time_s: float, forward_time_s: float, update_time_s: float,
               accepted_per_draft: list[tuple[int, int]] = (),
               kv_transfers: tuple[tuple[int, float], ...] = ()) -> StepStats:
    """The StepStats of the step that ran `plan` (and filled in its token timings)."""
    return StepStats(
        ran=ran, num_running=num_running, num_waiting=num_waiting, num_scheduled_tokens=plan.num_scheduled_tokens,
        num_generated_tokens=num_generated_tokens, num_preempted=len(plan.preempted),
        prefix_query_tokens=plan.prefix_query_tokens, prefix_hit_tokens=plan.prefix_hit_tokens,
        prefilled_prompt_tokens=plan.prefilled_prompt_tokens,
        first_token_latencies_s=tuple(plan.first_token_latencies_s),
        inter_token_latencies_s=tuple(plan.inter_token_latencies_s),
        service_by_tenant=tuple(plan.service_by_tenant.items()),
        schedule_time_s=plan.schedule_time_s, prepare_time_s=prepare_time_s, forward_time_s=forward_time_s,
        update_time_s=update_time_s, kv_transfers=kv_transfers, **_speculation(accepted_per_draft),
    )


def _speculation(accepted_per_draft: list[tuple[int, int]]) -> dict:
    """The spec_decode fields from (drafts verified, accepted) per speculating request."""
    if not accepted_per_draft:
        return {}
    per_position = [0] * max(drafts for drafts, _ in accepted_per_draft)
    for _, accepted in accepted_per_draft:
        for position in range(accepted):
            per_position[position] += 1
    return dict(num_drafts=len(accepted_per_draft), num_draft_tokens=sum(d for d, _ in accepted_per_draft),
                num_accepted_tokens=sum(a for _, a in accepted_per_draft), accepted_per_position=tuple(per_position))


def snapshot(scheduler: Scheduler, step: StepStats, totals: Totals, *, num_waiting: int,
             max_loras: int | None = None) -> EngineStats:
    """The engine as `scheduler` holds it after `step`: one pass over its requests.
    `num_waiting` also counts requests not yet the scheduler's (a grammar compiling);
    `max_loras` is None for a model without LoRA adapters."""
    running = scheduler.running
    pool = scheduler.kv.pool
    # (all, running) per tenant; the scheduler holds each request either running or waiting.
    counts: dict[str, list[int]] = {}
    for request in scheduler.requests.values():
        counts.setdefault(request.tenant, [0, 0])[0] += 1
    for request in running:
        counts[request.tenant][1] += 1
    lora = {}
    if max_loras is not None:
        lora = dict(
            running_lora_adapters=tuple(sorted({r.lora_name for r in running if r.lora_name is not None})),
            waiting_lora_adapters=tuple(sorted({r.lora_name for r in scheduler.waiting if r.lora_name is not None})),
            max_loras=max_loras,
        )
    return EngineStats(
        num_running=len(running), num_waiting=num_waiting,
        num_prefilling=sum(1 for r in running if r.num_computed_tokens < len(r.prompt_token_ids)),
        num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free,
        requests_by_tenant=tuple((tenant, n[1], n[0] - n[1]) for tenant, n in sorted(counts.items())),
        step=step, totals=totals, **lora,
    )
