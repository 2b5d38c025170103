"""What the vLLM peers share with the project's benchmark: the request file of
client/bench/vllm_offline.py and the CPU settings both peers give vLLM (the reasons are in
vllm_offline.py's docstring). Standard library only: it runs in .venv-peers as well as in
the project venv.
"""

from __future__ import annotations

import json
import os
import sys

DEFAULT_KVCACHE_SPACE_GIB = 2
REQUEST_KEYS = ("prompt_token_ids", "max_tokens", "temperature")


def make_request(prompt_token_ids, max_tokens: int, temperature: float) -> dict:
    """One entry of requests.json (plain ints and floats, so json can write numpy values too)."""
    return {"prompt_token_ids": [int(t) for t in prompt_token_ids], "max_tokens": int(max_tokens),
            "temperature": float(temperature)}


def load_requests(path: str) -> list[dict]:
    with open(path) as f:
        requests = json.load(f)
    check_requests(requests)
    return requests


def check_requests(requests) -> None:
    """Fail before vLLM's minute-long start-up rather than in the middle of it."""
    if not isinstance(requests, list) or not requests:
        raise ValueError("requests file must hold a non-empty JSON list")
    for i, r in enumerate(requests):
        if not isinstance(r, dict) or set(r) != set(REQUEST_KEYS):
            raise ValueError(f"request {i}: expected exactly the keys {REQUEST_KEYS}, got {r!r:.200}")
        ids = r["prompt_token_ids"]
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"request {i}: prompt_token_ids must be a non-empty list of token ids")
        if not isinstance(r["max_tokens"], int) or r["max_tokens"] < 1:
            raise ValueError(f"request {i}: max_tokens must be an int >= 1, got {r['max_tokens']!r}")
        if not isinstance(r["temperature"], (int, float)) or r["temperature"] < 0:
            raise ValueError(f"request {i}: temperature must be >= 0, got {r['temperature']!r}")


def cpu_environment(environ: dict | None = None) -> dict:
    """The vLLM CPU variables this peer sets when the caller has not (see the module docstring)."""
    environ = os.environ if environ is None else environ
    out = {}
    if "VLLM_CPU_KVCACHE_SPACE" not in environ:
        out["VLLM_CPU_KVCACHE_SPACE"] = str(DEFAULT_KVCACHE_SPACE_GIB)
    if "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return out


def preload_environment(environ: dict | None = None) -> dict:
    """LD_PRELOAD of this venv's Intel OpenMP, unless the caller set LD_PRELOAD (see above)."""
    environ = os.environ if environ is None else environ
    library = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if "LD_PRELOAD" in environ or not os.path.exists(library):
        return {}
    return {"LD_PRELOAD": library}
