"""The non-Llama families through tritonserver: tiny Qwen3, Qwen2, Phi-3, Qwen3-MoE, Gemma 2 and
Gemma 3 checkpoints, served by one tritonserver as models `llm`, `qwen2`, `phi3`, `moe`, `gemma2` and
`gemma3`, answer concurrent greedy requests with the token ids and text of transformers generate()
(the engine-level family tests are tests/engine/test_model_families.py). A tiny Mistral, `mistral`,
with a window of 16 positions on every layer and a pool of 12 blocks of 8 tokens, serves prompts
past its window, a prefix-cache hit on one, and a request longer than its whole pool
(tests/engine/test_sliding_window.py is the engine-level test). Through the OpenAI frontend,
/v1/chat/completions renders each family's own chat template (tests/checkpoints.py) and answers
with transformers' greedy text on the prompt `apply_chat_template` renders
(tests/unit/test_chat_templates.py checks the rendering alone).
"""

from __future__ import annotations

import openai
import pytest
import requests
import transformers

from backend.detokenizer import INCOMPLETE
from tests.checkpoints import hf_greedy, make_tiny_checkpoint
from tests.e2e.e2e_util import greedy_tokens_and_texts, wait_idle
from tests.e2e.openai_frontend import run_frontend
from tests.engine.test_model_families import CASES, MAX_TOKENS, PROMPTS
from tests.unit.test_chat_templates import CONVERSATION, SYSTEM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN2_CASE = "qwen2-untied-qkv-bias-gqa"
PHI3_CASE = "phi3-fused-untied-gqa"
MOE_CASE = "qwen3-moe-dense-layer0-unnormalised"
GEMMA2_CASE = "gemma2-window16-softcap"
GEMMA3_CASE = "gemma3-local-global-two-ropes"
WINDOW = 16
# 12 blocks of 8 tokens, prefill chunks of 13: a 16-position window holds at most 5 blocks.
MISTRAL_PARAMETERS = {"max_num_seqs": "4", "num_kv_blocks": "12", "block_size": "8",
                      "long_prefill_token_threshold": "13", "max_model_len": "256"}
PAST_THE_WINDOW = ("A sliding window lets every token attend to the last few positions only, so a model can "
                   "serve long sequences while it keeps the cache of a short one; tell me more about that.")


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"family": "qwen3", "attention_bias": True}


@pytest.fixture(scope="module")
def families_server(tritonserver, tiny_checkpoint, tmp_path_factory):
    """A tritonserver of its own serving a tiny Qwen3 checkpoint as `llm`, a tiny Qwen2 one as
    `qwen2`, a tiny Phi-3 one
    (q|k|v and gate|up stored fused, a sliding window) as `phi3`, a tiny Qwen3-MoE one as `moe`,
    and tiny Gemma 2 and Gemma 3 ones (windows of 16 positions, which the prompts cross) as
    `gemma2` and `gemma3`."""
    paths = {"llm": tiny_checkpoint}
    for model, case in (("qwen2", QWEN2_CASE), ("phi3", PHI3_CASE), ("moe", MOE_CASE), ("gemma2", GEMMA2_CASE), ("gemma3", GEMMA3_CASE)):
        family, overrides, _ = CASES[case]
        paths[model] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(model) / "ckpt"), family=family, **overrides)
    parameters = {"max_num_seqs": "8", "kv_cache_memory_mb": "64", "max_model_len": "256"}
    models = {model: {"model_path": path, **parameters} for model, path in paths.items()}
    paths["mistral"] = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mistral") / "ckpt"), family="mistral",
                                            sliding_window=WINDOW)
    models["mistral"] = {"model_path": paths["mistral"], **MISTRAL_PARAMETERS}
    with tritonserver(models) as server:
        yield server, paths


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["llm", "qwen2", "phi3", "moe", "gemma2", "gemma3"],
                         ids=["qwen3", "qwen2", "phi3", "qwen3-moe", "gemma2", "gemma3"])
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


def reused_blocks(server) -> float:
    return wait_idle(server.metrics_port, "mistral").get("nv_trt_llm_kv_cache_block_metrics", model="mistral",
                                                         kv_cache_block_type="reused")


@pytest.mark.e2e
def test_mistral_past_its_window_and_longer_than_its_pool(families_server):
    """A prompt past the 16-position window gives transformers' tokens; the same request again
    hits the prefix cache (the blocks of its prompt, those behind the window too) and gives them
    again; then a request of 150 tokens, more than the pool's 96, is admitted and gives
    transformers' tokens, holding a window's blocks at a time."""
    server, paths = families_server
    path = paths["mistral"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = tokenizer.encode(PAST_THE_WINDOW)
    assert 2 * WINDOW < len(prompt_ids) < 96 - 24
    want = hf_greedy(path, [prompt_ids], 24)[0]
    before = reused_blocks(server)
    for _ in range(2):
        [(token_ids, text)] = greedy_tokens_and_texts(server.grpc_url, "mistral", [PAST_THE_WINDOW], 24)
        assert token_ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True).rstrip(INCOMPLETE)
    # The second request's hit: every full block of its prompt but one that would hold its last token.
    assert reused_blocks(server) - before == (len(prompt_ids) - 1) // 8
    max_tokens = 150 - len(prompt_ids)
    [(token_ids, _)] = greedy_tokens_and_texts(server.grpc_url, "mistral", [PAST_THE_WINDOW], max_tokens)
    assert token_ids == hf_greedy(path, [prompt_ids], max_tokens)[0]
    idle = wait_idle(server.metrics_port, "mistral")
    assert idle.get("nv_trt_llm_kv_cache_block_metrics", model="mistral", kv_cache_block_type="used") == 0


CHAT_TOKENS = 16


@pytest.fixture(scope="module")
def families_openai(families_server):
    """The OpenAI frontend in front of `families_server`: each model's chat template is its checkpoint's."""
    server, _ = families_server
    with run_frontend(server.grpc_url) as frontend:
        yield frontend.openai()


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["llm", "qwen2", "phi3", "moe", "gemma2", "mistral"],
                         ids=["qwen3", "qwen2.5", "phi3.5", "qwen3-moe", "gemma2", "mistral-nemo"])
def test_chat_completions_render_the_family_template(families_server, families_openai, model):
    """A system + user + assistant + user chat (Gemma's template refuses the system turn: a 400
    naming messages, and the chat without it): the prompt's token count and the greedy text are
    those of transformers generate() on `apply_chat_template`'s prompt."""
    _, paths = families_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths[model])
    messages = [SYSTEM, *CONVERSATION]
    if model == "gemma2":
        with pytest.raises(openai.BadRequestError, match="System role not supported") as refused:
            families_openai.chat.completions.create(model=model, messages=messages, max_tokens=CHAT_TOKENS)
        assert refused.value.body["param"] == "messages"
        messages = CONVERSATION
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    want = hf_greedy(paths[model], [prompt_ids], CHAT_TOKENS)[0]
    out = families_openai.chat.completions.create(model=model, messages=messages, max_tokens=CHAT_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})
    # Gemma's and Mistral's tokenizers add a BOS when encoding, and their templates write one:
    # the prompt has one only if the frontend asks the backend to add no special tokens.
    assert out.usage.prompt_tokens == len(prompt_ids)
    render = requests.post(f"{families_openai.base_url}chat/completions/render",
                           json={"model": model, "messages": messages}, timeout=60)
    assert render.status_code == 200 and render.json()["token_ids"] == prompt_ids, render.text
    assert out.usage.completion_tokens == CHAT_TOKENS
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True).rstrip(INCOMPLETE)
