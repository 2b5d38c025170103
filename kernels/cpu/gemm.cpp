// GEMMs against a weight packed once into column panels: out[M, N] = x[M, K] W^T (+ bias).
//
// Why our own: a decode step's projections are GEMMs of a few to a few hundred rows, where
// the libraries behind torch lose most of their time outside the arithmetic (MKL's sgemm
// re-blocks the row-major weight on every call; oneDNN's packed path adds ~40-100 us of
// per-call setup), and neither promises a summation order that is the same whatever the
// number of rows. Here every output element is one chain of multiply-adds over k in order,
// from zero, then + bias, then one rounding to the output dtype: the same instructions
// whatever M, the tile a row lands in, the thread count or the work split. So a row's result
// never depends on the other rows of the batch (the engine's batch invariance rests on it).
//
// One code path per instruction set, chosen once per weight at packing time
// (kernels/linear.py; `isa` below); the build is -march=native, so the paths compiled are the
// machine's own and every lower one:
// - kIsaAvx2: float32, a 6-row x 16-column tile in 12 AVX registers (2 loads + 6 broadcasts
//   per 12 FMAs);
// - kIsaAvx512: float32, 12 rows x 32 columns in 24 zmm registers. Its chains are the AVX2
//   path's (the same FMAs in the same order), so the two give the same bits;
// - kIsaAvx512Bf16: bfloat16 weights and activations, `vdpbf16ps` (AVX512-BF16): each step
//   adds two k's products to a float32 sum; 14 rows x 32 columns. On a 2-core Zen 4 EPYC
//   vdpbf16ps runs at ~232 GFLOP/s a core against ~117 for float32 FMAs. The output is
//   rounded to bfloat16 once (after the bias), as torch's bf16 GEMM does.
// - kIsaAmx: bfloat16 on AMX tiles (Xeons from Sapphire Rapids on), `tdpbf16ps` on 32 rows x
//   32 columns a pass, 32 k's at a time, on the same packed weight as kIsaAvx512Bf16. Each
//   output element is the tiles' sums over k in order of 32-k blocks, from zero: a row's
//   result depends on its own x only, not on the rows around it. The default wherever it is
//   built and Linux lends the process the tiles (`request_amx_permission`; kernels/cpu_ext.py
//   falls back to the best vector path, with one warning, where it does not). Tested on AMX
//   hardware and, on any CPU, against a software model of the tile instructions
//   (TileModel in amx.h, tests/kernels/test_linear.py), which also checks each tile
//   operation's shapes as the hardware would refuse them.
//
// Layouts. float32: W [N, K] becomes [ceil(N / 16), K, 16]: panel p holds output columns
// 16p..16p+15, one 64-byte line per k. bfloat16: [ceil(N / 16), ceil(K / 2), 16, 2]: one
// 64-byte line per pair of k's, each column's two weights side by side, as vdpbf16ps pairs
// them. Columns past N (and the k past an odd K) are zeros.
// Work is split over the cores by (row block, group of panels), in chunks taken as cores come
// free; a row block is sized so that its rows of x stay in L2 while the panels stream past.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "ops.h"
#include "prefetch.h"
#include "work_split.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The instruction sets, as kernels/linear.py names them by number.
enum Isa : int64_t { kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Bf16 = 3, kIsaAmx = 4 };

constexpr int64_t kPanel = 16;  // output columns per panel
// x rows of one row block: at most this many bytes (a quarter of a Zen 4 core's L2).
constexpr int64_t kRowBlockBytes = 256 * 1024;

#if defined(__AVX2__) && defined(__FMA__)
#define INFLIGHT_HAVE_AVX2 1
// What a path supplies to the one tile below: its vector, how a panel's line loads, how one
// row's x for one step is broadcast, the multiply-add, and how a finished line is stored.
struct Avx2F32 {
  using In = float;
  using Out = float;
  using Vec = __m256;
  static constexpr int kVectorsPerLine = 2;  // a panel's 16 columns: two registers
  static constexpr int kStepK = 1;
  static constexpr int kMaxRows = 6, kMaxPanels = 1;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const In* w) { return _mm256_loadu_ps(w); }
  static Vec broadcast(const In* x) { return _mm256_broadcast_ss(x); }
  static Vec broadcast_last(const In* x) { return _mm256_broadcast_ss(x); }
  static Vec madd(Vec acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static void to_floats(const Vec (&line)[kVectorsPerLine], float* dst) {
    _mm256_storeu_ps(dst, line[0]);
    _mm256_storeu_ps(dst + 8, line[1]);
  }
  static void store(const Vec (&line)[kVectorsPerLine], const float* bias, Out* dst) {
    _mm256_storeu_ps(dst, bias != nullptr ? _mm256_add_ps(line[0], _mm256_loadu_ps(bias)) : line[0]);
    _mm256_storeu_ps(dst + 8, bias != nullptr ? _mm256_add_ps(line[1], _mm256_loadu_ps(bias + 8)) : line[1]);
  }
};
#endif

