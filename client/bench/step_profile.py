"""Where a step's time goes, in process: `python -m client.bench.step_profile`.

The engine runs W1 (all requests at once) as client.bench does; over the timed run, after
load and warm-up, two views of the same steps:

- the engine's own phase times per iteration (`StepStats`: schedule, prepare, forward with
  the sampler, update with the detokenizers and outputs);
- Linux perf's samples of this process's CPU time (`perf record -F FREQ -p PID`, no call
  graphs), each sample put in one class by the function it was in (`CLASSES`, first match):
  the GEMMs, the attention, the elementwise kernels, the sampler, the Python interpreter,
  OpenMP's waits, memory copies and allocation, the Linux kernel, other.

    python -m client.bench.step_profile --dtype bfloat16 --num-requests 64 \\
        --json bench/results/avx2/step_profile_w1_bf16.json

Shares are of the samples, so of CPU time over every thread, not of wall time. perf must
be allowed to read this process (root, or kernel.perf_event_paranoid <= 2 for one's own).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from backend.paths import DEFAULT_CHECKPOINT

# (class, pattern on "dso symbol"), the first that matches wins. The C++ kernels' symbols are
# in the module's own DSO (inflight_cpu_kernels*.so); torch's (libtorch_cpu.so) are named.
CLASSES = (
    # The quantized GEMMs' tiles and items (gemm_quant.cpp, gemm_int8_dots.cpp) are named as such:
    # their names do not say gemm.
    ("gemm", r"panel_gemm|gemm_amx|\bgemm<|Avx2F32|Avx512F32|Avx512Bf16|mkl_blas|sgemm|dnnl|brgemm|cpublas|"
             r"bf16_dot_|vector_item|direct_(tile|rows)|buffered_tile|scalar_item|gemm_bf16|dequantize_pairs|"
             r"int8_dot_gemm|vnni_tile|avx2_tile|run_tile|tiles_gemm"),
    ("attention", r"paged_attention|attention|attend_|sdpa|flash_attention"),
    ("sampler", r"(?i)keep_nucleus|cumsum|sampling|topk|top_k|argmax|multinomial|softmax|exponential|sort|gumbel"),
    ("elementwise", r"rms_norm|silu|rotary|layer_ops|activation|elementwise|vectorized_loop|cpu_kernel_vec|"
                    r"VectorizedLoop|index_select|embedding|add_kernel|mul_kernel|copy_kernel|direct_copy|"
                    r"DecoderLayer|unary|binary|reduce"),
    ("openmp_wait", r"libgomp|gomp_|omp_"),
    ("memory", r"memcpy|memset|memmove|malloc|free|_int_free|_int_malloc|mmap|munmap|cfree|c10::alloc|"
               r"CPUAllocator"),
    ("python", r"libpython|python3|_PyEval|Py[A-Z_]|_Py|pybind11"),
    ("linux_kernel", r"\[kernel\.kallsyms\]|\[unknown\]\s+\[k\]"),
)
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CLASSES]


def classify(dso: str, symbol: str) -> str:
    text = f"{dso} {symbol}"
    for name, pattern in _COMPILED:
        if pattern.search(text):
            return name
    # A symbol perf could not name inside our module is still ours: the kernels' own code.
    if "inflight_cpu_kernels" in dso:
        return "elementwise"
    return "other"


_REPORT_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)$")


def parse_report(text: str) -> list[tuple[float, str, str]]:
    """(percent, dso, symbol) from `perf report --sort dso,sym --stdio` lines."""
    rows = []
    for line in text.splitlines():
        match = _REPORT_LINE.match(line)
        if match:
            percent, dso, _, symbol = match.groups()
            rows.append((float(percent), dso, symbol.strip()))
    return rows


def shares(rows: list[tuple[float, str, str]]) -> tuple[dict[str, float], dict[str, list]]:
    """Per class: its share of the samples (0-1), and its largest functions."""
    by_class: dict[str, float] = defaultdict(float)
    top: dict[str, list] = defaultdict(list)
    for percent, dso, symbol in rows:
        name = classify(dso, symbol)
        by_class[name] += percent
        top[name].append((percent, f"{os.path.basename(dso)}: {symbol}"))
    total = sum(by_class.values()) or 1.0
    return ({name: round(value / total, 4) for name, value in sorted(by_class.items(), key=lambda kv: -kv[1])},
            {name: [[round(p / total, 4), s] for p, s in sorted(items, reverse=True)[:6]] for name, items in top.items()})


class PerfRecorder:
    """`perf record` of this process between start() and stop()."""

    def __init__(self, frequency: int):
        self.frequency = frequency
        self.dir = tempfile.mkdtemp(prefix="step-profile-")
        self.data = os.path.join(self.dir, "perf.data")

    def start(self) -> None:
        self.proc = subprocess.Popen(["perf", "record", "-F", str(self.frequency), "-p", str(os.getpid()),
                                      "-o", self.data, "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # perf attaches to every thread before the timed run begins
        if self.proc.poll() is not None:
            raise RuntimeError(f"perf record failed: {self.proc.stderr.read().decode()[-2000:]}")

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=300)
        report = subprocess.run(["perf", "report", "-i", self.data, "--no-children", "--sort", "dso,sym", "--stdio",
                                 "--percent-limit", "0.01"], capture_output=True, text=True, check=True)
        return report.stdout


def profile(model: str, dtype: str, num_requests: int, frequency: int, progress: bool) -> dict:
    import torch
    from tqdm import tqdm

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams
    from client.bench.runners import _warm_up
    from client.bench.workloads import w1_variance

    workload = w1_variance(num_requests=num_requests)
    engine = LLMEngine(EngineConfig(model_path=model, dtype=dtype, device="cpu", **workload.engine_overrides))
    _warm_up(engine)
    for i, spec in enumerate(workload.requests):
        engine.add_request(str(i), spec.prompt_token_ids,
                           SamplingParams(temperature=spec.temperature, max_tokens=spec.max_tokens, ignore_eos=True))
    recorder = PerfRecorder(frequency)
    recorder.start()
    before = engine.stats.totals
    start = time.perf_counter()
    tokens = 0
    bar = tqdm(desc=f"W1 {dtype}", unit="tok", disable=not progress, leave=False)
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids_delta)
            bar.update(len(out.token_ids_delta))
    duration = time.perf_counter() - start
    bar.close()
    totals = engine.stats.totals.since(before)
    report = recorder.stop()
    steps = max(1, totals.steps)
    phases_ms = {phase: 1e3 * getattr(totals, f"sum_{phase}_time_s") / steps
                 for phase in ("schedule", "prepare", "forward", "update")}
    step_ms = 1e3 * duration / steps
    phases_ms["outside_phases"] = step_ms - sum(phases_ms.values())  # the engine loop, this driver
    rows = parse_report(report)
    classes, top = shares(rows)
    return {
        "dtype": dtype,
        "num_requests": num_requests,
        "output_tokens": tokens,
        "duration_s": round(duration, 3),
        "output_tokens_per_s": round(tokens / duration, 2),
        "iterations": totals.steps,
        "step_ms": round(step_ms, 3),
        "engine_phases_ms_per_iteration": {k: round(v, 3) for k, v in phases_ms.items()},
        "engine_phase_shares": {k: round(v / step_ms, 4) for k, v in phases_ms.items()},
        "cpu_time_shares": classes,
        "largest_functions": top,
        "functions": [[round(p, 3), os.path.basename(dso), symbol[:200]] for p, dso, symbol in rows],
        "largest_share": next(iter(classes)),
        "torch_threads": torch.get_num_threads(),
        "perf_frequency_hz": frequency,
    }


def main(argv: list[str] | None = None) -> int:
    from client.bench.records import git_commit, machine, write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes, one run each")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=499, help="perf samples per second per thread")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    results = [profile(args.model, dtype, args.num_requests, args.frequency, not args.no_progress)
               for dtype in args.dtype.split(",")]
    for result in results:
        print(f"{result['dtype']}: {result['output_tokens_per_s']} tok/s, {result['step_ms']} ms/step; CPU time: "
              + ", ".join(f"{k} {100 * v:.1f}%" for k, v in result["cpu_time_shares"].items()))
        print("  engine phases ms/step: " + ", ".join(f"{k} {v}" for k, v in result["engine_phases_ms_per_iteration"].items()))
    report = {
        "benchmark": "step profile, W1 in process (engine phase times + perf samples by function class)",
        "command": " ".join([os.path.basename(sys.executable), "-m", "client.bench.step_profile", *(argv or sys.argv[1:])]),
        "commit": git_commit(),
        "machine": machine(),
        "model": os.path.basename(os.path.abspath(args.model)),
        "classes": dict(CLASSES),
        "results": results,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
