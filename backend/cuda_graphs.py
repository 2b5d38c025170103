"""CUDA graphs of the decode-only step (`enforce_eager` false, on CUDA).

A decode step of a small model on a GPU is bound by the host, not the device: each layer is a
dozen kernel launches, and each costs tens of microseconds in Python, torch and Triton's
launcher, while the device reads a layer's weights in a few. On an H200, G3's Llama-3.2-1B
shape spent 10-11 ms an iteration in a forward pass whose bytes take under 1 ms to read.

So at load the whole decode forward pass, output head included, is recorded once for each
batch size in `capture_sizes`, over static device buffers. A decode-only step of n requests then
takes the smallest recorded size B >= n: its metadata is written into pinned host staging,
moved by two host-to-device copies and one device copy of the block table, and the graph of
B is replayed. Rows n..B are padding the kernels skip or ignore: no KV slot (-1), one key of
context, no sample. Steps with a chunk of prompt, drafts to verify, LoRA adapters or more
requests than the largest size run eagerly, as before.

The kernels and their shapes are those of the eager path for B requests, so a padded row
changes nothing a real row computes except through the GEMMs' choice of algorithm for B rows
instead of n; greedy tokens stay those of transformers (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from backend.models.llama import AttentionMetadata

# Decode batch sizes recorded below max_num_seqs, as vLLM's defaults: 1, 2, 4, then every
# multiple of 8. A step pads to the next one (at most 7 rows of 8 more), and a decode step of
# a GPU-sized model reads its weights once whatever its rows, so padding costs little.
SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes recorded for an engine of `max_num_seqs`: the largest is max_num_seqs."""
    sizes = {b for b in SMALL_SIZES if b < max_num_seqs}
    sizes.update(range(SIZE_STEP, max_num_seqs, SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


# The forward pass and output head of a decode step over the given tensors: logits [B, vocab].
DecodeBody = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """The recorded decode steps of one model runner and the static buffers they read.

    `capture` false: nothing is recorded, and `replay` runs the same forward pass eagerly over
    the same static buffers (a CPU has no graphs; the tests check the padding that way).
    """

    def __init__(self, body: DecodeBody, device: torch.device, sizes: list[int], max_model_len: int,
                 block_size: int, batch_invariant: bool, capture: bool = True):
        self.body = body
        self.device = device
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.batch_invariant = batch_invariant
        self.capture = capture
        pin = device.type == "cuda"
        b, w = self.max_batch, self.max_blocks
        # Int64 per token: input ids [0, B), positions [B, 2B), KV slots [2B, 3B) for a step of
        # graph B. Int32: context lengths [0, B), then the step's block table [B, w) packed.
        self.host64 = torch.empty(3 * b, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.empty(b + b * w, dtype=torch.int32, pin_memory=pin)
        self.host64_np, self.host32_np = self.host64.numpy(), self.host32.numpy()
        self.dev64 = torch.empty(3 * b, dtype=torch.int64, device=device)
        self.dev32 = torch.empty(b + b * w, dtype=torch.int32, device=device)
        # The block table the kernels read, its row stride fixed for every graph.
        self.block_tables = torch.zeros((b, w), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=device)
        # Set after the copies of a step, waited on before the staging is written again.
        self.staged = torch.cuda.Event() if device.type == "cuda" else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps replayed (or, without capture, run over the static buffers)

    def size_for(self, n: int, width: int) -> int | None:
        """The recorded size a decode step of `n` requests whose block table is `width` wide
        replays, or None when it must run eagerly."""
        if n > self.max_batch or width > self.max_blocks:
            return None
        return next(b for b in self.sizes if b >= n)

    def views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(
            slot_mapping=self.dev64[2 * batch : 3 * batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.dev32[:batch],
            cu_seqlens_q=self.cu_seqlens_q[: batch + 1],
            max_seqlen_q=1,
            # Read by the CPU's path choice alone; the Triton kernel's grid is shape-only.
            max_seqlen_k=self.max_model_len,
            batch_invariant=self.batch_invariant,
        )
        return self.dev64[:batch], self.dev64[batch : 2 * batch], meta

    def stage(self, batch: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
              seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """Copy one decode step of n = len(input_ids) requests into graph `batch`'s buffers,
        padded to `batch` rows. Asynchronous: the copies are ordered before the replay on the stream."""
        n = len(input_ids)
        width = block_tables.shape[1]
        if self.staged is not None:
            self.staged.synchronize()  # the last step's copies out of the staging are done
        h64, h32 = self.host64_np, self.host32_np
        for field, (values, pad) in enumerate(((input_ids, 0), (positions, 0), (slot_mapping, -1))):
            h64[field * batch : field * batch + n] = values
            h64[field * batch + n : (field + 1) * batch] = pad
        h32[:n] = seq_lens
        h32[n:batch] = 1  # padding rows attend to one key: the first slot of block 0
        table = h32[batch : batch + batch * width].reshape(batch, width)
        table[:n] = block_tables
        table[n:] = 0
        used32 = batch + batch * width
        self.dev64[: 3 * batch].copy_(self.host64[: 3 * batch], non_blocking=True)
        self.dev32[:used32].copy_(self.host32[:used32], non_blocking=True)
        self.block_tables[:batch, :width].copy_(self.dev32[batch:used32].view(batch, width))
        if self.staged is not None:
            self.staged.record()

    def replay(self, batch: int) -> torch.Tensor:
        """The logits [batch, vocab] of the step staged for graph `batch`; valid until the next
        replay of any size (the graphs share one memory pool)."""
        self.replays += 1
        if not self.capture:
            return self.body(*self.views(batch))
        self.graphs[batch].replay()
        return self.outputs[batch]

    def record(self) -> None:
        """Record every size, largest first, so the smaller graphs reuse its memory. Each size
        runs eagerly once before it is recorded (no kernel compiles inside a capture). The steps
        write no KV: every slot is -1."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):
            self.stage(batch, np.zeros(batch, np.int64), np.zeros(batch, np.int64), np.full(batch, -1, np.int64),
                       np.ones(batch, np.int32), np.zeros((batch, 1), np.int32))
            # Warmed on a side stream, as torch asks of code about to be captured.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.body(*self.views(batch))
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a second engine in the process) may go
            # on while this one records; only this thread's calls must be capturable.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[batch] = self.body(*self.views(batch))
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
