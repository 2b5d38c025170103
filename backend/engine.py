"""The engine's synchronous core: `add_request`, `abort`, `step`.

One `step()` is one iteration of continuous batching: schedule (backend/scheduler.py),
execute (one ragged forward pass, backend/model_runner.py, and the samples), update (each
sample into its request, the stop check and, for a request that ends, its finish, in one
pass). Around it, each job has a module of its own: the checks a request passes
(backend/validation.py), the n/best_of fork and fold (backend/parallel_sampling.py),
request traces (backend/trace.py), the per-step snapshot (backend/stats.py), what a step
returns (backend/output.py). Tests drive `step()` directly; `EngineLoop`
(backend/engine_loop.py) runs it on a thread for the Triton adapter and is the only way
in from other threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from backend.config import EngineConfig, resolve_max_model_len, token_budget
from backend.detokenizer import IncrementalDetokenizer, SharedTokenizer
from backend.disagg import (
    KVLayout,
    Transfer,
    export_request,
    request_header,
    restore_generator,
    sweep_expired_transfers,
)
from backend.disagg_tcp import TransferPuller, TransferServer, is_tcp_handle
from backend.kv_cache import KVCacheManager, SwapSpace
from backend.kv_events import ZmqEventPublisher
from backend.lora import install_adapters, load_adapter
from backend.model_runner import ModelRunner, kv_block_bytes, resolve_batch_invariance, resolve_device, resolve_dtype
from backend.models.llama import StepInterrupted
from backend.models.loader import checkpoint_dtype, eos_token_ids, load_arch, load_model, load_tokenizer
from backend.output import RequestOutput, logprob_entry
from backend.parallel_sampling import ParallelSampling
from backend.request import FinishReason, Request, RequestError, SamplingParams, SequenceGroup
from backend.sampler import Sampler, SampleResult
from backend.scheduler import Scheduler, SchedulerOutput, check_stop
from backend.spec_decode import SpeculativeConfig
from backend.spec_decode.adaptive import DraftBudget
from backend.spec_decode.proposers import make_proposer
from backend.spec_decode.verify import Verified, can_speculate, verify
from backend.stats import EngineStats, StepStats, Totals, snapshot, step_stats
from backend.structured_output import GrammarCompiler, GrammarState
from backend.trace import RequestTrace, trace_plan, trace_step
from backend.validation import Admission, check_not_in_flight, check_queue_room
from kernels import cpu_ext

log = logging.getLogger("inflight")

# How long an idle step waits for a grammar under compilation before it returns to the loop.
GRAMMAR_IDLE_WAIT_S = 0.05
# How often, at most, an engine of role prefill or decode looks for expired KV transfers on
# its host (a listing of /dev/shm).
TRANSFER_SWEEP_INTERVAL_S = 1.0


@dataclass
class AwaitingImport:
    """role decode: a handed-over request that found the engine full. Its transfer stays
    claimed and open, not yet in the pool, until a step finds it room or `deadline`
    (monotonic) passes."""

    request: Request
    transfer: Transfer
    header: dict
    deadline: float


@dataclass
class Executed:
    """What executing a step's plan produced, for the step's update."""

    # The requests sampled, and their samples (row i is sample_requests[i]'s).
    sample_requests: list[Request] = field(default_factory=list)
    sampled: SampleResult | None = None
    # Speculating requests and their verification outcomes (backend/spec_decode/verify.py).
    verified_requests: list[Request] = field(default_factory=list)
    verified: list[Verified] = field(default_factory=list)
    interrupted: bool = False
    error: Exception | None = None
    # perf_counter() times: the pass began, and its samples were taken (None: no pass completed).
    started: float = 0.0
    forwarded: float | None = None
    prepare_s: float = 0.0
    forward_s: float = 0.0
    num_generated: int = 0


def is_device_fault(exc: BaseException) -> bool:
    """Whether `exc` leaves the accelerator unusable for good: after a CUDA error such as an
    illegal address or a failed launch the context is lost, and every later step fails too.
    Running out of memory (torch.OutOfMemoryError, not an AcceleratorError) is not one: the
    step's memory is freed and the next may fit."""
    return isinstance(exc, torch.AcceleratorError)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        # Resolved before the weights are packed: a quantized weight's CPU path follows the mode.
        config = replace(config, max_num_batched_tokens=token_budget(config, self.device.type),
                         batch_invariant=resolve_batch_invariance(config.batch_invariant, self.device))
        self.config = config
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.model_path))
        self.tokenizer = load_tokenizer(config.model_path, config.tokenizer)
        self.shared_tokenizer = SharedTokenizer(self.tokenizer)
        arch, _ = load_arch(config.model_path)  # refuses unsupported checkpoints first, by name
        self.max_model_len = resolve_max_model_len(config.max_model_len, arch)
        self.model, self.hf_config = load_model(config.model_path, self.dtype, self.device, self.max_model_len,
                                                quantization=config.quantization,
                                                quantization_group_size=config.quantization_group_size,
                                                activation_quantization=config.activation_quantization,
                                                batch_invariant=config.batch_invariant)
        self.weight_bytes = self.model.resident_weight_bytes()
        self.arch = self.model.arch
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = eos_token_ids(config.model_path, self.hf_config, self.tokenizer)
        # Adapter name -> index among the stacked adapters (backend/lora.py), in multi_lora.json's order.
        lora_modules = config.lora_modules or {}
        adapters = [load_adapter(name, path, self.arch, config.max_lora_rank) for name, path in lora_modules.items()]
        install_adapters(self.model, adapters, self.dtype, self.device)
        self.lora_adapters = {adapter.name: i for i, adapter in enumerate(adapters)}
        for adapter in adapters:
            log.info("LoRA adapter %r: r=%d on %s (%s)", adapter.name, adapter.rank,
                     "/".join(adapter.target_modules), adapter.path)

        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        # Before the pool is sized: a draft model's weights and its KV come out of the same memory.
        self.proposer = make_proposer(
            self.speculative, target_vocab_size=self.vocab_size, target_vocab=self.tokenizer.get_vocab(),
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
        ) if self.speculative is not None else None
        block_bytes = kv_block_bytes(self.arch, config.block_size, self.dtype, config.kv_cache_dtype)
        draft_block_bytes = self.proposer.kv_block_bytes(config.block_size, self.dtype) if self.proposer else 0
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(block_bytes + draft_block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV pool too small: {num_blocks} blocks of {block_bytes + draft_block_bytes} bytes")
        if self.proposer is not None:
            self.proposer.allocate_kv(num_blocks, config.block_size)
        num_host_blocks = config.swap_space_mb * 2**20 // block_bytes if config.preemption_mode == "swap" else 0
        # A prefill-role engine exports its prompts' every block (backend/disagg.py): it keeps them.
        window = self.arch.sliding_window if config.role != "prefill" else None
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 record_events=bool(config.kv_events_endpoint), window=window,
                                 max_step_tokens=min(config.long_prefill_token_threshold,
                                                     config.max_num_batched_tokens))
        self.kv_event_publisher = ZmqEventPublisher(
            config.kv_events_endpoint, config.kv_events_replay_endpoint or None, config.kv_events_topic,
        ) if config.kv_events_endpoint else None
        self.swap_space = SwapSpace(num_host_blocks) if num_host_blocks else None
        self.scheduler = Scheduler(config, self.kv, self.swap_space)
        self.runner = ModelRunner(config, self.model, self.arch, num_blocks, num_host_blocks, self.device, self.dtype)
        self.sampler = Sampler(config.seed)
        # What a transfer's blocks must look like to be imported here, and what ours look like.
        self.kv_layout = KVLayout.of(self.runner.kv_blocks, config.block_size)
        # (KV bytes, seconds) of each transfer made since the last step's stats.
        self._kv_transfers: list[tuple[int, float]] = []
        # kv_transfer tcp (backend/disagg_tcp.py): a prefill engine serves its transfers, a
        # decode engine pulls them off its step loop (EngineLoop).
        self.transfer_server = TransferServer(
            config.kv_transfer_address, config.kv_transfer_port, config.kv_transfer_timeout_s,
        ) if config.role == "prefill" and config.kv_transfer == "tcp" else None
        self.transfer_puller = TransferPuller(config.kv_transfer_timeout_s) if config.role == "decode" else None
        # role decode: handed-over requests waiting for room (import_request), in arrival order.
        self._awaiting_import: dict[str, AwaitingImport] = {}
        # role prefill or decode: the first sweep, at startup, removes what a dead process left.
        self._next_transfer_sweep = 0.0
        self._sweep_transfers(time.monotonic())
        self.draft_budget = (DraftBudget(self.speculative.num_speculative_tokens)
                             if self.speculative is not None and self.speculative.adaptive else None)
        if self.device.type == "cuda":
            self.warm_up()
            self._capture_decode_graphs()
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.admission = Admission(
            vocab_size=self.vocab_size, max_model_len=self.max_model_len, default_max_tokens=config.default_max_tokens,
            max_num_seqs=config.max_num_seqs, kv=self.kv, lora_adapters=self.lora_adapters,
            tokenizer=self.shared_tokenizer,
        )
        # Requests whose grammar is still compiling: enqueued, not yet the scheduler's.
        self._awaiting_grammar: dict[str, Request] = {}
        # Written by the engine alone, once per step (and here): a new object each time, so
        # a reader on another thread always holds one whole snapshot.
        self._totals = Totals()
        self.stats = self._snapshot(StepStats())
        self._pending: list[RequestOutput] = []
        self.parallel = ParallelSampling(self.scheduler, on_fork=self._add_detokenizer)
        self._arrival_seq = itertools.count()
        self._step_index = 0  # iterations so far: the step numbers of request traces
        self._num_traced = 0  # unfinished requests with a trace: none, and tracing costs nothing
        # Test-only fault injection: the forward pass raises once, in the first step whose batch
        # holds at least this many requests (then the engine serves again, as after a transient
        # fault). A batch size, not a step count, so that a test knows which requests it fails:
        # all it sent, however long they took to arrive.
        self._fail_at_batch = int(os.environ.get("INFLIGHT_FAULT_INJECT_AT_BATCH", "0") or 0)
        # Test-only: the first step whose batch holds at least this many requests never ends,
        # as a hung kernel or device would not (the health check's case).
        self._stall_at_batch = int(os.environ.get("INFLIGHT_FAULT_STALL_AT_BATCH", "0") or 0)
        # Why the device can no longer run a step (`is_device_fault`), once it cannot.
        self.device_fault: str | None = None
        log.info(
            "inflight engine: %s on %s/%s, %d KV blocks of %d tokens (%.0f MiB, kv_cache_dtype %s), max_model_len %d, "
            "batch_invariant %s, CPU GEMM path %s",
            self.arch.architecture, self.device, self.dtype, num_blocks, config.block_size,
            num_blocks * (block_bytes + draft_block_bytes) / 2**20, config.kv_cache_dtype, self.max_model_len,
            self.runner.batch_invariant,
            cpu_ext.isa().name.lower() if self.device.type == "cpu" else "-",
        )

    # ---- setup helpers -----------------------------------------------------------------

    def warm_up(self) -> None:
        """The largest steps, run once before the first request (on CUDA, at load; see
        ModelRunner.warm_up): on an H200, G3's first requests otherwise waited ~2 s in all
        for Triton to compile kernels. The sampler is warmed on max_num_seqs rows by a
        throwaway copy, so the engine's own random stream is untouched."""
        started = time.perf_counter()
        kinds = [SamplingParams(temperature=0.0, logprobs=2),
                 SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1)]
        try:
            logits = self.runner.warm_up(self.max_model_len)
            requests = [Request(request_id=f"warm-up-{i}", prompt_token_ids=[0], params=kinds[i % 2], max_tokens=1,
                                arrival_time=0.0, arrival_seq=-1, needs_logprobs=kinds[i % 2].logprobs is not None)
                        for i in range(logits.shape[0])]
            Sampler(self.config.seed)(logits, requests)
        except torch.OutOfMemoryError as exc:
            kv = "gpu_memory_utilization" if self.config.gpu_memory_utilization else "kv_cache_memory_mb"
            raise ValueError(
                f"the largest step (max_num_batched_tokens={self.config.max_num_batched_tokens}, "
                f"max_num_seqs={self.config.max_num_seqs}) does not fit in the {self.device.type} memory left beside "
                f"the weights and the KV pool ({self.kv.num_blocks} blocks): lower {kv}, max_num_batched_tokens "
                f"or max_num_seqs ({str(exc).splitlines()[0]})") from None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warmed up the %s kernels in %.1f s", self.device.type, time.perf_counter() - started)

    def _capture_decode_graphs(self) -> None:
        """The decode step as CUDA graphs (backend/cuda_graphs.py) unless `enforce_eager`."""
        if self.config.enforce_eager:
            return
        reason = self.runner.decode_graphs_possible()
        if reason is not None:
            log.info("decode steps run eagerly: %s", reason)
            return
        started = time.perf_counter()
        try:
            self.runner.capture_decode_graphs(self.max_model_len)
        except Exception:  # a step that cannot be recorded must not keep the model from serving
            self.runner.graphs = None
            log.error("could not record the decode step as CUDA graphs; decode steps run eagerly\n%s",
                      traceback.format_exc())
            return
        log.info("recorded the decode step at %d batch sizes up to %d in %.1f s", len(self.runner.graphs.sizes),
                 self.runner.graphs.max_batch, time.perf_counter() - started)

    def _blocks_for_memory(self, block_bytes: int) -> int:
        if self.device.type == "cuda" and self.config.gpu_memory_utilization > 0:
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_utilization) // block_bytes
        return self.config.kv_cache_memory_mb * 2**20 // block_bytes

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    # ---- requests ----------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     needs_logprobs: bool = False, arrival_time: float | None = None, trace: bool = False) -> Request:
        """A request, once it has passed every check that depends on the model
        (validation.Admission); RequestError for the first it fails."""
        admitted = self.admission.check(prompt, params)
        num_seqs = params.num_sequences
        if self.config.role != "both":
            self._check_disaggregable(params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=admitted.prompt_token_ids,
            params=params,
            max_tokens=admitted.max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            arrival_seq=next(self._arrival_seq),
            eos_token_ids=self.eos_token_ids,
            prompt_text=admitted.prompt_text,
            # best_of > n ranks the sequences by cumulative logprob.
            needs_logprobs=needs_logprobs or params.logprobs is not None or num_seqs > params.n,
            bad_words_token_ids=admitted.bad_words_token_ids,
            lora_name=params.lora_name,
            lora_index=admitted.lora_index,
        )
        if params.seed is not None:
            request.generator = Sampler.make_request_generator(params.seed)
        if num_seqs > 1:
            request.group = SequenceGroup(request_id, params.n, num_seqs, seqs=[request])
        if trace:
            request.trace = RequestTrace(request.arrival_time)
        if params.structured_outputs is not None:
            request.grammar = GrammarState(self.grammar_compiler.submit(params.structured_outputs))
        return request

    def _check_disaggregable(self, params: SamplingParams) -> None:
        """What a request handed over between a prefill and a decode engine cannot carry yet."""
        role = self.config.role
        if params.num_sequences > 1:
            raise RequestError.invalid("n", f"at most 1 sequence (n, best_of) with disaggregated serving (role {role})")
        if params.structured_outputs is not None:
            raise RequestError.invalid("structured_outputs", f"not supported with disaggregated serving (role {role})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    needs_logprobs: bool = False, arrival_time: float | None = None, trace: bool = False) -> Request:
        request = self.make_request(request_id, prompt, params or SamplingParams(), needs_logprobs, arrival_time, trace)
        self.accept(request)
        return request

    def check_queue_room(self, num_arriving: int = 0) -> None:
        """Refuse (UNAVAILABLE) a request for which the waiting queue, with `num_arriving`
        more already on their way to it, has no room."""
        check_queue_room(self.num_waiting + num_arriving, self.config.max_queue_len)

    def accept(self, request: Request) -> None:
        """Take in a request `make_request` built, once the queue has room for it and its id
        is not in flight (RequestError otherwise): the scheduler's, or its grammar's to wait for."""
        self.check_queue_room()
        check_not_in_flight(request.request_id,
                            request.request_id in self.scheduler.requests or request.request_id in self._awaiting_grammar)
        self._add_detokenizer(request)
        if request.group is not None:
            self.parallel.add(request.group)
        if request.trace is not None:
            request.trace.queued(self._step_index, running=self.num_running, waiting_ahead=self.num_waiting)
            self._num_traced += 1
        if request.grammar is not None:  # admitted by the next step that finds its grammar compiled
            self._awaiting_grammar[request.request_id] = request
        else:
            self.scheduler.enqueue(request)
        self._totals = self._totals.plus(prompt_tokens=request.num_prompt_tokens)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the requests whose grammar is compiled now to the scheduler (in arrival order);
        end those whose constraint did not compile (their final outputs are returned)."""
        outputs = []
        for request_id, request in list(self._awaiting_grammar.items()):
            if not request.grammar.ready:
                continue
            error = request.grammar.error()
            if error is not None:
                outputs.append(self.finish(request, FinishReason.ERROR, error=error))
            else:
                del self._awaiting_grammar[request_id]
                self.scheduler.enqueue(request)
        return outputs

    def _add_detokenizer(self, request: Request) -> None:
        params = request.params
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output, decode=self.shared_tokenizer.decoder(params.spaces_between_special_tokens),
        )

    def abort(self, request_id: str) -> bool:
        """End a request (every sequence of it) now, freeing its blocks in this call; its
        final output comes with the next step."""
        group = self.parallel.groups.get(request_id)
        if group is not None:  # any live sequence: finishing one ends them all (`finish`)
            request = next((r for r in group.seqs if not r.is_finished), None)
        else:
            request = self.scheduler.requests.get(request_id) or self._awaiting_grammar.get(request_id)
            if request is None and request_id in self._awaiting_import:
                request = self._awaiting_import[request_id].request
        if request is None:
            return False
        self._pending.append(self.finish(request, FinishReason.ABORT))
        return True

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None, *,
               error: RequestError | None = None, token_ids: list[int] | None = None,
               logprobs_delta: list[dict] | None = None) -> RequestOutput:
        """The one way a request ends, whatever ends it: a stop token or string, its length,
        an abort, an error, shutdown, refusal at the door. The scheduler releases it at once
        (a request already finished keeps its reason); the engine counts it and returns its
        final output, the one with finished=True, carrying the last `token_ids`."""
        text = ""
        if request.trace is not None and not request.is_finished:
            self._num_traced -= 1
            request.trace.finished(self._step_index, reason=reason.value,
                                   output_tokens=request.num_output_tokens)
        was_compiling = self._awaiting_grammar.pop(request.request_id, None) is request
        awaiting = self._awaiting_import.get(request.request_id)
        if awaiting is not None and awaiting.request is request:  # its transfer is let go, unimported
            del self._awaiting_import[request.request_id]
            awaiting.transfer.close()
        request.grammar = None  # a finished request keeps no matcher
        if self.scheduler.finish_request(request, reason, stop_reason) or was_compiling:
            if self.proposer is not None and error is None:
                self.proposer.request_finished(request)
            detok = self.detokenizers.pop(request.request_id)
            if error is None:
                text = detok.take_delta(finished=True)
            if reason is FinishReason.ABORT and request.seq_index == 0:
                self._totals = self._totals.plus(aborts=1)
            if request.group is not None and reason in (FinishReason.ABORT, FinishReason.ERROR):
                # An aborted or failed sequence takes its group with it: no sequence runs on alone.
                for sibling in request.group.seqs:
                    if not sibling.is_finished:
                        self._pending.append(self.finish(sibling, reason, error=error))
        return RequestOutput.of(request, text, token_ids or [], logprobs_delta, error, now=time.monotonic())

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or bool(self._pending) or bool(self._awaiting_grammar)
                or bool(self._awaiting_import))

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued, waiting for their grammar, or (role decode)
        handed over and waiting for room."""
        return len(self.scheduler.waiting) + len(self._awaiting_grammar) + len(self._awaiting_import)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, so that a benchmark starts cold; call it while idle."""
        self.kv.pool.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.kv.pool.take_events()
            if events:
                self.kv_event_publisher.publish(events)

    def close(self) -> None:
        """Send the KV events still queued and close their sockets (the engine serves no more)."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None
        for transport in (self.transfer_server, self.transfer_puller):
            if transport is not None:
                transport.close()
        self.transfer_server = self.transfer_puller = None

    @property
    def num_pending_transfers(self) -> int:
        """TCP transfers between here and the other engine: exported and not yet pulled (role
        prefill), or being pulled (role decode)."""
        if self.transfer_server is not None:
            return self.transfer_server.num_held
        return self.transfer_puller.num_in_flight if self.transfer_puller is not None else 0

    # ---- the step: schedule -> execute -> update ---------------------------------------

    def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One iteration; its snapshot is `self.stats` when it returns.

        schedule (the plan: who runs, how many tokens each), execute (one ragged forward
        pass and the samples), update (each sample into its request: the stop check and, for
        a request that ends, its finish, in one pass). The outputs are those of requests
        that ended between steps (aborts, grammars that failed to compile), then this step's.

        `interrupt` is asked between the layers of the forward pass; when it answers True
        the pass is abandoned with nothing advanced (the scheduled tokens are computed again
        by a later step, as after a preemption), so that an abort need not wait for a long
        prefill to finish. Its requests keep their blocks and places."""
        outputs = self._begin_step()
        if self.speculative is not None:
            self._propose()
        plan = self.scheduler.schedule()
        self._after_schedule(plan)
        num_running, num_waiting = self.num_running, self.num_waiting
        executed = self._execute_plan(plan, interrupt)
        outputs.extend(self._update(plan, executed))
        self._record_step(plan, executed, num_running, num_waiting)
        return self.parallel.fold(outputs, time.monotonic()) if self.parallel.has_groups else outputs

    def _begin_step(self) -> list[RequestOutput]:
        """The final outputs of requests ended since the last step; requests whose grammar
        has compiled join the scheduler."""
        outputs, self._pending = self._pending, []
        self._step_index += 1
        if self._awaiting_grammar:
            if not self.scheduler.has_work() and not outputs:
                # Nothing to run until a grammar is ready: wait for one, briefly, rather than spin
                # against the compiler for the CPU (the loop still sees commands between steps).
                wait_futures([r.grammar.compiled for r in self._awaiting_grammar.values()],
                             timeout=GRAMMAR_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            outputs.extend(self._admit_compiled())
        if self._awaiting_import:
            outputs.extend(self._admit_imports())
        self._sweep_transfers(time.monotonic())
        return outputs

    def _propose(self) -> None:
        """Drafts for each running request that decodes and may speculate, at most as many
        as its max_tokens leaves room for after the token its verification adds, and (with
        `adaptive`) only as many as the measured step costs and acceptance say will pay: a
        draft model's length is chosen before it runs, since its passes cost whatever the
        verification keeps; every proposer's drafts are then trimmed to those worth a row."""
        spec = self.speculative
        running = self.scheduler.running
        off = spec.disable_by_batch_size is not None and len(running) >= spec.disable_by_batch_size
        asking, ks = [], []
        num_decodes = 0
        for request in running:
            k = min(spec.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1)
            decoding = request.num_computed_tokens == request.num_tokens - 1
            num_decodes += decoding
            if not off and k > 0 and decoding and can_speculate(request):
                asking.append(request)
                ks.append(k)
            elif request.spec_token_ids:
                request.spec_token_ids = []
        if not asking:
            return
        budget = self.draft_budget
        base_tokens = min(self.config.max_num_batched_tokens,
                          sum(r.num_tokens - r.num_computed_tokens for r in running))
        if budget is not None and self.proposer.pass_cost is not None:
            length = budget.draft_length(len(asking), base_tokens, num_decodes, max(ks), self.proposer.pass_cost)
            self._totals = self._totals.plus(spec_trimmed_draft_tokens=sum(max(0, k - length) for k in ks))
            if length == 0:
                for request in asking:
                    request.spec_token_ids = []
                return
            ks = [min(k, length) for k in ks]
        speculating = []
        for request, drafts in zip(asking, self.proposer.propose(asking, ks)):
            request.spec_token_ids = drafts
            if drafts:
                speculating.append(request)
        if speculating and budget is not None:
            proposed = [len(r.spec_token_ids) for r in speculating]
            kept = budget.trim(proposed, base_tokens, num_decodes)
            for request, count in zip(speculating, kept):
                request.spec_token_ids = request.spec_token_ids[:count]
            self._totals = self._totals.plus(spec_trimmed_draft_tokens=sum(proposed) - sum(kept))

    def _after_schedule(self, plan: SchedulerOutput) -> None:
        if self._num_traced:
            trace_plan(plan, self._step_index, self.kv.block_size)
        for request in plan.preempted:
            if request.grammar is not None and request.num_computed_tokens == 0:
                request.grammar.release()  # recompute: rebuilt from its tokens when next sampled

    def _execute_plan(self, plan: SchedulerOutput, interrupt: Callable[[], bool] | None) -> Executed:
        """The plan's forward pass and its samples (forking the groups whose prefill ends)."""
        executed = Executed()
        if plan.is_empty:
            return executed
        start = executed.started = time.perf_counter()
        try:
            if self._fail_at_batch and len(plan.scheduled) >= self._fail_at_batch:
                self._fail_at_batch = 0
                raise RuntimeError("injected fault (INFLIGHT_FAULT_INJECT_AT_BATCH)")
            if self._stall_at_batch and len(plan.scheduled) >= self._stall_at_batch:
                log.error("injected stall (INFLIGHT_FAULT_STALL_AT_BATCH): this step never ends")
                threading.Event().wait()
            inputs = self.runner.prepare(plan)
            prepared = time.perf_counter()
            logits, sample_requests = self.runner.run(plan, inputs, interrupt)
            if logits is not None and inputs.num_logit_rows is not None:
                logits, sample_requests = self._verify(logits, sample_requests, inputs.num_logit_rows, executed)
            if logits is not None and self.scheduler.has_unforked_leaders:
                logits, sample_requests = self.parallel.fork(logits, sample_requests)
            executed.sampled = self.sampler(logits, sample_requests) if logits is not None else None
        except StepInterrupted:
            executed.interrupted = True
        except Exception as exc:  # every in-flight request must end, whatever broke
            log.error("forward pass failed; failing %d in-flight requests\n%s", len(plan.scheduled), traceback.format_exc())
            executed.error = exc
        else:
            executed.sample_requests = sample_requests
            executed.forwarded = time.perf_counter()
            executed.prepare_s, executed.forward_s = prepared - start, executed.forwarded - prepared
        return executed

    def _verify(self, logits: torch.Tensor, requests: list[Request], num_rows: list[int],
                executed: Executed) -> tuple[torch.Tensor | None, list[Request]]:
        """Verify the drafts of the requests with more than one logits row (into `executed`);
        the logits and requests of the others, one row each, to be sampled as usual."""
        plain_rows, plain, spec_rows, spec, spec_counts = [], [], [], [], []
        row = 0
        for request, n in zip(requests, num_rows):
            if n == 1:
                plain_rows.append(row)
                plain.append(request)
            else:
                spec_rows.extend(range(row, row + n))
                spec.append(request)
                spec_counts.append(n)
            row += n
        if spec:
            executed.verified_requests = spec
            executed.verified = verify(self.sampler, logits[spec_rows], spec, spec_counts)
        return (logits[plain_rows] if plain else None), plain

    def _update(self, plan: SchedulerOutput, executed: Executed) -> list[RequestOutput]:
        """The executed step into its requests: the scheduled tokens are computed, and each
        sample, in one pass, joins its request, meets the stop check and, when it ends the
        request, finishes it (its blocks freed, its final output built)."""
        if executed.interrupted:
            log.info("step of %d tokens interrupted", plan.num_scheduled_tokens)
            self.scheduler.refund(plan)  # its tokens are computed, and charged, by a later step
            return []
        if executed.error is not None:
            exc = executed.error
            if is_device_fault(exc) and self.device_fault is None:
                self.device_fault = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            return self._fail_scheduled(plan, exc)
        if executed.forwarded is None:
            return []  # nothing was scheduled
        now = time.monotonic()
        self.scheduler.advance(plan)
        sampled = executed.sampled
        if self._num_traced:
            trace_step(plan, self._step_index, executed.forwarded - executed.started, now,
                       executed.sample_requests + executed.verified_requests)
        outputs = []
        for request, verified in zip(executed.verified_requests, executed.verified):
            outputs.append(self._take_verified(request, verified, plan, now, executed))
        for row, request in enumerate(executed.sample_requests):
            if request.is_finished:
                continue  # ended by a sequence of its group earlier in this pass
            token_id = sampled.token_ids[row]
            refused = self._append_token(request, token_id, now, plan)
            if refused is not None:
                outputs.append(refused)
                continue
            outputs.append(self._take_token(request, token_id, sampled, row, now))
        executed.num_generated += len(executed.sample_requests)
        return outputs

    def _append_token(self, request: Request, token_id: int, now: float, plan: SchedulerOutput) -> RequestOutput | None:
        """A sampled or verified token into its request, through its grammar first (the matcher is
        rebuilt from the request's tokens after a recompute); the request's final error output
        when the grammar refuses it: every row is masked by its grammar, so a broken invariant."""
        accepted = request.grammar is None or request.grammar.accept(request, token_id)
        self.scheduler.append_token(request, token_id, now, plan)
        if accepted:
            return None
        return self.finish(request, FinishReason.ERROR, error=RequestError(
            RequestError.INTERNAL, f"internal error: structured_outputs: token {token_id} is outside the grammar"))

    def _take_verified(self, request: Request, verified: Verified, plan: SchedulerOutput, now: float,
                       executed: Executed) -> RequestOutput:
        """A speculating request's accepted drafts and the token after them, each through the
        stop check in turn (none is taken past a stop); then its rejected drafts' KV is dropped."""
        if request.trace is not None:
            request.trace.verified(drafts=verified.num_drafts, accepted=verified.num_accepted)
        detok = self.detokenizers[request.request_id]
        wants_logprobs = request.params.logprobs is not None
        logprobs_delta = [] if wants_logprobs else None
        for i, token_id in enumerate(verified.token_ids):
            refused = self._append_token(request, token_id, now, plan)
            if refused is not None:
                return refused
            stop = check_stop(request, token_id, detok.add_token)
            lp = verified.logprobs[i]
            if lp is not None:
                request.cumulative_logprob += lp
            if wants_logprobs:
                logprobs_delta.append(logprob_entry(token_id, lp, verified.top_logprobs[i], self.shared_tokenizer.decoder()))
            if stop is not None:
                executed.num_generated += i + 1
                self.scheduler.charge_accepted_drafts(request, i, plan)
                return self.finish(request, *stop, token_ids=verified.token_ids[: i + 1], logprobs_delta=logprobs_delta)
        executed.num_generated += len(verified.token_ids)
        self.scheduler.charge_accepted_drafts(request, verified.num_accepted, plan)
        self.scheduler.accept_drafts(request, verified.num_accepted)
        return RequestOutput.of(request, detok.take_delta(finished=False), verified.token_ids, logprobs_delta, now=now)

    def _take_token(self, request: Request, token_id: int, sampled: SampleResult, row: int, now: float) -> RequestOutput:
        """The stop check of `request`'s new token, and its output: the final one when the
        token ends the request."""
        detok = self.detokenizers[request.request_id]
        stop = check_stop(request, token_id, detok.add_token)
        if stop is None and request.grammar is not None and request.grammar.is_terminated:
            stop = (FinishReason.STOP, None)  # the grammar took its stop token (ignore_eos or not)
        lp = sampled.logprobs[row]
        if lp is not None:
            request.cumulative_logprob += lp
        logprobs_delta = None
        if request.params.logprobs is not None:
            logprobs_delta = [logprob_entry(token_id, lp, sampled.top_logprobs[row], self.shared_tokenizer.decoder())]
        if stop is not None:
            return self.finish(request, *stop, token_ids=[token_id], logprobs_delta=logprobs_delta)
        if self.config.role == "prefill":
            return self._hand_over(request, token_id, lp, sampled.top_logprobs[row], logprobs_delta)
        return RequestOutput.of(request, detok.take_delta(finished=False), [token_id], logprobs_delta, now=now)

    # ---- disaggregated serving (backend/disagg.py) --------------------------------------

    def _hand_over(self, request: Request, token_id: int, logprob: float | None,
                   top_logprobs: list[tuple[int, float]] | None, logprobs_delta: list[dict] | None) -> RequestOutput:
        """role prefill: `request` has its first token; its prompt's KV and its state go into a
        transfer, and it ends here (its blocks freed) with a final output carrying the handle."""
        started = time.perf_counter()
        num_blocks = self.kv.blocks_needed(request.num_prompt_tokens)
        header = request_header(request, logprob, top_logprobs)
        try:
            handle = (self.transfer_server.export(request, num_blocks, self.runner.kv_blocks, self.kv_layout, header)
                      if self.transfer_server is not None else
                      export_request(request, num_blocks, self.runner.kv_blocks, self.kv_layout, header,
                                     self.config.kv_transfer_timeout_s))
        except (OSError, MemoryError) as exc:  # /dev/shm or memory full
            return self.finish(request, FinishReason.ERROR, error=RequestError(
                RequestError.UNAVAILABLE, f"could not export the request's KV for its decode instance: {exc}"))
        self._kv_transfers.append((num_blocks * self.kv_layout.block_bytes, time.perf_counter() - started))
        output = self.finish(request, FinishReason.TRANSFERRED, token_ids=[token_id], logprobs_delta=logprobs_delta)
        output.transfer = handle  # before anyone else sees the output
        return output

    def import_request(self, handle: str | Transfer, request_id: str | None = None, prompt_text: str = "",
                       arrival_time: float | None = None,
                       params: SamplingParams | None = None) -> tuple[Request, RequestOutput | None]:
        """role decode: the request a prefill engine exported as `handle` (a shared-memory
        handle, or a TCP transfer already pulled: `transfer_puller`), straight into the
        running batch after its first token; the request and its first output, which carries
        the first token. When the running batch or the KV pool is full (or requests already
        wait), the request waits, its transfer claimed and held, and its first output is None
        here: a later step takes it in (its first output among that step's) or, once it has
        waited kv_transfer_wait_timeout_s, ends it with UNAVAILABLE naming that limit.
        RequestError, the transfer let go: INVALID_ARG for a handle that names no transfer, or
        one of another KV layout or a request this engine refuses; UNAVAILABLE when the engine
        is full and kv_transfer_wait_timeout_s is 0, or the waiting queue is (max_queue_len).
        `params`: the decode half's own sampling parameters, which the request runs on with instead
        of the handed-over ones (vllm-router sends the prefill half with max_tokens and min_tokens
        1, and the client's on the decode half); its seeded generator goes on where it was."""
        if self.config.role != "decode":
            raise RequestError.invalid("transfer", f"this model's role is {self.config.role!r}; only role 'decode' "
                                       "imports a transfer")
        if is_tcp_handle(handle):
            raise RequestError.invalid("transfer", "a TCP transfer is pulled (transfer_puller) before its import")
        transfer = handle if isinstance(handle, Transfer) else Transfer(handle)
        try:
            if transfer.layout != self.kv_layout:
                raise RequestError.invalid("transfer", f"KV layout {transfer.layout} is not this engine's "
                                           f"{self.kv_layout} (same model, dtype, kv_cache_dtype and block_size needed)")
            header = transfer.header
            params = params or SamplingParams.model_validate(header["params"])
            request = self.make_request(request_id or header["request_id"], header["prompt_token_ids"], params,
                                        header["needs_logprobs"], arrival_time)
            request.prompt_text = prompt_text
            check_not_in_flight(request.request_id, request.request_id in self.scheduler.requests
                                or request.request_id in self._awaiting_import)
            # In arrival order: none overtakes a request already waiting.
            if not self._awaiting_import and self.scheduler.adopt(request, request.num_prompt_tokens):
                return request, self._take_imported(request, transfer, header)
            if self.config.kv_transfer_wait_timeout_s == 0:
                raise RequestError(RequestError.UNAVAILABLE, f"{self._why_full(transfer)}; retry later")
            self.check_queue_room()
        except BaseException:
            transfer.close()
            raise
        deadline = time.monotonic() + self.config.kv_transfer_wait_timeout_s
        self._awaiting_import[request.request_id] = AwaitingImport(request, transfer, header, deadline)
        return request, None

    def _why_full(self, transfer: Transfer) -> str:
        return (f"this decode instance is full: {self.num_running} of max_num_seqs={self.config.max_num_seqs} "
                f"running, {self.kv.pool.num_free} KV blocks free, {transfer.num_blocks} needed")

    def _admit_imports(self) -> list[RequestOutput]:
        """role decode: take in the waiting handed-over requests that fit now, in arrival order
        (their first outputs), and end with UNAVAILABLE those that have waited their limit."""
        outputs = []
        now = time.monotonic()
        blocked = False
        for request_id, waiting in list(self._awaiting_import.items()):
            request = waiting.request
            if not blocked and self.scheduler.adopt(request, request.num_prompt_tokens):
                del self._awaiting_import[request_id]
                outputs.append(self._take_imported(request, waiting.transfer, waiting.header))
                continue
            blocked = True
            if now >= waiting.deadline:
                limit = self.config.kv_transfer_wait_timeout_s
                outputs.append(self.finish(request, FinishReason.ERROR, error=RequestError(RequestError.UNAVAILABLE, (
                    f"{self._why_full(waiting.transfer)}, for all of kv_transfer_wait_timeout_s={limit:g}s; "
                    "retry later"))))
        return outputs

    def _take_imported(self, request: Request, transfer: Transfer, header: dict) -> RequestOutput:
        """`request`, adopted into the running batch, gets its transfer's blocks and state; its
        first output."""
        started = time.perf_counter()
        try:
            transfer.write_blocks(request.block_ids[: transfer.num_blocks], self.runner.kv_blocks)
        finally:
            transfer.close()
        # A TCP transfer's time includes its pull.
        self._kv_transfers.append((transfer.num_blocks * self.kv_layout.block_bytes,
                                   transfer.pull_s + time.perf_counter() - started))
        params = request.params
        request.generator = restore_generator(header["generator_state"])
        request.num_cached_prompt_tokens = header["num_cached_prompt_tokens"]
        request.cumulative_logprob = header["cumulative_logprob"]
        now = time.monotonic()
        request.first_token_time = request.last_token_time = now
        self._add_detokenizer(request)
        detok = self.detokenizers[request.request_id]
        for token_id in header["output_token_ids"]:
            request.append_output_token(token_id)
            detok.add_token(token_id)
        # Its prompt tokens are the prefill engine's (vllm:prompt_tokens_total counts them there).
        self.kv.cache_computed_blocks(request)
        logprobs_delta = None
        (first,) = header["output_token_ids"]
        if params.logprobs is not None:
            top = header["first_top_logprobs"]
            logprobs_delta = [logprob_entry(first, header["first_logprob"], [tuple(t) for t in top] if top else None,
                                            self.shared_tokenizer.decoder())]
        if request.num_output_tokens >= request.max_tokens:  # a decode half that asked for one token
            return self.finish(request, FinishReason.LENGTH, token_ids=[first], logprobs_delta=logprobs_delta)
        return RequestOutput.of(request, detok.take_delta(finished=False), [first], logprobs_delta, now=now)

    def _sweep_transfers(self, now: float) -> None:
        """role prefill or decode: remove the host's expired KV transfers (backend/disagg.py),
        at most once every TRANSFER_SWEEP_INTERVAL_S."""
        if self.config.role == "both" or now < self._next_transfer_sweep:
            return
        self._next_transfer_sweep = now + TRANSFER_SWEEP_INTERVAL_S
        removed = sweep_expired_transfers()
        if removed:
            log.warning("removed %d KV transfer(s) that no decode engine claimed in time: %s", len(removed),
                        ", ".join(removed[:4]))

    def _fail_scheduled(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A failed forward pass ends every request it carried; the engine stays usable."""
        outputs = []
        error = RequestError(RequestError.INTERNAL, f"engine error in the forward pass: {exc}")
        for request, _ in plan.scheduled:
            if request.is_finished:
                continue
            outputs.append(self.finish(request, FinishReason.ERROR, error=error))
        return outputs

    def _record_step(self, plan: SchedulerOutput, executed: Executed, num_running: int, num_waiting: int) -> None:
        ran = executed.forwarded is not None
        update_s = time.perf_counter() - executed.forwarded if ran else 0.0
        step = step_stats(plan, ran=ran, num_running=num_running, num_waiting=num_waiting,
                          num_generated_tokens=executed.num_generated, prepare_time_s=executed.prepare_s,
                          forward_time_s=executed.forward_s, update_time_s=update_s,
                          accepted_per_draft=[(v.num_drafts, v.num_accepted) for v in executed.verified],
                          kv_transfers=tuple(self._kv_transfers))
        self._kv_transfers.clear()
        self._totals = self._totals.with_step(step)
        self.stats = self._snapshot(step)
        self._publish_kv_events()
        if self.draft_budget is not None and ran:
            self.draft_budget.observe_step(plan.num_scheduled_tokens, executed.prepare_s + executed.forward_s)
            for verified in executed.verified:
                self.draft_budget.observe_verification(verified.num_drafts, verified.num_accepted)

    def take_aborted(self) -> list[RequestOutput]:
        """The final outputs of requests aborted since the last step, at once rather than
        with the next step's (which may take a second with a long prefill in the batch), and
        a snapshot that shows their blocks freed. The snapshot keeps the last step's
        `StepStats`, so a reader that counts steps sees no new one."""
        outputs, self._pending = self._pending, []
        if outputs:
            self.stats = self._snapshot(self.stats.step)
        return outputs

    def _snapshot(self, step: StepStats) -> EngineStats:
        return snapshot(self.scheduler, step, self._totals, num_waiting=self.num_waiting,
                        max_loras=self.config.max_loras if self.lora_adapters else None)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Request]:
        """Offline convenience: run prompts to completion; returns finished requests in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.add_request(f"offline-{next(self._arrival_seq)}", p, sp) for p, sp in zip(prompts, params_list)]
        while self.has_unfinished():
            self.step()
        return requests
