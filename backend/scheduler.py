"""Iteration-level scheduler: decides, every step, which requests run and how many tokens each.

There are no prefill and decode phases. Each request has `num_tokens` and
`num_computed_tokens`; a step grants new tokens so the two meet, under one token budget
(`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`). Running
requests are served first, then waiting ones. A long prompt is granted at most
`long_prefill_token_threshold` tokens a step (chunked prefill), so its prefill shares
steps with other requests' decodes.

What differs between policies (`fcfs`, `priority`, `static`, `fair`) is one class each in
backend/policies.py: the waiting queue's order, admission, the victim order. The rules
every request lives by are here too: when one stops (`check_stop`), and
`Scheduler.finish_request`, which ends it.

Service is charged to a request's tenant as tokens are granted, under every policy (the
per-tenant metrics read it; `fair` schedules by it): each input token computed costs
`tenant_input_token_cost`, each output token `tenant_output_token_cost`. Prefix-cache
hits and swapped-in blocks are not computed, so not charged; a recomputed prefix is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from backend.config import EngineConfig
from backend.kv_cache import BlockTable, KVCacheManager, SwapSpace
from backend.policies import Policy
from backend.request import FinishReason, Request, RequestStatus

# Why a running request was preempted (SchedulerOutput.preemption_causes).
PREEMPTED_FOR_BLOCKS = "kv_blocks_exhausted"  # a running request needed a block and none was free
PREEMPTED_FOR_WAITING = "outranked_by_waiting_request"  # the policy let a waiting request take its place


@dataclass
class SchedulerOutput:
    """The plan of one step. `scheduled` is in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Per preempted request, in the same order: why (PREEMPTED_FOR_BLOCKS or
    # PREEMPTED_FOR_WAITING) and how many tokens it had computed.
    preemption_causes: list[tuple[str, int]] = field(default_factory=list)
    # Preempted requests that rejoin this step from swap space.
    swapped_in: list[Request] = field(default_factory=list)
    # Copies the model runner makes before the forward pass, swap-outs first.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Copy-on-write of blocks shared by a group's sequences: destination -> source, made after
    # the swap-outs and before the swap-ins (KVCacheManager.copy_on_write).
    block_copies: dict[int, int] = field(default_factory=dict)
    # The KV manager's block table, where the model runner reads the scheduled requests'
    # block ids (their rows change only when blocks are allocated or freed).
    block_table: BlockTable | None = None
    schedule_time_s: float = 0.0
    # Draft tokens granted this step (after their requests' last tokens; speculative decoding).
    num_draft_tokens: int = 0
    # Prefix-cache lookups of the requests admitted this step (first admissions only): prompt
    # tokens looked up, and of those, tokens found cached.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Service granted this step per tenant (token-cost weighted, before tenant weights).
    service_by_tenant: dict[str, float] = field(default_factory=dict)
    # Filled by `append_token`, per request that received a token: its prompt length and time to
    # first token when the token was its first, else the time since its previous token.
    prefilled_prompt_tokens: int = 0
    first_token_latencies_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, swap: SwapSpace | None = None):
        self.config = config
        self.kv = kv
        self.swap = swap
        self.policy = Policy.create(config.scheduling_policy, config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Host blocks read by this step's swap-ins; freed only after the step's copies ran.
        self._host_blocks_to_free: list[int] = []
        # Group leaders whose prefill has not forked their sequences yet: admission keeps
        # room in max_num_seqs for the sequences they will add.
        self._unforked_leaders: set[Request] = set()

    @property
    def waiting(self) -> Policy:
        """The waiting requests: the policy is their queue."""
        return self.policy

    # ---- request lifecycle -------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        if request.seqs_to_fork:
            self._unforked_leaders.add(request)
        self.policy.push(request)

    def adopt(self, request: Request, num_computed: int) -> bool:
        """Take `request`, whose first `num_computed` tokens were computed elsewhere (a request
        imported by a role-decode engine, backend/disagg.py), straight into the running batch
        with blocks for them; False, changing nothing, when the batch or the pool has no room."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(request, num_computed):
            return False
        request.num_computed_tokens = num_computed
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.first_scheduled_time = time.monotonic()
        return True

    def fork(self, leader: Request, child: Request) -> None:
        """Add `child`, a sequence forked off the running `leader` at the end of its prefill,
        as a running request that shares the leader's blocks (KVCacheManager.fork)."""
        assert child.request_id not in self.requests, f"duplicate request id {child.request_id}"
        self._unforked_leaders.discard(leader)
        self.requests[child.request_id] = child
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.kv.fork(leader, child)

    @property
    def has_unforked_leaders(self) -> bool:
        return bool(self._unforked_leaders)

    def has_work(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> bool:
        """End a request wherever it is and release everything it holds, at once; True when
        it ended one this scheduler held. A finished request keeps its first reason; one the
        scheduler never held (refused at admission) only takes the reason."""
        if request.is_finished:
            return False
        held = self.requests.get(request.request_id) is request
        if held:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.policy.remove(request)
            self.kv.free(request)
            if request.swapped_block_ids:
                self.swap.free(request.swapped_block_ids)
                request.swapped_block_ids = []
            del self.requests[request.request_id]
            self._unforked_leaders.discard(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        return held

    # ---- the step ----------------------------------------------------------------------

    def is_protected(self, request: Request) -> bool:
        """Preempted often enough: it now reserves the blocks it can ever hold at once (its whole
        life's, or with a sliding window a window's worth) and is never a victim."""
        return request.num_preemptions >= self.config.max_preemptions

    def _pick_victim(self) -> Request | None:
        candidates = [r for r in self.running if not self.is_protected(r)]
        return max(candidates, key=self.policy.victim_key) if candidates else None

    def refund(self, plan: SchedulerOutput) -> None:
        """Take back the charges of a plan whose step computed nothing (interrupted)."""
        for request, num_new in plan.scheduled:
            self._charge(request, num_new, plan, sign=-1)

    def _charge(self, request: Request, num_new: int, plan: SchedulerOutput, sign: int = 1) -> None:
        """Charge `request`'s tenant for a grant of `num_new` tokens (`sign` -1: take it back).
        A grant that reaches the end of the request's tokens samples one output token; its
        last token, when it was sampled, is that output's own input and not charged twice.
        Draft tokens (speculative decoding, after the last token) are not charged: the engine
        chose to verify them, and a tenant pays for the drafts it gets as outputs
        (`charge_accepted_drafts`), never for those rejected."""
        drafts = max(0, request.num_computed_tokens + num_new - request.num_tokens)
        reaches_end = request.num_computed_tokens + num_new >= request.num_tokens
        fed_back = reaches_end and request.num_tokens > request.num_prompt_tokens
        cfg = self.config
        inputs = num_new - drafts - fed_back
        self._add_service(request.tenant, sign * (cfg.tenant_input_token_cost * inputs
                                                  + cfg.tenant_output_token_cost * reaches_end), plan)

    def charge_accepted_drafts(self, request: Request, num_tokens: int, plan: SchedulerOutput) -> None:
        """`request` took `num_tokens` accepted drafts as outputs, beyond the one output its grant paid."""
        self._add_service(request.tenant, self.config.tenant_output_token_cost * num_tokens, plan)

    def _add_service(self, tenant: str, service: float, plan: SchedulerOutput) -> None:
        plan.service_by_tenant[tenant] = plan.service_by_tenant.get(tenant, 0.0) + service
        self.policy.charge(tenant, service)

    def _preempt(self, victim: Request, plan: SchedulerOutput, granted: dict[Request, int], cause: str) -> int:
        """Move `victim`, with the rest of its group that is running and not protected, back
        to the waiting queue; return the budget they gave back. A group goes whole because
        its sequences share blocks: one sequence alone frees little."""
        if victim.group is None:
            return self._preempt_one(victim, plan, granted, cause)
        return sum(
            self._preempt_one(r, plan, granted, cause)
            for r in victim.group.seqs
            if r.status is RequestStatus.RUNNING and (r is victim or not self.is_protected(r))
        )

    def _preempt_one(self, victim: Request, plan: SchedulerOutput, granted: dict[Request, int], cause: str) -> int:
        plan.preemption_causes.append((cause, victim.num_computed_tokens))
        self.running.remove(victim)
        returned = granted.pop(victim, 0)
        if returned:
            self._charge(victim, returned, plan, sign=-1)
        held = victim.block_ids[victim.num_freed_blocks :]  # not those released behind the window
        use_swap = (
            self.swap is not None
            and victim.num_computed_tokens > 0
            and self.swap.num_free >= len(held)
        )
        copies = plan.block_copies
        if use_swap:
            host_ids = self.swap.allocate(len(held))
            # A block copied-on-write this step holds nothing yet: swap out its source, and
            # drop the copy into a block that is being freed.
            device_ids = [copies.pop(b, b) for b in held] if copies else held
            plan.swap_out.extend(zip(device_ids, host_ids))
            victim.swapped_block_ids = host_ids
            # Its device blocks hold valid KV until this step's forward pass, and the
            # runner copies them out before that; a cached block keeps its hash for the same reason.
            self.kv.free(victim)
        else:
            for b in held if copies else ():
                copies.pop(b, None)
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.num_freed_blocks = 0
        victim.status = RequestStatus.WAITING
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.policy.push_front(victim)
        plan.preempted.append(victim)
        return returned

    def schedule(self) -> SchedulerOutput:
        start = time.perf_counter()
        if self._host_blocks_to_free:
            self.swap.free(self._host_blocks_to_free)
            self._host_blocks_to_free = []
        cfg = self.config
        plan = SchedulerOutput(block_table=self.kv.block_table)
        budget = cfg.max_num_batched_tokens
        granted: dict[Request, int] = {}  # insertion order is batch order
        running_at_start = bool(self.running)
        policy = self.policy
        policy.order_running(self.running)

        # The hot loop of every iteration (one pass over up to max_num_seqs requests): locals
        # and plain attributes rather than properties keep it near 1 us per request.
        running_status, chunk_limit, allocate = RequestStatus.RUNNING, cfg.long_prefill_token_threshold, self.kv.allocate
        block_size = self.kv.block_size
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not running_status:
                continue  # preempted earlier in this loop
            num_computed = request.num_computed_tokens
            # A speculating request's drafts follow its last token (trimmed by the limits below).
            num_new = len(request.token_ids) + len(request.spec_token_ids) - num_computed
            if num_new > chunk_limit or num_new > budget:
                num_new = min(num_new, chunk_limit, budget)
            if num_new <= 0:
                continue
            # Most steps a decode's last block still has room: that is allocate's own first
            # test, done here without the call (~25% of this loop at 256 running). A group's
            # sequence may also need its own copy of a block it shares before writing to it.
            while ((num_computed + num_new > len(request.block_ids) * block_size and not allocate(request, num_new))
                   or (request.group is not None and not self.kv.copy_on_write(request, plan.block_copies))):
                if request.spec_token_ids:  # drafts are worth no other request's preemption
                    request.spec_token_ids = []
                    num_new = min(num_new, len(request.token_ids) - num_computed)
                    continue
                victim = self._pick_victim()
                # Protected requests reserved their blocks (KVCacheManager.reserved_tokens), so an
                # allocation that fails belongs to an unprotected request: a victim always exists.
                # A block shared with another sequence means that sequence still runs from
                # its group's fork, unpreempted, so unprotected: a victim exists then too.
                assert victim is not None, "allocation failed for a protected request"
                budget += self._preempt(victim, plan, granted, PREEMPTED_FOR_BLOCKS)
                if request.status is not running_status:
                    break
            if request.status is running_status:
                granted[request] = num_new
                budget -= num_new
                if request.spec_token_ids:
                    plan.num_draft_tokens += max(0, num_computed + num_new - len(request.token_ids))
                # Charged at once, so that this step's admission sees this step's service.
                self._charge(request, num_new, plan)

        # Admitting while evicting would only thrash: wait for the pool to recover.
        admit = not plan.preempted and policy.may_admit(running_at_start)
        # LoRA adapters of the running requests: at most max_loras in a step. A request of a
        # further adapter stops admission rather than being passed over, so that it cannot
        # starve: the running adapters' requests finish and make room for it.
        active_loras = {r.lora_name for r in self.running if r.lora_name is not None}
        # Seats in max_num_seqs that running group leaders keep for the sequences they fork.
        seats_kept = sum(r.seqs_to_fork for r in self._unforked_leaders if r.status is running_status)
        while admit and len(policy) > 0 and (budget > 0 or policy.admits_beyond_budget):
            request = policy.peek()
            if request in plan.preempted:
                break  # a victim of this very step: re-admitting it now would only thrash
            lora = request.lora_name
            if lora is not None and lora not in active_loras and len(active_loras) >= cfg.max_loras:
                break
            if len(self.running) + seats_kept + request.seqs_to_fork >= cfg.max_num_seqs:
                if not self._preempt_for(request, plan, granted):
                    break
                budget = cfg.max_num_batched_tokens - sum(granted.values())
                continue
            num_new, ok = self._try_admit(request, budget, plan)
            if not ok:
                if not self._preempt_for(request, plan, granted):
                    break
                budget = cfg.max_num_batched_tokens - sum(granted.values())
                continue
            policy.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                active_loras.add(lora)
            seats_kept += request.seqs_to_fork
            if num_new > 0:
                granted[request] = num_new
                budget -= num_new
                self._charge(request, num_new, plan)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()

        plan.scheduled = list(granted.items())
        plan.schedule_time_s = time.perf_counter() - start
        return plan

    def _try_admit(self, request: Request, budget: int, plan: SchedulerOutput) -> tuple[int, bool]:
        """Allocate what `request` needs to join the batch; (tokens granted, ok)."""
        cfg = self.config
        protected = self.is_protected(request)
        if request.swapped_block_ids:
            reserve = self.kv.reserved_tokens(request) if protected else 0
            num_new = min(request.num_tokens - request.num_computed_tokens, cfg.long_prefill_token_threshold, budget)
            host_ids = request.swapped_block_ids
            if not self.kv.allocate(request, num_new, reserve_tokens=reserve):
                return 0, False
            freed = request.num_freed_blocks  # the host blocks hold the blocks after those
            plan.swap_in.extend(zip(host_ids, request.block_ids[freed : freed + len(host_ids)]))
            self._host_blocks_to_free.extend(host_ids)
            request.swapped_block_ids = []
            plan.swapped_in.append(request)
            return num_new, True
        cached = self.kv.find_cached_prefix(request)
        num_computed = len(cached) * self.kv.block_size
        num_new = min(request.num_tokens - num_computed, cfg.long_prefill_token_threshold, max(budget, 0))
        reserve = self.kv.reserved_tokens(request, len(cached)) if protected else 0
        if not self.kv.allocate(request, num_new, cached, reserve_tokens=reserve):
            return 0, False
        if request.num_preemptions == 0:
            plan.prefix_query_tokens += request.num_prompt_tokens
            plan.prefix_hit_tokens += num_computed
            request.num_cached_prompt_tokens = num_computed
        return num_new, True

    def _preempt_for(self, request: Request, plan: SchedulerOutput, granted: dict[Request, int]) -> bool:
        """Make room for `request` by preempting a running request it outranks, where the policy allows it."""
        if not self.policy.preempts_for_waiting:
            return False  # spares the O(running) victim search
        victim = self._pick_victim()
        if victim is None or not self.policy.outranks(request, victim):
            return False
        self._preempt(victim, plan, granted, PREEMPTED_FOR_WAITING)
        return True

    def advance(self, plan: SchedulerOutput) -> None:
        """The plan's forward pass has run: its tokens are computed, the full blocks they fill
        join the prefix cache, and the blocks that fell behind a sliding window are released."""
        for request, num_new in plan.scheduled:
            # Drafts are computed only once accepted (`accept_drafts`).
            request.num_computed_tokens = min(request.num_computed_tokens + num_new, request.num_tokens)
            self.kv.cache_computed_blocks(request)
            self.kv.free_behind_window(request, reserve=self.is_protected(request))

    def accept_drafts(self, request: Request, num_accepted: int) -> None:
        """`request`'s verification step accepted its first `num_accepted` drafts (already
        appended as its tokens): their KV is computed; the rejected drafts' blocks are freed."""
        request.num_computed_tokens += num_accepted
        request.spec_token_ids = []
        # A protected request keeps the blocks it reserved.
        protected = self.is_protected(request)
        self.kv.truncate(request, self.kv.reserved_tokens(request) if protected else request.num_tokens)
        self.kv.cache_computed_blocks(request)
        self.kv.free_behind_window(request, reserve=protected)

    def append_token(self, request: Request, token_id: int, now: float, plan: SchedulerOutput) -> None:
        """Append a sampled token to `request` and time it (into `plan`, for the step's
        stats). Whether it ends the request is `check_stop`'s question, asked next."""
        request.append_output_token(token_id)
        if request.first_token_time is None:
            request.first_token_time = now
            if request.seq_index == 0:  # a group's prompt and first token count once
                plan.first_token_latencies_s.append(now - request.arrival_time)
                plan.prefilled_prompt_tokens += request.num_prompt_tokens
        else:
            # Preemption and recompute happen between two tokens, so their time is in
            # the interval, as a client sees it.
            plan.inter_token_latencies_s.append(now - request.last_token_time)
        request.last_token_time = now

    def check_invariants(self) -> None:
        cfg = self.config
        assert len(self.running) <= cfg.max_num_seqs, (len(self.running), cfg.max_num_seqs)
        assert len(self.running) + len(self.policy) == len(self.requests)
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert len(request.block_ids) * self.kv.block_size >= request.num_computed_tokens
        # Only running requests hold blocks, and each of those has a row in the block table.
        assert set(self.kv.block_table.row_of) == {r for r in self.running if r.block_ids}
        self.kv.check_invariants()


def check_stop(request: Request, token_id: int,
               match_stop_string: Callable[[int], str | None] | None = None) -> tuple[FinishReason, int | str | None] | None:
    """Whether the token just appended ends `request`: (reason, stop_reason), or None.

    In this order: EOS or a stop token (once `min_tokens` are out); then a stop string,
    which `match_stop_string(token_id)` reports after taking the token's text (it is not
    asked about a stop token, whose text never reaches the output); then the length limit.
    A stop string found on the last allowed token is a stop, not a length.
    """
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
    if match_stop_string is not None:
        stop = match_stop_string(token_id)
        if stop is not None:
            return FinishReason.STOP, stop
    if request.num_output_tokens >= request.max_tokens:
        return FinishReason.LENGTH, None
    return None
