"""Structured outputs through the engine: every output of a constrained request matches its
constraint (JSON schema, regex, choice, grammar), compilation runs off the engine loop and is
cached, a constraint that does not compile ends its request with INVALID_ARG, and neither
early stops nor preemption change what a request produces or leave grammar state behind.

The tiny random-weight Llama samples from a flat-ish distribution, the hardest case for a
constraint: nothing but the bitmask keeps its output in the language.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import RequestError, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Strings are bounded by patterns, not minLength/maxLength: xgrammar 0.2.8 lets a string
# with a length bound take raw control characters (bytes 0x00-0x1f), which is not JSON.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z .'-]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z0-9]{0,6}$"}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "admin"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)"
CHOICES = ["red", "green", "blue", 'a "quoted" \\ choice']
PROMPT = [1, 415, 3278, 314, 2484, 28, 1458, 28]


def make_engine(model_path: str, **overrides) -> LLMEngine:
    config = dict(model_path=model_path, device="cpu", dtype="float32", max_num_seqs=16, num_kv_blocks=256)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def run_to_completion(engine: LLMEngine, requests: dict, on_step=None, max_steps: int = 5000) -> dict:
    """Step until every request has its one final output; return {request id: final output}
    with the streamed token ids of each in `.all_token_ids`."""
    finals, streamed = {}, {rid: [] for rid in requests}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finals, f"output after the final one for {out.request_id}"
            streamed[out.request_id].extend(out.token_ids_delta)
            if out.finished:
                out.all_token_ids = streamed[out.request_id]
                finals[out.request_id] = out
        if on_step is not None:
            on_step(engine)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    assert set(finals) == set(requests)
    return finals


def assert_no_grammar_state(engine: LLMEngine, requests) -> None:
    assert engine.num_waiting == 0 and not engine.has_unfinished()
    assert all(r.grammar is None for r in requests), "a finished request kept its matcher"
    assert not engine.detokenizers, "a finished request kept its detokenizer"
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def text_of(engine: LLMEngine, out) -> str:
    return engine.tokenizer.decode(out.all_token_ids, skip_special_tokens=True)


def test_fifty_seeded_sampled_requests_validate_against_the_schema(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    requests = {}
    for i in range(50):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs={"json": SCHEMA})
        requests[f"r{i}"] = engine.add_request(f"r{i}", PROMPT, params)
    finals = run_to_completion(engine, requests)
    texts = set()
    for rid, out in finals.items():
        assert out.error is None and out.finish_reason == "stop", (rid, out)
        text = text_of(engine, out)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 25, "seeded sampling should give mostly distinct documents"
    assert engine.grammar_compiler.num_compiled == 1, "one schema must be compiled once"
    assert_no_grammar_state(engine, requests.values())


@pytest.mark.parametrize("constraint, holds", [
    ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ({"choice": CHOICES}, lambda text: text in CHOICES),
    ({"grammar": 'root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'}, lambda text: re.fullmatch(r"\(\d+( \+ \d+)*\)", text)),
], ids=["regex", "choice", "grammar"])
def test_constraints_always_hold(tiny_checkpoint, constraint, holds):
    engine = make_engine(tiny_checkpoint)
    requests = {}
    for i in range(20):
        params = SamplingParams(temperature=1.0 if i % 4 else 0.0, seed=i, max_tokens=256, structured_outputs=constraint)
        requests[f"r{i}"] = engine.add_request(f"r{i}", PROMPT, params)
    finals = run_to_completion(engine, requests)
    for rid, out in finals.items():
        text = text_of(engine, out)
        assert out.finish_reason == "stop" and holds(text), (rid, text, out.finish_reason)
    if "choice" in constraint:
        assert len({text_of(engine, out) for out in finals.values()}) > 1, "sampling never left one choice"


def test_json_object_is_an_object(tiny_checkpoint):
    """Any JSON object: a random model may write a key forever, so those that reach
    max_tokens are only checked to be an object's beginning; the others parse as objects."""
    engine = make_engine(tiny_checkpoint)
    requests = {f"r{i}": engine.add_request(f"r{i}", PROMPT, SamplingParams(
        temperature=1.0, seed=i, max_tokens=128, structured_outputs={"json_object": True})) for i in range(20)}
    finals = run_to_completion(engine, requests)
    stopped = 0
    for rid, out in finals.items():
        text = text_of(engine, out)
        assert text.startswith("{"), (rid, text)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), (rid, text)
            stopped += 1
    assert stopped >= 5, f"only {stopped} of 20 objects were closed"


