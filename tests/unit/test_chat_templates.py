"""Each family's chat template, rendered the way /v1/chat/completions renders it.

The OpenAI frontend renders a chat with the checkpoint's template (client/openai/upstream.py,
`Catalog.chat_prompt`) and the backend's engine tokenizes that text (backend/detokenizer.py's
`SharedTokenizer.encode`): on each family's tiny checkpoint, which carries the template of the
family's own instruct model (tests/checkpoints.py, `FAMILY_CHAT_TEMPLATES`), the token ids are
those of transformers' `apply_chat_template(..., add_generation_prompt=True)`, and each family's
quirk (Gemma refusing a system turn, Mistral folding it into the last user turn, ...) is there.
The same prompts through tritonserver: tests/e2e/test_e2e_model_families.py.
"""

from __future__ import annotations

import asyncio

import pytest
import transformers
from jinja2.exceptions import TemplateError

from backend.detokenizer import SharedTokenizer
from backend.models.loader import load_tokenizer
from backend.validation import parse_sampling_params
from client.openai.schema import ApiError, ChatCompletionRequest
from client.openai.settings import Settings
from client.openai.translation import sampling_parameters
from client.openai.upstream import Catalog, ModelInfo
from tests.checkpoints import FAMILY_CHAT_TEMPLATES, make_tiny_checkpoint

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
# family -> text its template puts in the prompt of SYSTEM + CONVERSATION (None: it refuses the system turn).
QUIRKS = {
    "gemma2": None,
    "phi3": "<|system|>\nYou answer in one short sentence.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n"
            "<|assistant|>\nParis.<|end|>\n<|user|>\nAnd of Italy?<|end|>\n<|assistant|>\n",
    "qwen2": "<|im_start|>system\nYou answer in one short sentence.<|im_end|>\n",
    "qwen3": "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
    "qwen3_moe": "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
    # The system text goes into the last user turn.
    "mistral": "<s>[INST]What is the capital of France?[/INST]Paris.</s>[INST]You answer in one short sentence.\n\n"
               "And of Italy?[/INST]",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chat-templates")
    return {family: make_tiny_checkpoint(str(root / family), family=family, num_hidden_layers=1)
            for family in FAMILY_CHAT_TEMPLATES}


def frontend_prompt(path: str, messages: list[dict]) -> str:
    """The prompt /v1/chat/completions sends the backend."""
    catalog = Catalog(Settings(tokenizer=path), client=None)
    info = ModelInfo(name="llm", config={}, versions=["1"], created=0)
    return asyncio.run(catalog.chat_prompt(info, messages))


def transformers_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def test_every_family_with_a_template_has_its_quirk_here():
    assert set(QUIRKS) == set(FAMILY_CHAT_TEMPLATES)


@pytest.mark.parametrize("family", list(FAMILY_CHAT_TEMPLATES))
def test_template_special_tokens_are_one_token_each(checkpoints, family):
    template = FAMILY_CHAT_TEMPLATES[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[family])
    assert tokenizer.chat_template == template.tokenizer().chat_template
    config = transformers.AutoConfig.from_pretrained(checkpoints[family])
    for token in (*template.special_tokens, *(t for t in (template.bos, template.eos) if t)):
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < config.vocab_size, (token, ids)
        assert tokenizer.added_tokens_decoder[ids[0]].special, token
        assert tokenizer.decode(ids, skip_special_tokens=True) == ""
    if template.bos:
        assert tokenizer.bos_token == template.bos


@pytest.mark.parametrize("family", list(FAMILY_CHAT_TEMPLATES))
def test_chat_completions_prompt_is_transformers_apply_chat_template(checkpoints, family):
    path = checkpoints[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    engine_tokenizer = SharedTokenizer(load_tokenizer(path))
    messages = [SYSTEM, *CONVERSATION]
    quirk = QUIRKS[family]
    if quirk is None:
        with pytest.raises(TemplateError, match="System role not supported"):
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with pytest.raises(ApiError) as refused:
            frontend_prompt(path, messages)
        assert refused.value.status == 400 and refused.value.param == "messages"
        assert "System role not supported" in refused.value.message
        messages = CONVERSATION
    prompt = frontend_prompt(path, messages)
    assert prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # What the backend encodes the prompt with: the frontend's sampling parameters for a chat.
    sent = parse_sampling_params(sampling_parameters(ChatCompletionRequest(model="llm", messages=messages)))
    expected = transformers_ids(tokenizer, messages)
    assert engine_tokenizer.encode(prompt, add_special_tokens=sent.add_special_tokens) == expected
    if FAMILY_CHAT_TEMPLATES[family].adds_bos:  # what add_special_tokens false spares the prompt
        assert engine_tokenizer.encode(prompt) == [tokenizer.bos_token_id, *expected]
        assert expected[0] == tokenizer.bos_token_id
    if quirk is None:  # Gemma: BOS, the assistant is the "model", the turns' own tokens
        assert prompt == ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                          "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
                          "<start_of_turn>model\n")
    else:
        assert quirk in prompt
