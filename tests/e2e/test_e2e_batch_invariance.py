"""Batch invariance through a real tritonserver: a probe request's `logprobs` output is the
same, bit for bit, alone and under a concurrent load of other streams (the served model runs
with `batch_invariant` at its default, auto: on for this CPU). Greedy and seeded sampling."""

from __future__ import annotations

import json
import random

import pytest

from tests.e2e.e2e_util import Stream, inputs_for, output, wait_for, wait_idle, wait_until

pytestmark = pytest.mark.e2e

RETURNS = ("return_logprobs", "return_num_output_tokens")
PROBE = ("Batch invariance means that the numbers computed for one request do not depend on which "
         "other requests happen to share its batch. Explain why that matters for evaluations:")


def probe_logprobs(outcome) -> list[tuple[int, float]]:
    """(sampled token id, its logprob) per output token, as the float the server sent."""
    pairs = []
    for r in outcome.responses:
        for entry in json.loads(output(r, "logprobs") or "null") or []:
            token_id, info = next(iter(entry.items()))
            pairs.append((int(token_id), info["logprob"]))
    return pairs


def run_probe(server, sampling: dict, crowd: int) -> list[tuple[int, float]]:
    """The probe's logprobs, sent after `crowd` other streams have started generating."""
    rng = random.Random(crowd)
    words = PROBE.split()
    with Stream(server.grpc_url) as load, Stream(server.grpc_url) as probe_stream:
        others = [load.send(server.model, inputs_for(" ".join(rng.choices(words, k=rng.randint(3, 120))),
                                                     {"temperature": 0.7, "seed": i, "max_tokens": rng.randint(8, 40),
                                                      "ignore_eos": True}, stream=True))
                  for i in range(crowd)]
        if others:  # the crowd is running (and holding batch seats) when the probe arrives
            wait_for_any_tokens(others)
        probe = wait_for(probe_stream.send(server.model, inputs_for(PROBE, sampling, stream=True, returns=RETURNS)), 300)
        for other in others:
            wait_for(other, 300)
    assert probe.error is None, probe.message
    assert all(o.error is None for o in others)
    return probe_logprobs(probe)


def wait_for_any_tokens(outcomes) -> None:
    wait_until(lambda: sum(bool(o.responses) for o in outcomes) >= min(4, len(outcomes)), 120, 0.01,
               "the crowd's first tokens")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_requests_logprobs_are_the_same_bits_alone_and_under_load(triton_server, sampling):
    sampling = {**sampling, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}
    wait_idle(triton_server.metrics_port, triton_server.model)
    alone = run_probe(triton_server, sampling, crowd=0)
    assert len(alone) == 16
    for crowd in (5, 14):  # the e2e server has 8 seats: 14 others keep some waiting too
        assert run_probe(triton_server, sampling, crowd) == alone, f"with {crowd} other streams"
