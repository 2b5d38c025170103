"""Turns a step's plan into one ragged forward pass over the paged KV cache.

Per-step metadata is built with numpy in one go (no per-token Python). The runner owns
the KV tensors: per layer K and V of shape [num_blocks, block_size, num_kv_heads, head_dim],
in the model's dtype or, with a quantized kv_cache_dtype (int8, fp8_e4m3, fp8_e5m2),
`QuantizedKV`s (one-byte rows and their scales in each block's bytes), plus, in swap mode, a host pool of the same block layout.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backend.config import EngineConfig
from backend.cuda_graphs import DecodeGraphs, capture_sizes
from backend.models.llama import AttentionMetadata, LoRABatch, ModelArch, StepInterrupted
from backend.request import Request
from backend.scheduler import SchedulerOutput
from kernels import cpu_ext
from kernels.kv_store import KV_QUANT_DTYPES, QuantizedKV, kv_storage, pool_zeros

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


def resolve_batch_invariance(requested: bool | None, device: torch.device) -> bool:
    """Whether the engine runs batch-invariant (`batch_invariant`; None: wherever it can).
    It can on the CPU with the C++ kernels: the panel GEMM and the attention kernel reduce in
    an order fixed per row and per token. On CUDA the GEMMs are cuBLAS's, whose order depends
    on the batch's shape."""
    if requested is False:
        return False
    if device.type != "cpu":
        reason = f"the {device.type} path's GEMMs sum in an order that depends on the batch's shape"
    elif cpu_ext.isa() < cpu_ext.Isa.AVX2:
        reason = "the C++ CPU kernels (AVX2 and FMA) are not available on this machine"
    else:
        return True
    if requested:
        raise ValueError(f"invalid engine parameter: batch_invariant=true is not possible here: {reason}")
    return False


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block of every layer's K and V (a quantized block's scales included)."""
    if kv_cache_dtype in KV_QUANT_DTYPES:
        return 2 * arch.num_layers * QuantizedKV.block_bytes(block_size, arch.num_kv_heads, arch.head_dim)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


def make_kv_cache(num_blocks: int, block_size: int, arch: ModelArch, dtype: torch.dtype, kv_cache_dtype: str,
                  device: torch.device | str, pin_memory: bool = False) -> torch.Tensor | QuantizedKV:
    """One layer's K (or V) pool, zeroed."""
    kind = KV_QUANT_DTYPES.get(kv_cache_dtype)
    if kind is not None:
        if arch.head_dim % 4:
            raise ValueError(f"invalid engine parameter: kv_cache_dtype={kv_cache_dtype} needs a head size that is a "
                             f"multiple of 4 (the model's: {arch.head_dim})")
        return QuantizedKV.zeros(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, kind, device, pin_memory)
    return pool_zeros((num_blocks, block_size, arch.num_kv_heads, arch.head_dim), dtype, device, pin_memory)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Requests whose scheduled tokens reach their end of input: each gets one sample.
    sample_requests: list[Request]
    # With draft tokens scheduled (speculative decoding): the logits rows of each sampling
    # request, consecutive (1 + its drafts granted); None: one each.
    num_logit_rows: list[int] | None = None
    # A decode step staged for the CUDA graph of this many rows (backend/cuda_graphs.py), whose
    # first len(input_ids) rows are the step's; 0: the step runs eagerly on the tensors above.
    graph_batch: int = 0


