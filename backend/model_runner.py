"""Turns a step's plan into one ragged forward pass over the paged KV cache.

Per-step metadata is built with numpy in one go (no per-token Python). The runner owns
the KV tensors: per layer K and V of shape [num_blocks, block_size, num_kv_heads, head_dim],
plus, in swap mode, a host pool of the same block shape.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from backend.config import EngineConfig
from backend.models.llama import AttentionMetadata, ModelArch
from backend.request import Request
from backend.scheduler import SchedulerOutput
from kernels import cpu_ext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    if name == "auto":
        # float32 on CPU: it is what the correctness oracle compares against, and this
        # CPU's bf16 matmuls are not reliably faster for small models. On CUDA the
        # checkpoint's half type (fp16 stays fp16, as in vLLM), else bf16.
        if device.type != "cuda":
            return torch.float32
        return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16
    return DTYPES[name]


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Requests whose scheduled tokens reach their end of input: each gets one sample.
    sample_requests: list[Request]


class ModelRunner:
    def __init__(self, config: EngineConfig, model, arch: ModelArch, num_blocks: int, num_host_blocks: int,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        if device.type == "cpu":
            cpu_ext.load()  # at startup, not in the first request's forward pass
        shape = (num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)
        ]
        host_shape = (num_host_blocks,) + shape[1:]
        pin = device.type == "cuda"
        self.host_caches = [
            (torch.zeros(host_shape, dtype=dtype, pin_memory=pin), torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
            for _ in range(arch.num_layers)
        ] if num_host_blocks else []

    def prepare(self, plan: SchedulerOutput) -> StepInputs | None:
        scheduled = plan.scheduled
        if not scheduled:
            return None
        bs = self.block_size
        requests = [r for r, _ in scheduled]
        # A few flat passes of Python attribute reads (one per field is faster than building
        # tuples); everything after is numpy over the batch. This runs every iteration for
        # every request, so it stays free of per-token Python.
        num_new_list = [n for _, n in scheduled]
        num_new = np.array(num_new_list, dtype=np.int64)
        start_list = [r.num_computed_tokens for r in requests]
        start = np.array(start_list, dtype=np.int64)
        num_tokens = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        num_blocks = np.array([len(r.block_ids) for r in requests], dtype=np.int64)
        cu = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        seq_index = np.repeat(np.arange(len(scheduled)), num_new)
        positions = np.arange(total, dtype=np.int64) - cu[seq_index] + start[seq_index]
        if total == len(scheduled):  # one token each (decodes, mostly): no slices to chain
            input_ids = np.array([r.token_ids[s] for r, s in zip(requests, start_list)], dtype=np.int64)
        else:
            input_ids = np.fromiter(
                itertools.chain.from_iterable(r.token_ids[s : s + n]
                                              for r, s, n in zip(requests, start_list, num_new_list)),
                dtype=np.int64, count=total,
            )
        block_tables = np.zeros((len(scheduled), int(num_blocks.max())), dtype=np.int32)
        flat_blocks = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in requests), dtype=np.int32,
                                  count=int(num_blocks.sum()))
        rows = np.repeat(np.arange(len(scheduled)), num_blocks)
        block_starts = np.cumsum(num_blocks) - num_blocks
        block_tables[rows, np.arange(len(flat_blocks)) - block_starts[rows]] = flat_blocks
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start + num_new
        ends_input = seq_lens == num_tokens
        logits_indices = cu[1:][ends_input] - 1
        sample_requests = [r for r, ends in zip(requests, ends_input.tolist()) if ends]

        def to_device(array, dtype):
            return torch.from_numpy(array).to(device=self.device, dtype=dtype, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            cu_seqlens_q=to_device(cu, torch.int32),
            max_seqlen_q=int(num_new.max()),
            max_seqlen_k=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            meta=meta,
            logits_indices=to_device(logits_indices, torch.int64),
            sample_requests=sample_requests,
        )

    def swap(self, plan: SchedulerOutput) -> None:
        """Swap-outs before swap-ins: a block freed by a victim may be refilled in the same step."""
        if plan.swap_out:
            device_ids = torch.tensor([d for d, _ in plan.swap_out], device=self.device)
            host_ids = torch.tensor([h for _, h in plan.swap_out])
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                hk[host_ids] = k[device_ids].to("cpu")
                hv[host_ids] = v[device_ids].to("cpu")
        if plan.swap_in:
            host_ids = torch.tensor([h for h, _ in plan.swap_in])
            device_ids = torch.tensor([d for _, d in plan.swap_in], device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                k[device_ids] = hk[host_ids].to(self.device)
                v[device_ids] = hv[host_ids].to(self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, inputs: StepInputs | None) -> tuple[torch.Tensor | None, list[Request]]:
        """Run the step prepared from `plan` (None: nothing scheduled, only swaps); logits
        (float32, one row per sampling request) and those requests."""
        self.swap(plan)
        if inputs is None:
            return None, []
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sample_requests:
            return None, []
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits, inputs.sample_requests
