"""model_repository/llm_q4 through tritonserver: the shipped Q4_1 GGUF file of SmolLM2-135M,
served with its weights 4-bit, answers concurrent greedy requests with the tokens of
transformers running that file de-quantized (the engine-level tests of every format are
tests/engine/test_quantized.py), and exports its resident weight bytes; with int8 activations
from config.pbtxt, the engine's own tokens.
"""

from __future__ import annotations

import os
import urllib.request

import pytest
import transformers

import kernels
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models.llama import Linear
from backend.paths import DEFAULT_CHECKPOINT, DEFAULT_GGUF
from backend.request import SamplingParams
from tests.checkpoints import hf_greedy
from tests.e2e.e2e_util import greedy_tokens_and_texts

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three colors: red,"]
MAX_TOKENS = 16


def test_llm_q4_serves_the_gguf_file_as_transformers_reads_it(tritonserver):
    parameters = {"model_path": str(DEFAULT_GGUF), "tokenizer": str(DEFAULT_CHECKPOINT), "max_num_seqs": "8",
                  "kv_cache_memory_mb": "64"}
    with tritonserver({"llm_q4": parameters}, sources={"llm_q4": "llm_q4"}) as server:
        results = greedy_tokens_and_texts(server.grpc_url, "llm_q4", PROMPTS, MAX_TOKENS)
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            metrics = response.read().decode()
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    expected = hf_greedy(os.path.dirname(DEFAULT_GGUF), [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS,
                         gguf_file=os.path.basename(DEFAULT_GGUF))
    for (token_ids, text), want in zip(results, expected):
        assert token_ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
    weight_bytes = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("inflight_model_weight_bytes{")]
    # 135M weights: 540 MB in float32; 4-bit projections and an 8-bit embedding, well under 200.
    assert weight_bytes and 50e6 < weight_bytes[0] < 200e6, weight_bytes


def test_llm_q4_with_int8_activations_serves_the_engines_tokens(tritonserver):
    """`activation_quantization` from config.pbtxt reaches the engine: tritonserver's greedy tokens
    are those of the engine in this process with the same parameters (whose numbers
    tests/engine/test_quantized.py checks against int8_activation_linear's model)."""
    parameters = {"model_path": str(DEFAULT_GGUF), "tokenizer": str(DEFAULT_CHECKPOINT), "max_num_seqs": "8",
                  "kv_cache_memory_mb": "64", "activation_quantization": "int8"}
    with tritonserver({"llm_q4": parameters}, sources={"llm_q4": "llm_q4"}) as server:
        results = greedy_tokens_and_texts(server.grpc_url, "llm_q4", PROMPTS, MAX_TOKENS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_CHECKPOINT)
    engine = LLMEngine(EngineConfig(model_path=str(DEFAULT_GGUF), tokenizer=str(DEFAULT_CHECKPOINT), device="cpu",
                                    dtype="float32", kv_cache_memory_mb=64, activation_quantization="int8"))
    assert all(p.isa == kernels.cpu_ext.QUANT_INT8_DOTS for p in
               (m.packed for m in engine.model.modules() if isinstance(m, Linear) and m.quantized is not None))
    outputs = engine.generate([tokenizer.encode(p) for p in PROMPTS],
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [token_ids for token_ids, _ in results] == [o.output_token_ids for o in outputs]
