"""A role-prefill engine with `kv_transfer: tcp` in a process of its own, for the tests that put
it on another host (a network namespace: tests/engine/test_disagg_tcp.py).

    python -m tests.engine.disagg_prefill_worker '<EngineConfig as JSON>'

Reads one JSON line, {"prompts": [[token ids]], "params": {sampling parameters}}, runs every
prompt to its first token and writes one JSON line: a list of {"request_id", "token_ids",
"logprobs", "finish_reason", "transfer"}. Then serves the transfers until it reads a line
"stats", answers {"pending": transfers not pulled, "used_blocks": KV blocks held} and exits.
"""

from __future__ import annotations

import json
import sys

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(**json.loads(sys.argv[1])))
    job = json.loads(sys.stdin.readline())
    params = SamplingParams.model_validate(job["params"])
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(f"r{i}", prompt, params)
    results = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            results.append({"request_id": out.request_id, "token_ids": out.token_ids_delta,
                            "logprobs": out.logprobs_delta, "finish_reason": out.finish_reason,
                            "transfer": out.transfer})
    print(json.dumps(results), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps({"pending": engine.num_pending_transfers, "used_blocks": engine.kv.pool.num_used}),
                  flush=True)
            break
    engine.close()


if __name__ == "__main__":
    main()
