// float32 GEMM against a weight packed once into column panels: out[M, N] = x[M, K] W^T (+ bias).
//
// Why our own: a decode step's projections are GEMMs of a few to a few hundred rows, where
// the libraries behind torch lose most of their time outside the arithmetic. MKL's sgemm
// (F.linear) re-blocks the row-major weight on every call; oneDNN's packed path adds
// ~40-100 us of per-call setup. On a 2-core AVX2 EPYC this kernel ran the small random
// Llama's 16 projections of a 32-row decode step in 0.67 ms against 1.19 (F.linear), and
// SmolLM2's at 8-32 rows at 1.0-2.5x oneDNN's rate (numbers in kernels/linear.py).
//
// Layout: W [N, K] becomes [ceil(N / 16), K, 16]: panel p holds output columns 16p..16p+15,
// one 64-byte line per k, so the inner loop streams a panel front to back. The micro-tile
// keeps 6 rows x 16 columns of sums in 12 AVX registers; per k it loads the panel's line
// once and broadcasts one x value per row (2 loads + 6 broadcasts per 12 FMAs).
// Work is split over the cores by (row block, panel), in chunks taken as cores come free;
// a row block is sized so that its rows of x stay in L2 while every panel streams past them.
//
// Each output is one float32 FMA chain over k in order, then + bias: a different summation
// order from MKL's or oneDNN's, so results equal F.linear's up to float32 rounding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two AVX registers
constexpr int64_t kTileRows = 6;
// x rows of one row block: at most this many bytes (half of a Zen 2/3 core's L2).
constexpr int64_t kRowBlockBytes = 256 * 1024;
// Below this many multiply-adds one core finishes before a second would have started.
constexpr int64_t kMinParallelMacs = 1 << 18;
// Work chunks per thread in a parallel GEMM: enough that a core that falls behind hands
// its share to the others, few enough that taking a chunk costs nothing measurable.
constexpr int64_t kChunksPerThread = 8;

// `next`: the panel this core computes next, or nullptr. The first tile of a panel finds the
// panel in memory, not cache (a step reads each weight once); it asks for the next panel's
// lines one per k, as it consumes its own, so that the next panel's first tile finds them in
// cache instead of waiting on memory. Measured on a 2-core AVX2 EPYC, SmolLM2's 30 layers'
// projections and its output head, GFLOP/s with / without, two A/B runs of 12 interleaved
// rounds: 8 rows 118 / 120 and 110 / 102, 32 rows 161 / 160 and 149 / 137, 145 rows 174 / 169
// and 162 / 157.
template <int Rows, bool kPrefetchNext>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* out,
                 int64_t ldo, int64_t cols, const float* next) {
  __m256 acc[Rows][2];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kPrefetchNext) _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    // Unrolled so that the sums live in registers (a rolled loop kept them on the stack,
    // storing all 12 every k: 3x slower).
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (bias != nullptr) {
    alignas(32) float padded[kPanel] = {};
    std::copy(bias, bias + cols, padded);
    b0 = _mm256_load_ps(padded);
    b1 = _mm256_load_ps(padded + 8);
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    const __m256 o0 = bias != nullptr ? _mm256_add_ps(acc[r][0], b0) : acc[r][0];
    const __m256 o1 = bias != nullptr ? _mm256_add_ps(acc[r][1], b1) : acc[r][1];
    if (cols == kPanel) {
      _mm256_storeu_ps(out + r * ldo, o0);
      _mm256_storeu_ps(out + r * ldo + 8, o1);
    } else {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, o0);
      _mm256_store_ps(row + 8, o1);
      std::copy(row, row + cols, out + r * ldo);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr,         tile<1, false>, tile<2, false>, tile<3, false>,
                                          tile<4, false>, tile<5, false>, tile<6, false>};
constexpr TileFn kPrefetchingTiles[kTileRows + 1] = {nullptr,        tile<1, true>, tile<2, true>, tile<3, true>,
                                                     tile<4, true>, tile<5, true>, tile<6, true>};

}  // namespace

bool panel_gemm_supported() { return true; }

at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: float32 weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  // Zero columns past N: the last panel's tail computes zeros that are never stored.
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor panel_gemm(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_gemm: float32 x [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "panel_gemm: panels from pack_panels");
  const int64_t m = x.size(0), k = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == k, "panel_gemm: x has ", k, " columns, the weight ", panels.size(1));
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel, "panel_gemm: n does not match the panels");
  if (x.stride(1) != 1 || x.stride(0) < k) x = x.contiguous();
  const float* bias_data = nullptr;
  at::Tensor bias_contig;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "panel_gemm: float32 bias [N]");
    bias_contig = bias->contiguous();
    bias_data = bias_contig.data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;

  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t block_rows =
      std::max<int64_t>(kTileRows, kRowBlockBytes / (k * int64_t(sizeof(float))) / kTileRows * kTileRows);
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;

  // Work items ordered row block first: consecutive items share a row block, so a core
  // keeps its x rows in cache and streams panels past them.
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / num_panels, p = item % num_panels;
      const int64_t row_end = std::min(m, (block + 1) * block_rows);
      const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
      const float* panel = wp + p * k * kPanel;
      const float* panel_bias = bias_data != nullptr ? bias_data + col : nullptr;
      const float* next = item + 1 < end ? wp + (item + 1) % num_panels * k * kPanel : nullptr;
      for (int64_t row = block * block_rows; row < row_end; row += kTileRows) {
        const int64_t rows = std::min(kTileRows, row_end - row);
        const bool first_tile = row == block * block_rows && next != nullptr;
        (first_tile ? kPrefetchingTiles : kTiles)[rows](xp + row * ldx, ldx, panel, k, panel_bias,
                                                        op + row * n + col, n, cols, next);
      }
    }
  };
  const int64_t items = row_blocks * num_panels;
  const int64_t threads = at::get_num_threads();
  if (m * n * k < kMinParallelMacs || threads == 1) {
    run(0, items);
    return out;
  }
  // Handed out in chunks, several per core, as each core comes back for more (not one equal
  // range per core, as at::parallel_for does): when another thread of the process (Triton's
  // response thread, the gRPC server) or of the machine takes a core for a while, the other
  // core does that core's remaining chunks instead of the whole GEMM waiting for it.
  const int64_t chunk = std::max<int64_t>(1, items / (threads * kChunksPerThread));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t first = 0; first < items; first += chunk) {
    run(first, std::min(items, first + chunk));
  }
  return out;
}

#else  // no AVX2/FMA: kernels/linear.py packs for oneDNN or MKL instead

bool panel_gemm_supported() { return false; }

at::Tensor pack_panels(at::Tensor) { TORCH_CHECK(false, "pack_panels: built without AVX2 and FMA"); }

at::Tensor panel_gemm(at::Tensor, at::Tensor, std::optional<at::Tensor>, int64_t) {
  TORCH_CHECK(false, "panel_gemm: built without AVX2 and FMA");
}

#endif
