"""The non-Llama families through tritonserver: tiny Qwen3, Phi-3, Qwen3-MoE, Gemma 2 and Gemma 3
checkpoints, served by one tritonserver as models `llm`, `phi3`, `moe`, `gemma2` and `gemma3`, answer concurrent greedy requests with the token ids and
text of transformers generate() (the engine-level family tests are
tests/engine/test_model_families.py).
"""

from __future__ import annotations

import pytest
import transformers

from backend.detokenizer import INCOMPLETE
from tests.checkpoints import hf_greedy, make_tiny_checkpoint
from tests.e2e.e2e_util import greedy_tokens_and_texts
from tests.engine.test_model_families import CASES, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PHI3_CASE = "phi3-fused-untied-gqa"
MOE_CASE = "qwen3-moe-dense-layer0-unnormalised"
GEMMA2_CASE = "gemma2-window16-softcap"
GEMMA3_CASE = "gemma3-local-global-two-ropes"


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"family": "qwen3", "attention_bias": True}


@pytest.fixture(scope="module")
def families_server(tritonserver, tiny_checkpoint, tmp_path_factory):
    """A tritonserver of its own serving a tiny Qwen3 checkpoint as `llm`, a tiny Phi-3 one
    (q|k|v and gate|up stored fused, a sliding window) as `phi3`, a tiny Qwen3-MoE one as `moe`,
    and tiny Gemma 2 and Gemma 3 ones (windows of 16 positions, which the prompts cross) as
    `gemma2` and `gemma3`."""
    paths = {"llm": tiny_checkpoint}
    for model, case in (("phi3", PHI3_CASE), ("moe", MOE_CASE), ("gemma2", GEMMA2_CASE), ("gemma3", GEMMA3_CASE)):
        family, overrides, _ = CASES[case]
        paths[model] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(model) / "ckpt"), family=family, **overrides)
    parameters = {"max_num_seqs": "8", "kv_cache_memory_mb": "64", "max_model_len": "256"}
    with tritonserver({model: {"model_path": path, **parameters} for model, path in paths.items()}) as server:
        yield server, paths


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["llm", "phi3", "moe", "gemma2", "gemma3"],
                         ids=["qwen3", "phi3", "qwen3-moe", "gemma2", "gemma3"])
def test_family_through_tritonserver_matches_transformers(families_server, model):
    """A batch of concurrent greedy requests: the token ids (from the returned logprobs) and
    the text are those of transformers generate()."""
    server, paths = families_server
    path = paths[model]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    expected = hf_greedy(path, [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)
    results = greedy_tokens_and_texts(server.grpc_url, model, PROMPTS, MAX_TOKENS)
    for (token_ids, text), want in zip(results, expected):
        assert token_ids == want
        # Random weights may end on part of a UTF-8 sequence, which is never streamed (as vLLM's
        # detokenizer does): transformers shows it as U+FFFD.
        assert text == tokenizer.decode(want, skip_special_tokens=True).rstrip(INCOMPLETE)
