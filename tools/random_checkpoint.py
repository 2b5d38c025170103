"""Write a random-weight Hugging Face checkpoint (backend/models/random_checkpoint.py):

    python -m tools.random_checkpoint .models/random-llama-small --shape small

A random PEFT LoRA adapter for a checkpoint (any base model, e.g. the default one):

    python -m tools.random_checkpoint .models/lora-r8 --lora-for .models/SmolLM2-135M-Instruct --rank 8
"""

from __future__ import annotations

import argparse

import torch

from backend.models.random_checkpoint import (
    FAMILIES,
    LORA_TARGET_MODULES,
    SHAPES,
    make_random_adapter,
    make_tiny_checkpoint,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", help="checkpoint folder (left as is when it already holds one)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the dtype the weights are stored in")
    parser.add_argument("--lora-for", metavar="BASE", help="write a random LoRA adapter for the checkpoint BASE instead")
    parser.add_argument("--rank", type=int, default=8, help="the adapter's rank (with --lora-for)")
    parser.add_argument("--target-modules", nargs="+", default=list(LORA_TARGET_MODULES), choices=LORA_TARGET_MODULES,
                        help="the adapter's target modules (with --lora-for)")
    args = parser.parse_args(argv)
    if args.lora_for:
        print(make_random_adapter(args.dest, args.lora_for, rank=args.rank, seed=args.seed,
                                  target_modules=tuple(args.target_modules)))
        return 0
    print(make_tiny_checkpoint(args.dest, args.family, seed=args.seed, dtype=getattr(torch, args.dtype),
                               **SHAPES[args.shape]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
