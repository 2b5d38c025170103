"""Speculative decoding through tritonserver: a model with suffix decoding and one with the
served checkpoint (int8) as its own draft answer concurrent greedy gRPC streams with
transformers' tokens, and vLLM's spec-decode counters on /metrics show the drafts accepted
(the engine-level tests are tests/engine/test_spec_decode.py)."""

from __future__ import annotations

import json

import pytest
import transformers

from tests.checkpoints import hf_greedy
from tests.e2e.e2e_util import greedy_tokens_and_texts, wait_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Repetitive texts, so that the request's own tokens already give suffix decoding matches.
PROMPTS = ["one two three four one two three four one two three",
           "def add(a, b): return a + b\ndef add(a, b): return",
           "the cat sat on the mat and the cat sat on the"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def speculative_server(tritonserver, tiny_checkpoint):
    base = {"model_path": tiny_checkpoint, "max_num_seqs": "8", "kv_cache_memory_mb": "64", "max_model_len": "256"}
    # Without the draft budget: which drafts it keeps (and whether a draft model runs at all)
    # follows the machine's timings, and the counters below need drafts verified.
    suffix = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
    draft = {"method": "draft_model", "model": tiny_checkpoint, "quantization": "int8", "num_speculative_tokens": 3,
             "adaptive": False}
    models = {"suffix": {**base, "speculative_config": json.dumps(suffix)},
              "draft": {**base, "speculative_config": json.dumps(draft)}}
    with tritonserver(models) as server:
        yield server


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["suffix", "draft"])
def test_speculating_model_through_tritonserver_matches_transformers(speculative_server, tiny_checkpoint, model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    expected = hf_greedy(tiny_checkpoint, [tokenizer.encode(p) for p in PROMPTS], MAX_TOKENS)
    # Twice: the second round's outputs repeat the first's, which suffix decoding has cached.
    for _ in range(2):
        results = greedy_tokens_and_texts(speculative_server.grpc_url, model, PROMPTS, MAX_TOKENS)
        assert [token_ids for token_ids, _ in results] == expected
    metrics = wait_idle(speculative_server.metrics_port, model)
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens_total", model_name=model)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", model_name=model)
    assert 0 < accepted <= drafted, (accepted, drafted)
    assert metrics.get("vllm:spec_decode_num_drafts_total", model_name=model) > 0
