"""Paged KV-cache bookkeeping: block allocation, prefix caching, swap space.

Only ids and counts live here; the KV tensors themselves belong to the model runner.
A block holds `block_size` consecutive tokens of one sequence. Blocks may be shared,
reference counted: full blocks between requests through the prefix cache, and any block of
a prompt between the sequences of one parallel-sampling group (`fork`). A sequence about to
write into a block it shares gets its own copy first (`copy_on_write`): a block's reference
count is the number of block tables that hold it, and the prefix cache holds none.

On a model whose every layer slides with one window (ModelArch.sliding_window: Mistral, Phi-3
with a window), a running request releases the blocks that lie wholly behind its window
(`free_behind_window`), so a long sequence holds O(window) blocks. Its block list keeps its
positions: a released entry is NULL_BLOCK. A released block goes back to the pool like any
freed one, keeping its prefix-cache entry: its KV is still that of its whole prefix, so a later
hit on it is as good as on any cached block (a hit always covers a prefix from its first block).
A hit takes only the hit blocks that its first computed token's window reaches; those before
are released entries from the start. So a request holds at most `max_live_blocks` at once,
however long it is, and that, not its length, is what admission counts against the pool.
Models that mix windowed and global layers (Gemma, Qwen with max_window_layers) keep every
block: their global layers read the whole context.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from backend import kv_events
from backend.request import Request

# Chain root: the parent hash of a sequence's first block (with no LoRA adapter).
ROOT_HASH = b""
# A request's block-list entry for a block released behind the sliding window. In the runner's
# block table (BlockTable) it reads as block 0: attention masks every position behind the
# window, and the pool starts zeroed and is only ever written with finite KV, so what it
# reads there is finite and weighs exactly 0.
NULL_BLOCK = -1


@functools.lru_cache(maxsize=1024)
def root_hash(lora_name: str | None) -> bytes:
    """The parent hash of a sequence's first block: KV computed under a LoRA adapter differs
    from the base model's and from every other adapter's for the same tokens, so each adapter
    roots a chain of its own."""
    return ROOT_HASH if lora_name is None else hashlib.sha256(b"lora\0" + lora_name.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained content hash of a full block: equal iff the whole prefix is equal.

    sha256 so that a collision of two different prefixes is not a practical concern;
    hits still compare the block's token ids as a second line of defence.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Fixed pool of KV blocks with an LRU free list and a prefix-cache index.

    Invariants (checked by `check_invariants`, exercised by property tests):
    - a block with ref_count > 0 is never in the free list, one with ref_count == 0 always is;
    - the free list is in LRU order: allocation takes (and evicts) from its front, a freed
      block goes to its back; `OrderedDict` makes allocate, free and touch O(1);
    - every block in `cached` has the hash it is indexed under, and vice versa.

    With `record_events`, every change to `cached` is appended to `events` as a vLLM KV event
    (backend/kv_events.py), in order, for `take_events` to hand to a publisher.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, record_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_list: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events: list[kv_events.KVCacheEvent] | None = [] if record_events else None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self.free_list)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_list.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_list[block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the LRU list.

        Callers pass a sequence's blocks tail first, so a freed prefix outlives its tail.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_list[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...],
                    parent_hash: bytes = ROOT_HASH, lora_id: int | None = None, lora_name: str | None = None) -> None:
        """Register a full block. If an equal block is already indexed, keep that one."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block_id
        if self.events is not None:
            self.events.append(kv_events.block_stored(block_hash, parent_hash, token_ids, lora_id, lora_name))

    def reset_prefix_cache(self) -> None:
        events, self.events = self.events, None  # one AllBlocksCleared stands for every removal
        for block_hash, block_id in list(self.cached.items()):
            self._uncache(self.blocks[block_id])
        self.events = events
        if self.events is not None:
            self.events.append(kv_events.AllBlocksCleared())

    def take_events(self) -> list[kv_events.KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _uncache(self, block: Block) -> None:
        if self.events is not None:
            self.events.append(kv_events.block_removed(block.block_hash))
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self.free_list
            assert block.ref_count >= 0
            assert in_free == (block.ref_count == 0), f"block {block.block_id}: ref {block.ref_count}, free {in_free}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash


class BlockTable:
    """Every block-holding request's `block_ids` as one row of an int32 array, for the runner.

    The model runner needs a padded [batch, most blocks] table every step; flattening the
    requests' lists for it cost 100-250 us a step at 256 running requests, where `gather`
    is one fancy index. KVCacheManager, the only writer of `block_ids`, keeps the rows in
    step with the lists, which change little: while a request holds blocks its list only
    grows (`allocate` appends, a decode once every `block_size` steps; a prefix-cache hit
    fills an empty list) but for the tail a rejected draft leaves (`truncate`, which
    shortens the row with it) and the front a sliding window leaves behind (`release_front`,
    whose entries read 0), and `free` empties it at once (finish, abort, preemption by
    recompute or swap-out) and releases the row. So a list that is replaced, by a
    re-admission or a swap-in, is always written into a fresh row from its first block:
    no stale ids, whatever the new list's length or first block.

    Entries past a row's length are 0, so gathered rows equal a freshly padded table.
    """

    def __init__(self, num_rows: int = 64, num_cols: int = 32):
        self.ids = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.lengths = np.zeros(num_rows, dtype=np.int64)
        self.row_of: dict[Request, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest

    def sync(self, request: Request) -> None:
        """Copy the blocks appended to `request.block_ids` since its row was last written."""
        block_ids = request.block_ids
        row = self.row_of.get(request)
        if row is None:
            if not block_ids:
                return
            row = self._take_row(request)
        start, end = int(self.lengths[row]), len(block_ids)
        if end < start:
            raise RuntimeError(f"{request.request_id}: block list shrank without KVCacheManager.free or truncate")
        if end > self.ids.shape[1]:
            self._grow(self.ids.shape[0], max(end, 2 * self.ids.shape[1]))
        self.ids[row, start:end] = block_ids[start:]
        if start < request.num_freed_blocks:  # re-admitted from swap, its front released
            self.ids[row, start : request.num_freed_blocks] = 0
        self.lengths[row] = end

    def release_front(self, request: Request, start: int, end: int) -> None:
        """Entries `start:end` of the request's row were released behind the window (NULL_BLOCK)."""
        self.ids[self.row_of[request], start:end] = 0

    def replace(self, request: Request, index: int) -> None:
        """Rewrite entry `index` of the request's row (copy-on-write swapped that block)."""
        self.ids[self.row_of[request], index] = request.block_ids[index]

    def truncate(self, request: Request) -> None:
        """`request.block_ids` lost its tail (KVCacheManager.truncate): shorten its row."""
        row = self.row_of[request]
        end = len(request.block_ids)
        self.ids[row, end : self.lengths[row]] = 0
        self.lengths[row] = end

    def release(self, request: Request) -> None:
        row = self.row_of.pop(request, None)
        if row is None:
            return
        self.ids[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free_rows.append(row)

    def rows(self, requests: list[Request]) -> np.ndarray:
        """The rows of `requests`, which must hold blocks."""
        return np.fromiter(map(self.row_of.__getitem__, requests), dtype=np.intp, count=len(requests))

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), their most blocks] int32: those rows' block ids, 0-padded."""
        return self.ids[rows, : int(self.lengths[rows].max())]

    def _take_row(self, request: Request) -> int:
        if not self._free_rows:
            num_rows = self.ids.shape[0]
            self._grow(2 * num_rows, self.ids.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self.row_of[request] = row
        return row

    def _grow(self, num_rows: int, num_cols: int) -> None:
        ids = np.zeros((num_rows, num_cols), dtype=np.int32)
        ids[: self.ids.shape[0], : self.ids.shape[1]] = self.ids
        lengths = np.zeros(num_rows, dtype=np.int64)
        lengths[: len(self.lengths)] = self.lengths
        self.ids, self.lengths = ids, lengths

    def check_invariants(self) -> None:
        rows = list(self.row_of.values())
        assert len(set(rows)) == len(rows), "a row is held by two requests"
        assert sorted(rows + self._free_rows) == list(range(self.ids.shape[0])), "rows leaked or double-freed"
        for request, row in self.row_of.items():
            n = len(request.block_ids)
            assert n > 0 and self.lengths[row] == n, (request.request_id, n, int(self.lengths[row]))
            want = [0 if b == NULL_BLOCK else b for b in request.block_ids]
            assert self.ids[row, :n].tolist() == want, f"{request.request_id}: stale row"
        padding = np.arange(self.ids.shape[1]) >= self.lengths[:, None]
        assert not self.ids[padding].any(), "nonzero entry past a row's length"


class KVCacheManager:
    """Maps requests to blocks: prefix-cache lookup, growth, release.

    A request's `block_ids` cover `token_ids[:num_computed_tokens + granted]`. Its full
    blocks are hashed as they fill, so a later request with the same prefix (or the
    same request recomputing after preemption) reuses them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False, window: int | None = None, max_step_tokens: int | None = None):
        self.block_size = block_size
        # Every layer's sliding window, when they share one: blocks behind it are released.
        self.window = window
        # The most tokens one request computes in a step (its chunk): with a window, how far
        # its blocks may run ahead of the window's front (None: not known, so not bounded).
        self.max_step_tokens = max_step_tokens
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_events)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_table = BlockTable()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def window_bounds_live_blocks(self) -> bool:
        """Whether a request holds a bounded number of blocks at once, whatever its length:
        a window on every layer, and a known step size."""
        return self.window is not None and self.max_step_tokens is not None

    def max_live_blocks(self, num_tokens: int) -> int:
        """The most blocks a request whose KV covers `num_tokens` tokens holds at once. With a
        window, a step's tokens computed from position c need c - window + 1 on, and the blocks
        wholly before that are released: (window - 1 + a step's tokens) / block_size, plus one
        for a block only partly behind the window."""
        whole = self.blocks_needed(num_tokens)
        if not self.window_bounds_live_blocks:
            return whole
        return min(whole, self.blocks_needed(self.window - 1 + self.max_step_tokens) + 1)

    def _window_front(self, num_computed: int) -> int:
        """Blocks wholly behind the window of the token at position `num_computed`."""
        return max(0, (num_computed - self.window + 1) // self.block_size) if self.window is not None else 0

    def reserved_tokens(self, request: Request, num_cached_blocks: int = 0) -> int:
        """Tokens whose blocks a protected request holds (`allocate`'s reserve_tokens), so that
        none of its later allocations can fail: its whole life; with a window, the most blocks it
        holds at once past its released front (that a prefix hit of `num_cached_blocks` sets), and
        as the front advances the reservation follows it (`free_behind_window`)."""
        total = request.max_total_tokens
        if not self.window_bounds_live_blocks:
            return total
        front = max(request.num_freed_blocks, self._window_front(num_cached_blocks * self.block_size))
        return min(total, (front + self.max_live_blocks(total)) * self.block_size)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` over every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else root_hash(request.lora_name)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Longest run of cached full blocks that starts the request's tokens.

        Never covers the last token: its logits must be computed to sample from them.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        tokens = request.token_ids
        bs = self.block_size
        for i in range(max_blocks):
            block_id = self.pool.lookup(request.block_hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        return self._num_blocks_to_take(request, num_new_tokens, cached_blocks) <= self.pool.num_free

    def _num_blocks_to_take(self, request: Request, num_new_tokens: int, cached_blocks: list[int]) -> int:
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        total = self.blocks_needed(num_computed + num_new_tokens)
        # A request back from swap space re-takes none of the blocks released behind its window.
        fresh = max(0, total - max(len(request.block_ids), request.num_freed_blocks) - len(cached_blocks))
        # A hit on a free cached block takes it off the free list too (those behind the window: none).
        front = self._window_front(num_computed) if cached_blocks else 0
        revived = sum(1 for b in cached_blocks[front:] if self.pool.blocks[b].ref_count == 0)
        return fresh + revived

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] = (), reserve_tokens: int = 0
    ) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens (after any cached prefix),
        and at least `reserve_tokens` in all (a protected request: `reserved_tokens`).

        Returns False, changing nothing, when the pool cannot cover it.
        """
        if not cached_blocks:
            capacity = len(request.block_ids) * self.block_size
            if request.num_computed_tokens + num_new_tokens <= capacity and reserve_tokens <= capacity:
                return True  # the common decode step: the last block still has room
        num_new_tokens = max(num_new_tokens, reserve_tokens - request.num_computed_tokens - len(cached_blocks) * self.block_size)
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        if cached_blocks:
            assert not request.block_ids and request.num_computed_tokens == 0
            num_computed = len(cached_blocks) * self.block_size
            # The hit blocks behind the first computed token's window are released at once.
            front = self._window_front(num_computed)
            self.pool.touch(list(cached_blocks[front:]))
            request.block_ids.extend([NULL_BLOCK] * front)
            request.block_ids.extend(cached_blocks[front:])
            request.num_freed_blocks = front
            request.num_computed_tokens = num_computed
            request.num_registered_blocks = len(cached_blocks)
        if not request.block_ids and request.num_freed_blocks:
            request.block_ids.extend([NULL_BLOCK] * request.num_freed_blocks)
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        fresh = total - len(request.block_ids)
        if fresh > 0:
            request.block_ids.extend(self.pool.allocate(fresh))
        self.block_table.sync(request)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_ids))
        if num_full <= request.num_registered_blocks:
            return
        self._update_block_hashes(request)
        tokens = request.token_ids
        # vLLM's LoRA ids count from 1; the events name the adapter a block was computed under.
        lora_id = request.lora_index + 1 if request.lora_name is not None else None
        # Blocks released behind the window are gone from the list (back from swap space, the
        # request registers the rest again; the pool keeps one block per hash).
        for i in range(max(request.num_registered_blocks, request.num_freed_blocks), num_full):
            # A first block has no parent in the events, as vLLM's, whatever its adapter.
            parent = request.block_hashes[i - 1] if i else ROOT_HASH
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i], tuple(tokens[i * bs : (i + 1) * bs]),
                                  parent, lora_id, request.lora_name)
        request.num_registered_blocks = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` (no blocks yet) a reference to every block of `parent` that holds its
        computed tokens, as of `child.num_computed_tokens`. Full blocks stay shared for the
        sequences' lives; a shared partial block is copied by the first writer (`copy_on_write`)."""
        assert not child.block_ids
        shared = parent.block_ids[: self.blocks_needed(child.num_computed_tokens)]
        child.num_freed_blocks = min(parent.num_freed_blocks, len(shared))
        self.pool.touch(shared[child.num_freed_blocks :])
        child.block_ids.extend(shared)
        child.block_hashes = list(parent.block_hashes)
        self.block_table.sync(child)

    def copy_on_write(self, request: Request, copies: dict[int, int]) -> bool:
        """Make the block the request writes next its own: if another block table holds it too,
        move the request onto a fresh block and record the copy (destination -> source) in
        `copies`, which the model runner makes before the step's forward pass. False, changing
        nothing, when no block is free. O(1); only sequences of a group can share a block they write."""
        index = request.num_computed_tokens // self.block_size
        if index >= len(request.block_ids):
            return True
        source = request.block_ids[index]
        if self.pool.blocks[source].ref_count == 1:
            return True
        if self.pool.num_free == 0:
            return False
        (copy,) = self.pool.allocate(1)
        copies[copy] = source
        self.pool.free([source])
        request.block_ids[index] = copy
        self.block_table.replace(request, index)
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those that hold its first `num_tokens` tokens (the
        slots of rejected draft tokens). Those blocks were never full of computed tokens, so
        never in the prefix cache."""
        keep = max(1, self.blocks_needed(num_tokens))
        if len(request.block_ids) <= keep:
            return
        assert request.num_registered_blocks <= keep
        tail = request.block_ids[keep:]
        del request.block_ids[keep:]
        self.pool.free(list(reversed(tail)))
        self.block_table.truncate(request)

    def free_behind_window(self, request: Request, reserve: bool = False) -> None:
        """Release the request's blocks that lie wholly behind its window: the next token it
        computes, at position num_computed_tokens, sees keys from num_computed_tokens - window + 1
        on, and so does every later one. Called once its computed tokens are registered, so a
        released block keeps its prefix-cache entry. A protected request (`reserve`) moves its
        reservation (`reserved_tokens`) ahead by as many blocks as it released, which the pool
        has just got back (unless a group's sibling still holds one: then the blocks it lacks
        come with a later step's allocation)."""
        if self.window is None:
            return
        start = request.num_freed_blocks
        end = min(self._window_front(request.num_computed_tokens), len(request.block_ids))
        if end <= start:
            return
        released = request.block_ids[start:end]
        request.block_ids[start:end] = [NULL_BLOCK] * (end - start)
        request.num_freed_blocks = end
        self.block_table.release_front(request, start, end)
        self.pool.free(list(reversed(released)))  # the front last: a hit needs the first blocks most
        if reserve:
            self.allocate(request, 0, reserve_tokens=self.reserved_tokens(request))

    def free(self, request: Request) -> None:
        self.block_table.release(request)
        self.pool.free(list(reversed(request.block_ids[request.num_freed_blocks :])))
        request.block_ids.clear()
        request.num_registered_blocks = 0

    def check_invariants(self) -> None:
        """The pool's and the table's, and: every block's reference count is the number of
        block tables (requests) that hold it; the prefix cache holds no reference."""
        self.pool.check_invariants()
        self.block_table.check_invariants()
        for r in self.block_table.row_of:
            freed = r.num_freed_blocks
            assert all(b == NULL_BLOCK for b in r.block_ids[:freed]), f"{r.request_id}: a released entry holds a block"
            assert NULL_BLOCK not in r.block_ids[freed:], f"{r.request_id}: a NULL_BLOCK past the released front"
        holders = np.bincount(
            np.fromiter((b for r in self.block_table.row_of for b in r.block_ids[r.num_freed_blocks :]), dtype=np.int64),
            minlength=self.pool.num_blocks,
        )
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]} block tables")


class SwapSpace:
    """Host-memory blocks that hold preempted requests' KV in swap mode (no sharing)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids)
        return [self.free_ids.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self.free_ids.extend(block_ids)
