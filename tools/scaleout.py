"""Replicas behind real routers: N x (tritonserver + OpenAI frontend), haproxy in front of
Triton's HTTP and gRPC, vllm-router in front of the OpenAI frontends. ``tools/cluster.py``
is its command line (``make cluster``); tests and benchmarks use ``Cluster`` directly.

Routing, and why:
- haproxy, HTTP: ``mode http``, ``leastconn``, one balancing decision per request, so a
  ``generate_stream`` (one SSE response) stays on one replica.
- haproxy, gRPC: ``mode http`` over HTTP/2 on both sides, ``leastconn`` per gRPC call. A
  tritonclient stream (and every request sent on it) is one call, one HTTP/2 stream, so it
  stays on one replica; the calls of one client, which gRPC multiplexes on one connection
  (and gRPC shares one connection between a process's channels to the same address), still
  spread over the replicas.
- Both send each piece as it comes (``option http-no-delay``): by default haproxy asks the
  kernel to hold small writes for more data, which held some gRPC streams' first token 200 ms
  or more (c=1, 3 runs of 8 with prefix caching on, at dced014: TTFT mean through haproxy 1.54x
  direct without it, 1.04x with it; with caching off, 1.01x with it).
- Both check ``/v2/health/ready`` every second on the replica's HTTP port (``fall 2``);
  ``on-marked-down shutdown-sessions`` ends the sessions of a replica found down, so its
  streams end with an error at once even when the link, not the process, died (no RST).
- vllm-router checks each frontend's ``/health`` (which asks Triton) every second; its
  default of 60 s and 3 failures would take minutes to fail over.

Each replica may live in a network namespace of its own (``Replica.netns``, see
``tools/netns.py``): its processes then run under ``ip netns exec`` and bind its address.
The replicas' tritonservers and frontends are started by tools/launch.py, as `make serve`'s
and the tests' are.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from backend.paths import REPO_ROOT
from tools import launch

ROUTER_BIN = REPO_ROOT / ".venv-router" / "bin" / "vllm-router"
ROUTER_POLICIES = ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware", "random")
# Port offsets of replica i from base_port + 10 * i.
HTTP, GRPC, METRICS, OPENAI, KV_EVENTS, KV_REPLAY = range(6)
HEALTH_INTERVAL_S = 1
# A replica that dies before it is ready shows this much of its log in the error.
LOG_TAIL_LINES = 40


@dataclasses.dataclass
class Replica:
    """One tritonserver and its OpenAI frontend, on ``host`` (inside ``netns`` when set)."""

    index: int
    host: str
    base_port: int
    netns: str | None = None
    kv_events: bool = False
    triton: subprocess.Popen | None = None
    frontend: subprocess.Popen | None = None

    def port(self, offset: int) -> int:
        return self.base_port + offset

    @property
    def name(self) -> str:
        return f"replica{self.index}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.port(HTTP)}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.port(GRPC)}"

    @property
    def openai_url(self) -> str:
        return f"http://{self.host}:{self.port(OPENAI)}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port(METRICS)}/metrics"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port(KV_EVENTS)}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port(KV_REPLAY)}"


def haproxy_config(replicas: Sequence[Replica], bind_host: str, http_port: int, grpc_port: int) -> str:
    """haproxy's configuration for Triton's HTTP and gRPC in front of ``replicas``."""
    def servers(offset: int, options: str = "") -> str:
        return "\n".join(f"  server {r.name} {r.host}:{r.port(offset)}{options} check port {r.port(HTTP)}"
                          f" check-proto h1" for r in replicas)

    return f"""global
  maxconn 4096

defaults
  timeout connect 2s
  timeout client 10m
  timeout server 10m
  timeout tunnel 10m
  timeout check 1s
  retries 2
  option redispatch
  option http-no-delay
  default-server inter {HEALTH_INTERVAL_S}s fall 2 rise 2 on-marked-down shutdown-sessions

frontend triton_http
  mode http
  bind {bind_host}:{http_port}
  default_backend triton_http

