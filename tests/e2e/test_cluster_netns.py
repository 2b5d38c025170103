"""The cluster as several hosts (tools/netns.py): each replica in a network namespace of its
own, the routers in another, joined by veth pairs. A replica's link is cut instead of its
process killed (a partition sends no RST: the routers must notice by their health checks),
then restored.

The same promises as tests/e2e/test_cluster.py's kill: the streams on the cut-off replica end
with an error (within the health checks' 2 s, not the 10 min stream timeout), only those are
lost, every request sent from 10 s after the cut succeeds through both routers, and the
replica rejoins once its link is back. One more, that only a partition tests: the cut-off
replica finds its dead router connection by gRPC keepalive (tools/launch.py) and drops it
before the link comes back, rather than holding it, its unsent responses and its streams for
TCP's minutes of retransmissions. Needs root (ip netns); 32 streams keep it short.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.e2e.e2e_util import Stream, inputs_for, wait_while_streaming
from tests.e2e.test_cluster import (
    LONG_REQUEST,
    MAX_POSITIONS,
    MODEL,
    PARAMETERS,
    assert_rejoins,
    assert_survivor_serves,
    in_flight,
    streams_on,
)
from tools import netns, scaleout
from tools.launch import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

NUM_STREAMS = 32


@pytest.fixture(scope="module")
def hosts():
    if not netns.can_create_namespaces():
        pytest.skip("creating network namespaces needs root (ip netns add)")
    with netns.Hosts(2) as h:
        yield h


@pytest.fixture(scope="module")
def tiny_checkpoint_options() -> dict:
    return {"max_position_embeddings": MAX_POSITIONS}


@pytest.fixture(scope="module")
def cluster(hosts, tiny_checkpoint, tmp_path_factory):
    setup = subprocess.run(["make", "router", "haproxy"], cwd=scaleout.REPO_ROOT, capture_output=True, text=True)
    assert setup.returncode == 0 and shutil.which("haproxy"), setup.stdout[-2000:] + setup.stderr[-2000:]
    root = tmp_path_factory.mktemp("cluster-netns")
    # Each host has its own addresses, so any free port number serves every replica.
    base = free_ports(1)[0] // 10 * 10
    replicas = [scaleout.Replica(i, hosts.replica_host(i), base, netns=ns) for i, ns in enumerate(hosts.replica_ns)]
    http_port, grpc_port, openai_port, router_metrics_port = free_ports(4)
    c = scaleout.Cluster(replicas, scaleout.REPO_ROOT / "model_repository", http_port=http_port,
                         grpc_port=grpc_port, openai_port=openai_port, router_metrics_port=router_metrics_port,
                         router_host=hosts.router_host,
                         router_netns=hosts.router_ns, log_dir=root / "logs",
                         engine_parameters={"model_path": tiny_checkpoint, **PARAMETERS})
    try:
        c.start()
    except Exception as exc:
        c.stop()
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "logs").glob("*.log")))
        pytest.fail(f"cluster did not start: {exc}\n{logs}", pytrace=False)
    yield c
    c.stop()


def test_a_partitioned_replica_fails_over_and_rejoins(hosts, cluster):
    victim, survivor = cluster.replicas
    streams = [Stream(cluster.grpc_url) for _ in range(NUM_STREAMS)]
    try:
        outcomes = [s.send(MODEL, inputs_for(f"Stream {i}", LONG_REQUEST, stream=True)) for i, s in enumerate(streams)]
        deadline = time.monotonic() + 120
        while not all(o.responses for o in outcomes):
            assert time.monotonic() < deadline, "the streams never all started"
            assert not any(o.done.is_set() for o in outcomes), "a stream ended before the cut"
            time.sleep(0.05)
        on_victim = streams_on(victim, survivor, NUM_STREAMS)
        assert 0 < on_victim < NUM_STREAMS
        assert connections_to_grpc(victim), "the cut-off replica had no router connection to lose"
        cut_at = time.monotonic()
        hosts.cut(victim.index)

        # Keepalive: a ping every 10 s, 5 s for its answer; the rest is slack for a loaded machine.
        while connections_to_grpc(victim):
            assert time.monotonic() < cut_at + 45, "the cut-off replica still holds its dead router connection"
            time.sleep(0.5)
        dropped_after = time.monotonic() - cut_at

        for o in outcomes:
            wait_while_streaming(o)
        lost = [o for o in outcomes if o.error is not None]
        assert len(lost) == on_victim, f"lost {len(lost)} streams, {on_victim} were in flight on the cut-off replica"
        assert max(o.times[-1] for o in lost) - cut_at < 10, "a stream on the cut-off replica hung"
        assert all(o.finals == 1 and o.after_final == 0 for o in outcomes)
        print(f"\npartition: {len(lost)} of {NUM_STREAMS} streams lost, all on the cut-off replica, "
              f"ended {max(o.times[-1] for o in lost) - cut_at:.1f} s after the cut; the replica dropped its dead "
              f"router connection {dropped_after:.1f} s after the cut")
    finally:
        for s in streams:
            s.close()

    client = assert_survivor_serves(cluster, survivor, failed_at=cut_at, rounds=4)

    hosts.restore(victim.index)
    # Its streams were cancelled with the connection, or finished; either way none is left.
    deadline = time.monotonic() + 120
    while in_flight(victim):
        assert time.monotonic() < deadline, "the replica never ended the streams cut off from it"
        time.sleep(0.5)
    assert_rejoins(cluster, victim, client)


def connections_to_grpc(replica: scaleout.Replica) -> int:
    """Established TCP connections from other hosts to the replica's gRPC port (its own OpenAI
    frontend's is local), as its namespace sees them: reachable while its link is cut."""
    ss = subprocess.run(["ip", "netns", "exec", replica.netns, "ss", "-Htn", "state", "established",
                         f"( sport = :{replica.port(scaleout.GRPC)} )"], capture_output=True, text=True, check=True)
    peers = [line.split()[-1] for line in ss.stdout.splitlines()]
    return sum(1 for peer in peers if replica.host not in peer)
