"""A property test against the session's server: hypothesis generates `sampling_parameters`
objects (known and unknown keys, values of every JSON type, NaN and infinities, numbers far
beyond any limit) and sends each over gRPC streaming or HTTP generate.

Whatever it sends: exactly one final answer, never a 5xx; where `SamplingParams` (the
backend's own table of rules, run here on the same dict) refuses the object, the server
refuses it too, naming the same parameter; where the table accepts it, the server serves
it, or refuses it for a limit that only the loaded model knows (vocabulary, max_model_len),
naming the parameter. At the end the engine is empty and the stub never restarted.
"""

from __future__ import annotations

import json
import math

import pytest
import requests
from hypothesis import HealthCheck, event, given, settings, strategies as st

from backend.request import RequestError, SamplingParams
from backend.validation import parse_sampling_params
from client.soak import descendants
from tests.e2e.e2e_util import Stream, inputs_for, wait_for, wait_idle

pytestmark = pytest.mark.e2e

# Limits the engine checks at admission, against the loaded model (backend/engine.py): its
# vocabulary, max_model_len, adapters (lora_name), seats and KV pool (n, best_of), and the
# tokenizer (bad_words that tokenize to nothing, structured_outputs that do not compile).
MODEL_LIMITED = {"top_k", "stop_token_ids", "max_tokens", "lora_name", "n", "best_of", "bad_words",
                 "structured_outputs"}

# Values of every JSON type: NaN, infinities, numbers far beyond any limit, strings...
junk_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["inf", "nan", "-1", "1e400"]),
)
junk = st.one_of(junk_scalars, st.lists(junk_scalars, max_size=4),
                 st.dictionaries(st.text(max_size=4), junk_scalars, max_size=2))
# ... and values near the limits of most parameters, so that about half the objects are valid.
plausible = st.one_of(st.floats(0, 1), st.integers(0, 3),
                      st.sampled_from([0, 1, 0.5, "1", "0.5", "true", False, [], ["x"], [2], None]))
values = st.one_of(plausible, plausible, plausible, junk)
keys = st.sampled_from(SamplingParams.known_names() + ["temprature", "n", "best_of", "", "max_tokens "])
# max_tokens is always there and small when valid, so that a served example ends fast.
max_tokens = st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
                       st.sampled_from([0, -1, "2", 2.5, math.nan, True, [2], "x"]))
sampling_objects = st.builds(lambda rest, mt: {**rest, "max_tokens": mt}, st.dictionaries(keys, values, max_size=2),
                             max_tokens)


def expected_refusal(sampling: dict) -> str | None:
    """The parameter the backend's table refuses, or None when it accepts the object."""
    try:
        params = parse_sampling_params(sampling)
    except RequestError as exc:
        return exc.param
    # A valid min_tokens beyond this test's small max_tokens is refused by the table too;
    # anything else that passes may still meet a model limit.
    assert params.max_tokens is not None and params.max_tokens <= 3
    return None


@pytest.fixture(scope="module")
def server(triton_server):
    stubs = descendants(triton_server.proc.pid)
    yield triton_server
    wait_idle(triton_server.metrics_port, triton_server.model, 30)
    assert descendants(triton_server.proc.pid) == stubs, "the Python backend stub was replaced (it crashed)"


def answer(server, transport: str, text: str) -> tuple[str | None, list[str]]:
    """(error message or None, the finish_reason of each sequence: n of them, none on an error)."""
    if transport == "grpc":
        with Stream(server.grpc_url) as stream:
            got = wait_for(stream.send(server.model, inputs_for("Hello", text)), 60)
        assert got.finals == 1 and got.after_final == 0
        if got.error is not None:
            assert not got.responses
            return got.message, []
        return None, [r.decode() for r in got.last.as_numpy("finish_reason").reshape(-1)]
    r = requests.post(f"{server.http_url}/v2/models/{server.model}/generate",
                      json={"text_input": "Hello", "sampling_parameters": text}, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        return r.json()["error"], []
    reasons = r.json().get("finish_reason", [])
    return None, reasons if isinstance(reasons, list) else [reasons]


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=sampling_objects, transport=st.sampled_from(["grpc", "http"]))
def test_generated_sampling_parameters_are_served_or_refused_by_name(server, sampling, transport):
    text = json.dumps(sampling, allow_nan=True)
    error, finish_reasons = answer(server, transport, text)
    refused = expected_refusal(sampling)
    event("served" if error is None else "refused")
    if refused is not None:
        assert error is not None, f"served {text}, which the table refuses ({refused})"
        assert error.startswith(f"{refused}: "), (text, error)
    elif error is not None:
        assert any(error.startswith(f"{name}: ") for name in MODEL_LIMITED & set(sampling)), (text, error)
    else:
        n = parse_sampling_params(sampling).n
        assert len(finish_reasons) == n and set(finish_reasons) <= {"stop", "length"}, (text, finish_reasons)
