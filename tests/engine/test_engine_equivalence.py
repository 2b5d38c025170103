"""Greedy output of the engine is token-identical to `transformers` `generate()`.

Whatever the scheduler does — requests arriving at different steps into a full batch,
chunked prefill crossing block edges, prefix-cache hits, preemption by recompute or by
swap, priority and static policies — each request's greedy tokens must be exactly what
`transformers` produces for that prompt alone (`tests/checkpoints.hf_greedy`).

Most tests run on a tiny random-weight Llama (milliseconds per step); one `slow` test
runs the real default checkpoint (SmolLM2-135M-Instruct) on chat prompts.
"""

from __future__ import annotations

import collections
import importlib
import os
import random

import pytest
import torch

import kernels
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.paths import DEFAULT_CHECKPOINT
from backend.request import SamplingParams
from kernels.paged_attention import attention_config
from tests.checkpoints import hf_greedy

MAX_NEW = 16
VOCAB = 49152


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(length)]  # 0..2 are special tokens


_rng = random.Random(1234)
# 20 prompts of different lengths: 1 token, within one block, exactly a block, across
# several blocks; lengths 16/32/48 end on block edges.
LENGTHS = [1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 48, 55, 63, 70, 81, 3, 12]
PROMPTS = [_random_prompt(_rng, n) for n in LENGTHS]
# A shared "system prompt" of 37 tokens (two full blocks of 16 and a partial one) with
# different user suffixes, and one that is exactly the shared prefix.
SYSTEM = _random_prompt(_rng, 37)
SHARED_PROMPTS = [SYSTEM + _random_prompt(_rng, n) for n in (1, 4, 11, 19, 26, 8, 30, 2)] + [list(SYSTEM)]
# Per-request max_tokens vary so that requests leave the batch at different steps.
MAX_TOKENS = [MAX_NEW - (i * 5) % 9 for i in range(len(PROMPTS) + len(SHARED_PROMPTS))]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"))
# Every tiny-model test runs on the CPU's C++ kernels and, on a GPU, on the compiled Triton
# kernels (with cuBLAS in IEEE float32), against the same CPU oracle.
ON_EVERY_DEVICE = pytest.mark.parametrize("device", ["cpu", _CUDA])
# The two scenarios that vary most what the attention and KV kernels see (decodes beside
# prefill chunks that start and end inside blocks; chunks after a prefix-cache hit, over
# blocks another request wrote) also run the CUDA path's Triton kernels in Triton's
# interpreter on the CPU (`run_engine`): how the engine calls them is checked wherever the
# suite runs. The interpreter takes ~20 s a test on 2 cores, so not every scenario.
ON_EVERY_KERNEL_PATH = pytest.mark.parametrize(
    "device", ["cpu", pytest.param("triton-on-cpu", marks=pytest.mark.slow), _CUDA])


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint) -> dict[tuple[int, ...], list[int]]:
    prompts = PROMPTS + SHARED_PROMPTS
    outputs = hf_greedy(tiny_checkpoint, prompts, MAX_NEW)
    return {tuple(p): out for p, out in zip(prompts, outputs)}


def run_engine(model_path: str, prompts: list[list[int]], max_tokens: list[int], arrivals: list[int],
               priorities: list[int] | None = None, on_engine=None, tenants: list[str] | None = None,
               lora_names: list[str | None] | None = None, **config):
    """Drive `engine.step()` with requests arriving at the given steps.

    Returns (engine, {request id: streamed token ids}, {request id: prompt}) and checks on
    the way that every request gets exactly one final output and the batch never exceeds
    max_num_seqs. `device` "triton-on-cpu": on the CPU, through the CUDA path's Triton kernels
    (run by Triton's interpreter) and its per-module forward pass.
    """
    triton_on_cpu = config.get("device") == "triton-on-cpu"
    if triton_on_cpu:
        config["device"] = "cpu"
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    engine = LLMEngine(EngineConfig(model_path=model_path, **config))
    if triton_on_cpu:
        engine.model.cpu_layers = None   # each layer's one C++ call would take none of the kernels
    if on_engine is not None:
        on_engine(engine)
    if not triton_on_cpu:
        return _drive(engine, prompts, max_tokens, arrivals, priorities, tenants, lora_names)
    attention = kernels.paged_attention_triton
    launches = []
    kernels.paged_attention_triton = lambda *args, **kw: launches.append(1) or attention(*args, **kw)
    try:
        with kernels.triton_kernels_on_cpu():
            result = _drive(engine, prompts, max_tokens, arrivals, priorities, tenants, lora_names)
    finally:
        kernels.paged_attention_triton = attention
    assert len(launches) >= engine.arch.num_layers, "the Triton kernels did not run"
    return result


