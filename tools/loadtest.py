"""Triton's own load generators against a running server, with the recipes of BENCHMARKS.md.

    make perf        -> python -m tools.loadtest perf-analyzer  (exports under bench/perf_analyzer/)
    make genai-perf  -> python -m tools.loadtest genai-perf     (exports under bench/genai_perf/)

Both speak the gRPC streaming form of Triton's vLLM backend interface, as their users run
them against vLLM-backend models.

Every request sets the five `return_*` inputs. perf_analyzer 2.51 asks for every output
the model declares and, for an output a response does not carry, records whatever memory
its buffer points at: the exports then hold garbage counts and log-probabilities, and now
and then (a NaN among them) an empty profile export that genai-perf cannot parse. With the
flags set every response carries every output, with real values; the cost is one
log-softmax per sampled token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from backend.request import RETURN_FLAGS

REPO_ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER = REPO_ROOT / ".triton" / "bin" / "perf_analyzer"
DEFAULT_TOKENIZER = REPO_ROOT / ".models" / "SmolLM2-135M-Instruct"


def genai_perf_command(
    genai_perf: str | os.PathLike,
    *,
    model: str,
    grpc_url: str,
    tokenizer: str | os.PathLike,
    concurrency: int,
    num_requests: int,
    input_tokens: int,
    output_tokens: int,
    artifact_dir: str | os.PathLike,
    seed: int = 0,
) -> list[str]:
    """A genai-perf 0.0.16 profile: synthetic prompts of exactly `input_tokens` tokens
    (by the model's own tokenizer), `max_tokens` = `output_tokens` (sent as a string, as
    genai-perf does), no warm-up (perf_analyzer 2.51 hangs when the warm-up count is below
    the concurrency)."""
    command = [
        str(genai_perf), "profile", "-m", model, "--endpoint-type", "kserve", "--backend", "vllm", "--streaming",
        "-u", grpc_url, "--tokenizer", str(tokenizer),
        "--concurrency", str(concurrency), "--num-prompts", str(num_requests), "--request-count", str(num_requests),
        "--warmup-request-count", "0", "--random-seed", str(seed),
        "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
        "--artifact-dir", str(artifact_dir), "--verbose",
    ]
    for flag in RETURN_FLAGS:
        command += ["--extra-inputs", f"{flag}:true"]
    return command


def perf_analyzer_input_data(prompts: list[str], output_tokens: int) -> dict:
    """perf_analyzer's --input-data JSON: one entry per prompt, used round-robin.
    EOS is ignored so every request generates exactly `output_tokens` tokens."""
    sampling = json.dumps({"max_tokens": output_tokens, "ignore_eos": True})
    return {"data": [
        {"text_input": [prompt], "stream": [True], "exclude_input_in_output": [True],
         "sampling_parameters": [sampling], **{flag: [True] for flag in RETURN_FLAGS}}
        for prompt in prompts
    ]}


def synthetic_prompts(tokenizer_dir: str | os.PathLike, count: int, input_tokens: int, seed: int = 0) -> list[str]:
    """Prompts that tokenize to exactly `input_tokens` tokens, from random ordinary token ids.

    Decoded random ids rarely re-encode to the same ids (neighbours merge), so each prompt
    is re-encoded, trimmed or topped up, and decoded again until its length holds."""
    import numpy as np
    from transformers import AutoTokenizer

    from client.workloads import TOKEN_HIGH, TOKEN_LOW

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < count:
        ids = rng.integers(TOKEN_LOW, TOKEN_HIGH, size=input_tokens).tolist()
        for _ in range(20):
            text = tokenizer.decode(ids)
            ids = tokenizer(text)["input_ids"]
            if len(ids) == input_tokens:
                prompts.append(text)
                break
            ids = ids[:input_tokens] + rng.integers(TOKEN_LOW, TOKEN_HIGH, size=max(0, input_tokens - len(ids))).tolist()
    return prompts


def perf_analyzer_command(
    *,
    model: str,
    grpc_url: str,
    input_data: str | os.PathLike,
    concurrency: int,
    num_requests: int,
    csv_path: str | os.PathLike,
    profile_export: str | os.PathLike,
) -> list[str]:
    """perf_analyzer 2.51 over gRPC streaming at one concurrency: `num_requests` requests,
    one measurement (a stability threshold of 999% accepts the first window)."""
    return [
        str(PERF_ANALYZER), "-m", model, "-i", "grpc", "--streaming", "-u", grpc_url, "--async",
        "--input-data", str(input_data), "--concurrency-range", str(concurrency),
        "--request-count", str(num_requests), "--stability-percentage", "999",
        "-f", str(csv_path), "--profile-export-file", str(profile_export),
    ]


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=["perf-analyzer", "genai-perf"])
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="checkpoint folder with the tokenizer")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrencies, one profile each")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per concurrency")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--genai-venv", default=str(REPO_ROOT / ".venv-genai"))
    parser.add_argument("--out", help="export folder (default bench/perf_analyzer or bench/genai_perf)")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out or REPO_ROOT / "bench" / args.tool.replace("-", "_"))
    out.mkdir(parents=True, exist_ok=True)

    if args.tool == "genai-perf":
        venv_bin = Path(args.genai_venv) / "bin"
        env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("VIRTUAL_ENV", None)
        for concurrency in concurrencies:
            _run(genai_perf_command(
                venv_bin / "genai-perf", model=args.model, grpc_url=args.url, tokenizer=args.tokenizer,
                concurrency=concurrency, num_requests=args.num_requests, input_tokens=args.input_tokens,
                output_tokens=args.output_tokens, artifact_dir=out, seed=args.seed,
            ), env)
        print(f"genai-perf exports: {out}")
        return 0

    input_data = out / "input_data.json"
    prompts = synthetic_prompts(args.tokenizer, max(concurrencies), args.input_tokens, args.seed)
    input_data.write_text(json.dumps(perf_analyzer_input_data(prompts, args.output_tokens), indent=1))
    for concurrency in concurrencies:
        _run(perf_analyzer_command(
            model=args.model, grpc_url=args.url, input_data=input_data, concurrency=concurrency,
            num_requests=args.num_requests, csv_path=out / f"concurrency{concurrency}.csv",
            profile_export=out / f"concurrency{concurrency}_profile_export.json",
        ))
    print(f"perf_analyzer exports: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
