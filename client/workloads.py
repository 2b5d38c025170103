"""Seeded benchmark workloads of BENCHMARKS.md (W1, W2, W4, W5, W6), as plain request lists.

A workload is a list of `BenchRequest`: prompt token ids, output length, arrival offset
and priority. Synthetic token ids avoid the tokenizer's special tokens so no request
stops early or changes meaning; EOS is ignored so output lengths are exactly as drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    priority: int = 0
    temperature: float = 0.0
    # Class label for per-class metrics (W5: "high" / "low").
    label: str = ""


@dataclass
class Workload:
    name: str
    description: str
    requests: list[BenchRequest]
    # Engine settings the workload is defined with (BENCHMARKS.md), applied to every system.
    engine_overrides: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": len(self.requests),
            "total_prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "total_output_tokens": sum(r.max_tokens for r in self.requests),
            "engine_overrides": self.engine_overrides,
            **self.params,
        }


# Token ids well inside the vocabulary and past the special tokens at its start.
TOKEN_LOW, TOKEN_HIGH = 200, 40000


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


def w1_variance(seed: int = 0, num_requests: int = 256, max_num_seqs: int = 32) -> Workload:
    """The seeds' thesis: varied output lengths waste static batches."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_requests):
        out = int(min(512, max(1, round(rng.exponential(64)))))
        requests.append(BenchRequest(_tokens(rng, int(rng.integers(32, 129))), out))
    return Workload(
        "W1", f"{num_requests} requests at once, prompt 32-128, output capped-exponential mean 64 cap 512, EOS ignored",
        requests, {"max_num_seqs": max_num_seqs}, {"seed": seed, "max_num_seqs": max_num_seqs},
    )


def w2_offline(seed: int = 0, num_requests: int = 128, low: int = 16, high: int = 256, max_num_seqs: int = 32) -> Workload:
    rng = np.random.default_rng(seed)
    requests = [
        BenchRequest(_tokens(rng, int(rng.integers(low, high + 1))), int(rng.integers(low, high + 1)), temperature=0.6)
        for _ in range(num_requests)
    ]
    return Workload(
        "W2", f"{num_requests} requests, input and output uniform [{low}, {high}], temperature 0.6, EOS ignored",
        requests, {"max_num_seqs": max_num_seqs}, {"seed": seed, "max_num_seqs": max_num_seqs},
    )


def w4_shared_prefix(seed: int = 0, num_requests: int = 64, prefix_len: int = 256, tail_len: int = 32,
                     output_len: int = 16, rate_per_s: float = 0.0) -> Workload:
    """A shared system prompt: with prefix caching it is computed once."""
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, prefix_len)
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    requests = [BenchRequest(prefix + _tokens(rng, tail_len), output_len, arrival_s=t) for t in arrivals]
    return Workload(
        "W4", f"{num_requests} requests sharing one {prefix_len}-token prefix with distinct {tail_len}-token tails",
        requests, {}, {"seed": seed, "prefix_len": prefix_len, "tail_len": tail_len, "output_len": output_len,
                       "rate_per_s": rate_per_s},
    )


def w5_priority(seed: int = 0, num_requests: int = 200, high_fraction: float = 0.1, rate_per_s: float = 20.0,
                max_num_seqs: int = 16) -> Workload:
    """A saturating stream of long low-priority requests with a few short high-priority ones."""
    rng = np.random.default_rng(seed)
    arrivals = _poisson_arrivals(rng, num_requests, rate_per_s)
    requests = []
    for t in arrivals:
        if rng.random() < high_fraction:
            requests.append(BenchRequest(_tokens(rng, 32), 16, arrival_s=t, priority=0, label="high"))
        else:
            requests.append(BenchRequest(_tokens(rng, 128), 128, arrival_s=t, priority=1, label="low"))
    return Workload(
        "W5", f"Poisson {rate_per_s}/s: {1 - high_fraction:.0%} long low-priority (128/128), "
        f"{high_fraction:.0%} short high-priority (32/16)",
        requests, {"max_num_seqs": max_num_seqs},
        {"seed": seed, "high_fraction": high_fraction, "rate_per_s": rate_per_s, "max_num_seqs": max_num_seqs},
    )


def w6_overload(seed: int = 0, num_requests: int = 1000, pool_for: int = 50, prompt_len: int = 32,
                output_len: int = 32, block_size: int = 16) -> Workload:
    """Far more concurrent requests than the KV pool holds: all must complete."""
    rng = np.random.default_rng(seed)
    requests = [BenchRequest(_tokens(rng, prompt_len), output_len) for _ in range(num_requests)]
    blocks_per_request = -(-(prompt_len + output_len) // block_size)
    return Workload(
        "W6", f"{num_requests} concurrent requests ({prompt_len}/{output_len}) on a KV pool for ~{pool_for}",
        requests,
        {"num_kv_blocks": pool_for * blocks_per_request, "max_num_seqs": 256, "max_queue_len": num_requests + 1},
        {"seed": seed, "pool_for": pool_for},
    )


def _poisson_arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> list[float]:
    if rate_per_s <= 0:
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()


WORKLOADS = {
    "W1": w1_variance,
    "W2": w2_offline,
    "W4": w4_shared_prefix,
    "W5": w5_priority,
    "W6": w6_overload,
}
