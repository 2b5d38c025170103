"""Stream a completion from the inflight backend over Triton's gRPC streaming API.

    .venv/bin/python -m client.generate --chat "What is the capital of France?"
    .venv/bin/python -m client.generate --max-tokens 64 --temperature 0.8 --seed 1 "Once upon a time"

Text is printed as it arrives. ``--chat`` wraps the prompt in the model's chat template
(tokenizer from the checkpoint folder, ``--tokenizer``). Exit status: 0 on success, 1 when
the server answered with an error, 2 when it cannot be reached or the model is not ready.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any, Callable

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from backend.protocol import (
    FINISH_REASON,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    RETURN_FINISH_REASON,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
)
from client.triton import is_final, make_inputs, output_value, stream_generate, text_of


def build_sampling_parameters(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": args.temperature}
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.top_k is not None:
        params["top_k"] = args.top_k
    if args.seed is not None:
        params["seed"] = args.seed
    return params


def apply_chat_template(prompt: str, tokenizer_path: str, system: str | None = None) -> str:
    path = Path(tokenizer_path)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_server(client, url: str, model: str) -> str | None:
    """A one-line problem description, or None when the model is ready."""
    from tritonclient.utils import InferenceServerException

    def detail(exc: InferenceServerException) -> str:
        return ((exc.message() or str(exc)).splitlines() or ["?"])[0]

    try:
        if not client.is_server_live(client_timeout=5):
            return f"Triton at {url} is not live"
    except InferenceServerException as exc:
        return f"cannot reach Triton at {url}: {detail(exc)} (is `make serve` running?)"
    try:
        if not client.is_model_ready(model, client_timeout=5):
            return f"model '{model}' is not ready on Triton at {url} (unknown, or still loading)"
    except InferenceServerException as exc:
        return f"model '{model}' is not available on Triton at {url}: {detail(exc)}"
    return None


def main(argv: list[str] | None = None, out: Callable[[str], None] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt ('-' reads it from standard input)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--tokenizer", default=str(DEFAULT_CHECKPOINT), help="checkpoint folder with the chat template")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default %(default)s)")
    parser.add_argument("--model", default="llm", help="model name (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the server's default_max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the whole answer")
    parser.add_argument("--stats", action="store_true", help="print finish reason and token counts to stderr")
    args = parser.parse_args(argv)
    write = out or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        try:
            prompt = apply_chat_template(prompt, args.tokenizer, args.system)
        except (OSError, ValueError) as exc:
            print(f"error: cannot load the chat template from {args.tokenizer}: {exc}", file=sys.stderr)
            return 2

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(url=args.url)
    except InferenceServerException as exc:
        print(f"error: cannot reach Triton at {args.url}: {exc}", file=sys.stderr)
        return 2
    problem = check_server(client, args.url, args.model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    returns = (RETURN_FINISH_REASON, RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS) if args.stats else ()
    sampling = build_sampling_parameters(args)
    if args.chat:
        sampling["add_special_tokens"] = False  # the chat template wrote them
    inputs = make_inputs(prompt, sampling, returns=returns)
    num_output_tokens, finish_reason, num_input_tokens = 0, None, None
    start = time.monotonic()
    try:
        for result in stream_generate(client, args.model, inputs, timeout_s=args.timeout):
            write(text_of(result))
            if args.stats:
                num_output_tokens += int(output_value(result, NUM_OUTPUT_TOKENS) or 0)
                n = output_value(result, NUM_INPUT_TOKENS)
                num_input_tokens = int(n) if n is not None else num_input_tokens
                reason = output_value(result, FINISH_REASON)
                if reason is not None and is_final(result):
                    finish_reason = reason
    except InferenceServerException as exc:
        write("\n")
        print(f"error: {exc.message() or exc}", file=sys.stderr)
        return 1
    except (TimeoutError, queue.Empty):
        write("\n")
        print(f"error: no complete answer within {args.timeout:.0f}s", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        write("\n")
        print("interrupted: request cancelled", file=sys.stderr)
        return 130
    finally:
        client.close()
    write("\n")
    if args.stats:
        elapsed = time.monotonic() - start
        print(
            f"[finish_reason={finish_reason} prompt_tokens={num_input_tokens} output_tokens={num_output_tokens} "
            f"time={elapsed:.2f}s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
