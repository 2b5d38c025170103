"""The scheduling scenarios that a windowed model's tests run against transformers (Gemma's
interleaved windows in test_gemma.py, every layer sliding in test_sliding_window.py): prompts
of 16 to 81 tokens that cross a 16-position window, through staggered arrivals with chunked
prefill, prefix-cache hits and preemption, each checked against transformers' greedy tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.checkpoints import hf_greedy, make_tiny_checkpoint
from tests.engine.test_engine_equivalence import (
    PROMPTS,
    SHARED_PROMPTS,
    assert_matches_oracle,
    run_engine,
    spread_arrivals,
)

MAX_NEW = 12
CHOSEN = PROMPTS[5:18:2] + SHARED_PROMPTS[:4]   # 16 to 81 tokens, and a shared 37-token prefix
MAX_TOKENS = [MAX_NEW - (i * 5) % 7 for i in range(len(CHOSEN))]


def checkpoint_and_oracle(folder: Path, family: str, **overrides) -> tuple[str, dict]:
    """A tiny checkpoint of `family` and {prompt: transformers' greedy continuation}."""
    path = make_tiny_checkpoint(str(folder / "ckpt"), family=family, **overrides)
    outputs = hf_greedy(path, CHOSEN, MAX_NEW)
    return path, {tuple(p): out for p, out in zip(CHOSEN, outputs)}


def with_config(path: str, folder: Path, **changes) -> str:
    """A checkpoint that is `path` (its files linked) with `changes` in its config.json."""
    folder.mkdir()
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), folder / name)
    config = json.load(open(os.path.join(path, "config.json")))
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


def chunked_prefill_with_arrivals(path: str, oracle: dict, device: str):
    # Triton's interpreter runs each program in Python: there, the prompts of 16 to 48 tokens.
    prompts = CHOSEN[:5] if device == "triton-on-cpu" else CHOSEN
    engine, streamed, by_id = run_engine(path, prompts, MAX_TOKENS, spread_arrivals(len(prompts)), device=device,
                                         max_num_seqs=4, long_prefill_token_threshold=7, max_num_batched_tokens=20,
                                         num_kv_blocks=128, max_model_len=256)
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)
    return engine


def prefix_cache_hits(path: str, oracle: dict):
    prompts = SHARED_PROMPTS[:4] + CHOSEN[:3]
    max_tokens = [MAX_NEW] * len(prompts)
    arrivals = [0] + [3 + i // 3 for i in range(len(prompts) - 1)]
    engine, streamed, by_id = run_engine(path, prompts, max_tokens, arrivals, max_num_seqs=4,
                                         long_prefill_token_threshold=20, num_kv_blocks=128, max_model_len=256)
    assert engine.stats.totals.prefix_hit_tokens >= 32 * 3, "the shared blocks were not reused"
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)
    return engine


def preemption_under_a_tiny_kv_pool(path: str, oracle: dict, mode: str):
    engine, streamed, by_id = run_engine(path, CHOSEN, MAX_TOKENS, spread_arrivals(len(CHOSEN), every=1),
                                         max_num_seqs=5, block_size=8, num_kv_blocks=16,
                                         long_prefill_token_threshold=13, preemption_mode=mode, swap_space_mb=1,
                                         max_preemptions=3, max_model_len=128)
    assert engine.stats.totals.preemptions > 0
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)
    return engine
