"""The KV manager's persistent block table and the step inputs `ModelRunner.prepare` builds from it.

`BlockTable` keeps every block-holding request's `block_ids` as a row of one numpy array,
written only where a list grows, so that `prepare` gathers a batch's block tables with
one fancy index instead of flattening every list every step. A stale row would make
attention read another request's KV, so a hypothesis state machine drives
`KVCacheManager` the way the scheduler does (admission with prefix-cache hits, chunked
growth, decodes crossing block edges, whole-life reservations, finishing and aborting,
preemption by recompute, swap-out and swap-in) and after every operation checks the
table against the lists, and `prepare`'s every output for a random batch against a
naive per-token construction from the requests themselves.
"""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.config import EngineConfig
from backend.kv_cache import BlockTable, KVCacheManager
from backend.model_runner import ModelRunner
from backend.models.llama import ModelArch
from backend.request import Request, SamplingParams
from backend.scheduler import SchedulerOutput
from kernels import cpu_ext

BS = 8
NUM_BLOCKS = 24
# Shared starts so that prefix-cache hits (whole and partial) are common.
PREFIXES = [[], list(range(1, 17)), list(range(1, 9)) + [9] * 8, [7] * 20]


def make_runner(num_blocks: int = NUM_BLOCKS) -> ModelRunner:
    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=8, intermediate_size=16,
                     num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                     rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=True,
                     attention_bias=False, qk_norm=False)
    config = EngineConfig(model_path="unused", block_size=BS, batch_invariant=False)
    with mock.patch.object(cpu_ext, "load"):  # prepare needs no kernels: skip building them
        return ModelRunner(config, None, arch, num_blocks, 0, torch.device("cpu"), torch.float32)


def make_request(request_id: str, tokens: list[int], max_tokens: int = 16, seq: int = 0) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens), params=SamplingParams(),
                   max_tokens=max_tokens, arrival_time=0.0, arrival_seq=seq)


