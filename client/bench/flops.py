"""The FLOP bound of docs/benchmarks.md: each result's matmul GFLOP/s over this machine's best
matmul rate, measured in the same run as the systems it bounds."""

from __future__ import annotations

import json
import os
import time

import torch

import kernels


def model_flops(model_path: str) -> tuple[float, float]:
    """Matmul FLOPs (per token through the layers' projections, per output token through the
    output head). Every prompt and output token goes through the layers; the head runs
    once per generated token, at a prompt's last position for the first and at each decode
    after, as in every system measured here. Attention's own q.k and p.v terms, small at
    these context lengths, are left out."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * cfg["intermediate_size"]
    return 2.0 * layers * per_layer, 2.0 * hidden * cfg["vocab_size"]


def matmul_peak_gflops(dtype_name: str, rows: int = 256, size: int = 2048, seconds: float = 0.5,
                       windows: int = 4, device: torch.device | str = "cpu") -> float:
    """The best matmul rate of this machine now, at `rows` rows in `dtype_name`: the faster of
    torch's matmul and the engine's packed linear (docs/benchmarks.md's FLOP bound; measured in the
    same run as the systems it bounds). Both count: on a CPU without native bf16 the packed
    linear computes bf16 in float32 at ~7x torch's bf16 rate, and a bound below what the
    engine reaches would be no bound. Each rate is the best of `windows` windows of `seconds`,
    and client.bench measures it before the systems run: measured in one window right after
    vLLM, whose processes take a while to go, it read 132 GFLOP/s in float32 where the machine
    does 184 (2-core AVX512-BF16 EPYC)."""
    dtype = getattr(torch, dtype_name)
    device = torch.device(device)
    if device.type == "cuda":
        # A 256 x 2048 x 2048 product takes a few microseconds on a GPU, less than its launch.
        size = max(size, 8192)
    a, b = torch.randn(rows, size).to(dtype).to(device), torch.randn(size, size).to(dtype).to(device)
    packed = kernels.pack_linear_weight(b)

    def rate(call) -> float:
        return 2.0 * rows * size * size / seconds_per_call(call, device, seconds, windows) / 1e9

    peak = rate(lambda: torch.mm(a, b))
    if packed is not None:
        peak = max(peak, rate(lambda: kernels.linear(a, b, None, packed)))
    return peak


def add_flop_bound(results: list[dict], model_path: str, dtype_name: str, peak: float | None = None,
                   device: torch.device | str = "cpu") -> dict:
    """Each result's fraction of the FLOP bound: its matmul GFLOP/s (`model_flops`) over the
    matmul peak (`peak`, else measured now)."""
    peak = matmul_peak_gflops(dtype_name, device=device) if peak is None else peak
    per_token, per_output_token = model_flops(model_path)
    for result in results:
        achieved = (result["total_tokens_per_s"] * per_token + result["output_tokens_per_s"] * per_output_token) / 1e9
        result["model_gflops_per_s"] = achieved
        result["fraction_of_flop_bound"] = achieved / peak if peak else 0.0
    return {"dtype": dtype_name, "matmul_peak_gflops_at_256_rows": peak, "layer_gflops_per_token": per_token / 1e9,
            "head_gflops_per_output_token": per_output_token / 1e9}



WARMUP_CALLS = 3


def synchronizer(device: torch.device | str):
    """A call that waits for the device's queued work (nothing to wait for on the CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def seconds_per_call(call, device: torch.device | str, seconds: float, windows: int) -> float:
    """The best mean time of one call over `windows` windows of at least `seconds` (and one
    call) each, after WARMUP_CALLS calls; synchronised with the device at each window's ends."""
    sync = synchronizer(device)
    for _ in range(WARMUP_CALLS):
        call()
    best = float("inf")
    for _ in range(windows):
        sync()
        calls, start = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - start < seconds:
            call()
            calls += 1
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def copy_bandwidth_gbps(device: torch.device | str = "cpu", megabytes: int = 1024, seconds: float = 0.5,
                        windows: int = 4) -> float:
    """The device's memory bandwidth now, in GB/s: a copy of `megabytes` from one tensor to
    another, counted as the bytes read plus the bytes written (docs/benchmarks.md's G1 and G2
    roofline; a kernel that only reads reaches about this rate)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() / seconds_per_call(lambda: dst.copy_(src), device, seconds, windows) / 1e9
