"""model_repository/llm_q4 through tritonserver: the shipped Q4_1 GGUF file of SmolLM2-135M,
served with its weights 4-bit, answers concurrent greedy requests with the tokens of
transformers running that file de-quantized (the engine-level tests of every format are
tests/engine/test_quantized.py), and exports its resident weight bytes.
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import transformers

from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF
from tests.checkpoints import hf_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three colors: red,"]
MAX_TOKENS = 16


def test_llm_q4_serves_the_gguf_file_as_transformers_reads_it(tritonserver):
    import tritonclient.grpc as grpcclient

    from client.triton import make_inputs, stream_generate, text_of

    parameters = {"model_path": str(DEFAULT_GGUF), "tokenizer": str(DEFAULT_CHECKPOINT), "max_num_seqs": "8",
                  "kv_cache_memory_mb": "64"}
    with tritonserver({"llm_q4": parameters}, sources={"llm_q4": "llm_q4"}) as server:
        tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
        sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}

        def ask(i: int):
            client = grpcclient.InferenceServerClient(server.grpc_url)
            try:
                inputs = make_inputs(PROMPTS[i], sampling, stream=False, returns=("return_logprobs",))
                responses = list(stream_generate(client, "llm_q4", inputs, request_id=str(i), timeout_s=300))
            finally:
                client.close()
            assert len(responses) == 1
            entries = json.loads(responses[0].as_numpy("logprobs").reshape(-1)[0])
            return [int(next(iter(entry))) for entry in entries], text_of(responses[0])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(ask, range(len(PROMPTS))))
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            metrics = response.read().decode()
    expected = hf_greedy(os.path.dirname(DEFAULT_GGUF), [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS,
                         gguf_file=os.path.basename(DEFAULT_GGUF))
    for (token_ids, text), want in zip(results, expected):
        assert token_ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
    weight_bytes = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("inflight_model_weight_bytes{")]
    # 135M weights: 540 MB in float32; 4-bit projections and an 8-bit embedding, well under 200.
    assert weight_bytes and 50e6 < weight_bytes[0] < 200e6, weight_bytes