def _drive(engine: LLMEngine, prompts, max_tokens, arrivals, priorities, tenants, lora_names):
    priorities = priorities or [0] * len(prompts)
    tenants = tenants or ["default"] * len(prompts)
    lora_names = lora_names or [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    streamed: dict[str, list[int]] = collections.defaultdict(list)
    finals: collections.Counter = collections.Counter()
    requests = {}
    step = 0
    max_running = 0
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True, priority=priorities[i],
                                    tenant=tenants[i], lora_name=lora_names[i])
            requests[f"r{i}"] = engine.add_request(f"r{i}", prompts[i], params)
        for out in engine.step():
            assert finals[out.request_id] == 0, f"output after the final one for {out.request_id}"
            streamed[out.request_id].extend(out.token_ids_delta)
            if out.finished:
                finals[out.request_id] += 1
                assert out.error is None and out.finish_reason == "length", out
        max_running = max(max_running, engine.num_running)
        assert engine.num_running <= engine.config.max_num_seqs
        step += 1
        assert step < 5000, "engine did not finish"
    assert set(finals) == set(requests) and all(v == 1 for v in finals.values())
    for rid, request in requests.items():
        assert streamed[rid] == request.output_token_ids
    # Everything is released at the end.
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    engine.kv.pool.check_invariants()
    engine.max_running = max_running
    return engine, dict(streamed), {f"r{i}": p for i, p in enumerate(prompts)}


