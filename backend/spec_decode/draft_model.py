"""A draft model: a smaller model of the same tokenizer (or the served model quantized, as its
own draft) drafts k tokens greedily for every speculating request, batched.

The draft keeps its own paged KV cache. Each step it first catches each request up, in one
ragged pass: the tokens that joined the request since the draft last saw it (the whole prompt
the first time; after a verification, the tokens past the longest prefix the draft had right),
whose last logits row gives the first draft; then one pass per further draft, one token per
request. The draft's KV of its own accepted drafts stays valid (they are the request's
tokens), so a request costs the draft only its new tokens.

The draft is greedy: a deterministic draft is what the rejection rule in verify.py assumes for
sampled requests, and it keeps their output distributed as without speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from backend.models.llama import AttentionMetadata
from backend.models.loader import load_arch, load_model, load_tokenizer
from backend.request import RequestStatus
from backend.spec_decode.adaptive import CostCurve
from backend.spec_decode.base import Proposer

if TYPE_CHECKING:
    from backend.request import Request
    from backend.spec_decode.config import SpeculativeConfig


@dataclass
class _DraftState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    # The tokens whose K and V the draft's cache holds, positions 0.. in order.
    cached: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0])


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, *, target_vocab_size: int, target_vocab: dict[str, int],
                 dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        path = config.model
        arch, _ = load_arch(path)
        if arch.vocab_size != target_vocab_size:
            raise ValueError(f"invalid engine parameter: speculative_config: model={path!r} has a vocabulary "
                             f"of {arch.vocab_size} tokens, the served model {target_vocab_size}")
        if load_tokenizer(path).get_vocab() != target_vocab:
            raise ValueError(f"invalid engine parameter: speculative_config: model={path!r} has another "
                             "tokenizer than the served model (its token ids mean other text)")
        self.model, _ = load_model(path, dtype, device, max_model_len, quantization=config.quantization,
                                   activation_quantization=config.activation_quantization)
        self.dtype = dtype
        self.device = device
        self.kv_caches: list = []
        self._free: list[int] = []
        self._states: dict[tuple[str, int], _DraftState] = {}
        self.pass_cost = CostCurve()

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        from backend.model_runner import kv_block_bytes  # the runner imports the engine's pieces

        return kv_block_bytes(self.model.arch, block_size, dtype)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """As many blocks as the target's pool: every token a running request holds in the
        target's cache, drafts included, has room in the draft's."""
        from backend.model_runner import make_kv_cache

        self.block_size = block_size
        self.kv_caches = [(make_kv_cache(num_blocks, block_size, self.model.arch, self.dtype, "auto", self.device),
                           make_kv_cache(num_blocks, block_size, self.model.arch, self.dtype, "auto", self.device))
                          for _ in range(self.model.arch.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        self._release_idle()
        drafts: list[list[int]] = [[] for _ in requests]
        batch: list[tuple[int, _DraftState]] = []
        for i, (request, k) in enumerate(zip(requests, ks)):
            state = self._states.setdefault((request.request_id, request.seq_index), _DraftState(request))
            tokens = request.token_ids
            valid = min(_common_prefix(state.cached, tokens), len(tokens) - 1)
            del state.cached[valid:]
            # Room for the new tokens and the k - 1 drafts the later passes feed.
            if not self._reserve(state, len(tokens) + k - 1):
                continue
            batch.append((i, state))
        if not batch:
            return drafts
        feeds = [requests[i].token_ids[len(state.cached):] for i, state in batch]
        with torch.inference_mode():
            for step in range(max(ks[i] for i, _ in batch)):
                for (i, state), feed in zip(batch, feeds):
                    state.cached.extend(feed)
                start = time.perf_counter()
                next_tokens = self._forward(batch, feeds)  # returns host ints: the pass has ended
                self.pass_cost.observe(sum(map(len, feeds)), time.perf_counter() - start)
                for (i, _), token in zip(batch, next_tokens):
                    drafts[i].append(token)
                still = [n for n, (i, _) in enumerate(batch) if len(drafts[i]) < ks[i]]
                batch = [batch[n] for n in still]
                feeds = [[drafts[i][-1]] for i, _ in batch]
                if not batch:
                    break
        return drafts

    def _forward(self, batch: list[tuple[int, _DraftState]], feeds: list[list[int]]) -> list[int]:
        """One ragged pass: each state's `feed` (already appended to its `cached`) at its
        positions; the greedy next token of each."""
        bs = self.block_size
        q_lens = np.array([len(f) for f in feeds], dtype=np.int64)
        seq_lens = np.array([len(state.cached) for _, state in batch], dtype=np.int64)
        cu = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        seq_index = np.repeat(np.arange(len(batch)), q_lens)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[seq_index] + (seq_lens - q_lens)[seq_index]
        width = max(len(state.block_ids) for _, state in batch)
        tables = np.zeros((len(batch), width), dtype=np.int32)
        for row, (_, state) in enumerate(batch):
            tables[row, : len(state.block_ids)] = state.block_ids
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        def put(array: np.ndarray, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(self.device)

        meta = AttentionMetadata(slot_mapping=put(slots, np.int64), block_tables=put(tables, np.int32),
                                 seq_lens=put(seq_lens, np.int32), cu_seqlens_q=put(cu, np.int32),
                                 max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(seq_lens.max()))
        input_ids = put(np.fromiter((t for f in feeds for t in f), dtype=np.int64, count=int(cu[-1])), np.int64)
        hidden = self.model(input_ids, put(positions, np.int64), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[put(cu[1:] - 1, np.int64)])
        return logits.argmax(dim=-1).tolist()

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(state.block_ids)
        if need > len(self._free):
            return False
        for _ in range(need):
            state.block_ids.append(self._free.pop())
        return True

    def _release(self, key: tuple[str, int]) -> None:
        state = self._states.pop(key, None)
        if state is not None:
            self._free.extend(reversed(state.block_ids))

    def _release_idle(self) -> None:
        """Requests no longer running (preempted, or ended) give their blocks back: the draft
        catches them up again if they return."""
        for key, state in list(self._states.items()):
            if state.request.status is not RequestStatus.RUNNING:
                self._release(key)

    def request_finished(self, request: Request) -> None:
        self._release((request.request_id, request.seq_index))
