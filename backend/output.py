"""What the engine returns for a request, step by step: `RequestOutput`.

Built on the engine's thread once per step per request that advanced (or ended), and read
on others (the Triton adapter's response thread), so an output is never changed once built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backend.request import FinishReason, Request, RequestError, SequenceGroup


@dataclass
class RequestOutput:
    """What one step produced for one request. Exactly one output per request has finished=True."""

    request_id: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_text: str = ""
    stop_reason: int | str | None = None
    error: RequestError | None = None
    cumulative_logprob: float | None = None
    # vLLM's shape: per new token, {token id: {"logprob", "rank", "decoded_token"}}.
    logprobs_delta: list[dict] | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # The request's trace (backend/trace.py), on its final output when it asked for one.
    trace: dict | None = None
    # Parallel sampling (n or best_of > 1). A group's output: `sequences[i]` is what this step
    # produced for its sequence i (None: nothing), over all best_of sequences; `returned` the
    # indices of the n sequences the client gets, in order (on the final output, the n with the
    # highest cumulative logprob when best_of > n). Its top-level counts cover the whole group.
    sequences: list[RequestOutput | None] | None = None
    returned: list[int] | None = None
    # A sequence's own output, before the engine folds it into its group's.
    group: SequenceGroup | None = None
    seq_index: int = 0
    # role prefill: on the final output of a request handed over (finish_reason
    # "transferred"), the handle of its transfer (backend/disagg.py).
    transfer: str | None = None

    @classmethod
    def of(cls, request: Request, text_delta: str, token_ids_delta: list[int], logprobs_delta: list[dict] | None = None,
           error: RequestError | None = None, *, now: float) -> RequestOutput:
        """The one builder: `request` as it stands, with what this step added to it. The
        output is final (finished=True) when the request has finished, at `now` (the
        engine's monotonic clock)."""
        finished = request.is_finished
        return cls(
            request_id=request.request_id,
            text_delta=text_delta,
            token_ids_delta=token_ids_delta,
            finished=finished,
            finish_reason=request.finish_reason.value if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_text=request.prompt_text,
            stop_reason=request.stop_reason,
            error=error,
            cumulative_logprob=request.cumulative_logprob if request.needs_logprobs else None,
            logprobs_delta=logprobs_delta,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=now if finished else None,
            trace=request.trace.to_json() if finished and request.trace is not None else None,
            group=request.group,
            seq_index=request.seq_index,
        )

    @classmethod
    def refused(cls, request_id: str, error: RequestError) -> RequestOutput:
        """The one output of a request refused before the engine held it (an import refused)."""
        return cls(request_id=request_id, text_delta="", token_ids_delta=[], finished=True,
                   finish_reason=FinishReason.ERROR.value, num_prompt_tokens=0, num_output_tokens=0, error=error)

    @classmethod
    def of_group(cls, group: SequenceGroup, sequences: list[RequestOutput | None], *, now: float) -> RequestOutput:
        """The group's output for one step, from its sequences' (indexed by sequence); `now`
        as for `of`."""
        leader = group.seqs[0]
        finished = group.finished
        errors = [o.error for o in sequences if o is not None and o.error is not None]
        returned = list(range(group.n))
        reason = None
        if finished:
            seqs = group.seqs
            if group.best_of > group.n and len(seqs) == group.best_of:
                returned = sorted(range(len(seqs)), key=lambda i: -seqs[i].cumulative_logprob)[: group.n]
            reasons = {r.finish_reason for r in seqs}
            for worst in (FinishReason.ERROR, FinishReason.ABORT):
                if worst in reasons:
                    reason = worst.value
                    break
            else:
                reason = seqs[returned[0]].finish_reason.value
        return cls(
            request_id=group.request_id,
            text_delta="",
            token_ids_delta=[],
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=leader.num_prompt_tokens,
            num_output_tokens=sum(r.num_output_tokens for r in group.seqs),
            prompt_text=leader.prompt_text,
            error=errors[0] if errors else None,
            num_cached_prompt_tokens=leader.num_cached_prompt_tokens,
            num_preemptions=leader.num_preemptions,
            arrival_time=leader.arrival_time,
            first_scheduled_time=leader.first_scheduled_time,
            first_token_time=leader.first_token_time,
            finish_time=now if finished else None,
            trace=group.trace if finished else None,
            sequences=sequences,
            returned=returned,
        )



def logprob_entry(token_id: int, logprob: float, top: list[tuple[int, float]] | None,
                  decode: Callable[[list[int], bool], str]) -> dict:
    """One sampled token's entry of `RequestOutput.logprobs_delta` (vLLM's shape): it and
    the top tokens, each with its logprob, its rank and its text."""
    def decoded(t: int) -> str:
        return decode([t], False)

    entry = {token_id: {"logprob": logprob, "rank": None, "decoded_token": decoded(token_id)}}
    for rank, (t, value) in enumerate(top or [], start=1):
        if t == token_id:
            entry[t]["rank"] = rank
        else:
            entry[t] = {"logprob": value, "rank": rank, "decoded_token": decoded(t)}
    if entry[token_id]["rank"] is None:
        entry[token_id]["rank"] = (len(top) + 1) if top else 1
    return entry
