"""A fake model runner: drives the real Scheduler and KVCacheManager with no model.

`FakeRunner` plays the model runner's part of a step. It keeps, for every KV slot of the
device pool and of the host swap pool, a fingerprint of what a real forward pass would
have stored there: the hash of the whole token prefix ending at that position (a token's
K/V depend on every token before it). Each step it

- performs the plan's swap-outs, then swap-ins, as `ModelRunner.swap` does;
- checks that every scheduled request's block table holds the right fingerprint at every
  position it has already computed (what attention would read: prefix-cache hits,
  swapped-in blocks and recomputed blocks included);
- writes the fingerprints of the scheduled tokens;
- "samples" a deterministic token for each request whose scheduled tokens reach its end
  of input (a hash of the request id and the output position, or EOS when the request
  is scripted to stop there).

`Harness` wraps a Scheduler + FakeRunner with the engine's own admission and stop rules
(`validation.resolve_max_tokens`, `check_stop`) and records what each step granted, so tests can
assert invariants per step.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field

from backend.config import EngineConfig
from backend.kv_cache import KVCacheManager, SwapSpace
from backend.request import Request, RequestError, SamplingParams
from backend.scheduler import Scheduler, SchedulerOutput, check_stop
from backend.validation import resolve_max_tokens

EOS = 2
VOCAB = 1000


def fake_token(request_id: str, position: int) -> int:
    """Deterministic 'sample' that never is EOS (ids 3..VOCAB-1)."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % (VOCAB - 3)


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        self._prefix_fp: dict[str, list[int]] = {}
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # request id -> output position at which it samples EOS instead of a token.
        self.eos_at: dict[str, int] = {}

    def fingerprint(self, request: Request, position: int) -> int:
        fps = self._prefix_fp.setdefault(request.request_id, [])
        tokens = request.token_ids
        while len(fps) <= position:
            i = len(fps)
            parent = fps[-1] if fps else 0
            fps.append(hash((parent, tokens[i])))
        return fps[position]

    def run(self, plan: SchedulerOutput) -> dict[Request, int]:
        for device_block, host_block in plan.swap_out:
            self.host[host_block] = list(self.device[device_block])
        self.num_swapped_out_blocks += len(plan.swap_out)
        for host_block, device_block in plan.swap_in:
            self.device[device_block] = list(self.host[host_block])
        self.num_swapped_in_blocks += len(plan.swap_in)
        bs = self.block_size
        sampled: dict[Request, int] = {}
        # Attention reads the context first, then the step's keys are stored: check all
        # contexts before any write (a request's write must not fix another's read).
        for request, num_new in plan.scheduled:
            assert num_new > 0
            start = request.num_computed_tokens
            assert start + num_new <= request.num_tokens, "granted beyond the known tokens"
            assert len(request.block_ids) * bs >= start + num_new, "granted tokens have no block"
            for pos in range(start):
                got = self.device[request.block_ids[pos // bs]][pos % bs]
                assert got == self.fingerprint(request, pos), (
                    f"{request.request_id}: KV at position {pos} (block {request.block_ids[pos // bs]}) is stale"
                )
        written: set[tuple[int, int]] = set()
        for request, num_new in plan.scheduled:
            start = request.num_computed_tokens
            for pos in range(start, start + num_new):
                slot = (request.block_ids[pos // bs], pos % bs)
                assert slot not in written, f"two tokens of one step write KV slot {slot}"
                written.add(slot)
                self.device[slot[0]][slot[1]] = self.fingerprint(request, pos)
            if start + num_new == request.num_tokens:
                out_pos = request.num_output_tokens
                # Like the sampler, EOS cannot be drawn before min_tokens outputs exist.
                if self.eos_at.get(request.request_id) == out_pos and out_pos >= request.params.min_tokens:
                    sampled[request] = EOS
                else:
                    sampled[request] = fake_token(request.request_id, out_pos)
        return sampled


@dataclass
class StepRecord:
    plan: SchedulerOutput
    running_before: list[Request]
    running_after: list[Request]
    admitted: list[Request]


@dataclass
class Harness:
    config: EngineConfig
    num_blocks: int
    num_host_blocks: int = 0
    max_model_len: int = 4096
    scheduler: Scheduler = field(init=False)
    runner: FakeRunner = field(init=False)
    records: list[StepRecord] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    all_requests: list[Request] = field(default_factory=list)

    def __post_init__(self):
        kv = KVCacheManager(self.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        swap = SwapSpace(self.num_host_blocks) if self.num_host_blocks else None
        self.scheduler = Scheduler(self.config, kv, swap)
        self.runner = FakeRunner(self.num_blocks, self.config.block_size, self.num_host_blocks)
        self._seq = itertools.count()

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def num_preemptions(self) -> int:
        """Over the steps taken: each step's plan names its victims."""
        return sum(len(record.plan.preempted) for record in self.records)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / looked up, over the steps taken."""
        queries = sum(record.plan.prefix_query_tokens for record in self.records)
        return sum(record.plan.prefix_hit_tokens for record in self.records) / queries if queries else 0.0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
            eos_at: int | None = None, min_tokens: int = 0, tenant: str = "default") -> Request | None:
        """Admission as the engine does it: impossible requests are rejected at once."""
        try:
            resolve_max_tokens(len(prompt), max_tokens, default=self.config.default_max_tokens,
                               max_model_len=self.max_model_len, kv=self.kv)
        except RequestError:
            self.rejected.append(request_id)
            return None
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=SamplingParams(priority=priority, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                  tenant=tenant),
            max_tokens=max_tokens,
            arrival_time=0.0,
            arrival_seq=next(self._seq),
            eos_token_ids=frozenset({EOS}),
        )
        if eos_at is not None:
            self.runner.eos_at[request_id] = eos_at
        self.scheduler.enqueue(request)
        self.all_requests.append(request)
        return request

    def step(self) -> StepRecord:
        sched = self.scheduler
        running_before = list(sched.running)
        plan = sched.schedule()
        admitted = [r for r in sched.running if r not in running_before]
        sched.check_invariants()
        sampled = self.runner.run(plan)
        sched.advance(plan)
        now = time.monotonic()
        for request, token_id in sampled.items():
            sched.append_token(request, token_id, now, plan)
            stop = check_stop(request, token_id)
            if stop is not None:
                sched.finish_request(request, *stop)
                self.finished.append(request)
        sched.check_invariants()
        record = StepRecord(plan, running_before, list(sched.running), admitted)
        self.records.append(record)
        return record

    def run(self, max_steps: int) -> int:
        steps = 0
        while self.scheduler.has_work():
            assert steps < max_steps, f"no progress after {steps} steps: {len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting"
            self.step()
            steps += 1
        return steps

    def step_bound(self) -> int:
        """A generous bound on the steps any correct schedule needs for the requests added."""
        tokens = sum(r.num_prompt_tokens + r.max_tokens for r in self.all_requests)
        preempt = (self.config.max_preemptions + 1) * max(1, len(self.all_requests))
        return 10 * (tokens + preempt) + 100


def assert_all_free(harness: Harness) -> None:
    pool = harness.kv.pool
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} blocks still held"
    assert all(b.ref_count == 0 for b in pool.blocks)
    pool.check_invariants()
    if harness.scheduler.swap is not None:
        # Host blocks read by the last swap-ins are released at the next schedule().
        harness.scheduler.schedule()
        assert harness.scheduler.swap.num_free == harness.scheduler.swap.num_blocks
