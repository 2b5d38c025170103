"""Quality of quantized weights (issue 47): `python -m client.bench.perplexity`.

The perplexity of the engine's own forward pass (its kernels, its paged attention, the KV
cache and attention metadata of `ModelRunner`) on bench/data/devils-dictionary-a-f.txt, for
the float checkpoint, the same checkpoint quantized at load (int8, int4 in groups of 32 and
128; each also with int8 activations, `activation_quantization`), and GGUF files of it: the shipped Q4_1 file and Q8_0, Q4_0 and Q4_K_M files that
llama.cpp's own tools make from the float checkpoint (convert_hf_to_gguf.py to f32, then
llama-quantize). For each GGUF file llama.cpp's `llama-perplexity` scores the same file and
text, and the report gives the relative difference.

    .venv/bin/python -m client.bench.perplexity                  # writes bench/results/<kind>/perplexity.{json,md}
    .venv/bin/python -m client.bench.perplexity --only float32,Q4_1 --no-llama-cpp

The method is llama-perplexity's default (tools/perplexity/perplexity.cpp, `perplexity()`):
the whole text tokenized once (with BOS only where the tokenizer adds one), cut into
len // n_ctx windows of n_ctx tokens, each a fresh sequence from position 0 whose first token
becomes BOS where the tokenizer adds BOS; within a window only the second half is scored,
the logits at positions n_ctx/2 .. n_ctx-2 predicting the token after each. Perplexity is
exp of the mean negative log-likelihood over all scored tokens. llama.cpp and the engine
tokenize with their own tokenizers (the GGUF's and the checkpoint's tokenizer.json), so the
report records both window counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.model_runner import ModelRunner, resolve_device
from backend.models.loader import load_model
from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF, REPO_ROOT
from client.bench import llama_cpp
from client.bench.records import git_commit, machine, write_report

TEXT = REPO_ROOT / "bench" / "data" / "devils-dictionary-a-f.txt"
TEXT_SOURCE = ("The Devil's Dictionary by Ambrose Bierce (1911, public domain), the preface and the "
               "entries A to F as Debian's dict-devil 1.0-13.1 package holds them (usr/share/dictd/devil.dict.dz)")


@dataclass(frozen=True)
class Configuration:
    name: str
    model_path: str
    quantization: str = "none"
    group_size: int = 128
    kv_cache_dtype: str = "auto"
    activation_quantization: str = "none"

    @property
    def is_gguf(self) -> bool:
        return self.model_path.endswith(".gguf")


def configurations(checkpoint: str, shipped_gguf: str) -> list[Configuration]:
    quantized = [Configuration(t, llama_cpp.quantized_gguf_path(checkpoint, t)) for t in llama_cpp.QUANTIZED_TYPES]
    return [
        Configuration("float32", checkpoint),
        Configuration("int8", checkpoint, "int8"),
        Configuration("int4 g32", checkpoint, "int4", 32),
        Configuration("int4 g128", checkpoint, "int4", 128),
        *(Configuration(f"float32 + {kv} KV", checkpoint, kv_cache_dtype=kv) for kv in ("int8", "fp8_e4m3", "fp8_e5m2")),
        Configuration("Q4_1", shipped_gguf),
        *quantized,
        Configuration("int8 W8A8", checkpoint, "int8", activation_quantization="int8"),
        Configuration("int4 g32 W4A8", checkpoint, "int4", 32, activation_quantization="int8"),
        Configuration("int4 g128 W4A8", checkpoint, "int4", 128, activation_quantization="int8"),
        Configuration("Q4_1 W4A8", shipped_gguf, activation_quantization="int8"),
    ]


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama-perplexity takes them (special tokens added as the tokenizer
    adds them), and the BOS id each window starts with, None where the tokenizer adds no BOS."""
    tokens = tokenizer(text, add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][0] == bos
    return tokens, bos if adds_bos else None