backend triton_http
  mode http
  balance leastconn
  option httpchk GET /v2/health/ready
  http-check expect status 200
{servers(HTTP)}

frontend triton_grpc
  mode http
  bind {bind_host}:{grpc_port} proto h2
  default_backend triton_grpc

backend triton_grpc
  mode http
  balance leastconn
  option httpchk GET /v2/health/ready
  http-check expect status 200
{servers(GRPC, " proto h2")}
"""


def router_command(replicas: Sequence[Replica], bind_host: str, port: int, metrics_port: int, policy: str,
                   router_bin: Path = ROUTER_BIN, block_size: int = 16, model: str = "llm") -> list[str]:
    """vllm-router in front of the replicas' OpenAI frontends, with health checks tuned for failover.
    Its own Prometheus port is explicit: the default (29000) would clash between two clusters."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r}: expected one of {ROUTER_POLICIES}")
    cmd = [str(router_bin), "--host", bind_host, "--port", str(port), "--policy", policy,
           "--prometheus-host", bind_host, "--prometheus-port", str(metrics_port),
           "--worker-urls", *(r.openai_url for r in replicas),
           "--health-check-endpoint", "/health",
           "--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-check-timeout-secs", "1",
           "--health-failure-threshold", "2", "--health-success-threshold", "1",
           "--worker-startup-timeout-secs", "600", "--log-level", "warning"]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.openai_url}={r.kv_events_endpoint}",
                    "--kv-event-replay-source", f"{r.openai_url}={r.kv_replay_endpoint}"]
    return cmd


def _wait(predicate, timeout_s: float, what: str, procs: Sequence[subprocess.Popen | None] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for proc in procs:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what}: {proc.args[0]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen | None, timeout_s: float) -> None:
    if proc is not None:
        launch.stop(proc, timeout_s)


