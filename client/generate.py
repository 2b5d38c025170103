"""Stream a completion from the inflight backend over Triton's gRPC streaming API.

    .venv/bin/python -m client.generate --chat "What is the capital of France?"
    .venv/bin/python -m client.generate --max-tokens 64 --temperature 0.8 --seed 1 "Once upon a time"

Text is printed as it arrives. ``--chat`` wraps the prompt in the model's chat template
(tokenizer from the checkpoint folder, ``--tokenizer``). Exit status: 0 on success, 1 when
the server answered with an error, 2 when it cannot be reached or the model is not ready.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT


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


def make_inputs(prompt: str, sampling: dict[str, Any], stream: bool = True, exclude_input: bool = True,
                returns: tuple[str, ...] = ()) -> list:
    """The input tensors of one request (vLLM-backend conventions)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: Any, dtype: str):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.array([value], dtype=object if dtype == "BYTES" else bool))
        return t

    inputs = [
        tensor("text_input", prompt.encode("utf-8"), "BYTES"),
        tensor("stream", stream, "BOOL"),
        tensor("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
        tensor("exclude_input_in_output", exclude_input, "BOOL"),
    ]
    inputs += [tensor(name, True, "BOOL") for name in returns]
    return inputs


def stream_generate(client, model: str, inputs: list, request_id: str = "1", timeout_s: float = 600.0) -> Iterator[Any]:
    """Yield each response (an InferResult) of one request; raise its error if it fails.

    `client` is a tritonclient.grpc.InferenceServerClient with no stream open.
    """
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no final response after {timeout_s:.0f}s")
            result, error = responses.get(timeout=remaining)
            if error is not None:
                raise error
            finished = is_final(result)
            yield result
            if finished:
                return
    finally:
        # Leaving early (error, Ctrl-C, a consumer that stops reading) cancels the request.
        client.stop_stream(cancel_requests=not finished)


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def output_value(result, name: str):
    """The one element of a gRPC response's output `name` (str for BYTES), or None when the
    response lacks it (optional outputs come only when a return_* input asks)."""
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def text_of(result) -> str:
    array = result.as_numpy("text_output")
    if array is None or array.size == 0:
        return ""
    return b"".join(x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)).decode("utf-8")


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

    returns = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens") if args.stats else ()
    inputs = make_inputs(prompt, build_sampling_parameters(args), returns=returns)
    num_output_tokens, finish_reason, num_input_tokens = 0, None, None
    start = time.monotonic()
    try:
        for result in stream_generate(client, args.model, inputs, timeout_s=args.timeout):
            write(text_of(result))
            if args.stats:
                n = result.as_numpy("num_output_tokens")
                num_output_tokens += int(n.reshape(-1)[0]) if n is not None else 0
                n = result.as_numpy("num_input_tokens")
                num_input_tokens = int(n.reshape(-1)[0]) if n is not None else num_input_tokens
                reason = result.as_numpy("finish_reason")
                if reason is not None and is_final(result):
                    finish_reason = reason.reshape(-1)[0].decode()
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