#if defined(__AVX512F__)
#define INFLIGHT_HAVE_AVX512 1
struct Avx512F32 {
  using In = float;
  using Out = float;
  using Vec = __m512;
  static constexpr int kVectorsPerLine = 1;
  static constexpr int kStepK = 1;
  static constexpr int kMaxRows = 12, kMaxPanels = 2;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const In* w) { return _mm512_loadu_ps(w); }
  static Vec broadcast(const In* x) { return _mm512_set1_ps(*x); }
  static Vec broadcast_last(const In* x) { return _mm512_set1_ps(*x); }
  static Vec madd(Vec acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static void to_floats(const Vec (&line)[kVectorsPerLine], float* dst) { _mm512_storeu_ps(dst, line[0]); }
  static void store(const Vec (&line)[kVectorsPerLine], const float* bias, Out* dst) {
    _mm512_storeu_ps(dst, bias != nullptr ? _mm512_add_ps(line[0], _mm512_loadu_ps(bias)) : line[0]);
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFLIGHT_HAVE_AVX512_BF16 1
struct Avx512Bf16 {
  using In = c10::BFloat16;
  using Out = c10::BFloat16;
  using Vec = __m512;
  static constexpr int kVectorsPerLine = 1;
  static constexpr int kStepK = 2;  // a line holds each column's weights for two k's
  // 28 sums, the two panel lines and the broadcast: 31 of the 32 registers. Against 12 rows,
  // prefill-sized GEMMs (216-512 rows) ran ~5% faster and decode-sized ones the same (SmolLM2's
  // projections, 2-core AVX512-BF16 EPYC); float32's path measured no faster with 14.
  static constexpr int kMaxRows = 14, kMaxPanels = 2;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const In* w) { return _mm512_loadu_ps(w); }
  // A row's two x's of the step, as one 32-bit pair in every lane.
  static Vec broadcast(const In* x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
  }
  // The last step of an odd K: one x, paired with zero (never reads past the row's end).
  static Vec broadcast_last(const In* x) {
    uint16_t bits;
    std::memcpy(&bits, x, sizeof bits);
    return _mm512_castsi512_ps(_mm512_set1_epi32(bits));
  }
  static Vec madd(Vec acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static void to_floats(const Vec (&line)[kVectorsPerLine], float* dst) { _mm512_storeu_ps(dst, line[0]); }
  // Rounded to nearest even, as c10::BFloat16's conversion (which the partial lines use) rounds.
  static void store(const Vec (&line)[kVectorsPerLine], const float* bias, Out* dst) {
    const __m512 sum = bias != nullptr ? _mm512_add_ps(line[0], _mm512_loadu_ps(bias)) : line[0];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(sum));
  }
};
#endif

// One tile: Rows rows of x against Panels adjacent panels (Panels * 16 columns, of which
// `cols` are stored). A group's first tile finds its panels in memory, not cache (a step
// reads each weight once), so while the tiles of a group run, they ask for the next group's
// lines, into L2: `prefetch` points at this tile's share of them (`prefetch_steps` steps' lines,
// one per step of its own loop), or is nullptr. The shares spread the next group's lines over
// all of the group's tiles, so that memory sees a steady stream rather than a burst. Into L2
// rather than L1, and with every chunk's first group announced by the chunk before (gemm()
// below), a step's projections ran 20% faster at 8 rows, 15% at 32 and 5% at 80-160 (SmolLM2
// bf16, 30 layers' own weights, 2-core AVX512-BF16 EPYC; 9.3 ms at 8 rows: the weights streamed
// at the machine's ~29 GB/s).
template <class V, int Rows, int Panels>
inline void tile(const typename V::In* x, int64_t ldx, const typename V::In* panels, int64_t panel_elems,
                 int64_t steps, bool odd_k, const float* bias, typename V::Out* out, int64_t ldo, int64_t cols,
                 const typename V::In* prefetch, int64_t prefetch_steps) {
  using Vec = typename V::Vec;
  constexpr int kVectors = V::kVectorsPerLine;
  constexpr int64_t kLine = kPanel * V::kStepK;              // elements of one step's line
  constexpr int64_t kVectorElems = kLine / kVectors;
  Vec acc[Rows][Panels][kVectors];
#pragma GCC unroll 32
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p)
      for (int v = 0; v < kVectors; ++v) acc[r][p][v] = V::zero();
  const auto step = [&](int64_t s, auto broadcast) {
    Vec w[Panels][kVectors];
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p)
      for (int v = 0; v < kVectors; ++v) w[p][v] = V::load(panels + p * panel_elems + s * kLine + v * kVectorElems);
    // Unrolled so that the sums live in registers (a rolled loop kept them on the stack,
    // storing them all every step: 3x slower).
#pragma GCC unroll 32
    for (int r = 0; r < Rows; ++r) {
      const Vec a = broadcast(x + r * ldx + s * V::kStepK);
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p)
        for (int v = 0; v < kVectors; ++v) acc[r][p][v] = V::madd(acc[r][p][v], a, w[p][v]);
    }
  };
  for (int64_t s = 0; s < steps; ++s) {
    if (s < prefetch_steps) {
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p) inflight_cpu::prefetch_l2(prefetch + p * panel_elems + s * kLine);
    }
    step(s, [](const typename V::In* p) { return V::broadcast(p); });
  }
  if (odd_k) step(steps, [](const typename V::In* p) { return V::broadcast_last(p); });

  if (cols == Panels * kPanel) {
#pragma GCC unroll 32
    for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p)
        V::store(acc[r][p], bias != nullptr ? bias + p * kPanel : nullptr, out + r * ldo + p * kPanel);
    return;
  }
  alignas(64) float line[Panels * kPanel];
