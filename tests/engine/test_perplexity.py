"""The perplexity benchmark (client/bench/perplexity.py) computes the right number: on the tiny
checkpoint, the perplexity of the engine's forward pass over the shipped text equals exp of the
mean NLL that transformers' logits give on the same windows and scored positions. The windows
and scored positions are llama-perplexity's (tools/perplexity/perplexity.cpp)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from client.bench import perplexity

N_CTX = 128


@pytest.fixture(scope="module")
def text_tokens(tiny_checkpoint) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    with open(perplexity.TEXT, encoding="utf-8") as f:
        tokens, bos = perplexity.tokenize(tokenizer, f.read())
    assert bos is None  # SmolLM2's tokenizer adds no BOS, as its GGUF files say (add_bos_token false)
    return tokens


def test_shipped_text_has_at_least_20k_tokens(text_tokens):
    assert len(text_tokens) >= 20_000


def test_windows_follow_llama_perplexity():
    tokens = list(range(10, 10 + 3 * 8 + 5))
    got = perplexity.windows(tokens, 8, bos=None)
    assert got == [tokens[0:8], tokens[8:16], tokens[16:24]]  # the 5-token tail fills no window: left out
    with_bos = perplexity.windows(tokens, 8, bos=1)
    assert [w[0] for w in with_bos] == [1, 1, 1] and [w[1:] for w in with_bos] == [w[1:] for w in got]
    with pytest.raises(ValueError, match="at least 2 x n_ctx = 32"):
        perplexity.windows(tokens[:31], 16, bos=None)


def test_scored_nll_scores_the_second_half():
    window = [3, 1, 4, 1, 5, 9, 2, 6]  # positions 4..6 predict tokens 5..7
    logits = torch.zeros(3, 10, dtype=torch.float64)
    logits[0, 9] = math.log(3.0)  # token 9: probability 3/12
    logits[2, 6] = 5.0
    expected = -math.log(3 / 12) - math.log(1 / 10) - math.log(math.exp(5) / (math.exp(5) + 9))
    assert perplexity.scored_nll(logits, window) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="4 logit rows for 3 scored tokens"):
        perplexity.scored_nll(torch.zeros(4, 10), window)


def test_engine_perplexity_equals_transformers(tiny_checkpoint, text_tokens):
    windows = perplexity.windows(text_tokens[:4 * N_CTX + 17], N_CTX, bos=None)
    # Three windows to a pass, then the fourth alone: each window's attention sees only its own tokens.
    runner = perplexity.load_runner(perplexity.Configuration("tiny", tiny_checkpoint), N_CTX, "cpu", torch.float32,
                                    sequences=3)
    nll, count = perplexity.engine_nll(runner, windows, sequences=3)
    assert count == 4 * (N_CTX - 1 - N_CTX // 2)

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    first = N_CTX // 2
    expected_nll = 0.0
    with torch.no_grad():
        for window in windows:
            logits = model(torch.tensor([window])).logits[0].double()
            log_probs = torch.log_softmax(logits[first:N_CTX - 1], dim=-1)
            expected_nll -= float(log_probs.gather(1, torch.tensor(window[first + 1:])[:, None]).sum())
    assert math.exp(nll / count) == pytest.approx(math.exp(expected_nll / count), rel=1e-4)
