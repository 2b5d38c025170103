"""Decode steps through CUDA graphs (backend/cuda_graphs.py) give transformers' greedy tokens.

On a GPU the engine records its decode step at load and replays it; the tests check that the
replayed steps, padded to the recorded sizes, stream exactly the oracle's tokens under
continuous arrivals, chunked prefill and preemption. Where there is no GPU the same static
buffers and padding run eagerly (`capture_decode_graphs(capture=False)`) through the C++
kernels and, slowly, the CUDA path's Triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import collections

import pytest
import torch

from backend.config import EngineConfig
from backend.cuda_graphs import capture_sizes
from tests.checkpoints import hf_greedy
from tests.engine.test_engine_equivalence import (
    MAX_NEW,
    MAX_TOKENS,
    PROMPTS,
    SHARED_PROMPTS,
    assert_matches_oracle,
    run_engine,
    spread_arrivals,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint) -> dict[tuple[int, ...], list[int]]:
    prompts = PROMPTS + SHARED_PROMPTS
    return {tuple(p): out for p, out in zip(prompts, hf_greedy(tiny_checkpoint, prompts, MAX_NEW))}


def test_the_recorded_sizes_end_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert EngineConfig(model_path="x").enforce_eager is False


def _with_graphs(padded: collections.Counter):
    """Set the engine's decode graphs up (recorded on CUDA, where the engine has them already;
    static buffers run eagerly elsewhere) and count each staged step as (requests, graph size)."""
    def install(engine):
        if engine.device.type != "cuda":
            engine.runner.capture_decode_graphs(engine.max_model_len, capture=False)
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.sizes == capture_sizes(engine.config.max_num_seqs)
        stage = graphs.stage

        def counted(batch, input_ids, *rest):
            padded[(len(input_ids), batch)] += 1
            return stage(batch, input_ids, *rest)

        graphs.stage = counted
    return install


@pytest.mark.parametrize("device", ["cpu", pytest.param("triton-on-cpu", marks=pytest.mark.slow), _CUDA])
def test_padded_decode_steps_give_the_oracles_tokens(tiny_checkpoint, oracle, device):
    """20 prompts arriving over ~12 steps into 6 seats (recorded sizes 1, 2, 4, 6): decode steps
    of 3 and 5 requests replay the graphs of 4 and 6, beside steps that prefill eagerly."""
    padded: collections.Counter = collections.Counter()
    arrivals = spread_arrivals(len(PROMPTS))
    engine, streamed, prompts = run_engine(tiny_checkpoint, PROMPTS, MAX_TOKENS, arrivals, device=device,
                                           max_num_seqs=6, num_kv_blocks=256, on_engine=_with_graphs(padded))
    assert_matches_oracle(oracle, streamed, prompts, MAX_TOKENS)
    assert engine.runner.graphs.replays == sum(padded.values()) > 0
    assert any(n < batch for n, batch in padded), f"no step was padded: {padded}"
    assert all(batch == min(b for b in engine.runner.graphs.sizes if b >= n) for n, batch in padded)


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_preempted_and_chunked_requests_through_the_graphs(tiny_checkpoint, oracle, device):
    """A KV pool of 14 blocks of 8 for 6 seats and 13-token chunks: requests recompute after
    preemption and decode beside chunks, so steps alternate between graphs and eager passes
    over the same blocks."""
    prompts = PROMPTS[:14] + SHARED_PROMPTS[:4]
    max_tokens = MAX_TOKENS[: len(prompts)]
    padded: collections.Counter = collections.Counter()
    engine, streamed, by_id = run_engine(
        tiny_checkpoint, prompts, max_tokens, spread_arrivals(len(prompts), every=1), on_engine=_with_graphs(padded),
        device=device, max_num_seqs=6, block_size=8, num_kv_blocks=14, long_prefill_token_threshold=13,
        max_preemptions=3,
    )
    assert engine.stats.totals.preemptions > 0
    assert engine.runner.graphs.replays > 0
    assert_matches_oracle(oracle, streamed, by_id, max_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_cuda_the_engine_records_its_decode_step_unless_eager(tiny_checkpoint):
    from backend.engine import LLMEngine

    graphs = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cuda", dtype="float32", max_num_seqs=12,
                                    num_kv_blocks=64)).runner.graphs
    assert graphs is not None and graphs.capture and sorted(graphs.graphs) == [1, 2, 4, 8, 12]
    eager = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cuda", dtype="float32", max_num_seqs=12,
                                   num_kv_blocks=64, enforce_eager=True))
    assert eager.runner.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_cuda_graphs_and_eager_steps_give_the_same_logprobs(tiny_checkpoint):
    """The same 5 decoding requests, recorded graphs (padded to 6) against eager steps: float32
    logprobs within rounding, greedy tokens identical."""
    from backend.engine import LLMEngine
    from backend.request import SamplingParams

    def run(enforce_eager: bool):
        engine = LLMEngine(EngineConfig(model_path=tiny_checkpoint, device="cuda", dtype="float32", max_num_seqs=6,
                                        num_kv_blocks=128, enforce_eager=enforce_eager))
        for i, prompt in enumerate(PROMPTS[5:10]):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                                logprobs=0))
        tokens, logprobs = collections.defaultdict(list), collections.defaultdict(list)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids_delta)
                logprobs[out.request_id].extend(next(iter(e.values()))["logprob"] for e in out.logprobs_delta or [])
        return engine, tokens, logprobs

    graphed, graph_tokens, graph_logprobs = run(False)
    assert graphed.runner.graphs.replays >= 10
    _, eager_tokens, eager_logprobs = run(True)
    assert graph_tokens == eager_tokens
    for rid in eager_logprobs:
        assert graph_logprobs[rid] == pytest.approx(eager_logprobs[rid], abs=1e-4)
