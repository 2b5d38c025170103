"""Every check a request passes before the engine takes it, and nothing else.

A request meets them in this order, and the first that fails ends it with a RequestError
naming the parameter and the limit (INVALID_ARG; UNAVAILABLE for a full queue):

1. `parse_sampling_params`: a client's `sampling_parameters` object becomes a
   `SamplingParams`. Unknown names are refused, then pydantic checks each value against
   the types and per-field bounds `SamplingParams` declares, then `check_sampling_rules`
   (vLLM's rules, in its words), then what the request's own switches rule out (`stream`).
2. `Admission.check`: what depends on the loaded model and the engine's configuration:
   the vocabulary, max_model_len, the KV pool, max_num_seqs, the LoRA adapters, the
   tokenizer (bad_words). Each check is a comparison or two; bad_words tokenizes its words.
3. `check_queue_room` and `check_not_in_flight`: what depends on the engine's queue. The
   room is checked on the submitting thread (EngineLoop.submit) and again, with the id, on
   the loop thread, where the request joins the queue (LLMEngine.accept).

backend/protocol.py only decodes Triton's tensors (and refuses what cannot be decoded);
the Triton adapter, backend/model.py, maps them onto these calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic

from backend.request import (
    MAX_ECHOED_CHARS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    RequestError,
    SamplingParams,
)

if TYPE_CHECKING:
    from backend.detokenizer import SharedTokenizer
    from backend.kv_cache import KVCacheManager


def parse_sampling_params(values: dict[str, Any], *, stream: bool = False) -> SamplingParams:
    """A client's sampling values as SamplingParams; RequestError naming the first bad one.
    `stream`: the request streams its responses."""
    if not isinstance(values, dict):
        raise RequestError.invalid("sampling_parameters", "must be a JSON object")
    unknown = sorted(set(values) - set(SamplingParams.model_fields))
    if unknown:
        raise RequestError.invalid(
            unknown[0], f"unknown sampling parameter(s) {unknown}; known parameters: {SamplingParams.known_names()}"
        )
    try:
        params = SamplingParams.model_validate(values)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        name = loc[0] if loc else "sampling_parameters"
        where = f" at {'.'.join(loc)}" if len(loc) > 1 else ""
        got = repr(first.get("input"))
        if len(got) > MAX_ECHOED_CHARS:  # a 64 KiB grammar is not worth echoing
            got = got[:MAX_ECHOED_CHARS] + "..."
        raise RequestError.invalid(name, f"{first['msg']}{where} (got {got})") from None
    if params.best_of is not None and params.best_of < params.n:
        raise RequestError.invalid("best_of", f"must be >= n ({params.best_of} < {params.n})")
    if stream and params.num_sequences > params.n:
        # Which sequences are returned is known only once all have ended (as in vLLM).
        raise RequestError.invalid("best_of", f"streaming is not supported with best_of > n "
                                              f"({params.best_of} > {params.n})")
    return params


def check_sampling_rules(params: SamplingParams) -> None:
    """vLLM's checks (SamplingParams._verify_args, vLLM 0.32), in its order and words, with
    our limits where they differ (docs/usage.md, Request interface). SamplingParams runs them on
    every construction, so no SamplingParams breaks them, however it was built."""
    def refuse(param: str, message: str):
        raise RequestError.invalid(param, message)

    if not -2.0 <= params.presence_penalty <= 2.0:
        refuse("presence_penalty", f"presence_penalty must be in [-2, 2], got {params.presence_penalty}.")
    if not -2.0 <= params.frequency_penalty <= 2.0:
        refuse("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {params.frequency_penalty}.")
    if not math.isfinite(params.repetition_penalty):
        refuse("repetition_penalty", f"repetition_penalty must be a finite number, got {params.repetition_penalty}.")
    if params.repetition_penalty <= 0.0:
        refuse("repetition_penalty", f"repetition_penalty must be greater than zero, got {params.repetition_penalty}.")
    if params.repetition_penalty > MAX_REPETITION_PENALTY:
        refuse("repetition_penalty",
               f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {params.repetition_penalty}.")
    if not math.isfinite(params.temperature):
        refuse("temperature", f"temperature must be a finite number, got {params.temperature}.")
    if params.temperature < 0.0:
        refuse("temperature", f"temperature must be non-negative, got {params.temperature}.")
    if params.temperature > MAX_TEMPERATURE:
        refuse("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        refuse("top_p", f"top_p must be in (0, 1], got {params.top_p}.")
    if params.top_k < -1:
        refuse("top_k", f"top_k must be 0 (disable), or at least 1, got {params.top_k}.")
    if not 0.0 <= params.min_p <= 1.0:
        refuse("min_p", f"min_p must be in [0, 1], got {params.min_p}.")
    if params.max_tokens is not None and params.max_tokens < 1:
        refuse("max_tokens", f"max_tokens must be at least 1, got {params.max_tokens}.")
    if params.min_tokens < 0:
        refuse("min_tokens", f"min_tokens must be greater than or equal to 0, got {params.min_tokens}.")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        refuse("min_tokens",
               f"min_tokens must be less than or equal to max_tokens={params.max_tokens}, got {params.min_tokens}.")
    # vLLM also takes -1 (every token's logprob); we return at most MAX_LOGPROBS.
    if params.logprobs is not None and params.logprobs < -1:
        refuse("logprobs", f"logprobs must be non-negative or -1, got {params.logprobs}.")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        refuse("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}.")


@dataclass(frozen=True)
class Admitted:
    """What admission derived from a request, for the engine to build it with."""

    prompt_token_ids: list[int]
    prompt_text: str
    max_tokens: int
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    lora_index: int


@dataclass(frozen=True)
class Admission:
    """The checks that need the loaded model and the engine's configuration."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int
    max_num_seqs: int
    kv: KVCacheManager
    # Adapter name -> index among the engine's stacked adapters.
    lora_adapters: Mapping[str, int]
    tokenizer: SharedTokenizer

    def check(self, prompt: str | list[int], params: SamplingParams) -> Admitted:
        """Tokenize `prompt` and run every check that depends on the model; raise RequestError."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError.invalid("text_input", "must not be empty")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=params.add_special_tokens)
            prompt_text = prompt
        else:
            prompt_ids = list(prompt)
            prompt_text = ""
        if not prompt_ids:
            raise RequestError.invalid("text_input", "tokenizes to zero tokens")
        if params.top_k > self.vocab_size:
            raise RequestError.invalid("top_k", f"must be <= the vocabulary size {self.vocab_size} (got {params.top_k})")
        bad_ids = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_ids:
            raise RequestError.invalid("stop_token_ids", f"ids must be < the vocabulary size {self.vocab_size} (got {bad_ids})")
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        lora_index = self._lora_index(params.lora_name)
        max_tokens = resolve_max_tokens(len(prompt_ids), params.max_tokens, default=self.default_max_tokens,
                                        max_model_len=self.max_model_len, kv=self.kv)
        if params.num_sequences > 1:
            self._check_group_fits(params, len(prompt_ids), max_tokens)
        return Admitted(prompt_ids, prompt_text, max_tokens, bad_words_token_ids, lora_index)

    def _lora_index(self, lora_name: str | None) -> int:
        if lora_name is None:
            return -1
        index = self.lora_adapters.get(lora_name)
        if index is None:
            known = sorted(self.lora_adapters)
            served = f"known adapters: {known}" if known else "this model serves no LoRA adapters (multi_lora.json)"
            raise RequestError.invalid("lora_name", f"unknown LoRA adapter {lora_name!r}; {served}")
        return index

    def _check_group_fits(self, params: SamplingParams, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a group that could never run whole: more sequences than max_num_seqs, or
        more KV blocks than the pool has (the prompt's once, each sequence's own tail)."""
        name = "best_of" if params.best_of is not None else "n"
        num_seqs = params.num_sequences
        if num_seqs > self.max_num_seqs:
            raise RequestError.invalid(name, f"{num_seqs} sequences exceed max_num_seqs {self.max_num_seqs}")
        kv = self.kv
        shared = num_prompt_tokens // kv.block_size
        num_tokens = num_prompt_tokens + max_tokens - 1
        blocks = shared + num_seqs * (kv.blocks_needed(num_tokens) - shared)
        # With a sliding window, each sequence holds at most a window's blocks, shared or not.
        blocks = min(blocks, num_seqs * kv.max_live_blocks(num_tokens))
        if blocks > kv.num_blocks:
            raise RequestError.invalid(
                name, f"{num_seqs} sequences of prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                f"need {blocks} KV blocks of {kv.block_size} tokens{_at_once(kv)}; the whole pool has {kv.num_blocks}")

    def _bad_words_token_ids(self, bad_words: list[str]) -> tuple[tuple[int, ...], ...]:
        """The token sequences the sampler keeps out of a request's output, as vLLM derives
        them: each word as text starts it and, where the tokenizer gives a different first
        token of the same length for it, as a word after a space."""
        sequences: list[tuple[int, ...]] = []
        for word in bad_words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not alone:
                raise RequestError.invalid("bad_words", f"{word!r} tokenizes to zero tokens")
            sequences.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        return tuple(dict.fromkeys(sequences))


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, *, default: int, max_model_len: int,
                       kv: KVCacheManager) -> int:
    """The request's max_tokens (`default`, within the room left, when it asks for none),
    or RequestError (INVALID_ARG, with the numbers) for a request that could never finish:
    beyond `max_model_len`, or needing more KV blocks at once than the whole pool has (its
    whole length's; with one sliding window on every layer, a window's: `max_live_blocks`)."""
    if num_prompt_tokens >= max_model_len:
        raise RequestError.invalid(
            "text_input", f"prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}, leaving no room to generate"
        )
    if max_tokens is None:
        max_tokens = min(default, max_model_len - num_prompt_tokens)
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError.invalid(
            "max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
            f"exceeds max_model_len {max_model_len}",
        )
    blocks = kv.max_live_blocks(num_prompt_tokens + max_tokens - 1)
    if blocks > kv.num_blocks:
        raise RequestError.invalid(
            "max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks of "
            f"{kv.block_size} tokens{_at_once(kv)}; the whole pool has {kv.num_blocks}",
        )
    return max_tokens


def _at_once(kv: KVCacheManager) -> str:
    """What a windowed model's block count means: the blocks a request holds at once."""
    if not kv.window_bounds_live_blocks:
        return ""
    return f" at once (a sliding window of {kv.window} positions, steps of up to {kv.max_step_tokens} tokens)"


def check_queue_room(num_waiting: int, max_queue_len: int) -> None:
    """Refuse (UNAVAILABLE) a request for which the waiting queue, holding `num_waiting`
    (with those already on their way to it), has no room."""
    if num_waiting >= max_queue_len:
        raise RequestError(
            RequestError.UNAVAILABLE,
            f"waiting queue is full ({max_queue_len} requests, max_queue_len); retry later",
        )


def check_not_in_flight(request_id: str, in_flight: bool) -> None:
    if in_flight:
        raise RequestError.invalid("request_id", f"{request_id!r} is already in flight")