def assert_matches_oracle(oracle, streamed, prompts, max_tokens):
    mismatches = []
    for rid, tokens in streamed.items():
        i = int(rid[1:])
        want = oracle[tuple(prompts[rid])][: max_tokens[i]]
        if tokens != want:
            first = next((k for k, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
            mismatches.append(f"{rid} (prompt of {len(prompts[rid])} tokens) differs from token {first}: {tokens} != {want}")
    assert not mismatches, "\n".join(mismatches)


def probe_logprobs(engine: LLMEngine, probe: list[int], params: SamplingParams,
                   others: list[tuple[list[int], SamplingParams]] = ()) -> list[float]:
    """The probe's sampled-token logprobs, run to its end beside `others` (added before it): what
    the batch-invariance tests compare alone and in a busy batch."""
    for i, (prompt, other_params) in enumerate(others):
        engine.add_request(f"other-{i}", prompt, other_params)
    engine.add_request("probe", probe, params)
    logprobs: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "probe":
                logprobs.extend(next(iter(e.values()))["logprob"] for e in out.logprobs_delta or [])
    return logprobs


def spread_arrivals(n: int, every: int = 2) -> list[int]:
    return [(i // 3) * every for i in range(n)]


@ON_EVERY_DEVICE
def test_staggered_arrivals_with_a_full_batch(tiny_checkpoint, oracle, device):
    """20 prompts of different lengths arriving over ~12 steps, 4 seats."""
    arrivals = spread_arrivals(len(PROMPTS))
    engine, streamed, prompts = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, device=device, max_num_seqs=4, num_kv_blocks=256)
    assert engine.max_running == 4, "the batch never filled up"
    assert_matches_oracle(oracle, streamed, prompts, MAX_TOKENS)


@ON_EVERY_KERNEL_PATH
def test_odd_chunk_size_crossing_block_edges(tiny_checkpoint, oracle, device):
    arrivals = spread_arrivals(len(PROMPTS), every=1)
    chunks = []

    def record_chunks(engine):
        schedule = engine.scheduler.schedule

        def wrapped():
            plan = schedule()
            chunks.extend((r.num_computed_tokens, n) for r, n in plan.scheduled)
            return plan

        engine.scheduler.schedule = wrapped

    engine, streamed, prompts = run_engine(
        tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, on_engine=record_chunks, device=device,
        max_num_seqs=6, long_prefill_token_threshold=7, max_num_batched_tokens=40, num_kv_blocks=256,
    )
    assert max(n for _, n in chunks) == 7
    assert any(start // 16 != (start + n - 1) // 16 for start, n in chunks), "no chunk crossed a block edge"
    assert_matches_oracle(oracle, streamed, prompts, MAX_TOKENS)


@ON_EVERY_KERNEL_PATH
def test_prefix_cache_hits(tiny_checkpoint, oracle, device):
    # The first shared prompt runs alone, then the others arrive and hit its blocks.
    prompts = SHARED_PROMPTS + PROMPTS[:8]
    max_tokens = MAX_TOKENS[: len(prompts)]
    arrivals = [0] + [3 + i // 4 for i in range(len(prompts) - 1)]
    engine, streamed, by_id = run_engine(tiny_checkpoint, prompts, max_tokens, arrivals, device=device, max_num_seqs=5,
                                         long_prefill_token_threshold=20, num_kv_blocks=256)
    assert engine.stats.totals.prefix_hit_rate > 0
    assert engine.stats.totals.prefix_hit_tokens >= 32 * (len(SHARED_PROMPTS) - 1), "the shared blocks were not reused"
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


@ON_EVERY_DEVICE
def test_prefix_caching_disabled(tiny_checkpoint, oracle, device):
    prompts = SHARED_PROMPTS + PROMPTS[:8]
    max_tokens = MAX_TOKENS[: len(prompts)]
    arrivals = [0] + [3 + i // 4 for i in range(len(prompts) - 1)]
    engine, streamed, by_id = run_engine(tiny_checkpoint, prompts, max_tokens, arrivals, device=device, max_num_seqs=5,
                                         enable_prefix_caching=False, num_kv_blocks=256)
    assert engine.stats.totals.prefix_hit_rate == 0 and engine.kv.pool.cached == {}
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


def _count_swaps(counter: collections.Counter):
    def install(engine):
        swap = engine.runner.swap

        def wrapped(plan):
            counter["swap_out"] += len(plan.swap_out)
            counter["swap_in"] += len(plan.swap_in)
            return swap(plan)

        engine.runner.swap = wrapped

    return install


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@ON_EVERY_DEVICE
def test_preemption_under_a_tiny_kv_pool(tiny_checkpoint, oracle, mode, device):
    """14 blocks of 8 tokens for 6 seats: requests keep evicting each other."""
    prompts = PROMPTS[:14] + SHARED_PROMPTS[:4]
    max_tokens = MAX_TOKENS[: len(prompts)]
    arrivals = spread_arrivals(len(prompts), every=1)
    swaps: collections.Counter = collections.Counter()
    engine, streamed, by_id = run_engine(
        tiny_checkpoint, prompts, max_tokens, arrivals, on_engine=_count_swaps(swaps), device=device,
        max_num_seqs=6, block_size=8, num_kv_blocks=14, long_prefill_token_threshold=13,
        preemption_mode=mode, swap_space_mb=1, max_preemptions=3,
    )
    assert engine.stats.totals.preemptions > 0
    if mode == "swap":
        assert swaps["swap_out"] > 0 and swaps["swap_in"] > 0, swaps
    else:
        assert swaps["swap_out"] == swaps["swap_in"] == 0
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


@ON_EVERY_DEVICE
def test_priority_policy(tiny_checkpoint, oracle, device):
    prompts = PROMPTS[:12] + SHARED_PROMPTS[:4]
    max_tokens = MAX_TOKENS[: len(prompts)]
    arrivals = spread_arrivals(len(prompts), every=1)
    priorities = [(i * 7) % 4 for i in range(len(prompts))]
    engine, streamed, by_id = run_engine(
        tiny_checkpoint, prompts, max_tokens, arrivals, priorities, device=device,
        scheduling_policy="priority", max_num_seqs=4, block_size=8, num_kv_blocks=20, long_prefill_token_threshold=16,
    )
    assert engine.stats.totals.preemptions > 0, "expected priority or block-pressure preemption"
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@ON_EVERY_DEVICE
def test_fair_policy(tiny_checkpoint, oracle, mode, device):
    """Three tenants (one weighted 3x) and two priorities on a pool small enough to preempt:
    admission and victims follow the tenants' counters, the tokens stay transformers'."""
    prompts = PROMPTS[:12] + SHARED_PROMPTS[:6]
    max_tokens = MAX_TOKENS[: len(prompts)]
    arrivals = spread_arrivals(len(prompts), every=1)
    tenants = [("gold", "free", "free", "batch")[i % 4] for i in range(len(prompts))]
    priorities = [1 if i % 5 == 4 else 0 for i in range(len(prompts))]
    engine, streamed, by_id = run_engine(
        tiny_checkpoint, prompts, max_tokens, arrivals, priorities, tenants=tenants, device=device, scheduling_policy="fair",
        tenant_weights={"gold": 3.0}, max_num_seqs=5, block_size=8, num_kv_blocks=18, long_prefill_token_threshold=13,
        preemption_mode=mode, swap_space_mb=1, max_preemptions=3,
    )
    assert engine.stats.totals.preemptions > 0
    assert engine.scheduler.policy.kind == "fair"
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


@ON_EVERY_DEVICE
def test_static_policy(tiny_checkpoint, oracle, device):
    arrivals = spread_arrivals(len(PROMPTS))
    engine, streamed, prompts = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, device=device,
                                           scheduling_policy="static", max_num_seqs=5, num_kv_blocks=256)
    assert engine.max_running == 5
    assert_matches_oracle(oracle, streamed, prompts, MAX_TOKENS)


# --------------------------------------------------------------------------------------
# The real default checkpoint
# --------------------------------------------------------------------------------------

def test_warm_up_launches_both_attention_tile_shapes_and_leaves_no_trace(tiny_checkpoint, oracle):
    """`LLMEngine.warm_up` (at load on CUDA), driven here through the Triton kernels in the
    interpreter: it launches attention for decodes alone (16-row tiles) and for a chunk
    (64-row tiles), leaves the KV pool zeroed and the engine's random stream where it was,
    and the engine then gives transformers' tokens."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_num_seqs=4, max_num_batched_tokens=64))
    engine.model.cpu_layers = None   # the CUDA path's per-module forward pass
    random_state = engine.sampler.generator.get_state()
    attention = kernels.paged_attention_triton
    max_seqlen_q = []
    kernels.paged_attention_triton = lambda *args, **kw: max_seqlen_q.append(args[7]) or attention(*args, **kw)
    try:
        with kernels.triton_kernels_on_cpu():
            engine.warm_up()
    finally:
        kernels.paged_attention_triton = attention
    tiles = {attention_config(2, 16, 4, q)["BLOCK_M"] for q in max_seqlen_q}
    assert tiles == {16, 64}, max_seqlen_q
    assert all(not k.any() and not v.any() for k, v in engine.runner.kv_caches)
    assert torch.equal(engine.sampler.generator.get_state(), random_state)
    prompts = PROMPTS[:8]
    _, streamed, by_id = _drive(engine, prompts, MAX_TOKENS, spread_arrivals(len(prompts)), None, None, None)
    assert_matches_oracle(oracle, streamed, by_id, MAX_TOKENS)


def test_a_warm_up_out_of_memory_names_the_parameters_to_lower(tiny_checkpoint, monkeypatch):
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64,
                                    max_num_seqs=48, max_num_batched_tokens=4096))

    def out_of_memory(max_model_len: int):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    monkeypatch.setattr(engine.runner, "warm_up", out_of_memory)
    with pytest.raises(ValueError) as err:
        engine.warm_up()
    message = str(err.value)
    assert "max_num_batched_tokens=4096" in message and "max_num_seqs=48" in message and "64 blocks" in message
    assert "lower kv_cache_memory_mb, max_num_batched_tokens or max_num_seqs" in message
    assert "Tried to allocate 2.00 GiB" in message and "more lines" not in message


@pytest.mark.parametrize("num_kv_blocks", [1, 2, 5])
def test_warm_up_stays_inside_a_small_pool(tiny_checkpoint, num_kv_blocks):
    """A pool smaller than the largest step (a test's, on CUDA) warms smaller steps and writes
    no slot past the pool (which on the CPU crashes the process, on CUDA faults the device)."""
    engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks))
    engine.model.cpu_layers = None
    engine.warm_up()
    assert all(not k.any() and not v.any() for k, v in engine.runner.kv_caches)


def _compiled_variants() -> dict[str, int]:
    """How many variants of each Triton kernel are compiled, on every device."""
    from triton.runtime.jit import JITFunction

    counts = {}
    for module in ("activation", "kv_store", "lora", "paged_attention", "rms_norm", "rotary"):
        for name, fn in vars(importlib.import_module(f"kernels.{module}")).items():
            if isinstance(fn, JITFunction):
                counts[f"{module}.{name}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


@pytest.mark.parametrize("device", [_CUDA])
def test_no_kernel_compiles_after_the_engine_loads(tiny_checkpoint, oracle, device):
    """The engine compiles at load every Triton kernel variant its steps launch: steps of
    decodes alone and of chunks beside decodes, block tables of every width (1, 16, others),
    so no request waits for Triton's compiler."""
    long_prompt = _random_prompt(random.Random(5), 300)
    prompts = PROMPTS[:10] + [long_prompt]
    max_tokens = MAX_TOKENS[:10] + [MAX_NEW]
    at_load = {}
    engine, streamed, by_id = run_engine(tiny_checkpoint, prompts, max_tokens, spread_arrivals(len(prompts)),
                                         on_engine=lambda _: at_load.update(_compiled_variants()), device=device,
                                         max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=256)
    assert any(at_load.values()), "nothing was compiled at load"
    assert _compiled_variants() == at_load
    del streamed[f"r{len(prompts) - 1}"]   # the oracle has no 300-token prompt
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


QUESTIONS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a transformer neural network is.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly.",
    "What is 12 times 12?",
    "Give me a name for a pet turtle.",
    "Summarise the following text in a few words: The quick brown fox jumps over the lazy dog. "
    "The dog does not react, and the fox runs off into the forest, where it meets an owl "
    "that asks it why it is in such a hurry.",
    "What does CPU stand for?",
    "Describe the colour green to someone who cannot see.",
    "Tell me a fun fact about octopuses.",
    "What is the boiling point of water at sea level in Celsius?",
    "Suggest a title for a short story about a lighthouse keeper who finds a message in a bottle "
    "that was written by her grandmother fifty years earlier.",
    "Is a tomato a fruit or a vegetable?",
]


@pytest.mark.slow
def test_default_checkpoint_chat_prompts_match_transformers():
    assert os.path.isfile(os.path.join(DEFAULT_CHECKPOINT, "config.json")), f"{DEFAULT_CHECKPOINT} missing: run `make setup`"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) >= 8, "16 prompts of varied lengths"
    max_new = 24
    max_tokens = [max_new] * len(prompts)
    arrivals = [(i // 4) * 2 for i in range(len(prompts))]
    engine, streamed, by_id = run_engine(str(DEFAULT_CHECKPOINT), prompts, max_tokens, arrivals,
                                         max_num_seqs=8, num_kv_blocks=256, long_prefill_token_threshold=32)
    assert engine.max_running == 8
    reference = hf_greedy(str(DEFAULT_CHECKPOINT), prompts, max_new)
    oracle = {tuple(p): out for p, out in zip(prompts, reference)}
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)
    # The engine's answer to the classic question reads as it should.
    first = tokenizer.decode(streamed["r0"], skip_special_tokens=True)
    assert "Paris" in first, first
