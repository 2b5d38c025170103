"""OpenVINO GenAI peer: the workload through `ContinuousBatchingPipeline.generate`, run in its
own venv made by `make peers-openvino` (client/bench/peers.py starts it):

    .venv-openvino/bin/python -m client.bench.openvino_offline --requests requests.json \\
        --out result.json --model .models/SmolLM2-135M-Instruct --ir .models/openvino/SmolLM2-135M-Instruct \\
        --dtype bfloat16 --max-num-seqs 32

requests.json is client/bench/vllm_peer.py's: a list of {"prompt_token_ids", "max_tokens",
"temperature"}. The checkpoint is exported once to OpenVINO IR with optimum-intel
(`optimum-cli export openvino --weight-format fp32`: the weights as they are, bf16 ones
widened exactly; no int8 compression) into the --ir folder, then every request goes to one
`generate` on token ids with `ignore_eos`, so each makes exactly `max_tokens` tokens. Model
load, compilation and a one-request warm-up are not timed.

The settings (`plugin_properties`, `scheduler_settings`), each what the project's engine runs
with: INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION the dtype under test (OpenVINO's CPU
default would be bf16 compute wherever the CPU has it and a u8 KV cache). On a CPU without
bf16 arithmetic (AVX2) OpenVINO computes in f32 whatever the hint and takes only an f32 KV
cache, so a "bfloat16" run there is OpenVINO in f32 on the bf16 weights; one inference
thread per CPU this process may run on, `max_num_seqs` sequences and 2048 tokens a step
(the engine's max_num_batched_tokens), 2 GB of KV cache (as the vLLM peer), prefix caching
off (the engine's default) and the pipeline's chunked prefill (dynamic split-fuse) on.

Standard library at import (the settings are tested in the project venv); openvino_genai only
inside `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from client.bench.vllm_peer import load_requests

PRECISION = {"float32": "f32", "bfloat16": "bf16"}
MAX_NUM_BATCHED_TOKENS = 2048
CACHE_SIZE_GB = 2
# Same warm-up as client.bench.runners' engine warm-up: 40 prompt tokens, 4 output tokens.
WARMUP_PROMPT = list(range(1000, 1040))
WARMUP_TOKENS = 4
EXPORT_STAMP = "inflight-export.json"


def cpu_has_bf16_arithmetic() -> bool:
    """Whether the CPU computes in bf16 (AVX512-BF16 or AMX); elsewhere OpenVINO computes
    in f32 whatever the hint, and keeps its KV cache in f32 only."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def plugin_properties(dtype: str, threads: int, bf16_arithmetic: bool) -> dict:
    """The CPU plugin's properties for `dtype` ("float32" or "bfloat16") on `threads` threads;
    the KV cache in bf16 only where the CPU computes in bf16 (the plugin refuses it elsewhere)."""
    if dtype not in PRECISION:
        raise ValueError(f"openvino-offline: dtype {dtype!r}, expected one of {', '.join(PRECISION)}")
    if threads < 1:
        raise ValueError(f"openvino-offline: threads must be >= 1, got {threads}")
    kv = PRECISION[dtype] if bf16_arithmetic else "f32"
    return {"INFERENCE_PRECISION_HINT": PRECISION[dtype], "KV_CACHE_PRECISION": kv, "INFERENCE_NUM_THREADS": threads}


def scheduler_settings(max_num_seqs: int) -> dict:
    """SchedulerConfig's fields, by name."""
    if max_num_seqs < 1:
        raise ValueError(f"openvino-offline: max_num_seqs must be >= 1, got {max_num_seqs}")
    return {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max(MAX_NUM_BATCHED_TOKENS, max_num_seqs),
            "cache_size": CACHE_SIZE_GB, "enable_prefix_caching": False, "dynamic_split_fuse": True}


def generation_settings(request: dict, seed: int) -> dict:
    """GenerationConfig's fields for one request of requests.json."""
    sampling = ({"do_sample": True, "temperature": request["temperature"], "rng_seed": seed}
                if request["temperature"] > 0 else {"do_sample": False})
    return {"max_new_tokens": request["max_tokens"], "min_new_tokens": request["max_tokens"], "ignore_eos": True,
            **sampling}


def export_command(optimum_cli: str, model: str, ir: str) -> list[str]:
    return [optimum_cli, "export", "openvino", "--model", model, "--task", "text-generation-with-past",
            "--weight-format", "fp32", ir]


def _source_stamp(model: str) -> dict:
    files = sorted(f for f in os.listdir(model) if f.endswith((".safetensors", ".json")))
    return {"model": os.path.abspath(model), "files": {f: os.path.getmtime(os.path.join(model, f)) for f in files}}


def export(model: str, ir: str) -> float:
    """The checkpoint as OpenVINO IR in `ir`, exported unless a current export is there; the
    seconds the export took (0 when reused)."""
    stamp_path = os.path.join(ir, EXPORT_STAMP)
    stamp = _source_stamp(model)
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return 0.0
    start = time.perf_counter()
    optimum_cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
    subprocess.run(export_command(optimum_cli, model, ir), check=True)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return time.perf_counter() - start


def _configure(target, settings: dict):
    for name, value in settings.items():
        setattr(target, name, value)
    return target


def run(requests: list[dict], ir: str, dtype: str, max_num_seqs: int, seed: int = 0) -> dict:
    import numpy as np
    import openvino
    import openvino_genai as genai

    threads = len(os.sched_getaffinity(0))
    properties = plugin_properties(dtype, threads, cpu_has_bf16_arithmetic())
    scheduler = scheduler_settings(max_num_seqs)
    load_start = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(ir, _configure(genai.SchedulerConfig(), scheduler), "CPU", properties)
    load_s = time.perf_counter() - load_start

    def ids(prompt):
        return openvino.Tensor(np.array([prompt], dtype=np.int64))

    warmup = {"prompt_token_ids": WARMUP_PROMPT, "max_tokens": WARMUP_TOKENS, "temperature": 0.0}
    pipe.generate([ids(WARMUP_PROMPT)], [_configure(genai.GenerationConfig(), generation_settings(warmup, seed))])
    inputs = [ids(r["prompt_token_ids"]) for r in requests]
    configs = [_configure(genai.GenerationConfig(), generation_settings(r, seed + i)) for i, r in enumerate(requests)]
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    duration = time.perf_counter() - start
    token_ids = [[int(t) for t in result.m_generation_ids[0]] for result in results]
    return {
        "duration_s": duration,
        "num_output_tokens": [len(t) for t in token_ids],
        "output_token_ids": token_ids,
        "openvino_genai_version": genai.__version__,
        "openvino_version": openvino.__version__,
        "dtype": dtype,
        "properties": properties,
        "scheduler": scheduler,
        "load_s": load_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OpenVINO GenAI ContinuousBatchingPipeline peer (in .venv-openvino)")
    parser.add_argument("--requests", required=True, help="JSON list of {prompt_token_ids, max_tokens, temperature}")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--ir", required=True, help="folder of the OpenVINO IR export (made once, then reused)")
    parser.add_argument("--dtype", choices=sorted(PRECISION), default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    requests = load_requests(args.requests)
    export_s = export(args.model, args.ir)
    result = {**run(requests, args.ir, args.dtype, args.max_num_seqs, args.seed), "export_s": export_s}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"openvino-offline: {len(requests)} requests, {sum(result['num_output_tokens'])} output tokens "
          f"in {result['duration_s']:.3f} s (OpenVINO GenAI {result['openvino_genai_version']}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