#pragma GCC unroll 32
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p) V::to_floats(acc[r][p], line + p * kPanel);
    typename V::Out* o = out + r * ldo;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<typename V::Out>(line[c] + bias[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = static_cast<typename V::Out>(line[c]);
    }
  }
}

template <class V, int Panels>
struct TileTable {
  using Fn = void (*)(const typename V::In*, int64_t, const typename V::In*, int64_t, int64_t, bool, const float*,
                      typename V::Out*, int64_t, int64_t, const typename V::In*, int64_t);
  template <int... Rows>
  static constexpr auto make(std::integer_sequence<int, Rows...>) {
    return std::array<Fn, sizeof...(Rows) + 1>{nullptr, tile<V, Rows + 1, Panels>...};
  }
  static constexpr auto kTiles = make(std::make_integer_sequence<int, V::kMaxRows>{});
};

// Rows [first_row, row_end) of x against one group of `panels` adjacent panels (1 or 2, from
// `group`), in as few tiles as the registers allow, of equal height: 32 rows as 11 + 11 + 10
// rather than 12 + 12 + 8, whose last tile does two-thirds of the multiply-adds for the same panel
// loads and loop (a step's bf16 projections 4% faster at 32 and 64 rows; a row's sums do not depend
// on its tile, so the bits are the same). `next` (or nullptr): the panels whose lines the tiles
// ask for, each tile its share.
template <class V>
void row_tiles(const typename V::In* xp, int64_t ldx, int64_t first_row, int64_t row_end, const typename V::In* group,
               int64_t panel_elems, int64_t panels, int64_t k, const float* bias, typename V::Out* op, int64_t ldo,
               int64_t cols, const typename V::In* next) {
  constexpr int64_t kRows = V::kMaxRows, kGroup = V::kMaxPanels;
  const int64_t steps = k / V::kStepK;
  const bool odd_k = k % V::kStepK != 0;
  const int64_t tiles = (row_end - first_row + kRows - 1) / kRows;
  const int64_t tile_rows = (row_end - first_row + tiles - 1) / tiles;
  const int64_t prefetch_total = next != nullptr ? steps + odd_k : 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t row = first_row + t * tile_rows, rows = std::min(tile_rows, row_end - row);
    const int64_t share_begin = t * prefetch_total / tiles, share_end = (t + 1) * prefetch_total / tiles;
    const typename V::In* prefetch = next != nullptr ? next + share_begin * kPanel * V::kStepK : nullptr;
    const auto& table = panels == 2 ? TileTable<V, kGroup>::kTiles : TileTable<V, 1>::kTiles;
    table[rows](xp + row * ldx, ldx, group, panel_elems, steps, odd_k, bias, op + row * ldo, ldo, cols, prefetch,
                share_end - share_begin);
  }
}

