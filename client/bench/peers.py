"""Peer systems for the benchmark (issue #8), each returning a `SystemRun`.

- `run_vllm_offline`: vLLM's offline `LLM.generate` on CPU. vLLM needs its own torch and
  numpy 2, so it lives in .venv-peers (`make peers`) and runs as a subprocess
  (`client/bench/vllm_offline.py`) that gets the requests and returns the results as JSON.
- `run_openvino_offline`: OpenVINO GenAI's `ContinuousBatchingPipeline` (Intel's engine for
  its CPUs), in .venv-openvino (`make peers-openvino`), as a subprocess
  (`client/bench/openvino_offline.py`) with the same request and result JSON.
- `run_hf_continuous`: Hugging Face transformers' own continuous batching (the manager behind
  `generate_batch`), in this process.

All report per request what `client.bench.stats.summarize` needs. An offline generate streams
nothing, so every vllm-offline token "arrives" when the whole batch ends (as hf-static's do);
openvino-offline's likewise; hf-continuous records a time per token.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
import time
import warnings

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from backend.paths import MODELS_DIR, REPO_ROOT
from client.bench.records import RequestRecord, SystemRun
from client.bench.vllm_peer import check_requests, make_request
from client.bench.workloads import Workload

PEERS_VENV = os.path.join(REPO_ROOT, ".venv-peers")
PEERS_PYTHON = os.path.join(PEERS_VENV, "bin", "python")
OPENVINO_PYTHON = os.path.join(REPO_ROOT, ".venv-openvino", "bin", "python")

# transformers' continuous batching on CPU cannot size itself (it would take 60% of RAM), so
# both sizes are set. 2048 batch tokens per forward pass is the project engine's default
# max_num_batched_tokens; 256-token pages are transformers' default.
HF_MAX_BATCH_TOKENS = 2048
HF_PAGE_SIZE = 256


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _warn_if_timed_arrivals(workload: Workload, system: str) -> None:
    if any(r.arrival_s > 0 for r in workload.requests):
        warnings.warn(f"{system} submits every request of {workload.name} at once; its arrival times are ignored",
                      stacklevel=3)


# ---- vLLM offline ---------------------------------------------------------------------


def vllm_requests(workload: Workload) -> list[dict]:
    """The workload as client.bench.vllm_offline's requests.json, in workload order."""
    requests = [make_request(r.prompt_token_ids, r.max_tokens, r.temperature) for r in workload.requests]
    check_requests(requests)
    return requests


def vllm_records(workload: Workload, result: dict, start: float, end: float) -> list[RequestRecord]:
    """RequestRecords from client.bench.vllm_offline's result.json: the batch ran from `start` to `end`."""
    counts = result["num_output_tokens"]
    if len(counts) != len(workload.requests):
        raise ValueError(f"vllm-offline returned {len(counts)} results for {len(workload.requests)} requests")
    reasons = result.get("finish_reasons") or ["length"] * len(counts)
    return [
        RequestRecord(arrival=start, token_times=[end] * n, num_output_tokens=n, expected_output_tokens=spec.max_tokens,
                      finish_reason=reason or "length", label=spec.label)
        for spec, n, reason in zip(workload.requests, counts, reasons)
    ]


def _run_child(python: str, module: str, make: str, arguments: list[str], requests: list[dict], progress: bool,
               env: dict | None = None) -> dict:
    """Runs `python -m module --requests FILE --out FILE *arguments` in the repository root
    with `requests`, and returns its result JSON; a missing venv names the make target."""
    if not os.path.exists(python):
        raise FileNotFoundError(f"{python} is missing: run `{make}`")
    # The child must see only its own venv's packages, never the project venv's.
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    with tempfile.TemporaryDirectory(prefix=module.rsplit(".", 1)[-1] + "-") as tmp:
        requests_path = os.path.join(tmp, "requests.json")
        result_path = os.path.join(tmp, "result.json")
        with open(requests_path, "w") as f:
            json.dump(requests, f)
        command = [python, "-m", module, "--requests", requests_path, "--out", result_path, *arguments]
        if progress:
            proc = subprocess.run(command, cwd=REPO_ROOT, env=env)
            output = ""
        else:
            proc = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            output = proc.stdout
        if proc.returncode != 0:
            raise RuntimeError(f"{module} failed (exit {proc.returncode}): {' '.join(command)}\n{output[-4000:]}")
        with open(result_path) as f:
            return json.load(f)


def _offline_run(system: str, workload: Workload, result: dict, kpi_keys: tuple[str, ...]) -> SystemRun:
    # Only the duration crosses the process boundary; the records need a start and an end.
    end = time.perf_counter()
    start = end - result["duration_s"]
    return SystemRun(system, vllm_records(workload, result, start, end), result["duration_s"],
                     {key: result.get(key) for key in kpi_keys})


