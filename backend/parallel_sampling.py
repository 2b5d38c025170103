"""Parallel sampling (`n`, `best_of` > 1): the fork of a group's sequences and the fold of
their outputs into the group's.

A group's leader prefills the prompt alone (backend/request.py, SequenceGroup). In the step
whose sample ends that prefill, `fork` adds the other sequences, sharing the leader's KV
blocks and sampling from its logits row; from then on each is a request of its own to the
scheduler. `fold` turns the sequences' outputs of a step into one output for their group,
so the client sees one request. Both cost nothing while no group is in flight: the engine
calls them only when `has_groups` (fold) or the scheduler holds an unforked leader (fork).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from backend.output import RequestOutput
from backend.request import Request, SequenceGroup
from backend.sampler import Sampler
from backend.structured_output import GrammarState

if TYPE_CHECKING:
    from backend.scheduler import Scheduler


class ParallelSampling:
    """The groups in flight, by request id, until their final output."""

    def __init__(self, scheduler: Scheduler, on_fork: Callable[[Request], None]):
        """`on_fork(child)` runs for each forked sequence before the scheduler takes it."""
        self.scheduler = scheduler
        self.on_fork = on_fork
        self.groups: dict[str, SequenceGroup] = {}

    @property
    def has_groups(self) -> bool:
        return bool(self.groups)

    def add(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group

    def fork(self, logits: torch.Tensor, sample_requests: list[Request]) -> tuple[torch.Tensor, list[Request]]:
        """Fork each group leader that samples its first token now: its sequences join the
        running batch sharing its blocks, and sample from its logits row, each with its own
        generator (sequence i of a request with seed s uses seed s + i)."""
        rows: list[int] = []
        requests: list[Request] = []
        for row, request in enumerate(sample_requests):
            rows.append(row)
            requests.append(request)
            num_children = request.seqs_to_fork
            for i in range(1, num_children + 1):
                child = self._fork_one(request, i)
                rows.append(row)
                requests.append(child)
        if len(requests) == len(sample_requests):
            return logits, sample_requests
        return logits[torch.tensor(rows, device=logits.device)], requests

    def _fork_one(self, leader: Request, seq_index: int) -> Request:
        group = leader.group
        params = leader.params
        child = Request(
            request_id=f"{leader.request_id}/{seq_index}",
            prompt_token_ids=leader.prompt_token_ids,
            params=params,
            max_tokens=leader.max_tokens,
            arrival_time=leader.arrival_time,
            arrival_seq=leader.arrival_seq,
            eos_token_ids=leader.eos_token_ids,
            prompt_text=leader.prompt_text,
            needs_logprobs=leader.needs_logprobs,
            bad_words_token_ids=leader.bad_words_token_ids,
            num_cached_prompt_tokens=leader.num_cached_prompt_tokens,
            first_scheduled_time=leader.first_scheduled_time,
            group=group,
            seq_index=seq_index,
            lora_name=leader.lora_name,
            lora_index=leader.lora_index,
        )
        if leader.grammar is not None:  # the same compiled grammar, a matcher of its own
            child.grammar = GrammarState(leader.grammar.compiled)
        # Computed once the step that forks it ends: the leader's whole prefill.
        child.num_computed_tokens = leader.num_tokens
        if params.seed is not None:
            child.generator = Sampler.make_request_generator(params.seed + seq_index)
        group.seqs.append(child)
        if len(group.seqs) == group.best_of:
            group.forked = True
        self.on_fork(child)
        self.scheduler.fork(leader, child)
        return child

    def fold(self, outputs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """One output per group per step in place of its sequences' (RequestOutput.of_group);
        the group's final output, finished at `now`, once every sequence has ended."""
        folded: list[RequestOutput | SequenceGroup] = []
        by_group: dict[SequenceGroup, list[RequestOutput | None]] = {}
        for output in outputs:
            group = output.group
            if group is None:
                folded.append(output)
                continue
            sequences = by_group.get(group)
            if sequences is None:
                sequences = by_group[group] = [None] * group.best_of
                folded.append(group)
            sequences[output.seq_index] = output
            if output.finished:
                group.done.add(output.seq_index)
                if output.seq_index == 0:
                    group.trace = output.trace
        result = []
        for item in folded:
            if isinstance(item, SequenceGroup):
                output = RequestOutput.of_group(item, by_group[item], now=now)
                if output.finished:
                    self.groups.pop(item.request_id, None)
                item = output
            result.append(item)
        return result
