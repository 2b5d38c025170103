"""`speculative_config` (config.pbtxt, a JSON object in vLLM's shape), checked at load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
QUANTIZATIONS = ("none", "int8", "int4")
ACTIVATION_QUANTIZATIONS = ("none", "int8")
MAX_SPECULATIVE_TOKENS = 8
# Longest n-gram matched against the request's own tokens: each step searches every length
# from prompt_lookup_max down to prompt_lookup_min over the whole context.
MAX_PROMPT_LOOKUP = 16
# The most tokens of a request's context that suffix decoding may match (vLLM's default: 24).
MAX_SUFFIX_TREE_DEPTH = 64
MAX_SUFFIX_CACHED_REQUESTS = 1_000_000
COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", "adaptive")
KEYS = {
    "ngram": COMMON_KEYS + ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": COMMON_KEYS + ("suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob"),
    "draft_model": COMMON_KEYS + ("model", "quantization", "activation_quantization"),
}


def _refuse(message: str) -> None:
    raise ValueError(f"invalid engine parameter: speculative_config: {message}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # No drafts in a step that runs at least this many requests (vLLM's key); None: no limit.
    disable_by_batch_size: int | None = None
    # Trim each step's drafts to those expected to raise its output tokens/s (adaptive.py).
    adaptive: bool = True
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft's checkpoint (absolute, or relative to the model's version folder
    # in config.pbtxt), its load-time quantization, and int8 activations for its quantized weights
    # (the engine's activation_quantization: a served model's int4 + int8 activations drafts for it).
    model: str | None = None
    quantization: str = "none"
    activation_quantization: str = "none"

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """The config from config.pbtxt's object (or its JSON text); None (off) when empty.
        ValueError naming the key for an unknown method or key or a value out of range."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                _refuse(f"not valid JSON: {exc}")
        if not isinstance(value, dict):
            _refuse(f"must be a JSON object, got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            _refuse(f"method={method!r}, expected one of {list(METHODS)}")
        unknown = sorted(set(value) - set(KEYS[method]))
        if unknown:
            _refuse(f"unknown key(s) {unknown} for method {method!r}; known keys: {list(KEYS[method])}")
        if method != "suffix" and "num_speculative_tokens" not in value:
            _refuse(f"num_speculative_tokens is required (1 to {MAX_SPECULATIVE_TOKENS})")

        def integer(key: str, low: int, high: int, default: int) -> int:
            raw = value.get(key, default)
            if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= high:
                _refuse(f"{key}={raw!r} must be an integer in [{low}, {high}]")
            return raw

        def number(key: str, low: float, high: float, default: float) -> float:
            raw = value.get(key, default)
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not low <= raw <= high:
                _refuse(f"{key}={raw!r} must be a number in [{low}, {high}]")
            return float(raw)

        # Suffix decoding drafts only as far as its matches reach, so it may be given the most.
        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            _refuse(f"adaptive={adaptive!r} must be true or false")
        common = dict(adaptive=adaptive, disable_by_batch_size=(
            integer("disable_by_batch_size", 1, 1 << 20, 1) if value.get("disable_by_batch_size") is not None else None))
        if method == "suffix":
            return cls(method, k, **common,
                       suffix_decoding_max_tree_depth=integer("suffix_decoding_max_tree_depth", 1,
                                                              MAX_SUFFIX_TREE_DEPTH, 24),
                       suffix_decoding_max_cached_requests=integer("suffix_decoding_max_cached_requests", 0,
                                                                   MAX_SUFFIX_CACHED_REQUESTS, 10_000),
                       suffix_decoding_max_spec_factor=number("suffix_decoding_max_spec_factor", 0.0, 64.0, 1.0),
                       suffix_decoding_min_token_prob=number("suffix_decoding_min_token_prob", 0.0, 1.0, 0.1))
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                _refuse(f"model={model!r}: draft_model needs the draft checkpoint's path")
            quantization = value.get("quantization", "none")
            if quantization not in QUANTIZATIONS:
                _refuse(f"quantization={quantization!r}, expected one of {list(QUANTIZATIONS)}")
            activations = value.get("activation_quantization", "none")
            if activations not in ACTIVATION_QUANTIZATIONS:
                _refuse(f"activation_quantization={activations!r}, expected one of {list(ACTIVATION_QUANTIZATIONS)}")
            if activations != "none" and quantization == "none":
                _refuse(f"activation_quantization={activations!r} needs the draft quantized (quantization int8 or int4)")
            return cls(method, k, **common, model=model, quantization=quantization, activation_quantization=activations)
        lookup_min = integer("prompt_lookup_min", 1, MAX_PROMPT_LOOKUP, 1)
        lookup_max = integer("prompt_lookup_max", 1, MAX_PROMPT_LOOKUP, max(lookup_min, 4))
        if lookup_min > lookup_max:
            _refuse(f"prompt_lookup_min={lookup_min} must be <= prompt_lookup_max={lookup_max}")
        return cls(method, k, **common, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)
