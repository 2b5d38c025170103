"""IncrementalDetokenizer with the real tokenizer of the default checkpoint.

The engine feeds it one token per step and streams `take_delta(finished=False)`; the
request's last step (EOS, length, a stop string) takes `take_delta(finished=True)`.
`stream()` below plays exactly that part, and the tests check what a client would see:
the concatenated deltas equal `tokenizer.decode(output_ids)`, no delta ever carries a
half-decoded character (U+FFFD), stop strings cut the text where they should, and text
once streamed is never taken back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, assume, example, given, settings

from backend.detokenizer import IncrementalDetokenizer, raw_decoder
from backend.paths import DEFAULT_CHECKPOINT

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tokenizer():
    assert os.path.isfile(os.path.join(DEFAULT_CHECKPOINT, "tokenizer.json")), f"{DEFAULT_CHECKPOINT} missing: run `make setup`"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@dataclass
class Streamed:
    deltas: list[str]
    stop: str | None
    num_fed: int  # tokens fed before the request ended

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def stream(tokenizer, prompt_ids, output_ids, stop=None, include_stop=False, skip_special_tokens=True) -> Streamed:
    """What the engine does with one request's tokens. Checks, at every step, that the text
    streamed so far never has to be taken back (it stays a prefix of the final text)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, stop, include_stop)
    deltas: list[str] = []
    snapshots: list[str] = []
    found = None
    n = 0
    for n, token in enumerate(output_ids, start=1):
        found = detok.add_token(token)
        last = found is not None or n == len(output_ids)
        deltas.append(detok.take_delta(finished=last))
        snapshots.append("".join(deltas))
        if found is not None:
            break
    final = "".join(deltas)
    for snap in snapshots:
        assert final.startswith(snap), f"streamed {snap!r} was retracted; final text {final!r}"
    assert final == detok.text
    return Streamed(deltas, found, n)


# --------------------------------------------------------------------------------------
# Streaming equals decoding
# --------------------------------------------------------------------------------------

REAL_TEXTS = [
    "The capital of France is Paris.",
    "Hello world, this is a test.\nA second line\twith a tab, and  double  spaces.",
    "def f(x):\n    return x ** 2  # squares\n",
    "日本語のテキストを書きます。東京は日本の首都です。",
    "한국어 문장입니다. 中文句子。",
    "Emoji: 🎉🚀 👍🏽 👨‍👩‍👧 🇫🇷 — and a flag.",
    "Ünïcödé àccents: café, naïve, façade, Straße, ½ ∑ ∞ ≠ €.",
    "Mixed: abc日本😀def 123 ١٢٣ Ελληνικά русский",
    "   leading spaces and trailing   ",
    "\n\nnewlines first",
    "a",
    "🙂",
]

UNICODE_ALPHABET = list("abcxyz ABC,.!?\n\t0123") + ["é", "ß", "ñ", "日", "本", "語", "한", "中", "😀", "🎉", "👍🏽", "\u200d", "🇫", "€", "√", "ü"]


@pytest.mark.parametrize("text", REAL_TEXTS)
@pytest.mark.parametrize("prompt_kind", ["chat", "plain", "empty"])
def test_streamed_deltas_concatenate_to_the_decoded_text(tokenizer, chat_prompt, text, prompt_kind):
    prompt = {"chat": chat_prompt, "plain": tokenizer.encode("Some context before: "), "empty": []}[prompt_kind]
    ids = tokenizer.encode(text)
    result = stream(tokenizer, prompt, ids)
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert result.text == text
    for delta in result.deltas:
        assert "\ufffd" not in delta, f"half a character streamed: {result.deltas}"


def test_multibyte_characters_split_across_tokens_wait_for_completion(tokenizer):
    text = "日本語🎉🚀"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "precondition: some token holds only part of a character"
    result = stream(tokenizer, [], ids)
    assert result.text == text
    assert all("\ufffd" not in d for d in result.deltas)
    assert "" in result.deltas, "tokens that end mid-character must produce no text yet"
    # Each delta is made of whole characters of the text, in order.
    assert "".join(d for d in result.deltas if d) == text


@HYPOTHESIS
@given(text=st.lists(st.sampled_from(UNICODE_ALPHABET), min_size=1, max_size=60).map("".join),
       prompt_text=st.lists(st.sampled_from(UNICODE_ALPHABET), max_size=20).map("".join))
@example(text="😀😀", prompt_text="日")
def test_random_unicode_text_streams_exactly(tokenizer, text, prompt_text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode(prompt_text) if prompt_text else []
    result = stream(tokenizer, prompt, ids)
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True)
    for delta in result.deltas:
        assert "\ufffd" not in delta


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=1, max_size=40))
def test_arbitrary_unicode_streams_exactly(tokenizer, text):
    ids = tokenizer.encode(text)
    # The byte-level vocabulary lacks a few bytes (e.g. of U+40000): such text does not even
    # round-trip through encode/decode, so there is nothing exact to stream.
    assume(tokenizer.decode(ids) == text)
    result = stream(tokenizer, [], ids)
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in result.deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Done.") + [tokenizer.eos_token_id]
    assert stream(tokenizer, [], ids).text == "Done."
    kept = stream(tokenizer, [], ids, skip_special_tokens=False).text
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) == "Done." + tokenizer.eos_token


# --------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------

HELLO = "Hello world, this is a test."  # Hello| world|,| this| is| a| test|.