class Cluster:
    """Replicas plus both routers. ``start()`` returns once every part answers; ``stop()``
    (or leaving its ``with`` block) stops them all, replicas last, and is safe to repeat.

    Logs go to ``log_dir`` (``<part>.log``)."""

    def __init__(self, replicas: Sequence[Replica], model_repository: Path, *, http_port: int, grpc_port: int,
                 openai_port: int, router_metrics_port: int | None = None, router_host: str = "127.0.0.1",
                 router_policy: str = "round_robin", router_netns: str | None = None, router_bin: Path = ROUTER_BIN, log_dir: Path | None = None,
                 engine_parameters: dict[str, str] | None = None, ready_timeout_s: float = 600.0):
        self.replicas = list(replicas)
        self.model_repository = Path(model_repository)
        self.http_port, self.grpc_port, self.openai_port = http_port, grpc_port, openai_port
        self.router_metrics_port = router_metrics_port or openai_port + 1
        self.router_host, self.router_policy, self.router_netns = router_host, router_policy, router_netns
        self.router_bin = Path(router_bin)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="inflight-cluster-"))
        self.engine_parameters = dict(engine_parameters or {})
        self.ready_timeout_s = ready_timeout_s
        self.haproxy: subprocess.Popen | None = None
        self.router: subprocess.Popen | None = None

    # -- addresses ------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.router_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.router_host}:{self.grpc_port}"

    @property
    def openai_url(self) -> str:
        return f"http://{self.router_host}:{self.openai_port}"

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not self.router_bin.exists():
            raise FileNotFoundError(f"{self.router_bin} is missing: run `make router`")
        if shutil.which("haproxy") is None:
            raise FileNotFoundError("haproxy is not installed: run `make haproxy`")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for replica in self.replicas:
                self.start_triton(replica)
            for replica in self.replicas:
                self.wait_triton(replica)
                self.start_frontend(replica)
            self._start_routers()
        except BaseException:
            self.stop()
            raise

    def repository(self, replica: Replica) -> Path:
        return self.log_dir / f"{replica.name}-repository"

    def start_triton(self, replica: Replica) -> None:
        """Launch (or relaunch) the replica's tritonserver; returns at once."""
        repo = self.repository(replica)
        if not repo.exists():
            parameters = dict(self.engine_parameters)
            if replica.kv_events:
                parameters["kv_events_endpoint"] = replica.kv_events_endpoint
                parameters["kv_events_replay_endpoint"] = replica.kv_replay_endpoint
            launch.repository_with_parameters(self.model_repository, repo, parameters)
        with open(self.log_dir / f"{replica.name}-triton.log", "ab") as log:
            replica.triton = launch.launch_tritonserver(repo, replica.host, replica.port(HTTP), replica.port(GRPC),
                                                        replica.port(METRICS), stdout=log, stderr=subprocess.STDOUT,
                                                        netns=replica.netns)

    def wait_triton(self, replica: Replica) -> None:
        """Wait until the replica is ready and its metrics endpoint answers."""
        try:
            launch.wait_tritonserver(replica.port(HTTP), self.ready_timeout_s, replica.host, replica.triton,
                                     replica.port(METRICS))
        except (RuntimeError, TimeoutError) as exc:
            log = self.log_dir / f"{replica.name}-triton.log"
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.exists() else []
            raise type(exc)("\n".join([f"{replica.name}: {exc}; the end of {log}:", *tail])) from None

    def start_frontend(self, replica: Replica) -> None:
        if replica.frontend is not None and replica.frontend.poll() is None:
            return
        with open(self.log_dir / f"{replica.name}-openai.log", "ab") as log:
            replica.frontend = launch.launch_frontend(replica.grpc_url, replica.host, replica.port(OPENAI),
                                                      model_repository=self.repository(replica), stdout=log,
                                                      stderr=subprocess.STDOUT, netns=replica.netns)
        try:
            launch.wait_frontend(replica.port(OPENAI), 120, replica.host, replica.frontend)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{replica.name}: {exc}") from None

    def _start_routers(self) -> None:
        config = self.log_dir / "haproxy.cfg"
        config.write_text(haproxy_config(self.replicas, self.router_host, self.http_port, self.grpc_port))
        wrap = (lambda cmd: ["ip", "netns", "exec", self.router_netns, *cmd]) if self.router_netns else list
        with open(self.log_dir / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen(wrap(["haproxy", "-db", "-f", str(config)]), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        block_size = int(self.engine_parameters.get("block_size", "16"))
        cmd = router_command(self.replicas, self.router_host, self.openai_port, self.router_metrics_port,
                             self.router_policy, self.router_bin, block_size)
        with open(self.log_dir / "vllm-router.log", "ab") as log:
            self.router = subprocess.Popen(wrap(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: launch.tritonserver_ready(self.http_port, self.router_host), 30, "haproxy not serving",
              [self.haproxy])
        _wait(lambda: launch.http_status(self.router_host, self.openai_port, "/v1/models") == 200, 60,
              "vllm-router not serving", [self.router])

    def kill_triton(self, replica: Replica) -> None:
        """SIGKILL the replica's tritonserver alone, as a crash would; its Python backend stubs
        stay behind until ``restart_triton`` or ``stop`` kills its process group."""
        replica.triton.kill()
        replica.triton.wait()

    def restart_triton(self, replica: Replica) -> None:
        """Relaunch a dead replica's tritonserver and wait until it is ready; its frontend,
        which reconnects by itself, is left running."""
        _stop(replica.triton, 0)
        self.start_triton(replica)
        self.wait_triton(replica)
        self.start_frontend(replica)

    def stop(self) -> None:
        for proc in (self.router, self.haproxy):
            _stop(proc, 10)
        # Each tier's processes together: a tritonserver waits up to its exit timeout for a
        # connection whose peer vanished unannounced (a partition's), and those waits overlap.
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda r: _stop(r.frontend, 15), self.replicas))
            list(pool.map(lambda r: _stop(r.triton, launch.EXIT_TIMEOUT_SECS + 15), self.replicas))


def local_replicas(n: int, base_port: int, host: str = "127.0.0.1", kv_events: bool = False) -> list[Replica]:
    return [Replica(i, host, base_port + 10 * i, kv_events=kv_events) for i in range(n)]
