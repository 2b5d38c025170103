"""Write a random-weight Hugging Face checkpoint (backend/models/random_checkpoint.py):

    python -m tools.random_checkpoint .models/random-llama-small --shape small
"""

from __future__ import annotations

import argparse

from backend.models.random_checkpoint import FAMILIES, SHAPES, make_tiny_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", help="checkpoint folder (left as is when it already holds one)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.dest, args.family, seed=args.seed, **SHAPES[args.shape]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
