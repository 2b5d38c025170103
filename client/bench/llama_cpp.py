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

from backend.paths import MODELS_DIR, REPO_ROOT

LLAMA_CPP_DIR = REPO_ROOT / ".llama.cpp"
LLAMA_SERVER = LLAMA_CPP_DIR / "build" / "bin" / "llama-server"
# The perplexity benchmark's peer and the maker of its quantized GGUF files (client/bench/perplexity.py).
LLAMA_PERPLEXITY = LLAMA_CPP_DIR / "build" / "bin" / "llama-perplexity"
LLAMA_QUANTIZE = LLAMA_CPP_DIR / "build" / "bin" / "llama-quantize"
CONVERTER = LLAMA_CPP_DIR / "src" / "convert_hf_to_gguf.py"
CONVERTER_PYTHON = REPO_ROOT / ".venv-openvino" / "bin" / "python"
GGUF_TYPE = {"float32": ("f32", "f32"), "bfloat16": ("bf16", "bf16")}  # dtype -> (--outtype, KV cache type)


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
