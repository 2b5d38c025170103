"""Incremental detokenization with stop strings that never stream text to retract it.

Each new token decodes only a short window (the previous token or two plus the new one),
so the cost per token is constant. A window that ends in U+FFFD is an incomplete UTF-8
sequence: nothing is emitted until the next token completes it. Text that could still
grow into a stop string is held back until it either completes one or cannot anymore.
"""

from __future__ import annotations

import threading
from typing import Callable

# Prompt tokens decoded ahead of the first output token, so that the first token's
# leading space (SentencePiece) or merged bytes come out as they would mid-text.
CONTEXT_TOKENS = 6
INCOMPLETE = "\ufffd"


def raw_decoder(tokenizer, spaces_between_special_tokens: bool = True) -> Callable[[list[int], bool], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, straight from the Rust tokenizer
    where that gives the same text: a fast tokenizer that does not clean up tokenization
    spaces. transformers' wrapper converts and checks its input on every call, three
    quarters of the cost of decoding a few ids, and the engine decodes twice per token of
    every running request. `spaces_between_special_tokens` reaches slow tokenizers only:
    transformers' fast decode has no such option."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode
    if backend is not None:
        return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)


class SharedTokenizer:
    """A tokenizer for several threads: fast tokenizers are not safe to call from two at
    once, and the engine loop decodes while Triton's thread encodes new prompts. Every call
    holds one lock, for the few microseconds of an encode or a short decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        # By spaces_between_special_tokens (SamplingParams).
        self._decoders = {spaces: self._locked_decoder(spaces) for spaces in (True, False)}

    def _locked_decoder(self, spaces_between_special_tokens: bool) -> Callable[[list[int], bool], str]:
        raw_decode = raw_decoder(self.tokenizer, spaces_between_special_tokens)

        def locked_decode(ids: list[int], skip_special_tokens: bool) -> str:
            with self.lock:
                return raw_decode(ids, skip_special_tokens)

        return locked_decode

    def decoder(self, spaces_between_special_tokens: bool = True) -> Callable[[list[int], bool], str]:
        """`decode(ids, skip_special_tokens)`, under the lock."""
        return self._decoders[spaces_between_special_tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 decode: Callable[[list[int], bool], str] | None = None):
        self.raw_decode = decode or raw_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_sent = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.raw_decode(ids, self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one output token; return the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(INCOMPLETE):
            return None
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if not self.stop:
            self.text += delta
            return None
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += delta
        return self._find_stop(searched_from)

    @property
    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _find_stop(self, searched_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, searched_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
        return s

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def take_delta(self, finished: bool) -> str:
        """Text that is now certain and not yet handed out."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self.num_sent:
            return ""
        delta = self.text[self.num_sent : end]
        self.num_sent = end
        return delta