@pytest.mark.parametrize(
    "stop, include, expected",
    [
        # inside one token (" world"), with a suffix ("d") in that same token
        (["orl"], False, "Hello w"),
        (["orl"], True, "Hello worl"),
        # across two tokens ("Hello" + " world")
        (["lo wo"], False, "Hel"),
        (["lo wo"], True, "Hello wo"),
        # exactly one whole token
        ([" this"], False, "Hello world,"),
        ([" this"], True, "Hello world, this"),
        # the earliest of several; one never matches
        (["test", "is", "zzz"], False, "Hello world, th"),
        # two complete in the same token (" world"): the one that starts first wins
        (["world", "lo w"], False, "Hel"),
        # at the very start of the output
        (["Hell"], False, ""),
        # the last character of the output
        (["."], True, HELLO),
    ],
)
def test_stop_strings(tokenizer, chat_prompt, stop, include, expected):
    ids = tokenizer.encode(HELLO)
    result = stream(tokenizer, chat_prompt, ids, stop=stop, include_stop=include)
    assert result.text == expected
    assert result.stop is not None and result.stop in stop
    # It ends on the token that completed the stop string, not later.
    assert result.num_fed == first_completion(tokenizer, ids, stop)


def test_stop_string_inside_multibyte_text(tokenizer):
    text = "日本語のテキスト"
    ids = tokenizer.encode(text)
    assert stream(tokenizer, [], ids, stop=["語の"]).text == "日本"
    assert stream(tokenizer, [], ids, stop=["語の"], include_stop=True).text == "日本語の"


def test_partial_stop_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("Stop here STOP now")  # Stop| here| ST|OP| now
    result = stream(tokenizer, [], ids, stop=["STOP"])
    assert result.deltas == ["Stop", " here", " ", ""], "' ST' could start 'STOP': 'ST' must be held back"
    assert result.text == "Stop here " and result.stop == "STOP"
    # The same text without the stop completing: the held-back "ST" comes out later.
    ids = tokenizer.encode("Stop here STAY now")
    result = stream(tokenizer, [], ids, stop=["STOP"])
    assert result.stop is None and result.text == "Stop here STAY now"
    assert "ST" not in result.deltas[2]


def test_overlapping_partial_matches(tokenizer):
    ids = tokenizer.encode("abcabcabd xyz")  # abc|abc|ab|d| xy|z
    result = stream(tokenizer, [], ids, stop=["abcabd"])
    assert result.stop == "abcabd" and result.text == "abc"
    result = stream(tokenizer, [], ids, stop=["abcabd"], include_stop=True)
    assert result.text == "abcabcabd"


def test_held_back_text_is_flushed_when_the_request_ends_for_another_reason(tokenizer):
    ids = tokenizer.encode("Stop here ST")  # ends in what could still become "STOP"
    result = stream(tokenizer, [], ids, stop=["STOP"])
    assert result.stop is None
    assert result.text == "Stop here ST"
    assert result.deltas[-1].endswith("ST")


def first_completion(tokenizer, ids, stops) -> int | None:
    """Number of tokens after which the text first contains a stop string. Text that ends
    in the middle of a character is not known yet (a token may carry a space and half of
    a character): the stop is seen when the character completes."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if not text.endswith("\ufffd") and any(s in text for s in stops):
            return k
    return None


STOP_ALPHABET = list("ab c\n") + ["é", "日"]


@HYPOTHESIS
@given(
    text=st.text(st.sampled_from(STOP_ALPHABET), min_size=1, max_size=40),
    stops=st.lists(st.text(st.sampled_from(STOP_ALPHABET), min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
@example(text=" 日", stops=[" "], include=False)  # a token carries " " and half of 日
def test_stop_strings_property(tokenizer, text, stops, include):
    """Whatever the text and stop strings: streamed text is never retracted (checked in
    `stream`), the cut is at a stop string that the fed tokens really contain, no earlier
    stop string is missed, and the request ends on the token that completed it."""
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    result = stream(tokenizer, [], ids, stop=stops, include_stop=include)
    final = result.text
    fed_text = tokenizer.decode(ids[: result.num_fed])
    assert fed_text.startswith(final)
    if result.stop is None:
        assert final == full
        assert not any(s in full for s in stops)
        return
    s = result.stop
    assert s in stops
    before = final[: len(final) - len(s)] if include else final
    if include:
        assert final.endswith(s)
    else:
        assert fed_text[len(final):].startswith(s)
    assert not any(t in before for t in stops), "an earlier stop string was missed"
    # Ended on the token that completed the first stop string, not later.
    assert result.num_fed == first_completion(tokenizer, ids, stops)


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 49151), max_size=12), skip_special_tokens=st.booleans())
@example(ids=[1, 504, 3458, 2, 0, 7], skip_special_tokens=True)  # <|im_start|>, <|im_end|>, <|endoftext|>
def test_raw_decoder_gives_transformers_text(tokenizer, ids, skip_special_tokens):
    """The engine decodes through the Rust tokenizer directly: same text as transformers'."""
    assert raw_decoder(tokenizer)(ids, skip_special_tokens) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_raw_decoder_keeps_transformers_cleanup_when_the_tokenizer_asks_for_it(tokenizer):
    import copy

    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert raw_decoder(tokenizer) == tokenizer.backend_tokenizer.decode
    assert raw_decoder(cleaning) != cleaning.backend_tokenizer.decode  # transformers' decode, cleanup included
    ids = tokenizer.encode("Hello , world . It 's here")
    assert raw_decoder(cleaning)(ids, True) == cleaning.decode(ids, skip_special_tokens=True)
