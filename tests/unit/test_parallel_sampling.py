"""Parallel sampling's parts without a model: `n`/`best_of` validation, forking a sequence's
blocks and copy-on-write in the KV manager (with its reference-count invariant, also under
random operation sequences), and responses of shape [n]."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from backend.kv_cache import KVCacheManager
from backend.output import RequestOutput
from backend.protocol import (
    CUMULATIVE_LOGPROB,
    FINISH_REASON,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_NAMES,
    TEXT_OUTPUT,
    ParsedRequest,
    ResponseEncoder,
)
from backend.request import Request, RequestError, SamplingParams
from backend.validation import parse_sampling_params


@pytest.mark.parametrize("values, param", [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"best_of": 17}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": "x"}, "n"),
])
def test_bad_n_and_best_of_are_refused_naming_the_parameter(values, param):
    with pytest.raises(RequestError) as info:
        parse_sampling_params(values)
    assert info.value.param == param and str(info.value).startswith(f"{param}: "), str(info.value)


def test_n_and_best_of_set_the_number_of_sequences():
    assert parse_sampling_params({}).num_sequences == 1
    assert parse_sampling_params({"n": "4"}).num_sequences == 4  # strings, as Triton's clients send them
    assert parse_sampling_params({"n": 2, "best_of": 5}).num_sequences == 5


# ---------------------------------------------------------------------------- KV: fork, copy-on-write

def request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(), max_tokens=64,
                   arrival_time=0.0, arrival_seq=0)


def fork(kv: KVCacheManager, parent: Request, rid: str) -> Request:
    child = request(rid, parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    return child


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_sequences_share_blocks_and_copy_the_partial_one_on_write(prefix_caching):
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=prefix_caching)
    leader = request("g", list(range(10)))  # two full blocks and a partial one
    assert kv.allocate(leader, 10)
    leader.num_computed_tokens = 10
    kv.cache_computed_blocks(leader)
    children = [fork(kv, leader, f"g/{i}") for i in (1, 2, 3)]
    kv.check_invariants()
    assert all(c.block_ids == leader.block_ids for c in children)
    assert [kv.pool.blocks[b].ref_count for b in leader.block_ids] == [4, 4, 4]
    assert kv.pool.num_used == 3

    copies: dict[int, int] = {}
    partial = leader.block_ids[2]
    for seq in [leader] + children[:2]:
        assert kv.copy_on_write(seq, copies)
        assert seq.block_ids[2] != partial and copies[seq.block_ids[2]] == partial
        kv.check_invariants()
    # The last holder writes into the block itself.
    assert kv.copy_on_write(children[2], copies) and children[2].block_ids[2] == partial
    assert len(copies) == 3 and kv.pool.blocks[partial].ref_count == 1
    assert kv.block_table.ids[kv.block_table.row_of[leader], 2] == leader.block_ids[2]
    # Full blocks stay shared.
    assert [kv.pool.blocks[b].ref_count for b in leader.block_ids[:2]] == [4, 4]
    for seq in children + [leader]:
        kv.free(seq)
        kv.check_invariants()
    assert kv.pool.num_free == 12


def test_copy_on_write_without_a_free_block_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    leader = request("g", list(range(6)))
    assert kv.allocate(leader, 6)
    leader.num_computed_tokens = 6
    child = fork(kv, leader, "g/1")
    assert kv.pool.num_free == 0
    copies: dict[int, int] = {}
    assert not kv.copy_on_write(child, copies)
    assert copies == {} and child.block_ids == leader.block_ids
    kv.check_invariants()


def test_the_invariant_catches_a_reference_no_block_table_holds():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    leader = request("g", list(range(6)))
    assert kv.allocate(leader, 6)
    kv.pool.touch([leader.block_ids[0]])  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_count 2, held by 1"):
        kv.check_invariants()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fork", "write", "free", "grow"]), st.integers(0, 7)), max_size=60),
       st.integers(1, 23), st.booleans())
def test_random_forks_writes_and_frees_keep_reference_counts_equal_to_holders(ops, prompt_len, prefix_caching):
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=prefix_caching)
    leader = request("g", list(range(prompt_len)))
    assert kv.allocate(leader, prompt_len)
    leader.num_computed_tokens = prompt_len
    kv.cache_computed_blocks(leader)
    live = [leader]
    for op, k in ops:
        seq = live[k % len(live)] if live else None
        if op == "fork" and seq is not None and seq.block_ids:
            live.append(fork(kv, seq, f"g/{len(live)}-{k}"))
        elif op == "write" and seq is not None:
            # A decode step as the scheduler makes it: room for the token, then its own block.
            if kv.allocate(seq, 1) and kv.copy_on_write(seq, {}):
                seq.append_output_token(k)
                seq.num_computed_tokens += 1
                kv.cache_computed_blocks(seq)
        elif op == "free" and seq is not None:
            kv.free(seq)
            live.remove(seq)
        kv.check_invariants()


# ---------------------------------------------------------------------------- responses of shape [n]

def parsed(stream: bool) -> ParsedRequest:
    return ParsedRequest(prompt="P:", sampling={}, stream=stream, prepend_prompt=not stream, outputs=OUTPUT_NAMES)


def seq_output(text: str, tokens: int, total: int, finished: bool = False, reason: str | None = None,
               cumulative: float = -1.0, index: int = 0) -> RequestOutput:
    return RequestOutput(request_id=f"g/{index}", text_delta=text, token_ids_delta=[1] * tokens, finished=finished,
                         finish_reason=reason, num_prompt_tokens=3, num_output_tokens=total,
                         cumulative_logprob=cumulative, seq_index=index)


def group_output(sequences, finished=False, reason=None, returned=(0, 1)) -> RequestOutput:
    return RequestOutput(request_id="g", text_delta="", token_ids_delta=[], finished=finished, finish_reason=reason,
                         num_prompt_tokens=3, num_output_tokens=0, sequences=list(sequences), returned=list(returned))


def strings(arrays, name) -> list[str]:
    return [v.decode() for v in arrays[name]]


def test_streamed_group_sends_per_sequence_deltas_and_one_final_flag():
    encoder = ResponseEncoder(parsed(stream=True))
    # Before the fork only the leader has an output; the response still has shape [n].
    first = encoder.encode(group_output([seq_output("a", 1, 1), None]))
    assert strings(first, TEXT_OUTPUT) == ["a", ""] and list(first[NUM_OUTPUT_TOKENS]) == [1, 0]
    assert list(first[NUM_INPUT_TOKENS]) == [3]
    assert encoder.encode(group_output([seq_output("", 1, 2), seq_output("", 1, 1, index=1)])) is None
    ended = encoder.encode(group_output([seq_output("b", 1, 3, finished=True, reason="stop", cumulative=-2.0),
                                         seq_output("x", 0, 1, index=1)]))
    assert strings(ended, TEXT_OUTPUT) == ["b", "x"] and list(ended[NUM_OUTPUT_TOKENS]) == [2, 1]
    assert strings(ended, FINISH_REASON) == ["stop", "None"]
    assert list(ended[CUMULATIVE_LOGPROB]) == [-2.0, -1.0]
    last = encoder.encode(group_output([None, seq_output("y", 1, 2, finished=True, reason="length", index=1)],
                                       finished=True, reason="stop"))
    assert strings(last, TEXT_OUTPUT) == ["", "y"] and strings(last, FINISH_REASON) == ["stop", "length"]
    for name in (TEXT_OUTPUT, FINISH_REASON, CUMULATIVE_LOGPROB, LOGPROBS, NUM_OUTPUT_TOKENS):
        assert last[name].shape == (2,), name


def test_a_streamed_groups_queued_outputs_merge_per_sequence():
    # What the response thread does when a group's outputs queued up behind a slow send.
    encoder = ResponseEncoder(parsed(stream=True))
    encoder.absorb(group_output([seq_output("a", 1, 1), None]))
    encoder.absorb(group_output([seq_output("b", 1, 2), seq_output("x", 1, 1, index=1)]))
    merged = encoder.encode(group_output([seq_output("c", 1, 3, finished=True, reason="stop", cumulative=-2.0),
                                          seq_output("", 1, 2, index=1)]))
    assert strings(merged, TEXT_OUTPUT) == ["abc", "x"] and list(merged[NUM_OUTPUT_TOKENS]) == [3, 2]
    assert strings(merged, FINISH_REASON) == ["stop", "None"]
    last = encoder.encode(group_output([None, seq_output("y", 1, 3, finished=True, reason="length", index=1)],
                                       finished=True, reason="stop"))
    assert strings(last, TEXT_OUTPUT) == ["", "y"] and list(last[NUM_OUTPUT_TOKENS]) == [0, 1]


def test_unstreamed_best_of_returns_the_chosen_sequences_whole():
    encoder = ResponseEncoder(parsed(stream=False))
    three = [seq_output("s0", 1, 1, index=0), seq_output("s1", 1, 1, index=1), seq_output("s2", 1, 1, index=2)]
    assert encoder.encode(group_output(three, returned=(0, 1))) is None
    ends = [seq_output(f"+{i}", 1, 2, finished=True, reason="length", cumulative=-float(i), index=i) for i in range(3)]
    final = encoder.encode(group_output(ends, finished=True, reason="length", returned=(2, 0)))
    assert strings(final, TEXT_OUTPUT) == ["P:s2+2", "P:s0+0"]
    assert list(final[CUMULATIVE_LOGPROB]) == [-2.0, 0.0] and list(final[NUM_OUTPUT_TOKENS]) == [2, 2]
    assert [json.loads(v) for v in final[LOGPROBS]] == [None, None]


def test_one_sequence_keeps_shape_one():
    encoder = ResponseEncoder(parsed(stream=False))
    out = seq_output("hi", 1, 1, finished=True, reason="stop")
    arrays = encoder.encode(out)
    assert all(a.shape == (1,) for a in arrays.values()) and strings(arrays, TEXT_OUTPUT) == ["P:hi"]
    assert arrays[NUM_OUTPUT_TOKENS].dtype == np.uint32
