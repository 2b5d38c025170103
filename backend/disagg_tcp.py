"""KV transfers across hosts over TCP (ZeroMQ): backend/disagg.py's transfer, moved by the network.

The bytes are a shared-memory transfer's, header and block layout alike (`encode_header`,
`write_transfer`, `Transfer`); only where they live and how they move differ:

- A role-prefill engine with `kv_transfer: tcp` gathers each export into a buffer of its own
  and holds it in a `TransferServer`, a ROUTER socket bound on `kv_transfer_address` and
  `kv_transfer_port`. The handle says where to pull from:
  ``tcp://<kv_transfer_address>:<port>/inflight-kv-<24 hex>``.
- A role-decode engine pulls it (`TransferPuller`, threads of its own, off the engine's step
  loop): it asks for the name, and the server answers with the whole transfer as one frame,
  sent from the export buffer without a copy and received into one zmq frame, which the
  decode engine's pool reads straight from (`Transfer.of_buffer`).
- The server frees a transfer once it has sent it, one its request's orchestrator drops
  (`drop_transfer`: the request was cancelled or failed before its decode model pulled it),
  and one nobody pulls within `kv_transfer_timeout_s` (logged and counted: `num_expired`).
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import zmq

from backend.disagg import SHM_PREFIX, KVLayout, Transfer, encode_header, transfer_size, write_transfer
from backend.request import Request, RequestError

log = logging.getLogger(__name__)

TCP_SCHEME = "tcp://"
# The transfer names are the shared-memory ones: a handle is where, then which.
TCP_HANDLE = re.compile(r"tcp://(?P<endpoint>[^/\s]{1,300})/(?P<name>" + re.escape(SHM_PREFIX) + r"[0-9a-f]{24})")
OK, MISSING = b"ok", b"missing"
# A request's first frame: a pull is the name alone, a drop is DROP then the name.
DROP = b"drop"
# How often the server looks for transfers nobody pulled (and for its own shutdown).
SWEEP_INTERVAL_S = 0.5
PULL_THREADS = 4


def is_tcp_handle(handle: object) -> bool:
    return isinstance(handle, str) and handle.startswith(TCP_SCHEME)


class TransferServer:
    """The prefill side: exported transfers, served by name to whoever pulls them, each once."""

    def __init__(self, address: str, port: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._socket.bind(f"tcp://{address}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{address}")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise ValueError(f"invalid engine parameter: kv_transfer_address={address!r} kv_transfer_port={port}: "
                             f"cannot listen there: {exc}") from None
        self.endpoint = f"{address}:{port}"
        # name -> (the transfer's bytes, when it expires unpulled)
        self._held: dict[str, tuple[np.ndarray, float]] = {}
        self._lock = threading.Lock()
        self.num_expired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True)
        self._thread.start()

    @property
    def num_held(self) -> int:
        """Transfers exported and not yet pulled (nor expired)."""
        with self._lock:
            return len(self._held)

    def export(self, request: Request, num_blocks: int, kv_blocks: list[tuple[torch.Tensor, torch.Tensor]],
               layout: KVLayout, header: dict[str, Any]) -> str:
        """`request`'s first `num_blocks` KV blocks and `header` into a transfer held here; its handle."""
        body = encode_header(layout, num_blocks, header)
        buffer = np.empty(transfer_size(body, num_blocks, layout), dtype=np.uint8)
        write_transfer(buffer, body, request.block_ids[:num_blocks], kv_blocks, layout)
        name = SHM_PREFIX + secrets.token_hex(12)
        with self._lock:
            self._held[name] = (buffer, time.monotonic() + self.timeout_s)
        return f"{TCP_SCHEME}{self.endpoint}/{name}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()
        with self._lock:
            if self._held:
                log.warning("KV transfer server closed with %d transfer(s) never pulled", len(self._held))
            self._held.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(int(SWEEP_INTERVAL_S * 1000)):
                self._answer(self._socket.recv_multipart())
            self._sweep()

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == DROP:  # [identity, DROP, name]: free it unsent
            identity, _, name = frames
            with self._lock:
                held = self._held.pop(name.decode(errors="replace"), None)
            self._socket.send_multipart([identity, MISSING if held is None else OK])
            return
        if len(frames) != 2:  # not a puller's [identity, name]: nothing to answer
            return
        identity, name = frames
        with self._lock:
            held = self._held.pop(name.decode(errors="replace"), None)
        if held is None:
            self._socket.send_multipart([identity, MISSING])
        else:
            # copy=False: zmq sends from the export buffer and drops it once sent.
            self._socket.send_multipart([identity, OK, held[0]], copy=False)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [name for name, (_, deadline) in self._held.items() if deadline <= now]
            for name in expired:
                del self._held[name]
        if expired:
            self.num_expired += len(expired)
            log.warning("freed %d KV transfer(s) nobody pulled within kv_transfer_timeout_s=%gs",
                        len(expired), self.timeout_s)


