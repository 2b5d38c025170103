"""`bad_words`: the sampler keeps each word's token sequences out of a request's output.

The oracle is transformers' own ban of token sequences (`generate(bad_words_ids=...)`),
given the sequences the engine derived from the words: greedy output with bad words must be
token-identical to it, while a request without bad words in the same batch is untouched.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import RequestError, SamplingParams
from backend.validation import parse_sampling_params

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    assert os.path.isfile(os.path.join(DEFAULT_CHECKPOINT, "config.json")), f"{DEFAULT_CHECKPOINT} missing: run `make setup`"
    return LLMEngine(EngineConfig(model_path=str(DEFAULT_CHECKPOINT), device="cpu", dtype="float32", num_kv_blocks=128))


def chat_prompt(engine: LLMEngine, question: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.token_ids_delta)
    return out


def hf_greedy_banning(prompt: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_CHECKPOINT), dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None, bad_words_ids=bad_words_ids or None)
    return out[0, ids.shape[1]:].tolist()


def test_bad_words_never_appear_and_greedy_output_matches_transformers_ban(engine):
    prompt = chat_prompt(engine, "What is the capital of France?")
    greedy = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # "capital of" is two tokens here: the ban of its second token depends on the output so far.
    words = ["Paris", "capital of"]
    out = run(engine, {"free": (prompt, SamplingParams(**greedy)),
                       "banned": (prompt, SamplingParams(**greedy, bad_words=words))})
    free_text = engine.tokenizer.decode(out["free"])
    assert "Paris" in free_text and "capital of" in free_text, free_text
    banned_text = engine.tokenizer.decode(out["banned"])
    assert not any(word in banned_text for word in words), banned_text

    sequences = engine.make_request("probe", prompt, SamplingParams(bad_words=words)).bad_words_token_ids
    assert any(len(s) == 2 for s in sequences), sequences
    assert out["banned"] == hf_greedy_banning(prompt, [list(s) for s in sequences])
    assert out["free"] == hf_greedy_banning(prompt, []) != out["banned"]


def test_bad_words_that_tokenize_to_nothing_are_refused_by_name(engine):
    with pytest.raises(RequestError) as refused:
        engine.make_request("r", "Hi", SamplingParams(bad_words=[" "]))
    assert refused.value.code == RequestError.INVALID_ARG and str(refused.value).startswith("bad_words: ")


def test_bad_words_are_validated_like_stop_strings():
    for bad in ([""], ["x" * 257], ["w"] * 65, "Paris", [3]):
        with pytest.raises(RequestError) as refused:
            parse_sampling_params({"bad_words": bad})
        assert str(refused.value).startswith("bad_words: "), (bad, refused.value)
    assert parse_sampling_params({"bad_words": ["a", "b"], "spaces_between_special_tokens": False}).bad_words == ["a", "b"]
