"""The engine's synchronous core: `add_request`, `abort`, `step`.

One `step()` is one iteration of continuous batching: schedule, one ragged forward pass,
sample, update, detokenize. Tests drive `step()` directly; `EngineLoop`
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
from dataclasses import dataclass, replace
from typing import Callable

import torch
from transformers import AutoTokenizer, GenerationConfig

from backend.config import MAX_MODEL_LEN_CAP, EngineConfig, token_budget
from backend.detokenizer import IncrementalDetokenizer, raw_decoder
from backend.kv_cache import KVCacheManager, SwapSpace
from backend.kv_events import ZmqEventPublisher
from backend.lora import install_adapters, load_adapter
from backend.model_runner import ModelRunner, kv_block_bytes, resolve_device, resolve_dtype
from backend.models.llama import StepInterrupted
from backend.models.loader import checkpoint_dtype, load_arch, load_model
from backend.request import FinishReason, Request, RequestError, RequestStatus, SamplingParams, SequenceGroup
from backend.sampler import Sampler
from backend.scheduler import Scheduler, SchedulerOutput, check_stop, resolve_max_tokens
from backend.stats import EngineStats, StepStats, Totals
from backend.structured_output import GrammarCompiler, GrammarState
from backend.trace import RequestTrace
from kernels import cpu_ext

log = logging.getLogger("inflight")

# How long an idle step waits for a grammar under compilation before it returns to the loop.
GRAMMAR_IDLE_WAIT_S = 0.05


@dataclass
class RequestOutput:
    """What one step produced for one request. Exactly one output per request has finished=True."""

    request_id: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_text: str = ""
    stop_reason: int | str | None = None
    error: RequestError | None = None
    cumulative_logprob: float | None = None
    # vLLM's shape: per new token, {token id: {"logprob", "rank", "decoded_token"}}.
    logprobs_delta: list[dict] | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # The request's trace (backend/trace.py), on its final output when it asked for one.
    trace: dict | None = None
    # Parallel sampling (n or best_of > 1). A group's output: `sequences[i]` is what this step
    # produced for its sequence i (None: nothing), over all best_of sequences; `returned` the
    # indices of the n sequences the client gets, in order (on the final output, the n with the
    # highest cumulative logprob when best_of > n). Its top-level counts cover the whole group.
    sequences: list[RequestOutput | None] | None = None
    returned: list[int] | None = None
    # A sequence's own output, before the engine folds it into its group's.
    group: SequenceGroup | None = None
    seq_index: int = 0

    @classmethod
    def of(cls, request: Request, text_delta: str, token_ids_delta: list[int], logprobs_delta: list[dict] | None = None,
           error: RequestError | None = None) -> RequestOutput:
        """The one builder: `request` as it stands, with what this step added to it. The
        output is final (finished=True) when the request has finished."""
        finished = request.is_finished
        return cls(
            request_id=request.request_id,
            text_delta=text_delta,
            token_ids_delta=token_ids_delta,
            finished=finished,
            finish_reason=request.finish_reason.value if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_text=request.prompt_text,
            stop_reason=request.stop_reason,
            error=error,
            cumulative_logprob=request.cumulative_logprob if request.needs_logprobs else None,
            logprobs_delta=logprobs_delta,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=time.monotonic() if finished else None,
            trace=request.trace.to_json() if finished and request.trace is not None else None,
            group=request.group,
            seq_index=request.seq_index,
        )

    @classmethod
    def of_group(cls, group: SequenceGroup, sequences: list[RequestOutput | None]) -> RequestOutput:
        """The group's output for one step, from its sequences' (indexed by sequence)."""
        leader = group.seqs[0]
        finished = group.finished
        errors = [o.error for o in sequences if o is not None and o.error is not None]
        returned = list(range(group.n))
        reason = None
        if finished:
            seqs = group.seqs
            if group.best_of > group.n and len(seqs) == group.best_of:
                returned = sorted(range(len(seqs)), key=lambda i: -seqs[i].cumulative_logprob)[: group.n]
            reasons = {r.finish_reason for r in seqs}
            for worst in (FinishReason.ERROR, FinishReason.ABORT):
                if worst in reasons:
                    reason = worst.value
                    break
            else:
                reason = seqs[returned[0]].finish_reason.value
        return cls(
            request_id=group.request_id,
            text_delta="",
            token_ids_delta=[],
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=leader.num_prompt_tokens,
            num_output_tokens=sum(r.num_output_tokens for r in group.seqs),
            prompt_text=leader.prompt_text,
            error=errors[0] if errors else None,
            num_cached_prompt_tokens=leader.num_cached_prompt_tokens,
            num_preemptions=leader.num_preemptions,
            arrival_time=leader.arrival_time,
            first_scheduled_time=leader.first_scheduled_time,
            first_token_time=leader.first_token_time,
            finish_time=time.monotonic() if finished else None,
            trace=group.trace if finished else None,
            sequences=sequences,
            returned=returned,
        )


def is_device_fault(exc: BaseException) -> bool:
    """Whether `exc` leaves the accelerator unusable for good: after a CUDA error such as an
    illegal address or a failed launch the context is lost, and every later step fails too.
    Running out of memory (torch.OutOfMemoryError, not an AcceleratorError) is not one: the
    step's memory is freed and the next may fit."""
    return isinstance(exc, torch.AcceleratorError)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        config = replace(config, max_num_batched_tokens=token_budget(config, self.device.type))
        self.config = config
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path, trust_remote_code=False)
        # Fast tokenizers are not safe to call from two threads at once; the loop decodes
        # while Triton's thread encodes new prompts.
        self.tokenizer_lock = threading.Lock()
        # By spaces_between_special_tokens (SamplingParams).
        self._decoders = {spaces: self._locked_decoder(spaces) for spaces in (True, False)}
        self.decode = self._decoders[True]
        arch, _ = load_arch(config.model_path)  # refuses unsupported checkpoints first, by name
        self.max_model_len = self._resolve_max_model_len(arch)
        self.model, self.hf_config = load_model(config.model_path, self.dtype, self.device, self.max_model_len)
        self.arch = self.model.arch
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        # Adapter name -> index among the stacked adapters (backend/lora.py), in multi_lora.json's order.
        lora_modules = config.lora_modules or {}
        adapters = [load_adapter(name, path, self.arch, config.max_lora_rank) for name, path in lora_modules.items()]
        install_adapters(self.model, adapters, self.dtype, self.device)
        self.lora_adapters = {adapter.name: i for i, adapter in enumerate(adapters)}
        for adapter in adapters:
            log.info("LoRA adapter %r: r=%d on %s (%s)", adapter.name, adapter.rank,
                     "/".join(adapter.target_modules), adapter.path)

        block_bytes = kv_block_bytes(self.arch, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV pool too small: {num_blocks} blocks of {block_bytes} bytes")
        num_host_blocks = config.swap_space_mb * 2**20 // block_bytes if config.preemption_mode == "swap" else 0
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 record_events=bool(config.kv_events_endpoint))
        self.kv_event_publisher = ZmqEventPublisher(
            config.kv_events_endpoint, config.kv_events_replay_endpoint or None, config.kv_events_topic,
        ) if config.kv_events_endpoint else None
        self.swap_space = SwapSpace(num_host_blocks) if num_host_blocks else None
        self.scheduler = Scheduler(config, self.kv, self.swap_space)
        self.runner = ModelRunner(config, self.model, self.arch, num_blocks, num_host_blocks, self.device, self.dtype)
        self.sampler = Sampler(config.seed)
        if self.device.type == "cuda":
            self.warm_up()
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # Requests whose grammar is still compiling: enqueued, not yet the scheduler's.
        self._awaiting_grammar: dict[str, Request] = {}
        # Written by the engine alone, once per step (and here): a new object each time, so
        # a reader on another thread always holds one whole snapshot.
        self._totals = Totals()
        self.stats = self._snapshot(StepStats())
        self._pending: list[RequestOutput] = []
        # Parallel-sampling groups by request id, until their final output.
        self._groups: dict[str, SequenceGroup] = {}
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
            "inflight engine: %s on %s/%s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, "
            "batch_invariant %s, CPU GEMM path %s",
            self.arch.architecture, self.device, self.dtype, num_blocks, config.block_size,
            num_blocks * block_bytes / 2**20, self.max_model_len, self.runner.batch_invariant,
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
            logits = self.runner.warm_up()
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

    def _resolve_max_model_len(self, arch) -> int:
        model_max = arch.max_position_embeddings
        if self.config.max_model_len:
            if self.config.max_model_len > model_max:
                raise ValueError(
                    f"max_model_len={self.config.max_model_len} exceeds the model's max_position_embeddings={model_max}"
                )
            return self.config.max_model_len
        default = min(model_max, MAX_MODEL_LEN_CAP)
        if arch.sliding_window is not None:  # honoured only within the window
            default = min(default, arch.sliding_window)
        return default

    def _blocks_for_memory(self, block_bytes: int) -> int:
        if self.device.type == "cuda" and self.config.gpu_memory_utilization > 0:
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_utilization) // block_bytes
        return self.config.kv_cache_memory_mb * 2**20 // block_bytes

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        try:
            generation = GenerationConfig.from_pretrained(self.config.model_path)
            eos = generation.eos_token_id
        except OSError:
            eos = None
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        return frozenset(ids)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    # ---- requests ----------------------------------------------------------------------

    def _locked_decoder(self, spaces_between_special_tokens: bool) -> Callable[[list[int], bool], str]:
        raw_decode = raw_decoder(self.tokenizer, spaces_between_special_tokens)

        def locked_decode(ids: list[int], skip_special_tokens: bool) -> str:
            with self.tokenizer_lock:
                return raw_decode(ids, skip_special_tokens)

        return locked_decode

    def tokenize(self, prompt: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer.encode(prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     needs_logprobs: bool = False, arrival_time: float | None = None, trace: bool = False) -> Request:
        """Tokenize and run every admission check that depends on the model; raise RequestError."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError.invalid("text_input", "must not be empty")
            prompt_ids = self.tokenize(prompt)
            prompt_text = prompt
        else:
            prompt_ids = list(prompt)
            prompt_text = ""
        if not prompt_ids:
            raise RequestError.invalid("text_input", "tokenizes to zero tokens")
        if params.top_k > self.vocab_size:
            raise RequestError.invalid("top_k", f"must be <= the vocabulary size {self.vocab_size} (got {params.top_k})")
        bad_ids = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_ids:
            raise RequestError.invalid("stop_token_ids", f"ids must be < the vocabulary size {self.vocab_size} (got {bad_ids})")
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        lora_index = self._lora_index(params.lora_name)
        max_tokens = resolve_max_tokens(len(prompt_ids), params.max_tokens, default=self.config.default_max_tokens,
                                        max_model_len=self.max_model_len, kv=self.kv)
        num_seqs = params.num_sequences
        if num_seqs > 1:
            self._check_group_fits(params, len(prompt_ids), max_tokens)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            arrival_seq=next(self._arrival_seq),
            eos_token_ids=self.eos_token_ids,
            prompt_text=prompt_text,
            # best_of > n ranks the sequences by cumulative logprob.
            needs_logprobs=needs_logprobs or params.logprobs is not None or num_seqs > params.n,
            bad_words_token_ids=bad_words_token_ids,
            lora_name=params.lora_name,
            lora_index=lora_index,
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

    def _lora_index(self, lora_name: str | None) -> int:
        if lora_name is None:
            return -1
        index = self.lora_adapters.get(lora_name)
        if index is None:
            known = sorted(self.lora_adapters)
            served = f"known adapters: {known}" if known else "this model serves no LoRA adapters (multi_lora.json)"
            raise RequestError.invalid("lora_name", f"unknown LoRA adapter {lora_name!r}; {served}")
        return index

    def _check_group_fits(self, params: SamplingParams, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a group that could never run whole: more sequences than max_num_seqs, or
        more KV blocks than the pool has (the prompt's once, each sequence's own tail)."""
        name = "best_of" if params.best_of is not None else "n"
        num_seqs = params.num_sequences
        if num_seqs > self.config.max_num_seqs:
            raise RequestError.invalid(name, f"{num_seqs} sequences exceed max_num_seqs {self.config.max_num_seqs}")
        kv = self.kv
        shared = num_prompt_tokens // kv.block_size
        blocks = shared + num_seqs * (kv.blocks_needed(num_prompt_tokens + max_tokens - 1) - shared)
        if blocks > kv.num_blocks:
            raise RequestError.invalid(
                name, f"{num_seqs} sequences of prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                f"need {blocks} KV blocks of {kv.block_size} tokens; the whole pool has {kv.num_blocks}")

    def _bad_words_token_ids(self, bad_words: list[str]) -> tuple[tuple[int, ...], ...]:
        """The token sequences the sampler keeps out of a request's output, as vLLM derives
        them: each word as text starts it and, where the tokenizer gives a different first
        token of the same length for it, as a word after a space."""
        sequences: list[tuple[int, ...]] = []
        for word in bad_words:
            with self.tokenizer_lock:
                alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
                spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not alone:
                raise RequestError.invalid("bad_words", f"{word!r} tokenizes to zero tokens")
            sequences.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        return tuple(dict.fromkeys(sequences))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    needs_logprobs: bool = False, arrival_time: float | None = None, trace: bool = False) -> Request:
        request = self.make_request(request_id, prompt, params or SamplingParams(), needs_logprobs, arrival_time, trace)
        self.enqueue(request)
        return request

    def check_queue_room(self, num_arriving: int = 0) -> None:
        """Refuse (UNAVAILABLE) a request for which the waiting queue, with `num_arriving`
        more already on their way to it, has no room."""
        if self.num_waiting + num_arriving >= self.config.max_queue_len:
            raise RequestError(
                RequestError.UNAVAILABLE,
                f"waiting queue is full ({self.config.max_queue_len} requests, max_queue_len); retry later",
            )

    def enqueue(self, request: Request) -> None:
        self.check_queue_room()
        if request.request_id in self.scheduler.requests or request.request_id in self._awaiting_grammar:
            raise RequestError.invalid("request_id", f"{request.request_id!r} is already in flight")
        self._add_detokenizer(request)
        if request.group is not None:
            self._groups[request.request_id] = request.group
        if request.trace is not None:
            request.trace.queued(self._step_index, running=self.num_running, waiting_ahead=self.num_waiting)
            self._num_traced += 1
        if request.grammar is not None:  # admitted by the next step that finds its grammar compiled
            self._awaiting_grammar[request.request_id] = request
        else:
            self.scheduler.add_request(request)
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
                self.scheduler.add_request(request)
        return outputs

    def _add_detokenizer(self, request: Request) -> None:
        params = request.params
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output, decode=self._decoders[params.spaces_between_special_tokens],
        )

    def abort(self, request_id: str) -> bool:
        """End a request (every sequence of it) now, freeing its blocks in this call; its
        final output comes with the next step."""
        group = self._groups.get(request_id)
        if group is not None:  # any live sequence: finishing one ends them all (`finish`)
            request = next((r for r in group.seqs if not r.is_finished), None)
        else:
            request = self.scheduler.requests.get(request_id) or self._awaiting_grammar.get(request_id)
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
        request.grammar = None  # a finished request keeps no matcher
        if self.scheduler.finish_request(request, reason, stop_reason) or was_compiling:
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
        return RequestOutput.of(request, text, token_ids or [], logprobs_delta, error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or bool(self._awaiting_grammar)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued, or waiting for their grammar."""
        return len(self.scheduler.waiting) + len(self._awaiting_grammar)

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

    # ---- the iteration -----------------------------------------------------------------

    def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One iteration; its snapshot is `self.stats` when it returns.

        `interrupt` is asked between the layers of the forward pass; when it answers True
        the pass is abandoned with nothing advanced (the scheduled tokens are computed again
        by a later step, as after a preemption), so that an abort need not wait for a long
        prefill to finish. Its requests keep their blocks and places."""
        outputs, self._pending = self._pending, []
        self._step_index += 1
        if self._awaiting_grammar:
            if not self.scheduler.has_work() and not outputs:
                # Nothing to run until a grammar is ready: wait for one, briefly, rather than spin
                # against the compiler for the CPU (the loop still sees commands between steps).
                wait_futures([r.grammar.compiled for r in self._awaiting_grammar.values()],
                             timeout=GRAMMAR_IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            outputs.extend(self._admit_compiled())
        plan = self.scheduler.schedule()
        if self._num_traced:
            self._trace_plan(plan)
        for request in plan.preempted:
            if request.grammar is not None and request.num_computed_tokens == 0:
                request.grammar.release()  # recompute: rebuilt from its tokens when next sampled
        num_running, num_waiting = self.num_running, self.num_waiting
        ran, num_generated, prepare_s, forward_s, update_s = False, 0, 0.0, 0.0, 0.0
        if not plan.is_empty:
            start = time.perf_counter()
            try:
                if self._fail_at_batch and len(plan.scheduled) >= self._fail_at_batch:
                    self._fail_at_batch = 0
                    raise RuntimeError("injected fault (INFLIGHT_FAULT_INJECT_AT_BATCH)")
                if self._stall_at_batch and len(plan.scheduled) >= self._stall_at_batch:
                    log.error("injected stall (INFLIGHT_FAULT_STALL_AT_BATCH): this step never ends")
                    threading.Event().wait()
                inputs = self.runner.prepare(plan)
                prepared = time.perf_counter()
                logits, sample_requests = self.runner.execute(plan, inputs, interrupt)
                if logits is not None and self.scheduler.has_unforked_leaders:
                    logits, sample_requests = self._fork_groups(logits, sample_requests)
                sampled = self.sampler(logits, sample_requests) if logits is not None else None
            except StepInterrupted:
                log.info("step of %d tokens interrupted", plan.num_scheduled_tokens)
                self.scheduler.refund(plan)  # its tokens are computed, and charged, by a later step
            except Exception as exc:  # every in-flight request must end, whatever broke
                log.error("forward pass failed; failing %d in-flight requests\n%s", len(plan.scheduled), traceback.format_exc())
                outputs.extend(self._fail_scheduled(plan, exc))
                if is_device_fault(exc) and self.device_fault is None:
                    self.device_fault = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            else:
                forwarded = time.perf_counter()
                tokens = dict(zip(sample_requests, sampled.token_ids)) if sampled else {}
                rejected = self._advance_grammars(tokens)
                self.scheduler.update(plan, tokens)
                if self._num_traced:
                    self._trace_step(plan, forwarded - start)
                for row, request in enumerate(sample_requests):
                    if request in rejected:
                        outputs.append(self.finish(request, FinishReason.ERROR, error=rejected[request]))
                    else:
                        outputs.append(self._output_for(request, tokens[request], sampled, row))
                ran, num_generated = True, len(tokens)
                prepare_s, forward_s, update_s = prepared - start, forwarded - prepared, time.perf_counter() - forwarded
        step = StepStats(
            ran=ran, num_running=num_running, num_waiting=num_waiting, num_scheduled_tokens=plan.num_scheduled_tokens,
            num_generated_tokens=num_generated, num_preempted=len(plan.preempted),
            prefix_query_tokens=plan.prefix_query_tokens, prefix_hit_tokens=plan.prefix_hit_tokens,
            prefilled_prompt_tokens=plan.prefilled_prompt_tokens,
            first_token_latencies_s=tuple(plan.first_token_latencies_s),
            inter_token_latencies_s=tuple(plan.inter_token_latencies_s),
            service_by_tenant=tuple(plan.service_by_tenant.items()),
            schedule_time_s=plan.schedule_time_s, prepare_time_s=prepare_s, forward_time_s=forward_s,
            update_time_s=update_s,
        )
        self._totals = self._totals.with_step(step)
        self.stats = self._snapshot(step)
        self._publish_kv_events()
        return self._fold_groups(outputs) if self._groups else outputs

    def _fork_groups(self, logits: torch.Tensor, sample_requests: list[Request]) -> tuple[torch.Tensor, list[Request]]:
        """Fork each group leader that samples its first token now: its sequences join the
        running batch sharing its blocks, and sample from its logits row, each with its own
        generator (sequence i of a request with seed s uses seed s + i)."""
        rows: list[int] = []
        requests: list[Request] = []
        for row, request in enumerate(sample_requests):
            rows.append(row)
            requests.append(request)
            num_children = request.seqs_to_fork
            for i in range(1, num_children + 1):
                child = self._fork(request, i)
                rows.append(row)
                requests.append(child)
        if len(requests) == len(sample_requests):
            return logits, sample_requests
        return logits[torch.tensor(rows, device=logits.device)], requests

    def _fork(self, leader: Request, seq_index: int) -> Request:
        group = leader.group
        params = leader.params
        child = Request(
            request_id=f"{leader.request_id}/{seq_index}",
            prompt_token_ids=leader.prompt_token_ids,
            params=params,
            max_tokens=leader.max_tokens,
            arrival_time=leader.arrival_time,
            arrival_seq=leader.arrival_seq,
            eos_token_ids=leader.eos_token_ids,
            prompt_text=leader.prompt_text,
            needs_logprobs=leader.needs_logprobs,
            bad_words_token_ids=leader.bad_words_token_ids,
            num_cached_prompt_tokens=leader.num_cached_prompt_tokens,
            first_scheduled_time=leader.first_scheduled_time,
            group=group,
            seq_index=seq_index,
            lora_name=leader.lora_name,
            lora_index=leader.lora_index,
        )
        if leader.grammar is not None:  # the same compiled grammar, a matcher of its own
            child.grammar = GrammarState(leader.grammar.compiled)
        # Computed once the step that forks it ends: the leader's whole prefill.
        child.num_computed_tokens = leader.num_tokens
        if params.seed is not None:
            child.generator = Sampler.make_request_generator(params.seed + seq_index)
        group.seqs.append(child)
        if len(group.seqs) == group.best_of:
            group.forked = True
        self._add_detokenizer(child)
        self.scheduler.fork(leader, child)
        return child

    def _fold_groups(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per group per step in place of its sequences' (RequestOutput.of_group);
        the group's final output once every sequence has ended."""
        folded: list[RequestOutput | SequenceGroup] = []
        by_group: dict[SequenceGroup, list[RequestOutput | None]] = {}
        for output in outputs:
            group = output.group
            if group is None:
                folded.append(output)
                continue
            sequences = by_group.get(group)
            if sequences is None:
                sequences = by_group[group] = [None] * group.best_of
                folded.append(group)
            sequences[output.seq_index] = output
            if output.finished:
                group.done.add(output.seq_index)
                if output.seq_index == 0:
                    group.trace = output.trace
        result = []
        for item in folded:
            if isinstance(item, SequenceGroup):
                output = RequestOutput.of_group(item, by_group[item])
                if output.finished:
                    self._groups.pop(item.request_id, None)
                item = output
            result.append(item)
        return result

    def _trace_plan(self, plan: SchedulerOutput) -> None:
        """What this step's plan did to traced requests before it ran: preemptions and returns."""
        step = self._step_index
        for victim, (cause, computed) in zip(plan.preempted, plan.preemption_causes):
            if victim.trace is not None:
                mode = "swap" if victim.swapped_block_ids else "recompute"
                victim.trace.preempted(step, mode=mode, reason=cause,
                                       computed_tokens_lost=0 if mode == "swap" else computed)
        for request, _ in plan.scheduled:
            trace = request.trace
            if trace is None:
                continue
            if not trace.scheduled_before:
                queued_at = trace.events[0]["step"] if trace.events else step
                trace.first_scheduled(step, request.first_scheduled_time, waiting_steps=step - queued_at)
                if request.num_cached_prompt_tokens:
                    trace.prefix_cache_hit(step, blocks=request.num_cached_prompt_tokens // self.kv.block_size,
                                           tokens=request.num_cached_prompt_tokens)
            if request.num_preemptions > trace.returns:
                trace.returns += 1
                trace.readmitted(step, swapped_in=request in plan.swapped_in)

    def _trace_step(self, plan: SchedulerOutput, step_s: float) -> None:
        """What this step computed for traced requests, in the batch it shared."""
        step, now = self._step_index, time.monotonic()
        batch_requests, batch_tokens = len(plan.scheduled), plan.num_scheduled_tokens
        for request, num_new in plan.scheduled:
            trace = request.trace
            if trace is None or request.is_finished:
                continue
            computed_before = request.num_computed_tokens - num_new
            trace.scheduled(step, now, tokens=num_new, prefill=computed_before < request.num_prompt_tokens,
                            prompt_done=min(request.num_computed_tokens, request.num_prompt_tokens),
                            prompt_tokens=request.num_prompt_tokens, batch_requests=batch_requests,
                            batch_tokens=batch_tokens, step_ms=step_s * 1000.0)
            if request.first_token_time is not None and not trace.first_token_seen:
                trace.first_token_seen = True
                trace.first_token(step, now)
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
        running = self.scheduler.running
        pool = self.kv.pool
        counts: dict[str, list[int]] = {}
        for request in self.scheduler.requests.values():
            counts.setdefault(request.tenant, [0, 0])[request.status is not RequestStatus.RUNNING] += 1
        lora = {}
        if self.lora_adapters:
            lora = dict(
                running_lora_adapters=tuple(sorted({r.lora_name for r in running if r.lora_name is not None})),
                waiting_lora_adapters=tuple(sorted({r.lora_name for r in self.scheduler.waiting if r.lora_name is not None})),
                max_loras=self.config.max_loras,
            )
        return EngineStats(
            num_running=len(running), num_waiting=self.num_waiting,
            num_prefilling=sum(1 for r in running if r.num_computed_tokens < len(r.prompt_token_ids)),
            num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free,
            requests_by_tenant=tuple((tenant, n[0], n[1]) for tenant, n in sorted(counts.items())),
            step=step, totals=self._totals, **lora,
        )

    def _advance_grammars(self, tokens: dict[Request, int]) -> dict[Request, RequestError]:
        """Feed each constrained request's sampled token to its matcher; the requests whose
        token the grammar refused, with their error (the mask allows only tokens it accepts,
        so this is a broken invariant, not a client's doing)."""
        rejected = {}
        for request, token_id in tokens.items():
            if request.grammar is not None and not request.grammar.accept(request, token_id):
                rejected[request] = RequestError(
                    RequestError.INTERNAL, f"internal error: structured_outputs: sampled token {token_id} is outside the grammar")
        return rejected

    def _output_for(self, request: Request, token_id: int, sampled, row: int) -> RequestOutput:
        detok = self.detokenizers[request.request_id]
        stop = check_stop(request, token_id, detok.add_token)
        if stop is None and request.grammar is not None and request.grammar.is_terminated:
            stop = (FinishReason.STOP, None)  # the grammar took its stop token (ignore_eos or not)
        lp = sampled.logprobs[row]
        if lp is not None:
            request.cumulative_logprob += lp
        logprobs_delta = None
        if request.params.logprobs is not None:
            logprobs_delta = [self._logprob_entry(token_id, lp, sampled.top_logprobs[row])]
        if stop is not None:
            return self.finish(request, *stop, token_ids=[token_id], logprobs_delta=logprobs_delta)
        return RequestOutput.of(request, detok.take_delta(finished=False), [token_id], logprobs_delta)

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
        def decoded(t: int) -> str:
            return self.decode([t], False)

        entry = {token_id: {"logprob": logprob, "rank": None, "decoded_token": decoded(token_id)}}
        for rank, (t, value) in enumerate(top or [], start=1):
            if t == token_id:
                entry[t]["rank"] = rank
            else:
                entry[t] = {"logprob": value, "rank": rank, "decoded_token": decoded(t)}
        if entry[token_id]["rank"] is None:
            entry[token_id]["rank"] = (len(top) + 1) if top else 1
        return entry

    def _fail_scheduled(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A failed forward pass ends every request it carried; the engine stays usable."""
        outputs = []
        error = RequestError(RequestError.INTERNAL, f"engine error in the forward pass: {exc}")
        for request, _ in plan.scheduled:
            if request.is_finished:
                continue
            outputs.append(self.finish(request, FinishReason.ERROR, error=error))
        return outputs

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Request]:
        """Offline convenience: run prompts to completion; returns finished requests in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.add_request(f"offline-{next(self._arrival_seq)}", p, sp) for p, sp in zip(prompts, params_list)]
        while self.has_unfinished():
            self.step()
        return requests