def pull_transfer(handle: str, timeout_s: float) -> Transfer:
    """The transfer `handle` names, from the prefill instance that holds it (blocking: a
    puller's thread, or a test). RequestError: INVALID_ARG for a handle that is not one or
    names no transfer there; UNAVAILABLE when the prefill instance does not answer in time."""
    match = TCP_HANDLE.fullmatch(handle) if isinstance(handle, str) else None
    if match is None:
        raise RequestError.invalid("transfer", f"not a KV transfer handle: {str(handle)[:80]!r}")
    endpoint = match["endpoint"]
    started = time.perf_counter()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        try:
            socket.connect(f"tcp://{endpoint}")
        except zmq.ZMQError as exc:
            raise RequestError.invalid("transfer", f"cannot reach KV transfer {handle[:80]!r}: {exc}") from None
        socket.send(match["name"].encode())
        if not socket.poll(int(timeout_s * 1000)):
            raise RequestError(RequestError.UNAVAILABLE,
                               f"transfer: the prefill instance at {endpoint} did not send {match['name']} within "
                               f"kv_transfer_timeout_s={timeout_s:g}s", "transfer")
        frames = socket.recv_multipart(copy=False)
    finally:
        socket.close(linger=0)
    if frames[0].bytes != OK or len(frames) != 2:
        raise RequestError(RequestError.INVALID_ARG,
                           f"transfer: no KV transfer named {handle!r} (never exported, already imported "
                           "or expired)", "transfer")
    transfer = Transfer.of_buffer(frames[1].buffer, handle)
    transfer.pull_s = time.perf_counter() - started
    return transfer


def drop_transfer(handle: str, timeout_s: float = 5.0) -> bool:
    """Have the prefill instance holding the TCP transfer `handle` free it unsent, now rather
    than after kv_transfer_timeout_s: its request will not be imported (cancelled, or failed
    on the way). True when it was held there; False when it was not (already pulled, dropped
    or expired) or its instance did not answer within `timeout_s` (then it expires there)."""
    match = TCP_HANDLE.fullmatch(handle) if isinstance(handle, str) else None
    if match is None:
        return False
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{match['endpoint']}")
        socket.send_multipart([DROP, match["name"].encode()])
        return bool(socket.poll(int(timeout_s * 1000))) and socket.recv() == OK
    except zmq.ZMQError:
        return False
    finally:
        socket.close(linger=0)


class TransferPuller:
    """The decode side: pulls run on threads of their own, so the engine's steps go on while
    a transfer crosses; `on_done` gets the transfer, or the RequestError that ended its pull."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-transfer-pull")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def pull(self, handle: str, on_done: Callable[[Transfer | RequestError], None]) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._in_flight += 1
                self._executor.submit(self._pull, handle, on_done)
        if closed:
            on_done(RequestError(RequestError.UNAVAILABLE, "the model is shutting down"))

    def _pull(self, handle: str, on_done: Callable[[Transfer | RequestError], None]) -> None:
        try:
            result: Transfer | RequestError = pull_transfer(handle, self.timeout_s)
        except RequestError as exc:
            result = exc
        except Exception as exc:  # a network failure ends this request, not the puller
            result = RequestError(RequestError.UNAVAILABLE, f"transfer: pulling {handle[:80]!r} failed: {exc}",
                                  "transfer")
        finally:
            with self._lock:
                self._in_flight -= 1
        on_done(result)

    def close(self) -> None:
        """No more pulls: a new one ends at once with UNAVAILABLE, those not started are
        dropped, and nothing waits for those under way (each ends within kv_transfer_timeout_s)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
