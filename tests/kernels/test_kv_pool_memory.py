"""The KV pool's memory (kernels.kv_store.pool_zeros): zeroed, and on the CPU on 2 MiB
transparent huge pages, which the paged attention's scattered block reads need (huge_pages.cpp)."""

import gc
import os

import pytest
import torch

from kernels import QuantizedKV, cpu_ext
from kernels.kv_store import KV_QUANT_DTYPES, pool_zeros

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

