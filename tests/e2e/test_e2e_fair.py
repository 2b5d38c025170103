"""Fair share through a real tritonserver: two tenants over gRPC streaming under the `fair`
policy, checked with the per-tenant metrics on /metrics; and a bad `tenant` refused."""

from __future__ import annotations

import json

import pytest

from backend.protocol import RETURN_TRACE
from tests.e2e.e2e_util import Stream, generate, inputs_for, output, scrape, wait_for, wait_idle, wait_until

pytestmark = pytest.mark.e2e

RETURNS = ("return_num_input_tokens", "return_num_output_tokens")
MAX_TOKENS = 48
# Bob's requests run long: the window in which Bob runs while Alice's flood waits lasts as long
# as they do, and /metrics is polled across it. At 48 tokens it lasted ~0.1 s on the tiny model,
# which a 2-core machine's scrapes could miss; under `fair` Bob still ends before Alice's flood
# (her six waiting requests run after his, whatever his length).
BOB_MAX_TOKENS = 8 * MAX_TOKENS


def prompt_tokens(outcome) -> int:
    """Every streamed response repeats the prompt's token count."""
    return int(output(outcome.last, "num_input_tokens"))


def finished_step(outcome) -> int:
    """The engine iteration that ended the request (its trace's closing event): the scheduler's
    order, which the arrival times of the final responses at a busy client only approximate."""
    return json.loads(output(outcome.last, "trace"))["events"][-1]["step"]


@pytest.fixture(scope="module")
def fair_server(tritonserver, tiny_checkpoint):
    parameters = {"model_path": tiny_checkpoint, "kv_cache_memory_mb": "16", "max_num_seqs": "2",
                  "scheduling_policy": "fair", "tenant_weights": '{"alice": 1, "bob": 1}',
                  "enable_prefix_caching": "false"}
    with tritonserver({"llm": parameters}) as server:
        yield server


def test_two_tenants_share_the_batch_and_the_metrics_count_each(fair_server):
    """Alice floods first (8 requests on 2 seats), Bob sends 2 just after: Bob's do not wait
    behind Alice's flood, and the per-tenant counters hold exactly each tenant's service."""
    server = fair_server
    sampling = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    with Stream(server.grpc_url) as alice, Stream(server.grpc_url) as bob:
        flood = [alice.send(server.model, inputs_for(f"Alice asks question number {i}, a long one",
                                                     {**sampling, "tenant": "alice"}, stream=True,
                                                     returns=RETURNS + (RETURN_TRACE,)))
                 for i in range(8)]
        wait_until(lambda: flood[0].responses, 120, what="alice's first token")
        chats = [bob.send(server.model, inputs_for(f"Bob says hello {i}",
                                                   {**sampling, "max_tokens": BOB_MAX_TOKENS, "tenant": "bob"},
                                                   stream=True, returns=RETURNS + (RETURN_TRACE,)))
                 for i in range(2)]

        def bob_running_while_alice_waits():
            m = scrape(server.metrics_port)
            return (m.get("inflight_tenant_requests_running", model=server.model, tenant="bob") >= 1
                    and m.get("inflight_tenant_requests_waiting", model=server.model, tenant="alice") >= 1)

        wait_until(bob_running_while_alice_waits, 120, 0.05, "bob running while alice's flood waits")
        for outcome in flood + chats:
            wait_for(outcome, 300)
            assert outcome.error is None and outcome.finals == 1, outcome.message
    # Bob arrived behind six waiting requests of Alice's; under fcfs he would finish last.
    assert max(finished_step(c) for c in chats) < max(finished_step(f) for f in flood)

    m = wait_idle(server.metrics_port, server.model)

    def service(outcomes):  # input tokens cost 1, output tokens 2 (the defaults)
        return sum(prompt_tokens(o) + 2 * o.total("num_output_tokens") for o in outcomes)

    assert all(o.total("num_output_tokens") == MAX_TOKENS for o in flood)
    assert all(o.total("num_output_tokens") == BOB_MAX_TOKENS for o in chats)
    assert m.get("inflight_tenant_service_tokens_total", model=server.model, tenant="alice") == service(flood)
    assert m.get("inflight_tenant_service_tokens_total", model=server.model, tenant="bob") == service(chats)
    assert m.get("inflight_tenant_service_tokens_total", model=server.model, tenant="other") == 0
    for tenant in ("alice", "bob", "default", "other"):
        assert m.get("inflight_tenant_requests_running", model=server.model, tenant=tenant) == 0
        assert m.get("inflight_tenant_requests_waiting", model=server.model, tenant=tenant) == 0


def test_an_unlisted_tenant_is_counted_as_other_and_a_bad_one_refused(fair_server):
    server = fair_server
    before = scrape(server.metrics_port).get("inflight_tenant_service_tokens_total", model=server.model, tenant="other")
    ok = generate(server.grpc_url, server.model,
                  inputs_for("Hi", {"max_tokens": 4, "ignore_eos": True, "tenant": "carol"}, stream=True, returns=RETURNS))
    assert ok.error is None
    m = wait_idle(server.metrics_port, server.model)
    expected = prompt_tokens(ok) + 2 * ok.total("num_output_tokens")
    assert m.get("inflight_tenant_service_tokens_total", model=server.model, tenant="other") == before + expected
    assert not any(ls.get("tenant") == "carol" for _, ls, _ in m.samples)

    bad = generate(server.grpc_url, server.model, inputs_for("Hi", {"max_tokens": 4, "tenant": "no spaces"}, stream=True))
    assert bad.finals == 1 and bad.message.startswith("tenant: "), bad.message
    assert "1 to 64 characters" in bad.message
