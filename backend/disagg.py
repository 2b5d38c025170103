"""Disaggregated prefill and decode: a request handed over between two engines.

A `role: prefill` engine runs a request's prompt and samples its first token, then exports
the request (`export_request`) and frees its blocks; a `role: decode` engine imports it
(`LLMEngine.import_request`, through `open_transfer`) into its running batch and generates
the rest. This module owns what crosses between them and its wire format, a transfer:

    [8 bytes: header length, little-endian] [header: msgpack] [pad to 64] [KV blocks]

The header holds the request (prompt token ids, the first token, its logprob and top
logprobs, the cumulative logprob, the sampling parameters, the seeded generator's state)
and the layout of the blocks. The blocks are the prompt's KV as the pool stores them
(`kernels.kv_store.kv_storage`: whatever the KV dtype, int8 rows with their scales
included), as raw bytes: per layer, its K blocks then its V blocks, in the prompt's order. The decode side refuses a transfer whose layout is not its own.

On one host (`kv_transfer: shm`, the default) a transfer lives in a POSIX shared-memory
segment (/dev/shm) named by its handle: the prefill side gathers its blocks into a numpy view
of the segment, the decode side copies them from such a view straight into its pool. Opening a
transfer claims it: the decode side unlinks the name at once and keeps its mapping (the memory
lives as long as the mapping, also while the request waits for room, and goes with the process
if it dies); `discard_transfer` removes a handle that is never imported (either kind). The name carries the
time past which an unclaimed transfer is dead (its request failed on the way, or its exporter
died): `sweep_expired_transfers` removes those, whoever left them. Across hosts (`kv_transfer:
tcp`) the same bytes are written into a buffer the prefill engine serves and the decode engine
pulls (backend/disagg_tcp.py); `write_transfer` and `Transfer` are the one writer and reader of
the format for both.
"""

from __future__ import annotations

import _posixshmem
import base64
import os
import secrets
import struct
import time
import warnings
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgspec
import numpy as np
import torch

from backend.request import Request, RequestError