template <class V>
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  using In = typename V::In;
  using Out = typename V::Out;
  constexpr int64_t kRows = V::kMaxRows, kGroup = V::kMaxPanels;
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  const int64_t panel_elems = packed.stride(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const In* xp = reinterpret_cast<const In*>(x.data_ptr());
  const In* wp = reinterpret_cast<const In*>(packed.data_ptr());
  Out* op = reinterpret_cast<Out*>(out.data_ptr());
  const int64_t ldx = x.stride(0);
  const int64_t block_rows =
      std::max<int64_t>(kRows, kRowBlockBytes / (k * int64_t(sizeof(In))) / kRows * kRows);
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  const int64_t groups = (num_panels + kGroup - 1) / kGroup;

  // Work items ordered row block first: consecutive items share a row block, so a core
  // keeps its x rows in cache and streams panels past them.
  // Items [begin, end), then `after` (-1: nothing known), whose panels the last item's tiles ask for.
  auto run = [&](int64_t begin, int64_t end, int64_t after) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / groups, g = item % groups;
      const int64_t row_end = std::min(m, (block + 1) * block_rows);
      const int64_t first_panel = g * kGroup, panels = std::min(kGroup, num_panels - first_panel);
      const int64_t col = first_panel * kPanel, cols = std::min(panels * kPanel, n - col);
      // The group this core computes next, whose lines the tiles prefetch. (Past the last
      // panel a prefetch asks for nothing that exists, which costs nothing: prefetches never fault.)
      const int64_t next_item = item + 1 < end ? item + 1 : after;
      const In* next = next_item >= 0 ? wp + next_item % groups * kGroup * panel_elems : nullptr;
      row_tiles<V>(xp, ldx, block * block_rows, row_end, wp + first_panel * panel_elems, panel_elems, panels, k,
                   bias != nullptr ? bias + col : nullptr, op + col, n, cols, next);
    }
  };
  run_gemm_items(row_blocks * groups, m * n * k, at::get_num_threads(), run);
  return out;
}

using namespace inflight_cpu;

// How many tiles of k ahead of the ones multiplied a core working alone prefetches its panels.
constexpr int64_t kTilesAhead = 4;