def naive_inputs(scheduled: list[tuple[Request, int]], block_size: int) -> dict:
    """What prepare must produce, token by token from the requests' own lists."""
    width = max(len(r.block_ids) for r, _ in scheduled)
    out = dict(input_ids=[], positions=[], slot_mapping=[], logits_indices=[], sample_requests=[],
               block_tables=[r.block_ids + [0] * (width - len(r.block_ids)) for r, _ in scheduled],
               seq_lens=[r.num_computed_tokens + n for r, n in scheduled], cu_seqlens_q=[0])
    for request, num_new in scheduled:
        for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            out["input_ids"].append(request.token_ids[position])
            out["positions"].append(position)
            out["slot_mapping"].append(request.block_ids[position // block_size] * block_size + position % block_size)
        out["cu_seqlens_q"].append(len(out["positions"]))
        if request.num_computed_tokens + num_new == request.num_tokens:
            out["logits_indices"].append(len(out["positions"]) - 1)
            out["sample_requests"].append(request)
    return out


def assert_prepare_matches_naive(runner: ModelRunner, plan: SchedulerOutput) -> None:
    inputs = runner.prepare(plan)
    expected = naive_inputs(plan.scheduled, runner.block_size)
    meta = inputs.meta
    got = dict(input_ids=inputs.input_ids, positions=inputs.positions, logits_indices=inputs.logits_indices,
               slot_mapping=meta.slot_mapping, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
               cu_seqlens_q=meta.cu_seqlens_q)
    dtypes = dict(block_tables=torch.int32, seq_lens=torch.int32, cu_seqlens_q=torch.int32)
    for name, tensor in got.items():
        assert tensor.dtype == dtypes.get(name, torch.int64), (name, tensor.dtype)
        assert tensor.tolist() == expected[name], name
    assert inputs.sample_requests == expected["sample_requests"]
    assert meta.max_seqlen_q == max(n for _, n in plan.scheduled)
    assert meta.max_seqlen_k == max(expected["seq_lens"])


class BlockTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        # Start tiny so that growing rows and columns is exercised too.
        self.kv.block_table = BlockTable(num_rows=2, num_cols=2)
        self.runner = make_runner()
        self.waiting: list[Request] = []
        self.swapped: list[Request] = []  # preempted by swap: computed tokens kept, no device blocks
        self.running: list[Request] = []
        self.counter = 0

    def _compute(self, request: Request, num_new: int) -> None:
        """The step's forward pass ran: advance, register full blocks, sample at the end of input."""
        request.num_computed_tokens += num_new
        self.kv.cache_computed_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(request.num_tokens % 50 + 3)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)

    # ---- rules -----------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(20, 40), max_size=20),
          max_tokens=st.integers(1, 24))
    def new_request(self, prefix, suffix, max_tokens):
        self.counter += 1
        self.waiting.append(make_request(f"r{self.counter}", (prefix + suffix) or [5], max_tokens, self.counter))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def admit(self, data, chunk):
        """A prefix-cache lookup sets many blocks at once; the rest are fresh."""
        request = data.draw(st.sampled_from(self.waiting), label="request")
        hits = self.kv.find_cached_prefix(request)
        num_new = min(request.num_tokens - len(hits) * BS, chunk)
        if self.kv.allocate(request, num_new, hits):
            self.waiting.remove(request)
            self.running.append(request)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def swap_in(self, data, chunk):
        """Back from the host: the same computed tokens in new device blocks."""
        request = data.draw(st.sampled_from(self.swapped), label="request")
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if self.kv.allocate(request, num_new):
            self.swapped.remove(request)
            self.running.append(request)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def step(self, data):
        """A batch as the scheduler would grant it (blocks first), prepared, then computed."""
        candidates = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True), label="batch")
        scheduled = []
        for request in candidates:
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = data.draw(st.integers(1, remaining), label="num_new") if remaining > 1 else remaining
            if self.kv.allocate(request, num_new):
                scheduled.append((request, num_new))
        if not scheduled:
            return
        assert_prepare_matches_naive(self.runner, SchedulerOutput(scheduled=scheduled, block_table=self.kv.block_table))
        for request, num_new in scheduled:
            self._compute(request, num_new)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def reserve_whole_life(self, data):
        """A protected request takes the blocks for its whole life at once."""
        request = data.draw(st.sampled_from(self.running), label="request")
        self.kv.allocate(request, 0, reserve_tokens=request.max_total_tokens)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data):
        """Finished, cancelled or aborted: all the same to the KV manager."""
        self._release(data.draw(st.sampled_from(self.running), label="request"))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def preempt_recompute(self, data):
        request = data.draw(st.sampled_from(self.running), label="request")
        self._release(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def swap_out(self, data):
        request = data.draw(st.sampled_from(self.running), label="request")
        self._release(request)
        self.swapped.append(request)

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def table_mirrors_the_lists(self):
        table = self.kv.block_table
        table.check_invariants()  # rows equal the lists, padding is zero, no row leaked
        assert set(table.row_of) == {r for r in self.running if r.block_ids}
        self.kv.pool.check_invariants()


TestBlockTableMachine = BlockTableMachine.TestCase
TestBlockTableMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------------------
# Targeted cases
# --------------------------------------------------------------------------------------


def test_a_replaced_list_of_the_same_length_and_first_block_is_not_stale():
    """Preempted by recompute, re-admitted through the prefix cache: the same first block
    and length as before, other blocks after it. A mirror that compared only first id and
    length would keep the old ids; a freed request's row is rewritten from scratch."""
    kv = KVCacheManager(8, BS)
    runner = make_runner(8)
    request = make_request("a", list(range(1, 21)))  # 2 full blocks and 4 tokens
    assert kv.allocate(request, 20)
    request.num_computed_tokens = 20
    kv.cache_computed_blocks(request)
    other = make_request("b", [90] * 4)
    assert kv.allocate(other, 4)  # takes the block `request` will free first
    old_blocks = list(request.block_ids)
    kv.free(request)
    request.num_computed_tokens = 0
    hits = kv.find_cached_prefix(request)
    assert kv.allocate(request, request.num_tokens - len(hits) * BS, hits)
    assert len(request.block_ids) == len(old_blocks) and request.block_ids[0] == old_blocks[0]
    assert request.block_ids != old_blocks
    kv.block_table.check_invariants()
    plan = SchedulerOutput(scheduled=[(request, 4), (other, 4)], block_table=kv.block_table)
    assert_prepare_matches_naive(runner, plan)


def test_rows_are_reused_and_none_leak():
    kv = KVCacheManager(64, BS)
    kv.block_table = BlockTable(num_rows=2, num_cols=1)
    for wave in range(3):
        requests = [make_request(f"{wave}-{i}", [wave * 10 + i] * (5 + 9 * i)) for i in range(5)]
        for request in requests:
            assert kv.allocate(request, request.num_tokens)
        kv.block_table.check_invariants()
        for request in requests:
            kv.free(request)
        assert not kv.block_table.row_of
        kv.block_table.check_invariants()  # every row back on the free list, zeroed
    assert kv.block_table.ids.shape[0] == 8  # grew once to fit 5 at a time, then reused


def test_gather_pads_with_zeros_to_the_batch_widest():
    table = BlockTable(num_rows=4, num_cols=4)
    a, b, c = (make_request(name, [1]) for name in "abc")
    for request, blocks in ((a, [3, 1, 4, 1, 5, 9]), (b, [2, 6]), (c, [5, 3, 5])):
        request.block_ids.extend(blocks)
        table.sync(request)
    rows = table.rows([b, c])
    assert table.gather(rows).tolist() == [[2, 6, 0], [5, 3, 5]]
    assert table.gather(table.rows([a])).dtype == np.int32


def test_a_list_that_shrank_behind_the_managers_back_is_an_error():
    table = BlockTable()
    request = make_request("a", [1])
    request.block_ids.extend([1, 2, 3])
    table.sync(request)
    del request.block_ids[1:]
    try:
        table.sync(request)
    except RuntimeError as exc:
        assert "shrank" in str(exc)
    else:
        raise AssertionError("expected a RuntimeError")