# Every transfer's segment name starts so (and the handle is the name): a stale one is findable.
SHM_PREFIX = "inflight-kv-"
SHM_DIR = "/dev/shm"
# How long an exported transfer waits to be claimed, unless the exporter says otherwise.
DEFAULT_LIFETIME_S = 60.0
HEADER_LENGTH = struct.Struct("<Q")
ALIGNMENT = 64
WIRE_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    """What a transfer's block bytes mean: they are only written into a pool of the same layout."""

    num_layers: int
    block_size: int
    # One block row of one layer's K (or V) pool: its shape and dtype as the pool stores them.
    row_shape: tuple[int, ...]
    dtype: str

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape)) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_bytes(self) -> int:
        """One block of every layer's K and V."""
        return 2 * self.num_layers * self.row_bytes

    @classmethod
    def of(cls, kv_blocks: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> KVLayout:
        k = kv_blocks[0][0]
        return cls(len(kv_blocks), block_size, tuple(k.shape[1:]), str(k.dtype).removeprefix("torch."))

    def to_wire(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "block_size": self.block_size, "row_shape": list(self.row_shape),
                "dtype": self.dtype}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> KVLayout:
        return cls(wire["num_layers"], wire["block_size"], tuple(wire["row_shape"]), wire["dtype"])


def _numpy_dtype(torch_dtype: str) -> np.dtype:
    # bfloat16 has no numpy type: its bytes travel as int16.
    return np.dtype(np.int16) if torch_dtype == "bfloat16" else torch.empty((), dtype=getattr(torch, torch_dtype)).numpy().dtype


def _as_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def request_header(request: Request, first_logprob: float | None,
                   first_top_logprobs: list[tuple[int, float]] | None) -> dict[str, Any]:
    """What the decode side needs to continue `request` after its first token."""
    generator_state = None
    if request.generator is not None:
        generator_state = base64.b64encode(request.generator.get_state().numpy().tobytes()).decode()
    return {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "output_token_ids": list(request.output_token_ids),
        "params": request.params.model_dump(mode="json", by_alias=True, exclude_none=True),
        "needs_logprobs": request.needs_logprobs,
        "cumulative_logprob": request.cumulative_logprob,
        "first_logprob": first_logprob,
        "first_top_logprobs": [list(t) for t in first_top_logprobs] if first_top_logprobs is not None else None,
        "generator_state": generator_state,
        "num_cached_prompt_tokens": request.num_cached_prompt_tokens,
    }


def restore_generator(state: str | None) -> torch.Generator | None:
    if state is None:
        return None
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
    return generator


def _segment(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    """A segment that this process's resource tracker does not follow: a transfer outlives
    the prefill process's hold on it and is unlinked by its importer, so the tracker's
    unlink at exit (and its "leaked shared_memory" warning) would be wrong on both sides.
    (Python 3.13's `track=False`.)"""
    segment = shared_memory.SharedMemory(name=name, create=create, size=size)
    resource_tracker.unregister(segment._name, "shared_memory")
    return segment


def _unlink(segment: shared_memory.SharedMemory) -> None:
    """`segment.unlink()` without its resource-tracker unregister (`_segment` did that)."""
    _posixshmem.shm_unlink(segment._name)


def _blocks_offset(header_bytes: int) -> int:
    return -(-(HEADER_LENGTH.size + header_bytes) // ALIGNMENT) * ALIGNMENT


def encode_header(layout: KVLayout, num_blocks: int, header: dict[str, Any]) -> bytes:
    """A transfer's msgpack header: the wire version, the blocks' layout and count, the request."""
    return msgspec.msgpack.encode({"version": WIRE_VERSION, "layout": layout.to_wire(),
                                   "num_blocks": num_blocks, "request": header})


def transfer_size(body: bytes, num_blocks: int, layout: KVLayout) -> int:
    return _blocks_offset(len(body)) + num_blocks * layout.block_bytes


def write_transfer(buffer, body: bytes, block_ids: list[int], kv_blocks: list[tuple[torch.Tensor, torch.Tensor]],
                   layout: KVLayout) -> None:
    """A transfer (header `body`, then the pool's blocks `block_ids`) into `buffer`, a writable
    buffer of `transfer_size` bytes: a shared-memory segment here, a TCP send buffer in
    backend/disagg_tcp.py. The blocks are gathered in one copy per layer and K/V."""
    view = memoryview(buffer).cast("B")
    HEADER_LENGTH.pack_into(view, 0, len(body))
    view[HEADER_LENGTH.size:HEADER_LENGTH.size + len(body)] = body
    _gather(block_ids, kv_blocks, _blocks_view(view, _blocks_offset(len(body)), len(block_ids), layout), layout)


def export_request(request: Request, num_blocks: int, kv_blocks: list[tuple[torch.Tensor, torch.Tensor]],
                   layout: KVLayout, header: dict[str, Any], lifetime_s: float = DEFAULT_LIFETIME_S) -> str:
    """Write `request`'s first `num_blocks` KV blocks and `header` into a new shared-memory
    transfer, which expires unclaimed after `lifetime_s`; its handle."""
    body = encode_header(layout, num_blocks, header)
    name = _transfer_name(time.time() + lifetime_s)
    segment = _segment(name, create=True, size=transfer_size(body, num_blocks, layout))
    try:
        write_transfer(segment.buf, body, request.block_ids[:num_blocks], kv_blocks, layout)
    except BaseException:
        segment.close()
        _unlink(segment)
        raise
    segment.close()
    return name


def _transfer_name(expires_at: float) -> str:
    # The expiry in the name (wall-clock milliseconds, hex): any process on the host can tell
    # a dead transfer from a live one without asking its exporter, which may be gone.
    return f"{SHM_PREFIX}{int(expires_at * 1000):x}-{secrets.token_hex(12)}"


def _expires_at(name: str) -> float | None:
    stamp, dash, _ = name.removeprefix(SHM_PREFIX).partition("-")
    try:
        return int(stamp, 16) / 1000 if dash else None
    except ValueError:
        return None


def sweep_expired_transfers(now: float | None = None) -> list[str]:
    """Remove every transfer on this host that has outlived its lifetime unclaimed (never
    imported, or left by a process that died); the handles removed. A claimed transfer has
    no name left to remove, and a name without an expiry is not one of ours to judge."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        expires_at = _expires_at(name) if name.startswith(SHM_PREFIX) else None
        if expires_at is None or expires_at > now:
            continue
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:  # claimed or removed meanwhile
            continue
        removed.append(name)
    return removed


def _blocks_view(buffer, offset: int, num_blocks: int, layout: KVLayout) -> np.ndarray:
    """[num_layers, 2 (K, V), num_blocks, *row_shape] over a transfer's bytes (no copy):
    each layer's K (and V) blocks are contiguous, one gather or scatter each."""
    shape = (layout.num_layers, 2, num_blocks, *layout.row_shape)
    return np.ndarray(shape, dtype=_numpy_dtype(layout.dtype), buffer=buffer, offset=offset)


def _gather(block_ids: list[int], kv_blocks: list[tuple[torch.Tensor, torch.Tensor]], blocks: np.ndarray,
            layout: KVLayout) -> None:
    """The pool's blocks `block_ids` into `blocks` (a segment's view)."""
    ids = torch.tensor(block_ids, dtype=torch.long)
    for layer, (k, v) in enumerate(kv_blocks):
        for kind, pool in enumerate((k, v)):
            destination = _as_torch(blocks[layer, kind], layout.dtype)
            if pool.device.type == "cpu":
                torch.index_select(pool, 0, ids, out=destination)
            else:
                destination.copy_(pool[ids.to(pool.device)])


class Transfer:
    """An exported request opened, and so claimed, on the decode side: its header, and its
    blocks as a view of the transfer's bytes (a shared-memory segment, whose name is unlinked on
    opening, so that a transfer is imported at most once and a claimed one is never swept; or a
    buffer received over TCP: `Transfer.of_buffer`). `close` lets go of its memory."""

    def __init__(self, handle: str):
        if not isinstance(handle, str) or not handle.startswith(SHM_PREFIX):
            raise RequestError.invalid("transfer", f"not a KV transfer handle: {str(handle)[:80]!r}")
        try:
            self._segment = _segment(handle)
        except FileNotFoundError:
            raise RequestError(RequestError.INVALID_ARG,
                               f"transfer: no KV transfer named {handle!r} (never exported, already imported, "
                               "discarded or expired)", "transfer") from None
        except (OSError, ValueError) as exc:  # a name the system refuses
            raise RequestError.invalid("transfer", f"cannot open KV transfer {handle[:80]!r}: {exc}") from None
        try:
            _unlink(self._segment)
        except FileNotFoundError:  # swept between our open and now: the mapping holds it all the same
            pass
        self._parse(self._segment.buf, handle)

    @classmethod
    def of_buffer(cls, buffer, handle: str) -> Transfer:
        """The transfer whose bytes are `buffer` (read-only is fine: it is only read)."""
        transfer = cls.__new__(cls)
        transfer._segment = None
        transfer._parse(buffer, handle)
        return transfer

    def _parse(self, buffer, handle: str) -> None:
        self._buffer = memoryview(buffer).cast("B")
        # Seconds it took to move here before its import (a TCP pull), for the transfer time.
        self.pull_s = 0.0
        try:
            (length,) = HEADER_LENGTH.unpack_from(self._buffer, 0)
            body = msgspec.msgpack.decode(self._buffer[HEADER_LENGTH.size:HEADER_LENGTH.size + length])
            if body.get("version") != WIRE_VERSION:
                raise ValueError(f"wire version {body.get('version')!r}, expected {WIRE_VERSION}")
            self.layout = KVLayout.from_wire(body["layout"])
            self.num_blocks = int(body["num_blocks"])
            self.header: dict[str, Any] = body["request"]
            self._offset = _blocks_offset(length)
            if len(self._buffer) < self._offset + self.num_blocks * self.layout.block_bytes:
                raise ValueError(f"{len(self._buffer)} bytes, short of its {self.num_blocks} blocks")
        except Exception as exc:
            self.close()
            raise RequestError(RequestError.INVALID_ARG, f"transfer: {handle!r} is not a readable KV transfer: {exc}",
                               "transfer") from None

    @property
    def nbytes(self) -> int:
        return len(self._buffer)

    def write_blocks(self, block_ids: list[int], kv_blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The transfer's blocks into the pool's blocks `block_ids` (one per transferred block)."""
        assert len(block_ids) == self.num_blocks
        blocks = _blocks_view(self._buffer, self._offset, self.num_blocks, self.layout)
        ids = torch.tensor(block_ids, dtype=torch.long)
        with warnings.catch_warnings():
            # A buffer received over TCP is read-only; its tensors are only read from.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for layer, (k, v) in enumerate(kv_blocks):
                for kind, pool in enumerate((k, v)):
                    source = _as_torch(blocks[layer, kind], self.layout.dtype)
                    pool.index_copy_(0, ids.to(pool.device), source.to(pool.device))

    def close(self) -> None:
        self._buffer = None
        segment, self._segment = getattr(self, "_segment", None), None
        if segment is not None:
            segment.close()


def discard_transfer(handle: str) -> bool:
    """Let go of a transfer that will not be imported (its request failed or was cancelled
    in between): unlink its segment, or have the prefill instance that holds a TCP transfer
    free it (backend/disagg_tcp.py `drop_transfer`); False when there was none."""
    from backend.disagg_tcp import drop_transfer, is_tcp_handle  # it imports this module

    if is_tcp_handle(handle):
        return drop_transfer(handle)
    if not handle.startswith(SHM_PREFIX):
        return False
    try:
        segment = _segment(handle)
    except (FileNotFoundError, ValueError):
        return False
    segment.close()
    _unlink(segment)
    return True
