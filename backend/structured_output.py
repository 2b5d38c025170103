"""Structured outputs: a request's constraint compiled into a grammar (xgrammar), and the
matcher that turns it into a token bitmask for each of the request's sampling steps.

Compilation walks the whole vocabulary for each grammar position, tens to hundreds of
milliseconds for a JSON schema, so it never runs on the engine loop: `GrammarCompiler.submit`
hands it to one worker thread and returns a future, and the engine schedules the request
once the future is done (or ends it with the compile error, INVALID_ARG naming
`structured_outputs`). Each distinct constraint is compiled once: compiled grammars (and
compilations under way) stay in a bounded LRU cache keyed by the constraint's canonical text.

A `GrammarState` is one request's matcher. Its state is a function of the tokens the request
has accepted, so a request preempted by recompute drops it and rebuilds it by replaying its
output tokens when it is next sampled, and a finished request drops it at once.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from backend.request import RequestError, StructuredOutputs

if TYPE_CHECKING:
    from backend.request import Request

# Distinct constraints kept compiled; a compiled JSON schema over a 49k vocabulary is
# tens to hundreds of KiB.
GRAMMAR_CACHE_SIZE = 64


def compile_error(exc: Exception) -> str:
    """xgrammar's message without the "[time] source.cc:line: " its C++ side puts first."""
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(exc).strip())


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices`; JSON string escapes are EBNF literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints on one worker thread, each distinct constraint once.

    The xgrammar compiler (its tokenizer info is a pass over the whole vocabulary) is built
    by the first compilation, so an engine whose requests carry no constraint never pays for
    it. `submit` is thread-safe; the cache holds futures, so a constraint whose compilation is
    under way is not compiled twice. O(1) lookup; LRU eviction beyond `cache_size` entries.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int], cache_size: int = GRAMMAR_CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self.num_compiled = 0  # compilations run (not cache hits), for tests and stats

    def submit(self, constraint: StructuredOutputs) -> Future:
        """A future of the constraint's compiled grammar, or of the RequestError that refuses it."""
        key = constraint.constraint
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, *key)
            self._cache[key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            # Our LRU is the one cache; xgrammar's own would keep every grammar ever compiled.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.num_compiled += 1
        try:
            match kind:
                case "json":
                    # Compact JSON: with any whitespace allowed a sampled model may pad forever.
                    return self._compiler.compile_json_schema(text, any_whitespace=False)
                case "json_object":
                    # Any object: xgrammar's built-in JSON grammar also takes arrays and scalars.
                    return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                case "regex":
                    return self._compiler.compile_regex(text)
                case "choice":
                    return self._compiler.compile_grammar(choice_grammar(json.loads(text)))
                case "grammar":
                    return self._compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise RequestError.invalid("structured_outputs", f"the {kind} constraint does not compile: {compile_error(exc)}") from None
        raise AssertionError(f"unknown constraint kind {kind!r}")


class GrammarState:
    """One request's grammar: the compilation future, then a matcher over its output tokens.

    Invariant: a live matcher has accepted exactly the request's output tokens, in order.
    """

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        self.num_rebuilds = 0  # matchers rebuilt by replay (after preemption), for tests

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def error(self) -> RequestError | None:
        """The compile error that refuses the request, once compilation is done."""
        exc = self.compiled.exception()
        if exc is None:
            return None
        if isinstance(exc, RequestError):
            return exc
        return RequestError.invalid("structured_outputs", f"could not be compiled: {exc}")

    def matcher(self, output_token_ids: list[int]) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
            if output_token_ids:
                self.num_rebuilds += 1
                for token_id in output_token_ids:
                    accepted = self._matcher.accept_token(token_id)
                    assert accepted, "replay of the request's own tokens was rejected"
        return self._matcher

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance past the token just sampled (before it is appended to the request)."""
        return self.matcher(request.output_token_ids).accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has taken its stop token: nothing more may follow."""
        return self._matcher is not None and self._matcher.is_terminated()

    def release(self) -> None:
        """Drop the matcher (preemption); the next `matcher()` rebuilds it by replay."""
        self._matcher = None


class GrammarMasker:
    """Applies the grammars of a batch's constrained rows to their logits, in place.

    One bitmask fill over the constrained rows (xgrammar's batch matcher) and one masking
    pass over those rows only; the free rows are not touched. The bitmask covers the full
    logits width (the model's vocabulary, which may be padded beyond the tokenizer's): the
    compiler's tokenizer info is built with that size, so padded ids are masked too.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(0, vocab_size)

    def __call__(self, logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        assert logits.shape[1] == self.vocab_size, (logits.shape, self.vocab_size)
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        matchers = [requests[row].grammar.matcher(requests[row].output_token_ids) for row in rows]
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, self._bitmask, rows)
        bitmask = self._bitmask[: logits.shape[0]]
        if bitmask.device != logits.device:  # filled on the CPU; applied where the logits are
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def mask_drafted_rows(logits: torch.Tensor, requests: list[Request], num_rows: list[int]) -> None:
    """Speculative verification: each constrained request's rows masked, in place, by its
    grammar as of that row: row j allows what may follow its output and drafts 0..j-1. The
    matcher walks the drafts and is rolled back, so it still holds only the output (the
    accepted tokens advance it as plain samples do). Rows past a draft the grammar refuses
    are never reached (that draft is masked in its own row, so rejected) and stay as they are."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    rows: list[int] = []
    first = 0
    for request, n in zip(requests, num_rows):
        if request.grammar is not None:
            matcher = request.grammar.matcher(request.output_token_ids)
            walked = 0
            for j in range(n):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                rows.append(first + j)
                if j == n - 1 or not matcher.accept_token(request.spec_token_ids[j]):
                    break
                walked += 1
                if matcher.is_terminated():
                    break  # that draft is the stop token: the request ends there if it is accepted
            if walked:
                matcher.rollback(walked)
        first += n
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows)

