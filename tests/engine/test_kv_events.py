"""KV-cache events (backend/kv_events.py): what a router subscribing to the engine's ZMQ
socket learns must be exactly the engine's prefix cache.

The subscriber decodes with its own msgspec structs, written field for field after vLLM
0.32's ``vllm/distributed/kv_events.py`` (strict: a missing or mistyped field fails the
decode), rebuilds the set of cached blocks from the events alone, and compares it with the
KV manager's after a run with prefix hits, evictions, preemptions and a cache reset. Where
``make peers`` has installed vLLM, vLLM's own classes decode the same bytes too.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.kv_events import external_hash
from backend.paths import REPO_ROOT
from backend.request import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- vLLM 0.32's schema, as a subscriber writes it -----------------------------------------
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


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
BLOCK = 8


class Subscriber:
    """A router's side: SUB for the live stream, DEALER for replay."""

    def __init__(self, endpoint: str, replay_endpoint: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.messages: list[tuple[int, bytes]] = []

    def drain(self, settle_s: float = 0.5) -> None:
        """Receive until nothing has come for ``settle_s``."""
        while self.sub.poll(int(settle_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.messages.append((int.from_bytes(seq, "big"), payload))

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered message from ``start`` on, through the ROUTER replay socket."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            empty, _topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            out.append((int.from_bytes(seq, "big"), payload))
        dealer.close(linger=0)
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def rebuild(payloads: list[bytes]) -> dict[int, tuple[Optional[int], tuple[int, ...]]]:
    """hash -> (parent hash, token ids) of every block the events say is cached."""
    cached: dict[int, tuple[Optional[int], tuple[int, ...]]] = {}
    last_ts = 0.0
    for payload in payloads:
        batch = DECODER.decode(payload)
        assert batch.events and batch.ts >= last_ts
        last_ts = batch.ts
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.medium == "GPU" and event.block_size == len(event.token_ids) == BLOCK
                assert event.parent_block_hash is None or event.parent_block_hash in cached, \
                    "a block is stored before its parent"
                (block_hash,) = event.block_hashes
                assert block_hash not in cached, "stored twice without a removal"
                cached[block_hash] = (event.parent_block_hash, tuple(event.token_ids))
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert cached.pop(block_hash, None) is not None, "removed a block never stored"
            else:
                cached.clear()
    return cached


def engine_cache(engine: LLMEngine) -> dict[int, tuple[int, ...]]:
    pool = engine.kv.pool
    return {external_hash(h): pool.blocks[b].token_ids for h, b in pool.cached.items()}


def run(engine: LLMEngine, prompts: list[list[int]], tag: str, max_tokens: int = 24) -> None:
    """All at once, so that 4 seats of growing requests outgrow the pool."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 5000


def test_the_events_rebuild_the_engines_prefix_cache(tiny_checkpoint, tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    subscriber = Subscriber(endpoint, replay)
    # 16 blocks of 8 tokens for 4 seats: prompts sharing a system prompt hit the cache, and
    # the pool is small enough that requests evict cached blocks and preempt each other.
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", block_size=BLOCK,
                                    num_kv_blocks=16, max_num_seqs=4, long_prefill_token_threshold=12,
                                    kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay))
    try:
        time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the PUB socket
        rng = random.Random(7)
        system = [rng.randrange(3, 1000) for _ in range(20)]
        prompts = [system + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))] for _ in range(10)]
        prompts += [[rng.randrange(3, 1000) for _ in range(rng.randrange(9, 40))] for _ in range(8)]
        run(engine, prompts, "first")
        totals = engine.stats.totals
        assert totals.preemptions > 0 and engine.kv.pool.num_evictions > 0, "the run must preempt and evict"
        assert totals.prefix_hit_tokens > 0, "the run must hit the prefix cache"
        subscriber.drain()
        seqs = [seq for seq, _ in subscriber.messages]
        assert seqs == list(range(len(seqs))), "sequence numbers start at 0 and have no gaps"
        rebuilt = rebuild([p for _, p in subscriber.messages])
        assert {h: tokens for h, (_, tokens) in rebuilt.items()} == engine_cache(engine) != {}

        # A reset is one AllBlocksCleared; what is cached afterwards is stored anew.
        engine.reset_prefix_cache()
        run(engine, prompts[:3], "after-reset")
        subscriber.drain()
        payloads = [p for _, p in subscriber.messages]
        assert any(isinstance(e, AllBlocksCleared) for p in payloads for e in DECODER.decode(p).events)
        assert {h: tokens for h, (_, tokens) in rebuild(payloads).items()} == engine_cache(engine) != {}

        # The replay socket serves the same bytes from any sequence number on.
        assert subscriber.replay(0) == subscriber.messages
        assert subscriber.replay(5) == subscriber.messages[5:]
        vllm_decodes(payloads, tmp_path)
    finally:
        engine.close()
        subscriber.close()


def test_kv_events_are_off_by_default(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=16))
    assert engine.kv_event_publisher is None and engine.kv.pool.events is None


def test_a_replay_endpoint_needs_an_event_endpoint():
    with pytest.raises(ValueError, match="kv_events_replay_endpoint"):
        EngineConfig(model_path="x", kv_events_replay_endpoint="ipc:///tmp/x")


PEERS_PYTHON = REPO_ROOT / ".venv-peers" / "bin" / "python"
VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
for line in open(sys.argv[1]):
    for event in decoder.decode(bytes.fromhex(line.strip())).events:
        assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
        counts[type(event).__name__] += 1
print(json.dumps(counts))
"""


def vllm_decodes(payloads: list[bytes], tmp_path) -> None:
    """vLLM's own classes decode every batch into the same events, where vLLM is installed."""
    if not PEERS_PYTHON.exists():
        return
    path = tmp_path / "payloads.hex"
    path.write_text("\n".join(p.hex() for p in payloads))
    out = subprocess.run([str(PEERS_PYTHON), "-c", VLLM_DECODE, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    for payload in payloads:
        for event in DECODER.decode(payload).events:
            want[type(event).__name__] += 1
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want
