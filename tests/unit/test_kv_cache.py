"""Property tests of the paged KV bookkeeping (`backend/kv_cache.py`).

Two hypothesis state machines run long random operation sequences against a plain
reference model that mirrors, exactly, what the pool must look like after every step:

- `BlockPoolMachine` drives `BlockPool` directly (allocate, free, cache, lookup, touch,
  reset) and tracks the expected reference count of every block, the expected LRU order
  of the free list and the expected prefix-cache index.
- `KVManagerMachine` drives `KVCacheManager` the way the scheduler does (prefix lookup +
  admission, chunked growth, computing, decoding, finishing, recompute preemption) over
  requests that share prefixes, and checks that every cached block's hash is the
  `hash_block` chain of the exact tokens it holds.

After every operation both call the pool's own `check_invariants()` as well.
"""

from __future__ import annotations

import collections

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.kv_cache import NULL_BLOCK, ROOT_HASH, BlockPool, KVCacheManager, SwapSpace, hash_block
from backend.request import Request, SamplingParams

STATEFUL_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def chain_hashes(tokens: list[int] | tuple[int, ...], block_size: int) -> list[bytes]:
    """Reference: the chained hash of every full block of `tokens`, computed from scratch."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, list(tokens[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def make_request(request_id: str, tokens: list[int], max_tokens: int = 64, seq: int = 0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(),
        max_tokens=max_tokens,
        arrival_time=0.0,
        arrival_seq=seq,
    )


# --------------------------------------------------------------------------------------
# BlockPool on its own
# --------------------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 8

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.refs = [0] * self.NUM_BLOCKS  # expected ref count per block
        self.free_order: list[int] = list(range(self.NUM_BLOCKS))  # expected LRU order, front = oldest
        self.index: dict[bytes, int] = {}  # expected prefix-cache index
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (parent hash, tokens) when cached

    # ---- helpers -------------------------------------------------------------------

    def _held(self) -> list[int]:
        return [b for b in range(self.NUM_BLOCKS) if self.refs[b] > 0]

    def _drop_ref(self, block_id: int) -> None:
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.free_order.append(block_id)

    # ---- rules ---------------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data):
        n = data.draw(st.integers(0, len(self.free_order)), label="n")
        expected = self.free_order[:n]
        cached_before = {b for b in expected if b in self.content}
        evictions_before = self.pool.num_evictions
        got = self.pool.allocate(n)
        # LRU: exactly the n least recently freed blocks, oldest first.
        assert got == expected
        assert len(set(got)) == len(got), "a block handed out twice in one call"
        for b in got:
            assert self.refs[b] == 0, f"block {b} handed out while referenced"
            self.refs[b] = 1
            if b in self.content:
                parent_hash, tokens = self.content.pop(b)
                del self.index[hash_block(parent_hash, tokens)]
        del self.free_order[:n]
        # Evicted: exactly the cached blocks among them (the least recently freed ones).
        assert self.pool.num_evictions - evictions_before == len(cached_before)
        for b in got:
            assert self.pool.blocks[b].block_hash is None

    @rule(data=st.data())
    def allocate_past_the_cached_blocks(self, data):
        """Take blocks up to and including the oldest free cached one: it must be evicted,
        and no younger cached block may be."""
        cached_free = [b for b in self.free_order if b in self.content]
        if not cached_free:
            return
        n = self.free_order.index(cached_free[0]) + 1
        younger = cached_free[1:]
        got = self.pool.allocate(n)
        assert got == self.free_order[:n] and got[-1] == cached_free[0]
        assert self.pool.blocks[cached_free[0]].block_hash is None, "the least recently freed cached block survived"
        for b in younger:
            assert self.pool.blocks[b].block_hash is not None, f"block {b} was evicted out of LRU order"
        for b in got:
            self.refs[b] = 1
            if b in self.content:
                parent_hash, tokens = self.content.pop(b)
                del self.index[hash_block(parent_hash, tokens)]
        del self.free_order[:n]

    @rule()
    def allocate_too_many_fails_cleanly(self):
        before = list(self.pool.free_list)
        with pytest.raises(RuntimeError):
            self.pool.allocate(len(self.free_order) + 1)
        assert list(self.pool.free_list) == before

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data())
    def free_some(self, data):
        held = self._held()
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=len(held), unique=True), label="blocks")
        self.pool.free(chosen)
        for b in chosen:
            self._drop_ref(b)

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def cache_held_block(self, data, tokens):
        block_id = data.draw(st.sampled_from(self._held()), label="block")
        parents = [ROOT_HASH] + sorted(self.index)
        parent = data.draw(st.sampled_from(parents), label="parent")
        block_hash = hash_block(parent, tokens)
        self.pool.cache_block(block_id, block_hash, tuple(tokens))
        if block_id not in self.content and block_hash not in self.index:
            self.content[block_id] = (parent, tuple(tokens))
            self.index[block_hash] = block_id

    @precondition(lambda self: bool(self.index))
    @rule(data=st.data())
    def lookup_and_touch(self, data):
        block_hash = data.draw(st.sampled_from(sorted(self.index)), label="hash")
        block_id = self.index[block_hash]
        tokens = self.content[block_id][1]
        # Token ids are compared on a hit: a matching hash with other tokens is a miss.
        wrong = tuple((t + 1) % 4 for t in tokens)
        assert self.pool.lookup(block_hash, wrong) is None
        assert self.pool.lookup(block_hash, tokens) == block_id
        self.pool.touch([block_id])
        if self.refs[block_id] == 0:
            self.free_order.remove(block_id)
        self.refs[block_id] += 1

    @rule(tokens=st.lists(st.integers(0, 3), min_size=4, max_size=4))
    def lookup_unknown_misses(self, tokens):
        block_hash = hash_block(b"never-a-parent", tokens)
        assert self.pool.lookup(block_hash, tuple(tokens)) is None

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll:  # rare: it wipes what the other rules build up
            return
        self.pool.reset_prefix_cache()
        self.index.clear()
        self.content.clear()

    # ---- invariants ----------------------------------------------------------------

    @invariant()
    def matches_model(self):
        pool = self.pool
        pool.check_invariants()
        assert [b.ref_count for b in pool.blocks] == self.refs
        assert list(pool.free_list) == self.free_order, "free list is not in LRU order"
        assert pool.num_free == self.refs.count(0) == len(self.free_order)
        assert pool.num_used == self.NUM_BLOCKS - pool.num_free
        assert pool.cached == self.index
        for block_id, (parent, tokens) in self.content.items():
            block = pool.blocks[block_id]
            assert block.token_ids == tokens
            assert block.block_hash == hash_block(parent, tokens)


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(STATEFUL_SETTINGS, max_examples=100)


# --------------------------------------------------------------------------------------
# KVCacheManager driven like the scheduler drives it
# --------------------------------------------------------------------------------------

BS = 4
# Shared starts so that prefix-cache hits (and partial hits) are common.
PREFIXES = [
    [],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 9, 9, 9, 9, 5, 5],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
]


class KVManagerMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 16

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.counter = 0
        self.free_order: list[int] = list(range(self.NUM_BLOCKS))
        # Expected prefix-cache index: hash -> (block id, the whole prefix it ends).
        self.index: dict[bytes, tuple[int, tuple[int, ...]]] = {}

    # ---- reference model helpers -----------------------------------------------------

    def _expected_refs(self) -> list[int]:
        refs = [0] * self.NUM_BLOCKS
        for r in self.running:
            for b in r.block_ids:
                refs[b] += 1
        return refs

    def _block_cached_as(self, block_id: int) -> bytes | None:
        for h, (b, _) in self.index.items():
            if b == block_id:
                return h
        return None

    def _expected_hits(self, request: Request) -> list[int]:
        tokens = request.token_ids
        hits = []
        for i, h in enumerate(chain_hashes(tokens, BS)):
            if (i + 1) * BS > len(tokens) - 1:  # never cover the last token
                break
            entry = self.index.get(h)
            if entry is None or entry[1] != tuple(tokens[: (i + 1) * BS]):
                break
            hits.append(entry[0])
        return hits

    def _take_fresh(self, n: int) -> list[int]:
        got = self.free_order[:n]
        del self.free_order[:n]
        for b in got:
            h = self._block_cached_as(b)
            if h is not None:
                del self.index[h]  # evicted
        return got

    def _snapshot(self):
        pool = self.kv.pool
        return (list(pool.free_list), [b.ref_count for b in pool.blocks], dict(pool.cached))

    def _expect_cached_after_compute(self, request: Request) -> None:
        num_full = min(request.num_computed_tokens // BS, len(request.block_ids))
        hashes = chain_hashes(request.token_ids, BS)
        for i in range(request.num_registered_blocks, num_full):
            block_id = request.block_ids[i]
            if self._block_cached_as(block_id) is None and hashes[i] not in self.index:
                self.index[hashes[i]] = (block_id, tuple(request.token_ids[: (i + 1) * BS]))

    def _grow(self, request: Request, num_new: int) -> bool:
        """`kv.allocate` for a running request, checked against the model."""
        total = -(-(request.num_computed_tokens + num_new) // BS)
        fresh = max(0, total - len(request.block_ids))
        before = self._snapshot()
        old_blocks = list(request.block_ids)
        ok = self.kv.allocate(request, num_new)
        assert ok == (fresh <= len(self.free_order))
        if not ok:
            assert self._snapshot() == before and request.block_ids == old_blocks
            return False
        assert request.block_ids == old_blocks + self._take_fresh(fresh)
        return True

    # ---- rules -----------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=14), max_tokens=st.integers(1, 12))
    def new_request(self, prefix, suffix, max_tokens):
        tokens = prefix + suffix
        if not tokens:
            tokens = [0]
        self.counter += 1
        self.waiting.append(make_request(f"r{self.counter}", tokens, max_tokens, self.counter))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data(), chunk=st.integers(1, 20))
    def admit(self, data, chunk):
        request = data.draw(st.sampled_from(self.waiting), label="request")
        hits = self.kv.find_cached_prefix(request)
        assert hits == self._expected_hits(request)
        assert len(hits) * BS <= request.num_tokens - 1, "a prefix hit covers the last token"
        assert request.block_hashes[: len(chain_hashes(request.token_ids, BS))] == chain_hashes(request.token_ids, BS)
        num_new = min(request.num_tokens - len(hits) * BS, chunk)
        total = -(-(len(hits) * BS + num_new) // BS)
        refs = self._expected_refs()
        revived = [b for b in hits if refs[b] == 0]
        fresh = total - len(hits)
        before = self._snapshot()
        ok = self.kv.allocate(request, num_new, hits)
        assert ok == (fresh + len(revived) <= len(self.free_order))
        if not ok:
            assert self._snapshot() == before
            assert request.block_ids == [] and request.num_computed_tokens == 0
            return
        for b in revived:
            self.free_order.remove(b)
        new_blocks = self._take_fresh(fresh)
        assert request.block_ids == hits + new_blocks
        assert not set(new_blocks) & set(hits)
        assert request.num_computed_tokens == len(hits) * BS
        self.waiting.remove(request)
        self.running.append(request)
        # The granted chunk is computed by this step's forward pass.
        self._compute(request, num_new)

    def _compute(self, request: Request, num_new: int) -> None:
        request.num_computed_tokens += num_new
        assert len(request.block_ids) * BS >= request.num_computed_tokens
        self._expect_cached_after_compute(request)
        self.kv.cache_computed_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            # Reached the end of input: "sample" one more token (uncomputed until next step).
            request.append_output_token((request.num_tokens * 7) % 10)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def step_running(self, data, chunk):
        request = data.draw(st.sampled_from(self.running), label="request")
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        assert num_new > 0
        if self._grow(request, num_new):
            self._compute(request, num_new)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        """Finish a request, or preempt it (recompute): its blocks go back tail first."""
        request = data.draw(st.sampled_from(self.running), label="request")
        blocks = list(request.block_ids)
        self.kv.free(request)
        assert request.block_ids == [] and request.num_registered_blocks == 0
        self.running.remove(request)
        refs = self._expected_refs()
        for b in reversed(blocks):
            if refs[b] == 0 and b not in self.free_order:
                self.free_order.append(b)
        if preempt:
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.waiting.append(request)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def reserve_whole_life(self, data):
        """A protected request reserves blocks for every token it may ever hold."""
        request = data.draw(st.sampled_from(self.running), label="request")
        before = self._snapshot()
        old = list(request.block_ids)
        need = -(-request.max_total_tokens // BS)
        fresh = max(0, need - len(old))
        ok = self.kv.allocate(request, 0, reserve_tokens=request.max_total_tokens)
        assert ok == (fresh <= len(self.free_order))
        if ok:
            assert request.block_ids == old + self._take_fresh(fresh)
            assert len(request.block_ids) * BS >= request.max_total_tokens
        else:
            assert self._snapshot() == before and request.block_ids == old

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        kv = self.kv
        pool = kv.pool
        pool.check_invariants()
        refs = self._expected_refs()
        assert [b.ref_count for b in pool.blocks] == refs, "ref counts differ from the holders"
        assert pool.num_free == refs.count(0) == len(self.free_order)
        assert list(pool.free_list) == self.free_order, "free list is not in LRU order"
        # No block held by two requests unless it is a shared (cached) prefix block.
        owners = collections.defaultdict(list)
        for r in self.running:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id} holds a block twice"
            for b in r.block_ids:
                owners[b].append(r)
        for b, holders in owners.items():
            if len(holders) > 1:
                assert pool.blocks[b].block_hash is not None, f"uncached block {b} shared by {len(holders)} requests"
        # Expected index, and every cached block's hash is the chain of the tokens it ends.
        assert {h: b for h, (b, _) in self.index.items()} == pool.cached
        for h, (b, prefix) in self.index.items():
            block = pool.blocks[b]
            assert block.block_hash == h
            assert block.token_ids == prefix[-BS:]
            assert len(prefix) % BS == 0
            assert chain_hashes(prefix, BS)[-1] == h
        # A request's cached blocks hold exactly its tokens.
        for r in self.running:
            hashes = chain_hashes(r.token_ids, BS)
            for i, b in enumerate(r.block_ids):
                block = pool.blocks[b]
                if block.block_hash is not None:
                    assert block.block_hash == hashes[i]
                    assert block.token_ids == tuple(r.token_ids[i * BS : (i + 1) * BS])
        assert 0.0 <= kv.usage <= 1.0


TestKVCacheManager = KVManagerMachine.TestCase
TestKVCacheManager.settings = STATEFUL_SETTINGS


# --------------------------------------------------------------------------------------
# Targeted cases
# --------------------------------------------------------------------------------------


def test_eviction_takes_least_recently_freed_cached_block():
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(12)))  # 3 full blocks
    b = make_request("b", list(range(100, 108)))  # 2 full blocks
    for r in (a, b):
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    assert len(kv.pool.cached) == 5
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)  # freed first: least recently used
    kv.free(b)
    # The free list: the never-used block, then a's blocks tail first, then b's.
    assert list(kv.pool.free_list) == [5] + a_blocks[::-1] + b_blocks[::-1]
    got = kv.pool.allocate(2)
    assert got == [5, a_blocks[2]]
    assert kv.pool.num_evictions == 1
    # a's last block is gone from the cache; its first two and all of b's remain.
    assert kv.pool.blocks[a_blocks[2]].block_hash is None
    probe = make_request("p", list(range(12)) + [999])
    assert kv.find_cached_prefix(probe) == a_blocks[:2]
    probe_b = make_request("q", list(range(100, 108)) + [1])
    assert kv.find_cached_prefix(probe_b) == b_blocks
    kv.pool.check_invariants()


def test_a_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(16)))
    assert kv.allocate(a, 16)
    a.num_computed_tokens = 16
    kv.cache_computed_blocks(a)
    assert len(kv.pool.cached) == 4
    same = make_request("same", list(range(16)))  # the whole prompt is cached
    hits = kv.find_cached_prefix(same)
    assert len(hits) == 3, "the last block holds the last prompt token: it must be recomputed"
    assert kv.allocate(same, 16 - 3 * BS, hits)
    assert same.num_computed_tokens == 12
    one_more = make_request("more", list(range(16)) + [5])
    assert len(kv.find_cached_prefix(one_more)) == 4
    single = make_request("single", [0])
    assert kv.find_cached_prefix(single) == []


def test_hit_compares_token_ids_not_only_the_hash():
    kv = KVCacheManager(4, BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    (block_hash,) = kv.pool.cached
    # Forge a collision: same hash indexed, other tokens in the block.
    kv.pool.blocks[a.block_ids[0]].token_ids = (9, 9, 9, 9)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 6])) == []


def test_prefix_caching_disabled_caches_nothing():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make_request("a", list(range(13)))
    assert kv.allocate(a, 13)
    a.num_computed_tokens = 13
    kv.cache_computed_blocks(a)
    assert kv.pool.cached == {}
    kv.free(a)
    assert kv.find_cached_prefix(make_request("b", list(range(13)))) == []
    assert kv.pool.num_free == 8


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(10)))
    assert kv.allocate(a, 10)  # 3 blocks
    b = make_request("b", list(range(50, 60)))
    before = (list(kv.pool.free_list), [blk.ref_count for blk in kv.pool.blocks])
    assert not kv.allocate(b, 10)
    assert b.block_ids == [] and (list(kv.pool.free_list), [blk.ref_count for blk in kv.pool.blocks]) == before
    assert kv.allocate(b, 4)
    assert kv.pool.num_free == 0


def test_reviving_a_free_cached_block_counts_against_the_pool():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    a_blocks = list(a.block_ids)
    kv.free(a)
    filler = make_request("f", [42])
    assert kv.allocate(filler, 1)
    assert not set(filler.block_ids) & set(a_blocks), "took a cached block while a never-used one was older"
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits a's 2 blocks, needs 2 more
    hits = kv.find_cached_prefix(b)
    assert hits == a_blocks
    # 2 revived + 2 fresh > 3 free: refused without touching anything.
    assert not kv.can_allocate(b, 5, hits)
    assert not kv.allocate(b, 5, hits)
    assert kv.pool.num_free == 3 and len(kv.pool.cached) == 2 and b.block_ids == []
    kv.free(filler)
    assert kv.allocate(b, 5, hits)
    assert b.block_ids[:2] == hits and kv.pool.num_free == 0
    assert b.num_computed_tokens == 8
    kv.pool.check_invariants()


def test_swap_space_hands_out_each_host_block_once():
    swap = SwapSpace(5)
    a = swap.allocate(3)
    b = swap.allocate(2)
    assert sorted(a + b) == list(range(5)) and swap.num_free == 0
    swap.free(a)
    assert swap.num_free == 3
    c = swap.allocate(3)
    assert sorted(c) == sorted(a)


# --------------------------------------------------------------------------------------
# Blocks released behind a sliding window
# --------------------------------------------------------------------------------------


def test_blocks_wholly_behind_the_window_are_released_and_stay_cached():
    kv = KVCacheManager(16, BS, window=6)
    a = make_request("a", list(range(20)))
    assert kv.allocate(a, 20)   # 5 blocks
    blocks = list(a.block_ids)
    a.num_computed_tokens = 9   # the next token, at 9, sees 4..9: block 0 (0..3) is behind
    kv.cache_computed_blocks(a)
    kv.free_behind_window(a)
    assert a.block_ids == [NULL_BLOCK] + blocks[1:] and a.num_freed_blocks == 1
    row = kv.block_table.ids[kv.block_table.row_of[a]]
    assert row[:5].tolist() == [0] + blocks[1:]   # the runner reads block 0 there, masked
    kv.check_invariants()
    a.num_computed_tokens = 14   # sees 9..14: blocks 0 and 1 (..7) behind, block 2 (8..11) partly in
    kv.cache_computed_blocks(a)
    kv.free_behind_window(a)
    assert a.num_freed_blocks == 2 and a.block_ids[:2] == [NULL_BLOCK] * 2
    assert kv.pool.num_used == 3 and kv.pool.blocks[blocks[0]].block_hash is not None
    kv.check_invariants()
    # A request with a's first 13 tokens hits the released blocks (and the held one after them).
    b = make_request("b", list(range(13)))
    assert kv.find_cached_prefix(b) == blocks[:3]
    kv.free(a)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def test_no_window_keeps_every_block():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(20)))
    assert kv.allocate(a, 20)
    a.num_computed_tokens = 20
    kv.free_behind_window(a)
    assert a.num_freed_blocks == 0 and kv.pool.num_used == 5


def test_a_hit_takes_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(16, BS, window=6, max_step_tokens=4)
    a = make_request("a", list(range(20)))
    assert kv.allocate(a, 20)
    blocks = list(a.block_ids)
    a.num_computed_tokens = 20
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = make_request("b", list(range(20)) + [99])
    cached = kv.find_cached_prefix(b)
    assert cached == blocks
    assert kv._num_blocks_to_take(b, 1, cached) == 3   # blocks 3 and 4 revived, one for token 20
    assert kv.allocate(b, 1, cached)   # token 20 sees 15..20: blocks 0..2 (..11) are behind
    assert b.block_ids[:5] == [NULL_BLOCK] * 3 + blocks[3:] and b.num_freed_blocks == 3
    assert b.num_computed_tokens == 20 and b.num_registered_blocks == 5 and kv.pool.num_used == 3
    kv.check_invariants()
    kv.free(b)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def test_admission_and_reservation_count_a_window_of_blocks():
    """Steps of 4 tokens through a window of 6: (6 - 1 + 4) / 4 + 1 = 4 blocks at once, however
    long the request; a protected request reserves those, ahead of its released front."""
    kv = KVCacheManager(16, BS, window=6, max_step_tokens=4)
    assert kv.max_live_blocks(10) == 3 and kv.max_live_blocks(400) == 4
    assert KVCacheManager(16, BS).max_live_blocks(400) == 100
    c = make_request("c", list(range(8)), max_tokens=40)   # 47 tokens of KV
    assert kv.reserved_tokens(c) == 16
    assert kv.allocate(c, 4, reserve_tokens=kv.reserved_tokens(c)) and len(c.block_ids) == 4
    c.num_computed_tokens = 12   # sees 7..12: block 0 (0..3) behind
    kv.free_behind_window(c, reserve=True)
    assert c.num_freed_blocks == 1 and len(c.block_ids) == 5 and kv.pool.num_used == 4
    assert kv.reserved_tokens(c) == 20
    kv.check_invariants()
    kv.free(c)
    kv.check_invariants()


def test_back_from_swap_space_the_released_front_is_not_taken_again():
    kv = KVCacheManager(8, BS, window=4)
    a = make_request("a", list(range(18)))
    assert kv.allocate(a, 18)   # 5 blocks
    a.num_computed_tokens = 17   # sees 14..17: blocks 0..2 (..11) behind
    kv.cache_computed_blocks(a)
    kv.free_behind_window(a)
    held = a.block_ids[a.num_freed_blocks :]
    assert a.num_freed_blocks == 3 and len(held) == 2
    kv.free(a)   # swapped out: the host holds `held`
    assert a.num_freed_blocks == 3 and kv.pool.num_used == 0
    assert kv.can_allocate(a, 1)
    assert kv.allocate(a, 1)   # token 17 again: blocks 3 and 4 only
    assert a.block_ids[:3] == [NULL_BLOCK] * 3 and len(a.block_ids) == 5 and kv.pool.num_used == 2
    kv.check_invariants()
    kv.free(a)
    kv.check_invariants()
