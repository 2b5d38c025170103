"""Several hosts on one machine: network namespaces joined by veth pairs (iproute2), so that
the cluster's replicas and routers each have an address and a link of their own, and a link
can be cut (``ip link set ... down``) the way a real network partitions.

Topology, for ``n`` replicas (``Hosts(n)``; root privileges needed)::

    this namespace  10.X.100.1 ──veth── 10.X.100.2  routers' namespace  10.X.i.1 ──veth── 10.X.i.2  replica i

The routers' namespace forwards between its links, so this process reaches the routers'
ports and, through them, each replica's own ports (metrics) as a client on another host would.
"""

from __future__ import annotations

import os
import re
import subprocess


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def free_subnet() -> int:
    """An X of 10.X.0.0/16 that no route of this namespace uses yet, so that two sets of hosts
    (two tests, or one test run twice at once) never share addresses."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    used = {int(x) for x in re.findall(r"\b10\.(\d+)\.", routes)}
    start = os.getpid() % 150
    for offset in range(150):
        subnet = 64 + (start + offset) % 150
        if subnet not in used:
            return subnet
    raise RuntimeError("no free 10.X.0.0/16 subnet for network namespaces")


def can_create_namespaces() -> bool:
    name = f"inflight-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False
    _ip("netns", "del", name)
    return True


class Hosts:
    """``n`` replica namespaces and one for the routers; ``close()`` (or leaving the ``with``
    block) deletes them, and with them their veth pairs. Stop the processes inside first."""

    def __init__(self, n: int):
        self.tag = f"{os.getpid() % 100000}"
        self.prefix = f"10.{free_subnet()}"
        self.router_ns = f"inflight-rt-{self.tag}"
        self.replica_ns = [f"inflight-r{i}-{self.tag}" for i in range(n)]
        self.created: list[str] = []
        self.client_link = f"ifc{self.tag}"

    @property
    def router_host(self) -> str:
        """The routers' address as this namespace sees it."""
        return f"{self.prefix}.100.2"

    def replica_host(self, i: int) -> str:
        return f"{self.prefix}.{i}.2"

    def router_link(self, i: int) -> str:
        """The routers' end of replica i's link (what a partition takes down)."""
        return f"rt{i}-{self.tag}"

    def __enter__(self) -> "Hosts":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        try:
            for ns in (self.router_ns, *self.replica_ns):
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("link", "set", "lo", "up", netns=ns)
            # this namespace <-> routers
            peer = f"ifr{self.tag}"
            _ip("link", "add", self.client_link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", self.router_ns)
            _ip("addr", "add", f"{self.prefix}.100.1/24", "dev", self.client_link)
            _ip("link", "set", self.client_link, "up")
            _ip("addr", "add", f"{self.router_host}/24", "dev", peer, netns=self.router_ns)
            _ip("link", "set", peer, "up", netns=self.router_ns)
            subprocess.run(["ip", "netns", "exec", self.router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                           check=True, capture_output=True)
            for i, ns in enumerate(self.replica_ns):
                outer, inner = self.router_link(i), f"eth{i}-{self.tag}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "netns", self.router_ns)
                _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"{self.prefix}.{i}.1/24", "dev", outer, netns=self.router_ns)
                _ip("link", "set", outer, "up", netns=self.router_ns)
                _ip("addr", "add", f"{self.replica_host(i)}/24", "dev", inner, netns=ns)
                _ip("link", "set", inner, "up", netns=ns)
                _ip("route", "add", "default", "via", f"{self.prefix}.{i}.1", netns=ns)
                _ip("route", "add", f"{self.prefix}.{i}.0/24", "via", self.router_host)
        except BaseException:
            self.close()
            raise

    def cut(self, i: int) -> None:
        """Partition replica i: its link to the routers goes down (its processes live on)."""
        _ip("link", "set", self.router_link(i), "down", netns=self.router_ns)

    def restore(self, i: int) -> None:
        _ip("link", "set", self.router_link(i), "up", netns=self.router_ns)

    def close(self) -> None:
        for i in range(len(self.replica_ns)):
            subprocess.run(["ip", "route", "del", f"{self.prefix}.{i}.0/24"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.client_link], capture_output=True)
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()