class ModelRunner:
    def __init__(self, config: EngineConfig, model, arch: ModelArch, num_blocks: int, num_host_blocks: int,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.batch_invariant = resolve_batch_invariance(config.batch_invariant, device)
        self.has_lora = bool(config.lora_modules)
        if device.type == "cpu":
            cpu_ext.load()  # at startup, not in the first request's forward pass
        kv_dtype = config.kv_cache_dtype

        def pool(blocks: int, where: torch.device | str, pin: bool = False):
            return make_kv_cache(blocks, config.block_size, arch, dtype, kv_dtype, where, pin)

        self.kv_caches = [(pool(num_blocks, device), pool(num_blocks, device)) for _ in range(arch.num_layers)]
        pin = device.type == "cuda"
        self.host_caches = [(pool(num_host_blocks, "cpu", pin), pool(num_host_blocks, "cpu", pin))
                            for _ in range(arch.num_layers)] if num_host_blocks else []
        # Each layer's K and V as tensors whose rows are whole blocks (scales and all): what
        # swapping, copy-on-write and zeroing move, whatever the KV dtype.
        self.kv_blocks = [(kv_storage(k), kv_storage(v)) for k, v in self.kv_caches]
        self.host_blocks = [(kv_storage(k), kv_storage(v)) for k, v in self.host_caches]
        # The recorded decode steps (capture_decode_graphs), None: every step runs eagerly.
        self.graphs: DecodeGraphs | None = None

    def decode_graphs_possible(self) -> str | None:
        """Why this model's decode step cannot be recorded as a CUDA graph, or None if it can."""
        if self.arch.num_experts:
            return "a mixture of experts routes on the host"
        if self.model.embed_tokens.quantized is not None:
            return "a quantized embedding table is looked up on the host"
        return None

    def capture_decode_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Record the decode step at every size of `capture_sizes(max_num_seqs)`, for sequences
        of up to `max_model_len` tokens (the engine does so at load on CUDA unless `enforce_eager`).
        `capture` false (tests on a CPU): the padded steps over static buffers, run eagerly."""
        def body(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

        self.graphs = DecodeGraphs(body, self.device, capture_sizes(self.config.max_num_seqs), max_model_len,
                                   self.block_size, self.batch_invariant, capture)
        with torch.inference_mode():
            self.graphs.record()

    def prepare(self, plan: SchedulerOutput) -> StepInputs | None:
        scheduled = plan.scheduled
        if not scheduled:
            return None
        lora_indices = [r.lora_index for r, _ in scheduled] if self.has_lora else None
        if lora_indices is not None and max(lora_indices) >= 0:
            # Requests of one adapter side by side: one segment per adapter (kernels/lora.py).
            order = sorted(range(len(scheduled)), key=lora_indices.__getitem__)
            scheduled = [scheduled[i] for i in order]
            lora_indices = [lora_indices[i] for i in order]
        else:
            lora_indices = None
        bs = self.block_size
        n = len(scheduled)
        # This runs every iteration for every request. Per request only a few flat Python
        # passes (one per field read: cheaper than building tuples), nothing per token or
        # per block (block tables are rows of the KV manager's persistent table); then
        # numpy over the batch, in as few calls as it takes: after a real step's forward
        # pass each numpy or torch call starts with cold caches and costs 5-20 us.
        requests = [r for r, _ in scheduled]
        num_new_list = [k for _, k in scheduled]
        start_list = [r.num_computed_tokens for r in requests]
        token_lists = [r.token_ids for r in requests]
        num_drafts = plan.num_draft_tokens
        if num_drafts:  # each request's input runs on into its drafts
            real_lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=n)
            token_lists = [t + r.spec_token_ids if r.spec_token_ids else t for r, t in zip(requests, token_lists)]
        total = sum(num_new_list)
        start = np.fromiter(start_list, dtype=np.int64, count=n)
        table = plan.block_table
        rows = table.rows(requests)
        if total == n:  # one token each (decodes, mostly): the positions are the starts
            positions, token_rows = start, rows
            seq_lens = start + 1
            cu = np.arange(n + 1, dtype=np.int32)
            max_seqlen_q = 1
            input_ids = np.fromiter(map(operator.getitem, token_lists, start_list), dtype=np.int64, count=n)
        else:
            num_new = np.fromiter(num_new_list, dtype=np.int64, count=n)
            seq_lens = start + num_new
            cu = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(num_new, out=cu[1:])
            seq_index = np.repeat(np.arange(n), num_new)
            positions = np.arange(total, dtype=np.int64) - cu[seq_index] + start[seq_index]
            token_rows = rows[seq_index]
            max_seqlen_q = max(num_new_list)
            input_ids = np.fromiter(
                itertools.chain.from_iterable(t[s : s + k] for t, s, k in zip(token_lists, start_list, num_new_list)),
                dtype=np.int64, count=total,
            )
        block_tables = table.gather(rows)
        slot_mapping = np.multiply(table.ids[token_rows, positions // bs], bs, dtype=np.int64) + positions % bs
        graph_batch = (self.graphs.size_for(n, block_tables.shape[1])
                       if self.graphs is not None and total == n and not num_drafts and lora_indices is None else None)
        num_logit_rows = None
        if num_drafts:
            # A request whose grant reaches its last token keeps that row and one per draft after it.
            rows_per = np.maximum(seq_lens - real_lens + 1, 0)
            ends_input = rows_per > 0
            counts = rows_per[ends_input]
            firsts = np.repeat(cu[1:][ends_input] - counts, counts)
            logits_indices = firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            sample_requests = [r for r, ends in zip(requests, ends_input.tolist()) if ends]
            num_logit_rows = counts.tolist()
        # A step never schedules past a request's last token, so the scheduled tokens of
        # all of them end their input exactly when the totals agree: then all sample.
        elif sum(map(len, token_lists)) == sum(start_list) + total:
            logits_indices = cu[1:] - 1
            sample_requests = requests
        else:
            ends_input = seq_lens == np.fromiter(map(len, token_lists), dtype=np.int64, count=n)
            logits_indices = cu[1:][ends_input] - 1
            sample_requests = [r for r, ends in zip(requests, ends_input.tolist()) if ends]

        if graph_batch is not None:
            self.graphs.stage(graph_batch, input_ids, positions, slot_mapping, seq_lens, block_tables)
            return self._graph_inputs(graph_batch, n, logits_indices, sample_requests)

        def to_device(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            # dtype converted by numpy, cheaper than torch; on the CPU the tensor is the array.
            tensor = torch.from_numpy(array.astype(dtype, copy=False))
            return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

        lora = None
        if lora_indices is not None:
            starts, adapters = [], []
            for i, index in enumerate(lora_indices):
                if index >= 0 and (not adapters or adapters[-1] != index):
                    starts.append(int(cu[i]))
                    adapters.append(index)
            bounds = np.array(starts + [int(cu[-1])], dtype=np.int32)
            lora = LoRABatch(
                seg_indptr=to_device(bounds, np.int32),
                seg_adapter=to_device(np.array(adapters, dtype=np.int32), np.int32),
                max_seg_len=int(np.diff(bounds).max()),
            )
        meta = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, np.int64),
            block_tables=to_device(block_tables, np.int32),
            seq_lens=to_device(seq_lens, np.int32),
            cu_seqlens_q=to_device(cu, np.int32),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=int(seq_lens.max()),
            batch_invariant=self.batch_invariant,
            lora=lora,
        )
        return StepInputs(
            input_ids=to_device(input_ids, np.int64),
            positions=to_device(positions, np.int64),
            meta=meta,
            logits_indices=to_device(logits_indices, np.int64),
            sample_requests=sample_requests,
            num_logit_rows=num_logit_rows,
        )

    def _graph_inputs(self, graph_batch: int, n: int, logits_indices: np.ndarray,
                      sample_requests: list[Request]) -> StepInputs:
        """The StepInputs of a decode step staged for graph `graph_batch`: its tensors are the
        graph's own buffers; `logits_indices` picks the sampling rows when not all n sample."""
        input_ids, positions, meta = self.graphs.views(graph_batch)
        every_row = len(logits_indices) == n
        return StepInputs(
            input_ids=input_ids[:n], positions=positions[:n], meta=meta,
            logits_indices=(self.graphs.cu_seqlens_q[:n] if every_row  # 0..n-1, already there
                            else torch.from_numpy(logits_indices.astype(np.int64)).to(self.device)),
            sample_requests=sample_requests, graph_batch=graph_batch,
        )

    def synthetic_inputs(self, q_lens: list[int], seq_lens: list[int] | None = None,
                         lora: bool = False, scatter_seed: int | None = None) -> StepInputs:
        """A step over made-up sequences, for the warm-up and the benchmarks: sequence i holds
        seq_lens[i] tokens (default q_lens[i]), the last q_lens[i] of them new, in the pool's
        blocks from 0 on, one after another; each samples once. `lora`: every token through
        the first adapter. `scatter_seed`: the same blocks in a random order drawn from this
        seed instead, as a served pool hands them out once requests have come and gone. No
        request owns the blocks it writes, so only before any request (or with the pool's
        contents no longer needed) may it run."""
        seq_lens = list(q_lens) if seq_lens is None else list(seq_lens)
        bs = self.block_size
        blocks = [-(-n // bs) for n in seq_lens]
        if sum(blocks) > self.kv_caches[0][0].shape[0]:
            raise ValueError(f"{sum(blocks)} KV blocks needed, the pool has {self.kv_caches[0][0].shape[0]}")
        order = np.arange(sum(blocks))
        if scatter_seed is not None:
            order = np.random.default_rng(scatter_seed).permutation(order)
        tables = np.zeros((len(q_lens), max(blocks)), dtype=np.int32)
        for i, (first, count) in enumerate(zip(np.cumsum([0] + blocks[:-1]), blocks)):
            tables[i, :count] = order[first:first + count]
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        positions = np.concatenate([np.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
        seq_index = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        graph_batch = (self.graphs.size_for(len(q_lens), tables.shape[1])
                       if self.graphs is not None and not lora and max(q_lens) == 1 else None)
        if graph_batch is not None:
            self.graphs.stage(graph_batch, np.zeros(len(q_lens), np.int64), positions, slots, np.asarray(seq_lens), tables)
            return self._graph_inputs(graph_batch, len(q_lens), cu[1:] - 1, [])

        def put(array, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(self.device)

        meta = AttentionMetadata(
            slot_mapping=put(slots, np.int64), block_tables=put(tables, np.int32),
            seq_lens=put(seq_lens, np.int32), cu_seqlens_q=put(cu, np.int32),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), batch_invariant=self.batch_invariant,
            lora=LoRABatch(seg_indptr=put([0, cu[-1]], np.int32), seg_adapter=put([0], np.int32),
                           max_seg_len=int(cu[-1])) if lora else None,
        )
        return StepInputs(input_ids=torch.zeros(int(cu[-1]), dtype=torch.int64, device=self.device),
                          positions=put(positions, np.int64), meta=meta,
                          logits_indices=put(cu[1:] - 1, np.int64), sample_requests=[])

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass of `inputs` and the logits of its sampling rows (float32)."""
        if inputs.graph_batch:
            return self._replay(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def warm_up(self, max_model_len: int) -> torch.Tensor:
        """The largest steps the engine can take, once each, before any request: a chunk
        filling the token budget beside a decode (64-row attention tiles), then max_num_seqs
        decodes alone (16-row tiles), each again through the LoRA kernels when adapters are
        loaded. The first requests then wait neither for Triton to compile a kernel nor for
        the allocator to grow, and a batch too big for the memory left fails here, at load,
        not in a request. Returns the decode pass's logits, for the caller to warm the
        sampler with. The blocks it writes are zeroed again after. The chunk stays within
        `max_model_len` positions, which is all the RoPE table holds."""
        bs = self.block_size
        num_blocks = self.kv_caches[0][0].shape[0]
        # Within the pool: a small pool (a test's) warms smaller steps, and never writes past it.
        budget = min(self.config.max_num_batched_tokens, max_model_len)
        chunk = [max(1, min(budget - 1, (num_blocks - 1) * bs)), 1] if num_blocks > 1 else [min(budget, bs)]
        decodes = [1] * min(self.config.max_num_seqs, num_blocks)
        logits = None
        for q_lens in (chunk, decodes):
            for lora in (False, True) if self.has_lora else (False,):
                logits = self.forward_logits(self.synthetic_inputs(q_lens, lora=lora))
            used = sum(-(-q // bs) for q in q_lens)
            for k, v in self.kv_blocks:
                k[:used].zero_()
                v[:used].zero_()
        return logits

    def swap(self, plan: SchedulerOutput) -> None:
        """Swap-outs, then copy-on-write copies, then swap-ins: a block freed by a victim may
        be refilled in the same step. Each copy gathers all its sources before it writes."""
        if plan.swap_out:
            device_ids = torch.tensor([d for d, _ in plan.swap_out], device=self.device)
            host_ids = torch.tensor([h for _, h in plan.swap_out])
            for (k, v), (hk, hv) in zip(self.kv_blocks, self.host_blocks):
                hk[host_ids] = k[device_ids].to("cpu")
                hv[host_ids] = v[device_ids].to("cpu")
        if plan.block_copies:
            destinations = torch.tensor(list(plan.block_copies), device=self.device)
            sources = torch.tensor(list(plan.block_copies.values()), device=self.device)
            for k, v in self.kv_blocks:
                k[destinations] = k[sources]
                v[destinations] = v[sources]
        if plan.swap_in:
            host_ids = torch.tensor([h for h, _ in plan.swap_in])
            device_ids = torch.tensor([d for _, d in plan.swap_in], device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_blocks, self.host_blocks):
                k[device_ids] = hk[host_ids].to(self.device)
                v[device_ids] = hv[host_ids].to(self.device)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput, inputs: StepInputs | None,
                interrupt: Callable[[], bool] | None = None) -> tuple[torch.Tensor | None, list[Request]]:
        """Run the step prepared from `plan` (None: nothing scheduled, only swaps); logits
        (float32, one row per sampling request) and those requests. `interrupt` may abandon
        the pass between layers (StepInterrupted)."""
        self.swap(plan)
        if inputs is None:
            return None, []
        if inputs.graph_batch:
            if interrupt is not None and interrupt():
                raise StepInterrupted()
            logits = self._replay(inputs)  # a step with no sample still writes its KV
            return (logits if inputs.sample_requests else None), inputs.sample_requests
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, interrupt)
        if not inputs.sample_requests:
            return None, []
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits, inputs.sample_requests

    def _replay(self, inputs: StepInputs) -> torch.Tensor:
        """The sampling rows' logits of a step staged for a graph."""
        logits = self.graphs.replay(inputs.graph_batch)
        n = len(inputs.input_ids)
        return logits[:n] if len(inputs.logits_indices) == n else logits[inputs.logits_indices]