def run_vllm_offline(workload: Workload, model_path: str, max_num_seqs: int, dtype, progress: bool = True,
                     seed: int = 0) -> SystemRun:
    """The workload through vLLM's offline `LLM.generate`, in .venv-peers, all requests at once
    (arrival times and priorities are ignored).

    Model load, compilation (about two minutes here, every start) and one warm-up generate are
    not timed; the duration is the one timed generate. vLLM's CPU settings are those of
    client/bench/vllm_offline.py. A sampled request's seed is `seed` plus its index.
    """
    _warn_if_timed_arrivals(workload, "vllm-offline")
    env = dict(os.environ)
    if not progress:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    arguments = ["--model", os.path.abspath(model_path), "--dtype", _dtype_name(dtype),
                 "--max-num-seqs", str(max_num_seqs), "--seed", str(seed)] + (["--progress"] if progress else [])
    result = _run_child(PEERS_PYTHON, "client.bench.vllm_offline", "make peers-vllm", arguments, vllm_requests(workload),
                        progress, env)
    return _offline_run("vllm-offline", workload, result,
                        ("vllm_version", "dtype", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                         "kv_cache_space_gib", "omp_threads_bind", "ld_preload", "load_s"))


# ---- OpenVINO GenAI -----------------------------------------------------------------------


def openvino_ir_dir(model_path: str) -> str:
    """Where a checkpoint's OpenVINO IR export lives (made once by the child, then reused):
    .models/openvino/<checkpoint folder's name>-<a hash of its path>."""
    path = os.path.abspath(model_path)
    return str(MODELS_DIR / "openvino" / f"{os.path.basename(path)}-{hashlib.sha1(path.encode()).hexdigest()[:8]}")


def run_openvino_offline(workload: Workload, model_path: str, max_num_seqs: int, dtype, progress: bool = True,
                         seed: int = 0) -> SystemRun:
    """The workload through OpenVINO GenAI's `ContinuousBatchingPipeline.generate`, in
    .venv-openvino, all requests at once (arrival times and priorities are ignored), with
    INFERENCE_PRECISION_HINT and the KV cache in `dtype` (client/bench/openvino_offline.py has
    every setting). The IR export, model load, compilation and one warm-up request are not
    timed. A sampled request's seed is `seed` plus its index."""
    _warn_if_timed_arrivals(workload, "openvino-offline")
    arguments = ["--model", os.path.abspath(model_path), "--ir", openvino_ir_dir(model_path),
                 "--dtype", _dtype_name(dtype), "--max-num-seqs", str(max_num_seqs), "--seed", str(seed)]
    result = _run_child(OPENVINO_PYTHON, "client.bench.openvino_offline", "make peers-openvino", arguments,
                        vllm_requests(workload), progress)
    return _offline_run("openvino-offline", workload, result,
                        ("openvino_genai_version", "openvino_version", "dtype", "properties", "scheduler",
                         "load_s", "export_s"))


# ---- Hugging Face continuous batching ---------------------------------------------------


