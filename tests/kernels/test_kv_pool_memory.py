"""The KV pool's memory (kernels.kv_store.pool_zeros): zeroed, and on the CPU on 2 MiB
transparent huge pages, which the paged attention's scattered block reads need (huge_pages.cpp);
and the packed weights' memory, on huge pages too (kernels.linear.PackedWeight)."""

import gc
import os

import pytest
import torch

import kernels
from kernels import QuantizedKV, cpu_ext
from kernels.kv_store import KV_QUANT_DTYPES, pool_zeros
from kernels.quantized import quantize

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="the C++ kernels are not built on this machine")

HUGE_PAGE = 2 << 20
# Without THP in the kernel the advice is refused and the memory is ordinary (still aligned).
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping that holds `address`, None if nothing is mapped there."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_cpu_pool_is_zeroed_on_huge_pages_and_unmapped_when_freed(dtype):
    shape = (37, 16, 3, 64)  # not a whole number of huge pages
    pool = pool_zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    assert pool.data_ptr() % HUGE_PAGE == 0
    if THP:
        assert "hg" in mapping_flags(pool.data_ptr())
    pool.fill_(3)
    assert int(pool.float().sum()) == 3 * pool.numel()
    address = pool.data_ptr()
    del pool
    gc.collect()
    assert mapping_flags(address) is None


@pytest.mark.parametrize("kind", sorted(KV_QUANT_DTYPES))
def test_quantized_pool_lies_on_huge_pages(kind):
    cache = QuantizedKV.zeros(50, 16, 2, 64, KV_QUANT_DTYPES[kind])
    assert cache.blocks.data_ptr() % HUGE_PAGE == 0 and not cache.blocks.any()
    if THP:
        assert "hg" in mapping_flags(cache.blocks.data_ptr())



@pytest.mark.parametrize("weight", ["bfloat16", "float32", "int4", "int4+a8"])
def test_packed_weights_of_a_huge_page_or_more_lie_on_huge_pages_and_compute_the_same(weight):
    torch.manual_seed(0)
    w = torch.randn(4176, 1024) / 32  # more than a huge page in int4, a whole number of them in no format
    x = torch.randn(3, 1024).to(torch.bfloat16)
    if weight.startswith("int4"):
        quantized = quantize(w, 4, 128)
        packed = kernels.pack_linear_weight(quantized, dtype=torch.bfloat16, int8_activations=weight.endswith("a8"))
        w = quantized.dequantize()
    else:
        w = w.to(getattr(torch, weight))
        packed = kernels.pack_linear_weight(w)
    assert packed.kind in ("panels", "quant_panels")
    assert packed.data.numel() * packed.data.element_size() >= HUGE_PAGE
    assert packed.data.data_ptr() % HUGE_PAGE == 0
    if THP:
        assert "hg" in mapping_flags(packed.data.data_ptr())
    # The copy is the packed weight: the GEMM through it gives the weight's product.
    reference = torch.nn.functional.linear(x.float(), w.float())
    out = kernels.linear(x if weight != "float32" else x.float(), packed.shape_only, None, packed).float()
    tolerance = 0.15 if weight.endswith("a8") else 0.03  # the int8 activations' rounding
    assert (out - reference).abs().max() <= tolerance * reference.abs().max()
