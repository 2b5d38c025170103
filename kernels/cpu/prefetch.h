// Software prefetch into L2, shared by the kernels that stream from memory.
#pragma once

namespace inflight_cpu {

// prefetcht1: into L2, not L1, where the lines would compete with the loads of the data being
// worked on (the GEMM's panels, the attention's copy; both measured slower with prefetcht0).
// An asm statement rather than __builtin_prefetch, which g++ 12 drops from some loops once they
// are inlined (the attention kernel's copy loop lost every one of its prefetches).
inline void prefetch_l2(const void* line) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(line)));
}

}  // namespace inflight_cpu
