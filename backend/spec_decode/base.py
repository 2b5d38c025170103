"""The one interface every proposer has, with the defaults of a proposer that runs no model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from backend.request import Request
    from backend.spec_decode.adaptive import CostCurve


class Proposer:
    # The measured seconds of the proposer's own model passes by their tokens, for the draft
    # budget to weigh before drafting; None where no model runs (a scan of token ids, small
    # beside a step).
    pass_cost: CostCurve | None = None

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """For each request, up to its `k` draft tokens to follow its tokens."""
        raise NotImplementedError

    def request_finished(self, request: Request) -> None:
        """The request ended (its final tokens are in it): forget it, or learn from it."""

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the proposer's own KV for one block of the target's pool: a draft model
        keeps a block for each of the target's, out of the same memory."""
        return 0

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """The proposer's own KV pool, once the target's is sized."""
