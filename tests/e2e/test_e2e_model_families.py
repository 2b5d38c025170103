"""A non-Llama family through tritonserver: a tiny Qwen3 checkpoint served as model `llm`
answers concurrent greedy requests with the token ids and text of transformers generate()
(the engine-level family tests are tests/engine/test_model_families.py).
"""

from __future__ import annotations

import json

import pytest
import transformers

from tests.checkpoints import hf_greedy
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
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as grpcclient

    from client.triton import make_inputs, stream_generate, text_of

    server, path = qwen3_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    expected = hf_greedy(path, [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)
    sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}

    def ask(i: int):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            inputs = make_inputs(PROMPTS[i], sampling, stream=False, returns=("return_logprobs",))
            responses = list(stream_generate(client, "llm", inputs, request_id=str(i), timeout_s=300))
        finally:
            client.close()
        assert len(responses) == 1
        entries = json.loads(responses[0].as_numpy("logprobs").reshape(-1)[0])
        return [int(next(iter(entry))) for entry in entries], text_of(responses[0])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(ask, range(len(PROMPTS))))
    for (token_ids, text), want in zip(results, expected):
        assert token_ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