def windows(tokens: list[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """len(tokens) // n_ctx windows of n_ctx tokens, one after another, the first of each
    replaced by `bos` when given; the tail that fills no window is left out."""
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens: at least 2 x n_ctx = {2 * n_ctx} are needed")
    out = []
    for i in range(len(tokens) // n_ctx):
        window = tokens[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            window[0] = bos
        out.append(window)
    return out


def scored_nll(logits: torch.Tensor, window: list[int]) -> float:
    """The summed negative log-likelihood of the scored tokens of `window` given `logits`, the
    rows of positions n_ctx/2 .. n_ctx-2 (each predicting the next token), in float64."""
    first = len(window) // 2
    targets = torch.tensor(window[first + 1:], dtype=torch.int64, device=logits.device)
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} scored tokens")
    log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return -float(log_probs.gather(1, targets[:, None]).sum())


def load_runner(config: Configuration, n_ctx: int, device: str, dtype: torch.dtype, sequences: int = 1,
                block_size: int = 16) -> ModelRunner:
    """The configuration's model with a KV pool of `sequences` n_ctx-token sequences."""
    num_blocks = sequences * -(-n_ctx // block_size)
    engine_config = EngineConfig(model_path=config.model_path, device=device, block_size=block_size,
                                 max_num_seqs=sequences, max_model_len=n_ctx, max_num_batched_tokens=sequences * n_ctx,
                                 num_kv_blocks=num_blocks, quantization=config.quantization,
                                 quantization_group_size=config.group_size, kv_cache_dtype=config.kv_cache_dtype,
                                 activation_quantization=config.activation_quantization)
    torch_device = resolve_device(device)
    model, _ = load_model(config.model_path, dtype, torch_device, n_ctx, quantization=config.quantization,
                          quantization_group_size=config.group_size,
                          activation_quantization=config.activation_quantization)
    return ModelRunner(engine_config, model, model.arch, num_blocks, 0, torch_device, dtype)


@torch.inference_mode()
def engine_nll(runner: ModelRunner, windows_: list[list[int]], sequences: int = 1,
               progress: bool = False) -> tuple[float, int]:
    """The summed NLL over the scored tokens of all windows, and their count. Each window is
    its own sequence, prefilled from position 0 over the runner's paged KV cache, `sequences`
    windows to a forward pass (the pass's weight reads, and a fallback GEMM's de-quantization,
    are shared by all of them; each window's attention sees only its own tokens)."""
    n_ctx = len(windows_[0])
    first = n_ctx // 2
    total, count = 0.0, 0
    for start in range(0, len(windows_), sequences):
        batch = windows_[start:start + sequences]
        # A step of len(batch) n_ctx-token sequences in blocks 0.. of the pool; only the tokens are set.
        inputs = runner.synthetic_inputs([n_ctx] * len(batch))
        ids = torch.tensor(batch, dtype=torch.int64, device=runner.device).flatten()
        hidden = runner.model(ids, inputs.positions, runner.kv_caches, inputs.meta)
        for j, window in enumerate(batch):
            logits = runner.model.compute_logits(hidden[j * n_ctx + first:(j + 1) * n_ctx - 1])
            total += scored_nll(logits, window)
            count += n_ctx - 1 - first
        if progress:
            print(f"  [{start + len(batch)}/{len(windows_)}] ppl so far {math.exp(total / count):.4f}", flush=True)
    return total, count


def engine_row(config: Configuration, windows_: list[list[int]], n_ctx: int, device: str, sequences: int) -> dict:
    """The engine's figures for `config`: perplexity, and the bytes its weights hold resident
    (the packed and quantized forms the engine computes with)."""
    start = time.perf_counter()
    runner = load_runner(config, n_ctx, device, torch.float32, sequences)
    nll, count = engine_nll(runner, windows_, sequences, progress=True)
    return {"quantization": config.quantization, "group_size": config.group_size if config.quantization == "int4" else None,
            "kv_cache_dtype": config.kv_cache_dtype, "activation_quantization": config.activation_quantization,
            "resident_weight_bytes": runner.model.resident_weight_bytes(),
            "ppl": math.exp(nll / count), "mean_nll": nll / count, "scored_tokens": count,
            "seconds": time.perf_counter() - start, "git_commit": git_commit(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def llama_perplexity(gguf: str, text: str, n_ctx: int, threads: int) -> dict:
    """llama.cpp's own figure for `gguf` on `text`: its default method, one window per batch."""
    command = [str(llama_cpp.LLAMA_PERPLEXITY), "-m", gguf, "-f", text, "-c", str(n_ctx), "-b", str(n_ctx),
               "-t", str(threads), "-tb", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    log = done.stdout + done.stderr
    final, chunks = FINAL.search(log), CHUNKS.search(log)
    if done.returncode != 0 or final is None or chunks is None:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{log[-3000:]}")
    return {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2)), "windows": int(chunks.group(1)),
            "seconds": time.perf_counter() - start, "command": " ".join(command)}


def markdown(report: dict) -> str:
    lines = [
        f"Perplexity of SmolLM2-135M-Instruct on {report['text']['path']} ({report['text']['tokens']} tokens, "
        f"{report['method']['windows']} windows of n_ctx={report['method']['n_ctx']}, second half scored), "
        f"`{report['command']}` on {report['machine']['cpu']} ({report['machine']['cpu_kind']}).",
        "",
        "| weights | resident weights (MiB) | perplexity (engine) | llama-perplexity | difference |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report["results"]:
        peer = row.get("llama_perplexity")
        theirs = f"{peer['ppl']:.4f}" if peer else "-"
        diff = f"{row['relative_difference']:+.3%}" if "relative_difference" in row else "-"
        ours = f"{row['ppl']:.4f}" if "ppl" in row else "-"
        size = f"{row['resident_weight_bytes'] / 2**20:.1f}" if "resident_weight_bytes" in row else "-"
        lines.append(f"| {row['name']} | {size} | {ours} | {theirs} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="float checkpoint (and tokenizer)")
    parser.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the shipped Q4_1 GGUF file")
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--n-ctx", type=int, default=512, help="window length (llama-perplexity's -c)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", help="comma-separated configuration names (default: all)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama-perplexity")
    parser.add_argument("--llama-cpp-only", action="store_true", help="only llama-perplexity (with --update: "
                        "added to the engine's figures already in the report)")
    parser.add_argument("--sequences", type=int, default=8, help="windows to a forward pass")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity's threads")
    parser.add_argument("--json", help="default bench/results/<cpu kind>/perplexity.json, a .md table beside it")
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of the configurations not run from the report already at --json")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens, bos = tokenize(tokenizer, text)
    windows_ = windows(tokens, args.n_ctx, bos)
    selected = configurations(args.model, args.gguf)
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {c.name for c in selected}
        if unknown:
            raise SystemExit(f"--only: unknown configuration(s) {sorted(unknown)}; known: {[c.name for c in selected]}")
        selected = [c for c in selected if c.name in names]
    info = machine()
    print(f"{args.text}: {len(tokens)} tokens, {len(windows_)} windows of {args.n_ctx}; {info['cpu']}", flush=True)

    command = "python -m client.bench.perplexity " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {
        "benchmark": "perplexity of quantized weights (issue 47)",
        "command": command,
        "git_commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": info,
        "device": args.device,
        "text": {"path": os.path.relpath(args.text, REPO_ROOT), "source": TEXT_SOURCE, "characters": len(text),
                 "tokens": len(tokens), "tokenizer": os.path.relpath(args.model, REPO_ROOT)},
        "method": {"n_ctx": args.n_ctx, "windows": len(windows_), "bos": bos,
                   "scored_positions": f"{args.n_ctx // 2}..{args.n_ctx - 2} of each window (llama-perplexity's default)",
                   "llama_perplexity_threads": args.threads},
        "results": [],
    }
    path = args.json or str(REPO_ROOT / "bench" / "results" / info["cpu_kind"] / "perplexity.json")
    order = [c.name for c in configurations(args.model, args.gguf)]

    def earlier_rows() -> dict[str, dict]:
        """With --update, the rows of the report at `path` as it is now (another run, of other
        configurations, may have written it since this one began)."""
        if not (args.update and os.path.exists(path)):
            return {}
        with open(path) as f:
            earlier = json.load(f)
        if earlier["text"] != report["text"] or earlier["method"] != report["method"]:
            raise SystemExit(f"--update: {path} scores another text or method; run without --update")
        if command not in earlier["command"]:
            report["command"] = f"{earlier['command']}; {command}"
        return {row["name"]: row for row in earlier["results"]}

    earlier_rows()  # refuses a report of another text or method before the first configuration
    measured: dict[str, dict] = {}

    for config in selected:
        if config.name in llama_cpp.QUANTIZED_TYPES:
            config = Configuration(config.name, llama_cpp.make_quantized_gguf(args.model, config.name))
        row = {"name": config.name, "model_path": os.path.relpath(config.model_path, REPO_ROOT)}
        if not args.llama_cpp_only:
            row.update(engine_row(config, windows_, args.n_ctx, args.device, args.sequences))
            print(f"{config.name}: ppl {row['ppl']:.4f}, weights {row['resident_weight_bytes'] / 2**20:.1f} MiB",
                  flush=True)
        if config.is_gguf and not args.no_llama_cpp:
            row["llama_perplexity"] = llama_perplexity(config.model_path, args.text, args.n_ctx, args.threads)
            print(f"{config.name}: llama-perplexity {row['llama_perplexity']['ppl']:.4f}", flush=True)
        measured[config.name] = row
        # Written after each configuration: a long run stopped halfway keeps what it measured.
        rows = earlier_rows()
        for name, mine in measured.items():
            rows[name] = {**rows.get(name, {}), **mine}
        for row in rows.values():
            if "ppl" in row and "llama_perplexity" in row:
                row["relative_difference"] = (row["ppl"] - row["llama_perplexity"]["ppl"]) / row["llama_perplexity"]["ppl"]
        report["results"] = sorted(rows.values(), key=lambda r: order.index(r["name"]))
        write_report(path, report)
        table = os.path.splitext(path)[0] + ".md"
        with open(table, "w") as f:
            f.write(markdown(report))
    print(markdown(report))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
