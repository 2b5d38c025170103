"""Requests, their sampling parameters, and the errors a request can end with.

`SamplingParams` is the one table of validation rules for what a client may send in
`sampling_parameters` (vLLM's names). Rules that depend on the loaded model (vocabulary
size, max_model_len) are checked by the engine at admission, which knows the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.trace import RequestTrace


class RequestError(Exception):
    """An error that ends one request; `code` maps onto Triton's error codes."""

    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param

    @classmethod
    def invalid(cls, param: str, message: str) -> "RequestError":
        return cls(cls.INVALID_ARG, f"{param}: {message}", param)


# Largest list of stop strings / stop ids a request may carry: scanning them runs every step.
MAX_STOP_ENTRIES = 64
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
# Most sequences one request may ask for (`n`, `best_of`): each is a running sequence of its own.
MAX_SEQUENCES = 16


class SamplingParams(BaseModel):
    """vLLM-compatible sampling parameters. Values may arrive as strings ("64", "false")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    max_tokens: Optional[int] = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # As in vLLM and transformers: only a slow (Python) tokenizer puts spaces between special
    # tokens; a fast tokenizer's decode has no such option and ignores it.
    spaces_between_special_tokens: bool = True
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # Parallel sampling: `best_of` sequences share the prompt's KV, the `n` with the highest
    # cumulative logprob are returned (all of them when best_of is not given).
    n: int = Field(1, ge=1, le=MAX_SEQUENCES)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_SEQUENCES)

    @field_validator(
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "max_tokens", "min_tokens", "stop_token_ids", "logprobs", "priority", "n", "best_of", mode="before",
    )
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any) -> Any:
        # pydantic's lax mode reads true as 1; a boolean where a number belongs is a client bug.
        if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value)):
            raise ValueError("expected a number, got a boolean")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value] if value else []
        return value

    @field_validator("stop", "bad_words")
    @classmethod
    def _strings_bounded(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s:
                raise ValueError("entries must not be empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each entry must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for the request: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def known_names(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Validate a client's dict; raise RequestError naming the first bad parameter."""
        if not isinstance(values, dict):
            raise RequestError.invalid("sampling_parameters", "must be a JSON object")
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise RequestError.invalid(
                unknown[0], f"unknown sampling parameter(s) {unknown}; known parameters: {cls.known_names()}"
            )
        try:
            params = cls.model_validate(values)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "sampling_parameters"
            raise RequestError.invalid(name, f"{first['msg']} (got {first.get('input')!r})") from None
        if params.max_tokens is not None and params.min_tokens > params.max_tokens:
            raise RequestError.invalid(
                "min_tokens", f"must be <= max_tokens ({params.min_tokens} > {params.max_tokens})"
            )
        if params.best_of is not None and params.best_of < params.n:
            raise RequestError.invalid("best_of", f"must be >= n ({params.best_of} < {params.n})")
        return params


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request with more than one (`n` or `best_of` > 1).

    The leader (`seqs[0]`, which carries the client's request id) prefills the prompt alone;
    when that prefill ends the engine forks the others off it (`forked`), and each samples
    its first token from the leader's last logits row. From then on every sequence is a
    request of its own to the scheduler, sharing the prompt's KV blocks by reference.
    The group ends, with one final output, when all its sequences have.
    """

    request_id: str
    n: int
    best_of: int
    seqs: list["Request"] = field(default_factory=list)
    forked: bool = False
    # Sequence index -> whether its final output has been collected (engine's group outputs).
    done: set[int] = field(default_factory=set)
    # The leader's trace, kept from its final output for the group's.
    trace: dict | None = None

    @property
    def finished(self) -> bool:
        """Every sequence has ended (before the fork the leader is the only one)."""
        return len(self.done) == len(self.seqs)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"
    ABORT = "abort"  # cancelled by the client or the server shutting down
    ERROR = "error"


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    The model has computed KV for `token_ids[:num_computed_tokens]`; a step grants
    new tokens to close the gap to `len(token_ids)`. The last sampled token is always
    uncomputed, so a decoding request asks for exactly one token per step.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    arrival_seq: int
    eos_token_ids: frozenset[int] = frozenset()
    prompt_text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hashes of this request's full blocks, in order (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks already registered in the prefix cache (or found there).
    num_registered_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Swap mode: host blocks holding this request's KV while it is preempted.
    swapped_block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set by the engine: per-request torch.Generator when the request has a seed.
    generator: object = None
    # Compute the sampled token's logprob each step (logprobs or cumulative_logprob asked).
    needs_logprobs: bool = False
    # Token sequences of `params.bad_words` (SamplingParams.bad_words; Engine.make_request).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Set for a request whose client asked for its trace (backend/trace.py).
    trace: RequestTrace | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    cumulative_logprob: float = 0.0
    # Parallel sampling: the request's group, and this sequence's index in it (0: the leader).
    group: SequenceGroup | None = None
    seq_index: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV this request may ever hold (the last sampled token is never computed)."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def seqs_to_fork(self) -> int:
        """Sequences this request's prefill will fork off (a group leader not yet forked)."""
        group = self.group
        return group.best_of - 1 if group is not None and not group.forked and self.seq_index == 0 else 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