def hf_num_blocks(workload: Workload, max_num_seqs: int, page_size: int = HF_PAGE_SIZE) -> int:
    """Pages enough for `max_num_seqs` of the workload's longest requests at once, so the
    KV cache never limits transformers below the batch size it is given."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    return min(max_num_seqs, len(workload.requests)) * math.ceil(longest / page_size) + 1


def hf_continuous_generate(model, workload: Workload, max_num_seqs: int, progress: bool = True, seed: int = 0,
                           max_batch_tokens: int = HF_MAX_BATCH_TOKENS, page_size: int = HF_PAGE_SIZE,
                           num_blocks: int | None = None) -> tuple[list, list[float], float, float, dict]:
    """Run the workload through `model`'s continuous batching manager.

    Returns (one transformers GenerationOutput per request and the time each was submitted,
    both in workload order; the start and end of the timed run; the settings used).

    `generate_batch` takes one max_new_tokens for every prompt, so this drives the manager it
    wraps (`continuous_batching_context_manager`) directly: `add_request` takes each request's
    own max_new_tokens, and requests go in at their arrival times. Priorities are ignored
    (transformers' scheduler is FIFO).
    """
    temperatures = {r.temperature for r in workload.requests}
    if len(temperatures) != 1:
        # Sampling on or off is one setting for the whole manager in transformers 5.23.
        raise ValueError(f"hf-continuous needs one temperature for all requests, "
                         f"{workload.name} has {sorted(temperatures)}")
    temperature = temperatures.pop()
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    # eos_token_id=-1: no EOS, so every request runs to its max_new_tokens (as ignore_eos does elsewhere).
    generation_config = GenerationConfig(eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in workload.requests),
                                          **sampling)
    if num_blocks is None:
        num_blocks = hf_num_blocks(workload, max_num_seqs, page_size)
    # One seed for the manager's sampling stream: transformers has no per-request seeds.
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, page_size=page_size,
                                         max_requests_per_batch=max_num_seqs, seed=seed)
    settings = {"num_blocks": num_blocks, "page_size": page_size, "max_batch_tokens": max_batch_tokens,
                "max_num_seqs": max_num_seqs}
    requests = workload.requests
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    results = [None] * len(requests)
    arrivals = [0.0] * len(requests)

    def add(manager, request_id: str, prompt: list[int], max_new_tokens: int) -> None:
        if manager.add_request(list(prompt), request_id=request_id, max_new_tokens=max_new_tokens,
                               record_timestamps=True, eos_token_id=-1) is None:
            raise RuntimeError(f"hf-continuous: the manager refused request {request_id}")

    def wait_for(manager, request_id: str | None, timeout: float):
        result = manager.get_result(request_id=request_id, timeout=timeout)
        if result is None and not manager.is_running():
            raise RuntimeError("hf-continuous: the generation thread stopped")
        if result is not None and result.error is not None:
            raise RuntimeError(f"hf-continuous request {result.request_id} failed: {result.error}")
        return result

    with model.continuous_batching_context_manager(generation_config=generation_config, block=True, timeout=30,
                                                   continuous_batching_config=cb_config) as manager:
        # Same warm-up as the engine's in client.bench.runners: the first forward passes pay for setup.
        add(manager, "warmup", range(1000, 1040), 4)
        warmup = None
        while warmup is None or not warmup.is_finished():
            warmup = wait_for(manager, "warmup", 1.0)
        bar = tqdm(total=len(requests), desc=f"{workload.name} hf-continuous", unit="req", disable=not progress,
                   leave=False)
        start = time.perf_counter()
        next_index = finished = 0
        while finished < len(requests):
            now = time.perf_counter() - start
            while next_index < len(order) and requests[order[next_index]].arrival_s <= now:
                i = order[next_index]
                arrivals[i] = time.perf_counter()
                add(manager, str(i), requests[i].prompt_token_ids, requests[i].max_tokens)
                next_index += 1
            timeout = 1.0
            if next_index < len(order):
                until_next = requests[order[next_index]].arrival_s - (time.perf_counter() - start)
                timeout = max(0.001, min(timeout, until_next))
            result = wait_for(manager, None, timeout)
            if result is not None and result.is_finished():
                results[int(result.request_id)] = result
                finished += 1
                bar.update(1)
        end = time.perf_counter()
        bar.close()
    return results, arrivals, start, end, settings


def run_hf_continuous(workload: Workload, model_path: str, max_num_seqs: int, dtype, progress: bool = True,
                      seed: int = 0, max_batch_tokens: int = HF_MAX_BATCH_TOKENS, page_size: int = HF_PAGE_SIZE,
                      num_blocks: int | None = None, device: torch.device | str = "cpu") -> SystemRun:
    """The workload through transformers' continuous batching, `max_num_seqs` requests at most
    per step, each request submitted at its arrival time, on `device` (the engine's).

    Every token has its own time (the manager's per-token timestamps), so TTFT and TPOT are
    real. The KV cache holds `max_num_seqs` of the longest requests unless `num_blocks` says
    otherwise.
    """
    torch_dtype = getattr(torch, _dtype_name(dtype))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    results, arrivals, start, end, settings = hf_continuous_generate(
        model, workload, max_num_seqs, progress, seed, max_batch_tokens, page_size, num_blocks)
    records = []
    for spec, arrival, out in zip(workload.requests, arrivals, results):
        times = list(out.timestamps or [])
        if len(times) != len(out.generated_tokens):  # no per-token times: the request's end
            times = [out.lifespan[1] if out.lifespan[1] > 0 else end] * len(out.generated_tokens)
        scheduled = out.lifespan[0]
        records.append(RequestRecord(
            arrival=arrival, token_times=times, num_output_tokens=len(out.generated_tokens),
            expected_output_tokens=spec.max_tokens, finish_reason="length", label=spec.label,
            queue_time=scheduled - arrival if scheduled > 0 else None,
        ))
    kpis = {**settings, "dtype": _dtype_name(torch_dtype), "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "attn_implementation": model.config._attn_implementation}
    return SystemRun("hf-continuous", records, end - start, kpis)