// Tiles 0-1: two 16-row blocks of x; 2-3: two panels' 32 k's; 4-7: their four 16 x 16 sums.
template <class Tiles>
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& packed, const float* bias, int64_t n) {
  using In = c10::BFloat16;
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  const int64_t pairs = packed.size(1), panel_elems = packed.stride(0);
  const int64_t k_tiles = (k + kTileK - 1) / kTileK, padded_k = k_tiles * kTileK;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const In* xp = reinterpret_cast<const In*>(x.data_ptr());
  const In* wp = reinterpret_cast<const In*>(packed.data_ptr());
  In* op = reinterpret_cast<In*>(out.data_ptr());
  const int64_t ldx = x.stride(0);
  const int64_t row_blocks = (m + kAmxRows - 1) / kAmxRows, groups = (num_panels + 1) / 2;
  const int64_t items = row_blocks * groups;
  const int64_t threads = m * n * k < kMinParallelMacs ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.rows[t] = kTileRows, config.bytes_per_row[t] = kTileBytes;
    AMX_CONFIGURE(&config);
    // This thread's current row block of x, zero-padded to 32 rows and a whole number of
    // tiles of k; the panels' last, partial tile of k, zero-padded (no tile reads past a panel
    // or the weight's end); the four tiles' sums.
    std::vector<In> rows_of_x(kAmxRows * padded_k);
    std::vector<In> last_tile(2 * kTileK * kPanel);
    alignas(64) float sums[kAmxRows][2 * kPanel];
    int64_t block_held = -1;
    // A core streaming the panels alone (the experts of a MoE block side by side, one core each)
    // reads them at half the copy bandwidth when the tile loads are left to the hardware
    // prefetcher, which trails them; told the lines a few tiles ahead, the MoE block takes
    // 0.75x the time (qwen3-moe-small bf16 at 32 tokens, 2-core AMX Xeon). With the cores
    // sharing a GEMM the prefetcher keeps up and the prefetches measured no faster.
    const int64_t tiles_ahead = omp_get_num_threads() == 1 ? kTilesAhead : 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t block = item / groups, g = item % groups;
      const int64_t first_row = block * kAmxRows, rows = std::min(kAmxRows, m - first_row);
      if (block != block_held) {
        std::fill(rows_of_x.begin(), rows_of_x.end(), In(0.f));
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(rows_of_x.data() + r * padded_k, xp + (first_row + r) * ldx, k * sizeof(In));
        block_held = block;
      }
      // A group of one panel (the last of an odd count) runs it in both B tiles: n ends within
      // its 16 columns, so the second tile's sums are never stored.
      const In* panel[2] = {wp + 2 * g * panel_elems, wp + std::min(2 * g + 1, num_panels - 1) * panel_elems};
      AMX_ZERO(4);
      AMX_ZERO(5);
      AMX_ZERO(6);
      AMX_ZERO(7);
      for (int64_t t = 0; t < k_tiles; ++t) {
        const In* b[2] = {panel[0] + t * kTileK * kPanel, panel[1] + t * kTileK * kPanel};
        const int64_t tile_pairs = std::min<int64_t>(kTileK / 2, pairs - t * kTileK / 2);
        if (tile_pairs < kTileK / 2) {  // the weight's last k's: a full tile of pairs, the rest zero
          std::fill(last_tile.begin(), last_tile.end(), In(0.f));
          for (int p = 0; p < 2; ++p)
            std::memcpy(last_tile.data() + p * kTileK * kPanel, b[p], tile_pairs * kPanel * 2 * sizeof(In));
          b[0] = last_tile.data(), b[1] = last_tile.data() + kTileK * kPanel;
        }
        // (Past a panel's end a prefetch reads the next panel's first lines, which this core
        // may compute next; a prefetch of what is not there faults nothing.)
        for (int p = 0; p < 2 && tiles_ahead > 0; ++p) {
          const In* ahead = panel[p] + (t + tiles_ahead) * kTileK * kPanel;
#pragma GCC unroll 16
          for (int line = 0; line < kTileRows; ++line) inflight_cpu::prefetch_l2(ahead + line * kTileBytes / sizeof(In));
        }
        AMX_LOAD(0, rows_of_x.data() + t * kTileK, padded_k * sizeof(In));
        AMX_LOAD(1, rows_of_x.data() + kTileRows * padded_k + t * kTileK, padded_k * sizeof(In));
        AMX_LOAD(2, b[0], kTileBytes);
        AMX_LOAD(3, b[1], kTileBytes);
        AMX_DP(4, 0, 2);
        AMX_DP(5, 0, 3);
        AMX_DP(6, 1, 2);
        AMX_DP(7, 1, 3);
      }
      AMX_STORE(4, &sums[0][0], sizeof sums[0]);
      AMX_STORE(5, &sums[0][kPanel], sizeof sums[0]);
      AMX_STORE(6, &sums[kTileRows][0], sizeof sums[0]);
      AMX_STORE(7, &sums[kTileRows][kPanel], sizeof sums[0]);
      const int64_t col = 2 * g * kPanel, cols = std::min<int64_t>(2 * kPanel, n - col);
      for (int64_t r = 0; r < rows; ++r) {
        In* o = op + (first_row + r) * n + col;
        for (int64_t c = 0; c < cols; ++c) o[c] = In(bias != nullptr ? sums[r][c] + bias[col + c] : sums[r][c]);
      }
    }
    AMX_RELEASE();
  }
  return out;
}

int64_t vector_isa() {
#if defined(INFLIGHT_HAVE_AVX512_BF16)
  return kIsaAvx512Bf16;
#elif defined(INFLIGHT_HAVE_AVX512)
  return kIsaAvx512;
#elif defined(INFLIGHT_HAVE_AVX2)
  return kIsaAvx2;
#else
  return kIsaNone;
#endif
}