@pytest.mark.parametrize("constraint, needle", [
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
], ids=["json-unresolved-ref", "regex", "grammar"])
def test_a_constraint_that_does_not_compile_ends_its_request_with_invalid_arg(tiny_checkpoint, constraint, needle):
    engine = make_engine(tiny_checkpoint)
    bad = engine.add_request("bad", PROMPT, SamplingParams(max_tokens=8, structured_outputs=constraint))
    good = engine.add_request("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    finals = run_to_completion(engine, {"bad": bad, "good": good})
    error = finals["bad"].error
    assert error is not None and error.code == RequestError.INVALID_ARG
    assert str(error).startswith("structured_outputs: ") and needle in str(error), str(error)
    assert finals["bad"].finish_reason == "error" and finals["bad"].all_token_ids == []
    assert finals["good"].error is None and len(finals["good"].all_token_ids) == 8
    assert_no_grammar_state(engine, [bad, good])


def test_compilation_never_stalls_the_batch(tiny_checkpoint):
    """While a grammar compiles (held here until released), free requests keep decoding;
    the constrained request is scheduled once its grammar is ready."""
    engine = make_engine(tiny_checkpoint)
    release = threading.Event()
    compile_now = engine.grammar_compiler._compile

    def held_compile(*args):
        assert release.wait(60)
        return compile_now(*args)

    engine.grammar_compiler._compile = held_compile
    free = engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    constrained = engine.add_request("json", PROMPT, SamplingParams(temperature=0.0, max_tokens=64,
                                                                       structured_outputs={"json": SCHEMA}))
    finals = {}
    for _ in range(6):
        for out in engine.step():
            finals[out.request_id] = out
    assert "free" in finals and finals["free"].num_output_tokens == 6, "the free request waited for a compile"
    assert constrained.num_output_tokens == 0 and engine.num_waiting == 1
    release.set()
    finals.update(run_to_completion(engine, {"json": constrained}))
    assert finals["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(constrained.output_token_ids, skip_special_tokens=True)), SCHEMA)
    assert_no_grammar_state(engine, [free, constrained])


def test_free_rows_of_a_mixed_batch_are_untouched(tiny_checkpoint):
    """Greedy free requests give the same tokens beside constrained ones as alone."""
    prompts = [PROMPT[: 3 + i] for i in range(4)]
    alone = make_engine(tiny_checkpoint)
    want = [r.output_token_ids for r in alone.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]
    mixed = make_engine(tiny_checkpoint)
    requests = {}
    for i, prompt in enumerate(prompts):
        requests[f"free{i}"] = mixed.add_request(f"free{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12))
        requests[f"json{i}"] = mixed.add_request(f"json{i}", prompt, SamplingParams(
            temperature=1.0, seed=i, max_tokens=200, structured_outputs={"json": SCHEMA}))
    run_to_completion(mixed, requests)
    assert [requests[f"free{i}"].output_token_ids for i in range(4)] == want


def test_early_stops_leave_no_grammar_state(tiny_checkpoint):
    """max_tokens, a stop string, an abort while running and an abort while compiling."""
    engine = make_engine(tiny_checkpoint)
    release = threading.Event()
    compile_now = engine.grammar_compiler._compile
    engine.grammar_compiler._compile = lambda *args: (release.wait(60), compile_now(*args))[1]
    requests = {
        "length": engine.add_request("length", PROMPT, SamplingParams(max_tokens=3, structured_outputs={"json": SCHEMA})),
        "stop": engine.add_request("stop", PROMPT, SamplingParams(max_tokens=100, stop=['"'], structured_outputs={"json": SCHEMA})),
        "running": engine.add_request("running", PROMPT, SamplingParams(max_tokens=100, structured_outputs={"json": SCHEMA})),
        "compiling": engine.add_request("compiling", PROMPT, SamplingParams(structured_outputs={"regex": "[0-9]+"})),
    }
    engine.step()
    assert engine.abort("compiling")
    release.set()
    finals = {}
    while "running" not in finals:
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        if requests["running"].num_output_tokens == 2:
            engine.abort("running")
    finals.update(run_to_completion(engine, {k: v for k, v in requests.items() if k not in finals}))
    assert {k: v.finish_reason for k, v in finals.items()} == {
        "length": "length", "stop": "stop", "running": "abort", "compiling": "abort"}
    assert finals["stop"].stop_reason == '"'
    assert_no_grammar_state(engine, requests.values())


def test_preemption_by_recompute_rebuilds_the_matcher(tiny_checkpoint):
    """A tiny KV pool keeps evicting constrained requests; each rebuilds its matcher by
    replaying its tokens, and every request's tokens equal those of a run without preemption."""
    constraints = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, None]

    def run(**config):
        engine = make_engine(tiny_checkpoint, **config)
        requests = {}
        for i in range(12):
            so = constraints[i % len(constraints)]
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=so is None, structured_outputs=so)
            requests[f"r{i}"] = engine.add_request(f"r{i}", PROMPT + [100 + i] * (i % 5), params)
        rebuilt = set()

        def note_rebuilds(engine):
            rebuilt.update(r.request_id for r in engine.scheduler.running if r.grammar and r.grammar.num_rebuilds)

        finals = run_to_completion(engine, requests, on_step=note_rebuilds)
        assert_no_grammar_state(engine, requests.values())
        return engine, {rid: out.all_token_ids for rid, out in finals.items()}, rebuilt

    _, want, _ = run()
    engine, got, rebuilt = run(block_size=8, num_kv_blocks=12, max_num_seqs=6, max_preemptions=3)
    assert engine.stats.totals.preemptions > 0 and rebuilt, "no constrained request was preempted and rebuilt"
    assert got == want


def test_every_sequence_of_a_parallel_request_keeps_the_constraint(tiny_checkpoint):
    """n > 1: each forked sequence gets a matcher of its own on the one compiled grammar."""
    engine = make_engine(tiny_checkpoint)
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=256, structured_outputs={"choice": CHOICES})
    request = engine.add_request("group", PROMPT, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            for i, seq in enumerate(out.sequences or []):
                if seq is not None:
                    tokens[i].extend(seq.token_ids_delta)
            if out.finished:
                final = out
    assert final is not None and final.error is None
    texts = [engine.tokenizer.decode(tokens[i], skip_special_tokens=True) for i in range(4)]
    assert all(text in CHOICES for text in texts), texts
    assert len(set(texts)) > 1, "the sequences sampled one choice only"
    assert engine.grammar_compiler.num_compiled == 1
    assert_no_grammar_state(engine, request.group.seqs)
