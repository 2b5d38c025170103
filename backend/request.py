"""Requests, their sampling parameters, and the errors a request can end with.

`SamplingParams` declares what a client may send in `sampling_parameters` (vLLM's names):
each value's type and per-field bounds. The rules across values, and those that depend on
the loaded model, are in backend/validation.py, with every other check a request passes.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.config import DEFAULT_TENANT, TENANT_PATTERN, TENANT_RULE
from backend.trace import RequestTrace

if TYPE_CHECKING:
    from backend.structured_output import GrammarState


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
# vLLM allows temperature up to 2 and any repetition_penalty; ours are wider and narrower.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
# A constraint's text (schema, regex, grammar, choices) is compiled once per distinct text;
# the bound keeps one request from handing the compiler a megabyte of grammar.
MAX_STRUCTURED_OUTPUT_CHARS = 65536
# How much of a refused value an error message repeats.
MAX_ECHOED_CHARS = 200
# Most sequences one request may ask for (`n`, `best_of`): each is a running sequence of its own.
MAX_SEQUENCES = 16


def _json_object(value: Any, what: str) -> Any:
    """A JSON object given as itself or as a JSON string of one (how Triton clients send it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint the output must match."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: Optional[dict[str, Any]] = Field(None, alias="json")
    regex: Optional[str] = Field(None, min_length=1)
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = Field(None, min_length=1)
    json_object: Optional[bool] = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_as_object(cls, value: Any) -> Any:
        return None if value is None else _json_object(value, "json (a JSON schema)")

    @field_validator("json_object", mode="before")
    @classmethod
    def _json_object_is_true(cls, value: Any) -> Any:
        if value is not None and value not in (True, "true"):
            raise ValueError("json_object must be true when given")
        return value

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in self.constraint_fields().items() if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})")
        kind, text = self.constraint
        if len(text) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(f"the {kind} constraint is {len(text)} characters; the limit is {MAX_STRUCTURED_OUTPUT_CHARS}")
        return self

    def constraint_fields(self) -> dict[str, Any]:
        return {"json": self.json_schema, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object}

    @property
    def constraint(self) -> tuple[str, str]:
        """(kind, text): the compiler's input and its cache key. A schema keeps the client's key
        order, which is the order its properties are generated in."""
        for kind, value in self.constraint_fields().items():
            if value is not None:
                return kind, value if isinstance(value, str) else json.dumps(value)
        raise AssertionError("validated to hold exactly one constraint")


class SamplingParams(BaseModel):
    """vLLM-compatible sampling parameters. Values may arrive as strings ("64", "false")."""

    # Types here; the limits of what vLLM also checks are in validation.check_sampling_rules,
    # in vLLM's words (a NaN or inf is let through to be refused there, by name).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=True, frozen=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_STOP_ENTRIES)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's field: whether encoding the text prompt adds the tokenizer's special tokens (a BOS).
    # A prompt rendered by a chat template already writes its own, so the OpenAI frontend sends
    # false for chat completions, as vLLM does; a second BOS would change the model's output.
    add_special_tokens: bool = True
    # As in vLLM and transformers: only a slow (Python) tokenizer puts spaces between special
    # tokens; a fast tokenizer's decode has no such option and ignores it.
    spaces_between_special_tokens: bool = True
    logprobs: Optional[int] = None
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    # Who the request is for: the `fair` policy shares service between tenants, and every
    # policy counts per-tenant metrics.
    tenant: str = DEFAULT_TENANT
    structured_outputs: Optional[StructuredOutputs] = None

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _structured_outputs_as_object(cls, value: Any) -> Any:
        return None if value is None else _json_object(value, "structured_outputs")

    # The LoRA adapter to run the request with (a name from multi_lora.json); None: the base model.
    lora_name: Optional[str] = Field(None, min_length=1, max_length=256)
    # Parallel sampling: `best_of` sequences share the prompt's KV, the `n` with the highest
    # cumulative logprob are returned (all of them when best_of is not given).
    n: int = Field(1, ge=1, le=MAX_SEQUENCES)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_SEQUENCES)
    # False: this request never speculates, even where the model has a speculative_config.
    speculative: bool = True
    # Tokens a streamed response gathers after the first (vLLM's field; the engine ignores
    # it): raises the model's `stream_interval`, never lowers it (backend/protocol.py).
    stream_interval: Optional[int] = Field(None, ge=1, le=2**31 - 1)

    @field_validator(
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "max_tokens", "min_tokens", "stop_token_ids", "logprobs", "priority", "n", "best_of", "stream_interval",
        mode="before",
    )
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any) -> Any:
        # pydantic's lax mode reads true as 1; a boolean where a number belongs is a client bug.
        if isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value)):
            raise ValueError("expected a number, got a boolean")
        return value

    @field_validator("tenant", mode="before")
    @classmethod
    def _tenant_is_a_short_name(cls, value: Any) -> Any:
        # It becomes a metric label and a key the fair policy keeps: short and printable.
        if not isinstance(value, str) or re.fullmatch(TENANT_PATTERN, value) is None:
            raise ValueError(TENANT_RULE)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value] if value else []
        return value

    @field_validator("stop", "bad_words")
    @classmethod
    def _strings_bounded(cls, value: list[str], info: pydantic.ValidationInfo) -> list[str]:
        for s in value:
            if not s:
                # vLLM's words, as for the other checks (validation.check_sampling_rules)
                raise RequestError.invalid(info.field_name, f"{info.field_name} cannot contain an empty string.")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each entry must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @pydantic.model_validator(mode="after")
    def _verify(self) -> "SamplingParams":
        # The rules themselves live with every other check (backend/validation.py); imported
        # here, not at the top, because that module builds on this one.
        from backend.validation import check_sampling_rules

        check_sampling_rules(self)
        return self

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
    # Handed over to a decode instance after its first token (role prefill, backend/disagg.py).
    TRANSFERRED = "transferred"


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
    # Leading blocks released behind the model's sliding window (KVCacheManager.free_behind_window):
    # their entries in block_ids are NULL_BLOCK. Kept through a swap-out (the host blocks hold
    # the others), back to 0 when a preemption by recompute drops every computed token.
    num_freed_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Swap mode: host blocks holding this request's KV while it is preempted.
    swapped_block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set by the engine: per-request torch.Generator when the request has a seed.
    generator: object = None
    # Set by the engine when the request has `structured_outputs`.
    grammar: GrammarState | None = None
    # Compute the sampled token's logprob each step (logprobs or cumulative_logprob asked).
    needs_logprobs: bool = False
    # Token sequences of `params.bad_words` (SamplingParams.bad_words; validation.Admission).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The LoRA adapter (params.lora_name) and its index among the engine's adapters; -1: none.
    lora_name: str | None = None
    lora_index: int = -1
    # Set for a request whose client asked for its trace (backend/trace.py).
    trace: RequestTrace | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    cumulative_logprob: float = 0.0
    # Parallel sampling: the request's group, and this sequence's index in it (0: the leader).
    group: SequenceGroup | None = None
    seq_index: int = 0
    # Draft tokens a proposer made for this step (backend/spec_decode/): scheduled after the
    # last token and verified by the step; never part of `token_ids` until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

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
    def tenant(self) -> str:
        return self.params.tenant

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
