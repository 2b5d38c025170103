"""The sampler on CUDA logits: the [rows, vocab] work stays on the GPU and gives the CPU's
tokens and logprobs for the same logits and seeds. Skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

from backend.sampler import Sampler
from tests.unit.test_sampler import req

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

VOCAB = 32000


def _batch():
    """Every path of the sampler in one batch: greedy, seeded draws with each mask, penalties,
    a min_tokens ban, logprobs with and without top-N."""
    return [
        req("greedy", temperature=0.0, logprobs=3),
        req("plain", temperature=1.0, seed=1),
        req("top-k", temperature=0.7, top_k=40, seed=2, logprobs=0),
        req("top-p", temperature=0.9, top_p=0.8, seed=3, logprobs=5),
        req("min-p", temperature=1.2, min_p=0.05, seed=4),
        req("penalised", temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
            frequency_penalty=0.2, output=(11, 12, 11)),
        req("min-tokens", temperature=1.0, seed=6, min_tokens=5, output=(9,)),
        req("greedy-penalised", temperature=0.0, repetition_penalty=2.0, output=(7, 8)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_sampler_on_cuda_gives_the_cpus_tokens_and_logprobs(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, VOCAB, generator=g) * 4).to(dtype)
    logits[6, 2] = 100.0  # EOS, which min_tokens must keep out
    on_cpu = Sampler(seed=7)(logits, _batch())
    sampler = Sampler(seed=7)
    on_gpu = sampler(logits.cuda(), _batch())
    assert all(buffer.numel() == 0 or buffer.is_cuda for buffer in sampler._workspace)
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.token_ids[6] != 2
    for gpu, cpu in zip(on_gpu.logprobs, on_cpu.logprobs):
        assert (gpu is None) == (cpu is None)
        if gpu is not None:
            assert gpu == pytest.approx(cpu, abs=1e-4)
    for row, (gpu, cpu) in enumerate(zip(on_gpu.top_logprobs, on_cpu.top_logprobs)):
        assert (gpu is None) == (cpu is None)
        if gpu is not None:
            # The same ranking up to ties: bfloat16 logits tie often, and top-k orders equal
            # values differently on the two devices (torch leaves the order of ties open).
            ranked = logits[row].float()
            assert [ranked[t].item() for t, _ in gpu] == [ranked[t].item() for t, _ in cpu]
            assert len({t for t, _ in gpu}) == len(gpu)
            assert [v for _, v in gpu] == pytest.approx([v for _, v in cpu], abs=1e-4)