// A path is usable when built and, for the tiles, permitted: a tile instruction without the
// permission kills the process, so no call reaches one.
void check_isa(const char* op, int64_t isa) {
  TORCH_CHECK(isa > kIsaNone && isa <= gemm_isa(), op, ": instruction set ", isa,
              " is not built for this machine (best: ", gemm_isa(), ")");
  TORCH_CHECK(isa != kIsaAmx || amx_permitted(), op,
              ": the kernel refused this process the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM)");
}

}  // namespace

int64_t gemm_isa() { return tiles_built() ? kIsaAmx : vector_isa(); }

int64_t gemm_vector_isa() { return vector_isa(); }

bool request_amx_permission() { return amx_permitted(); }

void use_tile_model() { tile_model_in_use = true; }

void bf16_panel_rows(const c10::BFloat16* x, int64_t ldx, int64_t rows, const c10::BFloat16* panels,
                     int64_t panel_elems, int64_t num_panels, int64_t k, const float* bias, c10::BFloat16* out,
                     int64_t ldo, int64_t cols) {
#if defined(INFLIGHT_HAVE_AVX512_BF16)
  TORCH_CHECK(num_panels == 1 || num_panels == 2, "bf16_panel_rows: one or two panels, not ", num_panels);
  row_tiles<Avx512Bf16>(x, ldx, 0, rows, panels, panel_elems, num_panels, k, bias, out, ldo, cols, nullptr);
#else
  TORCH_CHECK(false, "bf16_panel_rows: this build has no AVX512-BF16 path");
#endif
}

at::Tensor pack_panels(at::Tensor weight, int64_t isa) {
  check_isa("pack_panels", isa);
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  if (isa == kIsaAvx512Bf16 || isa == kIsaAmx) {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "pack_panels: a bfloat16 weight for the bfloat16 paths");
    const int64_t pairs = (k + 1) / 2;
    at::Tensor padded = at::zeros({panels * kPanel, pairs * 2}, weight.options());
    padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
    // [P, 16, pairs, 2] -> [P, pairs, 16, 2]
    return padded.view({panels, kPanel, pairs, 2}).transpose(1, 2).contiguous();
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_panels: a float32 weight for the float32 paths");
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor panel_gemm(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias, int64_t n, int64_t isa) {
  check_isa("panel_gemm", isa);
  const bool bf16 = isa == kIsaAvx512Bf16 || isa == kIsaAmx;
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "panel_gemm: x [M, K] in ", dtype);
  TORCH_CHECK(panels.dim() >= 3 && panels.size(2) == kPanel && panels.is_contiguous() && panels.scalar_type() == dtype,
              "panel_gemm: panels from pack_panels for this instruction set");
  const int64_t k = x.size(1), num_panels = panels.size(0);
  const int64_t packed_k = bf16 ? panels.size(1) * 2 : panels.size(1);
  TORCH_CHECK(packed_k == k || (bf16 && packed_k == k + 1), "panel_gemm: x has ", k,
              " columns, the weight ", packed_k);
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel, "panel_gemm: n does not match the panels");
  if (x.stride(1) != 1 || x.stride(0) < k) x = x.contiguous();
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype,
                "panel_gemm: bias [N] in the weight's dtype");
    bias_float = bias->to(at::kFloat).contiguous();
  }
  const float* bias_data = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  switch (isa) {
    case kIsaAmx:
      return with_tiles([&](auto tiles) { return gemm_amx<decltype(tiles)>(x, panels, bias_data, n); });
#if defined(INFLIGHT_HAVE_AVX512_BF16)
    case kIsaAvx512Bf16:
      return gemm<Avx512Bf16>(x, panels, bias_data, n);
#endif
#if defined(INFLIGHT_HAVE_AVX512)
    case kIsaAvx512:
      return gemm<Avx512F32>(x, panels, bias_data, n);
#endif
#if defined(INFLIGHT_HAVE_AVX2)
    case kIsaAvx2:
      return gemm<Avx2F32>(x, panels, bias_data, n);
#endif
    default:
      TORCH_CHECK(false, "panel_gemm: no kernel for instruction set ", isa);
  }
}
