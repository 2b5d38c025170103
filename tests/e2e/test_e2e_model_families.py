"""A non-Llama family through tritonserver: a tiny Qwen3 checkpoint served as model `llm`
answers concurrent greedy requests with the token ids and text of transformers generate()
(the engine-level family tests are tests/engine/test_model_families.py).
"""

from __future__ import annotations

import pytest
import transformers

from tests.checkpoints import hf_greedy
from tests.e2e.e2e_util import greedy_tokens_and_texts
from tests.engine.test_model_families import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"family": "qwen3", "attention_bias": True}


@pytest.fixture(scope="module")
def qwen3_server(tritonserver, tiny_checkpoint):
    """A tritonserver of its own serving a tiny Qwen3 checkpoint as model `llm`."""
    parameters = {"model_path": tiny_checkpoint, "max_num_seqs": "8", "kv_cache_memory_mb": "64",
                  "max_model_len": "256"}
    with tritonserver({"llm": parameters}) as server:
        yield server, tiny_checkpoint


@pytest.mark.e2e
def test_qwen3_through_tritonserver_matches_transformers(qwen3_server):
    """A batch of concurrent greedy requests: the token ids (from the returned logprobs) and
    the text are those of transformers generate()."""
    server, path = qwen3_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    expected = hf_greedy(path, [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)
    results = greedy_tokens_and_texts(server.grpc_url, "llm", PROMPTS, MAX_TOKENS)
    for (token_ids, text), want in zip(results, expected):
        assert token_ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
