"""The grammar compiler's cache: each distinct constraint compiled once, the least recently
used dropped beyond the bound, compilations under way shared, errors cleaned of xgrammar's
C++ prefix. Real xgrammar, the default checkpoint's tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT
from backend.request import RequestError, StructuredOutputs
from backend.structured_output import GrammarCompiler, compile_error


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))


def regex(pattern: str) -> StructuredOutputs:
    return StructuredOutputs(regex=pattern)


def test_lru_bound_and_one_compilation_per_constraint(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}), cache_size=2)
    try:
        first = compiler.submit(regex("a+"))
        assert compiler.submit(regex("a+")) is first  # shared while under way, and after
        first.result(60)
        compiler.submit(regex("b+")).result(60)
        compiler.submit(regex("a+"))  # now the most recently used: "b+" goes next
        compiler.submit(regex("c+")).result(60)
        assert compiler.num_cached == 2 and compiler.num_compiled == 3
        compiler.submit(regex("a+")).result(60)
        assert compiler.num_compiled == 3, "a+ was evicted although used more recently than b+"
        compiler.submit(regex("b+")).result(60)
        assert compiler.num_compiled == 4
    finally:
        compiler.shutdown()


def test_a_compile_error_is_invalid_arg_without_the_cpp_prefix(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    try:
        with pytest.raises(RequestError) as info:
            compiler.submit(regex("(a")).result(60)
    finally:
        compiler.shutdown()
    assert info.value.code == RequestError.INVALID_ARG
    message = str(info.value)
    assert message.startswith("structured_outputs: the regex constraint does not compile: ") and ".cc:" not in message


def test_compile_error_strips_only_the_prefix():
    exc = RuntimeError("[18:01:02] /project/cpp/regex_converter.cc:83: Regex parsing error at position 10: x\n")
    assert compile_error(exc) == "Regex parsing error at position 10: x"
