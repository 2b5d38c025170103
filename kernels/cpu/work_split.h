// How the GEMMs (gemm.cpp, gemm_quant.cpp, gemm_int8_dots.cpp) split their work items over the cores.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

// A GEMM's next chunk is 1 / (this x threads) of the items left: the first chunks large
// enough that taking one costs nothing measurable, the last ones single items, so that a core
// that falls behind hands its share to the others and none waits long for the last chunk (a
// step's projections 3-8% faster than equal chunks of 1/16, SmolLM2 bf16 at 1 to 200 rows,
// 2-core AVX512-BF16 EPYC).
constexpr int64_t kShareOfWhatIsLeft = 8;

// Runs run(begin, end, next) over items [0, items) on `threads` OpenMP threads, in chunks
// handed out as each core comes back for more (not one equal range per core, as
// at::parallel_for does): when another thread of the process (Triton's response thread, the
// gRPC server) or of the machine takes a core for a while, the other core does that core's
// remaining chunks instead of the whole GEMM waiting for it. Chunks shrink as the work runs
// out, so that the cores finish together. A core claims its next chunk before it starts this
// one and passes that chunk's first item as `next` (-1: none), so that this chunk's last tiles
// can ask for the next chunk's first panels (OpenMP's dynamic schedule says which chunk comes
// next only once it is taken: every chunk's first group would come from memory unannounced).
template <class Run>
void run_in_shrinking_chunks(int64_t items, int64_t threads, const Run& run) {
  std::vector<int64_t> bounds{0};
  while (bounds.back() < items) {
    const int64_t left = items - bounds.back(), share = kShareOfWhatIsLeft * threads;
    bounds.push_back(bounds.back() + (left + share - 1) / share);
  }
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    int64_t mine = claimed.fetch_add(1, std::memory_order_relaxed);
    while (mine < chunks) {
      const int64_t following = claimed.fetch_add(1, std::memory_order_relaxed);
      run(bounds[mine], bounds[mine + 1], following < chunks ? bounds[following] : -1);
      mine = following;
    }
  }
}

// Below this many multiply-adds one core finishes before a second would have started.
constexpr int64_t kMinParallelMacs = 1 << 18;

// A GEMM of `macs` multiply-adds: run(0, items, -1) on this thread when it is smaller than
// kMinParallelMacs (or `threads` is 1), else run_in_shrinking_chunks over `threads`.
template <class Run>
void run_gemm_items(int64_t items, int64_t macs, int64_t threads, const Run& run) {
  if (macs < kMinParallelMacs || threads == 1) return run(0, items, -1);
  run_in_shrinking_chunks(items, threads, run);
}
