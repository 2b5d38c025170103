// GEMMs of int8 activations against int8 and int4 weights on integer dot products (W8A8 and
// W4A8: the `activation_quantization: int8` setting, as llama.cpp multiplies its Q4_0 and Q8_0
// weights with Q8 activations and vLLM-CPU runs W8A8): out[M, N] = x[M, K] W^T (+ bias).
//
// Numerics, the same on every path. x (float32 or bfloat16) is quantized in blocks of the
// weight's groups (a weight of one group per output channel: each row whole, per token), each
// block on its own, symmetric: inv = 127 / max|x|, q_x = round(x * inv) (to nearest, ties to
// even; a block of zeros stays zero), and the block's scale t = max|x| * fl(1 / 127), as llama.cpp
// quantizes its Q8 activations a block of 32 at a time. For each group g (in order), the exact
// integer dot product d = sum of q_w * q_x over the group and, for weights with mins, the exact
// group sum s = sum of q_x give
//     acc = fma(fl(scale_g * t_g), float(d), acc), then acc = fma(min_g, fl(t_g * float(s)), acc)
// (from zero), and out = acc (+ bias), rounded to x's dtype. Integers are exact whatever adds
// them, and the float operations are the same ones in the same order on every path: so AVX-512
// VNNI, AVX2, the AMX tiles and plain C++ give the same bits, and a row's bits depend on its own x
// only, at every row count (the batch-invariant mode costs nothing here).
// kernels/quantized.int8_activation_linear computes the same in torch, the tests' reference.
//
// Layout (pack_int8_dot_panels). Panel p holds output columns 16p..16p+15, in 64-byte lines
// shaped for vpdpbusd (each 32-bit lane one column's 4 consecutive k's):
// - int8: line j holds k's 4j..4j+3: byte 4c + i = q[c, 4j + i];
// - int4: line j holds k's 8j..8j+7: byte 4c + i = q[c, 8j + i] | q[c, 8j + 4 + i] << 4, so
//   one load, an and and a shift give two vpdpbusd operands (against x's two quads);
// - K padded with zero integers to whole lines; a group is whole lines (its size a multiple of 4
//   for int8, of 8 for int4, or one group); scales and mins as gemm_quant.cpp packs them
//   (quant_values.h).
// So an int4 weight costs 4 bits plus its scales and mins, as on the float paths.
//
// Kernels (per tile: rows 1-4 of x against 4 panels for one row, 2 for more):
// - AVX-512 VNNI: vpdpbusd multiplies the weight's unsigned bytes with x's signed ones. int4
//   nibbles are unsigned as they are; int8 weights are flipped to q + 128 by one xor, and
//   128 * s taken off the group's integer sum (exact). A decode's one row keeps separate sums
//   for the low and high nibbles: eight independent chains against vpdpbusd's latency.
// - AVX2 (no VNNI): vpmaddubsw (unsigned times signed bytes, pairs summed to 16 bits: at most
//   2 x 15 x 127 for int4, 2 x 128 x 127 for int8 as |q_w| times x with q_w's sign, so never
//   saturating) and vpmaddwd against ones.
// - Plain C++ otherwise.
// - From 32 rows on an AMX Xeon, the int8 tiles (below).
// The activations are quantized once a call, in parallel over rows; work is split over the
// cores by (row block, group of panels), as gemm_quant.cpp splits it.
//
// Measured on a 2-core AMX Xeon (client.bench.quant_gemm --bf16, bench/results/amx/
// quant_gemm_bf16_a8.json; SmolLM2's gate|up and Llama-3.2-1B's MLP, bf16 x): at one row 30-48
// GB/s of packed weight, past the 22 GB/s copy bandwidth, 1.3-2.1x the best weight-only path of
// the same format; from 32 rows int8 per channel and int4 g128 1.2-2.4x the bf16 tiles on the
// de-quantized weight, the formats in groups of 32 0.3-0.85x (their float steps once per 32 k's).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "amx.h"
#include "ops.h"
#include "prefetch.h"
#include "quant_values.h"
#include "work_split.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The float steps are written out as fused multiply-adds where they are meant; no other
// product and sum may be contracted into one (the paths must agree to the bit).
#pragma GCC optimize("fp-contract=off")

namespace {

using inflight_cpu::GroupValues;
constexpr int64_t kPanel = inflight_cpu::kQuantPanel;
constexpr int64_t kLineBytes = 64;  // one packed line of a panel: 16 columns x 4 bytes
constexpr int64_t kRowBlockBytes = 256 * 1024;

int64_t k_per_line(int64_t bits) { return bits == 4 ? 8 : 4; }

struct Weights {
  const uint8_t* q;     // [P, lines, 64]
  int64_t panel_bytes;  // lines * 64
  GroupValues scales, mins;
  int64_t groups, lines, lines_per_group;
};

// x quantized: q [M, lines * k_per_line] int8 (zero past K); per row and group, the block's scale
// t, t times the integers' sum (the mins' factor) and that sum.
struct QuantizedRows {
  const int8_t* q;
  int64_t ld;  // bytes from one row to the next
  const float* scales;       // [M, groups]
  const float* min_factors;  // [M, groups]
  const int32_t* group_sums;  // [M, groups]
  int64_t groups;
  // x's 4 bytes at k's 4i..4i+3 of row r, as one 32-bit lane.
  int32_t quad(int64_t r, int64_t i) const {
    int32_t v;
    std::memcpy(&v, q + r * ld + 4 * i, 4);
    return v;
  }
  int32_t group_sum(int64_t r, int64_t g) const { return group_sums[r * groups + g]; }
  float scale(int64_t r, int64_t g) const { return scales[r * groups + g]; }
  float min_factor(int64_t r, int64_t g) const { return min_factors[r * groups + g]; }
  QuantizedRows from(int64_t row) const {
    return {q + row * ld, ld, scales + row * groups, min_factors + row * groups, group_sums + row * groups, groups};
  }
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of x, a block (the weight's group) at a time.
template <class In>
void quantize_row(const In* x, int64_t k, int64_t padded_k, int64_t group_size, int64_t groups, int8_t* q,
                  float* scales, float* min_factors, int32_t* group_sums) {
  // A product by a constant: the build's -funsafe-math-optimizations may rewrite a division.
  constexpr float kStep = 1.f / 127.f;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * group_size, end = std::min(k, begin + group_size);
    float amax = 0.f;
    for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = begin; i < end; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(to_float(x[i]) * inv));
      sum += q[i];
    }
    scales[g] = amax * kStep;
    min_factors[g] = scales[g] * static_cast<float>(sum);
    group_sums[g] = sum;
  }
  std::memset(q + k, 0, padded_k - k);
}

// The row's outputs: acc + bias, in the output's dtype.
template <class Out>
inline void store_row(const float* acc, const float* bias, Out* out, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<Out>(bias != nullptr ? acc[c] + bias[c] : acc[c]);
}

// ---- the plain path ---------------------------------------------------------------------------

template <int Bits, bool Mins, class Out>
void scalar_rows(const QuantizedRows& x, int64_t rows, const Weights& w, int64_t panel, const float* bias, Out* out,
                 int64_t ldo, int64_t cols) {
  const uint8_t* q = w.q + panel * w.panel_bytes;
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xq = x.q + r * x.ld;
    float acc[kPanel] = {};
    for (int64_t g = 0; g < w.groups; ++g) {
      int32_t dot[kPanel] = {};
      for (int64_t j = g * w.lines_per_group; j < std::min(w.lines, (g + 1) * w.lines_per_group); ++j)
        for (int c = 0; c < kPanel; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = q[j * kLineBytes + 4 * c + i];
            if (Bits == 8) {
              dot[c] += static_cast<int8_t>(byte) * xq[4 * j + i];
            } else {
              dot[c] += (byte & 0xF) * xq[8 * j + i] + (byte >> 4) * xq[8 * j + 4 + i];
            }
          }
      const float t = x.scale(r, g), min_factor = x.min_factor(r, g);
      for (int c = 0; c < kPanel; ++c) {
        acc[c] = std::fma(w.scales.value(panel * w.groups + g, c) * t, static_cast<float>(dot[c]), acc[c]);
        if (Mins) acc[c] = std::fma(w.mins.value(panel * w.groups + g, c), min_factor, acc[c]);
      }
    }
    store_row(acc, bias, out + r * ldo, cols);
  }
}

// ---- AVX-512 VNNI -----------------------------------------------------------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INFLIGHT_HAVE_INT8_DOTS_VNNI 1

template <int Rows, int Panels, int Bits, bool Mins, class Out>
void vnni_tile(const QuantizedRows& x, const Weights& w, int64_t first_panel, const float* bias, Out* out,
               int64_t ldo, int64_t cols, const uint8_t* prefetch, int64_t line_begin, int64_t line_end) {
  // One row of int4 keeps the nibbles' sums apart (2 x Panels chains); otherwise one sum each.
  constexpr int kHalves = Bits == 4 && Rows == 1 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0xF), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[Rows][Panels];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p) acc[r][p] = _mm512_setzero_ps();
  const uint8_t* q = w.q + first_panel * w.panel_bytes;
  int64_t line = line_begin;
  for (int64_t g = 0; g < w.groups; ++g) {
    inflight_cpu::prefetch_group_values(w.scales, w.mins, first_panel, Panels, w.groups, g);
    __m512i dot[Rows][Panels][kHalves];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Panels; ++p)
        for (int h = 0; h < kHalves; ++h) dot[r][p][h] = _mm512_setzero_si512();
    const int64_t end = std::min(w.lines, (g + 1) * w.lines_per_group);
    for (int64_t j = g * w.lines_per_group; j < end; ++j) {
      __m512i low[Panels], high[Panels];
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) {
        const __m512i bytes = _mm512_loadu_si512(q + p * w.panel_bytes + j * kLineBytes);
        if (Bits == 4) {
          low[p] = _mm512_and_si512(bytes, nibble);
          high[p] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        } else {
          low[p] = _mm512_xor_si512(bytes, flip);  // q + 128, unsigned
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        if (Bits == 4) {
          const __m512i x_low = _mm512_set1_epi32(x.quad(r, 2 * j)), x_high = _mm512_set1_epi32(x.quad(r, 2 * j + 1));
#pragma GCC unroll 8
          for (int p = 0; p < Panels; ++p) {
            dot[r][p][0] = _mm512_dpbusd_epi32(dot[r][p][0], low[p], x_low);
            dot[r][p][kHalves - 1] = _mm512_dpbusd_epi32(dot[r][p][kHalves - 1], high[p], x_high);
          }
        } else {
          const __m512i xq = _mm512_set1_epi32(x.quad(r, j));
#pragma GCC unroll 8
          for (int p = 0; p < Panels; ++p) dot[r][p][0] = _mm512_dpbusd_epi32(dot[r][p][0], low[p], xq);
        }
      }
      // As many lines of the next item's panels as this line read of this tile's, so that the
      // whole next item is asked for (one a line asks for a quarter of it at one row: the decode
      // step of Llama-3.2-1B in int4 + int8 activations measured 11% slower so).
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p)
        if (line < line_end) inflight_cpu::prefetch_l2(prefetch + kLineBytes * line++);
    }
    __m512 s[Panels], m[Panels];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      s[p] = inflight_cpu::group_values_avx512(w.scales, (first_panel + p) * w.groups + g);
      if (Mins) m[p] = inflight_cpu::group_values_avx512(w.mins, (first_panel + p) * w.groups + g);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 t = _mm512_set1_ps(x.scale(r, g));
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) {
        __m512i d = kHalves == 2 ? _mm512_add_epi32(dot[r][p][0], dot[r][p][kHalves - 1]) : dot[r][p][0];
        if (Bits == 8) d = _mm512_sub_epi32(d, _mm512_set1_epi32(128 * x.group_sum(r, g)));
        acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(s[p], t), _mm512_cvtepi32_ps(d), acc[r][p]);
        if (Mins) acc[r][p] = _mm512_fmadd_ps(m[p], _mm512_set1_ps(x.min_factor(r, g)), acc[r][p]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      if (p * kPanel >= cols) continue;
      alignas(64) float sums[kPanel];
      _mm512_store_ps(sums, acc[r][p]);
      store_row(sums, bias != nullptr ? bias + p * kPanel : nullptr, out + r * ldo + p * kPanel,
                std::min<int64_t>(kPanel, cols - p * kPanel));
    }
}
#endif

// ---- AVX2 -------------------------------------------------------------------------------------

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(INFLIGHT_HAVE_INT8_DOTS_VNNI)
#define INFLIGHT_HAVE_INT8_DOTS_AVX2 1

template <int Rows, int Panels, int Bits, bool Mins, class Out>
void avx2_tile(const QuantizedRows& x, const Weights& w, int64_t first_panel, const float* bias, Out* out,
               int64_t ldo, int64_t cols, const uint8_t* prefetch, int64_t line_begin, int64_t line_end) {
  const __m256i nibble = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  __m256 acc[Rows][Panels][2];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const uint8_t* q = w.q + first_panel * w.panel_bytes;
  int64_t line = line_begin;
  for (int64_t g = 0; g < w.groups; ++g) {
    inflight_cpu::prefetch_group_values(w.scales, w.mins, first_panel, Panels, w.groups, g);
    __m256i dot[Rows][Panels][2];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Panels; ++p) dot[r][p][0] = dot[r][p][1] = _mm256_setzero_si256();
    const int64_t end = std::min(w.lines, (g + 1) * w.lines_per_group);
    for (int64_t j = g * w.lines_per_group; j < end; ++j) {
      __m256i bytes[Panels][2];
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p)
        for (int v = 0; v < 2; ++v)
          bytes[p][v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * w.panel_bytes + j * kLineBytes + 32 * v));
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const __m256i x_low = _mm256_set1_epi32(x.quad(r, Bits == 4 ? 2 * j : j));
        const __m256i x_high = Bits == 4 ? _mm256_set1_epi32(x.quad(r, 2 * j + 1)) : x_low;
#pragma GCC unroll 8
        for (int p = 0; p < Panels; ++p)
          for (int v = 0; v < 2; ++v) {
            __m256i pairs;
            if (Bits == 4) {
              const __m256i low = _mm256_and_si256(bytes[p][v], nibble);
              const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes[p][v], 4), nibble);
              pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
            } else {
              pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(bytes[p][v]), _mm256_sign_epi8(x_low, bytes[p][v]));
            }
            dot[r][p][v] = _mm256_add_epi32(dot[r][p][v], _mm256_madd_epi16(pairs, ones));
          }
      }
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p)  // as on AVX-512: the lines this line read of this tile's panels
        if (line < line_end) inflight_cpu::prefetch_l2(prefetch + kLineBytes * line++);
    }
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      __m256 s[2], m[2];
      inflight_cpu::group_values_avx2(w.scales, (first_panel + p) * w.groups + g, s);
      if (Mins) inflight_cpu::group_values_avx2(w.mins, (first_panel + p) * w.groups + g, m);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const __m256 t = _mm256_set1_ps(x.scale(r, g)), min_factor = _mm256_set1_ps(x.min_factor(r, g));
        for (int v = 0; v < 2; ++v) {
          acc[r][p][v] = _mm256_fmadd_ps(_mm256_mul_ps(s[v], t), _mm256_cvtepi32_ps(dot[r][p][v]), acc[r][p][v]);
          if (Mins) acc[r][p][v] = _mm256_fmadd_ps(m[v], min_factor, acc[r][p][v]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      if (p * kPanel >= cols) continue;
      alignas(32) float sums[kPanel];
      _mm256_store_ps(sums, acc[r][p][0]);
      _mm256_store_ps(sums + 8, acc[r][p][1]);
      store_row(sums, bias != nullptr ? bias + p * kPanel : nullptr, out + r * ldo + p * kPanel,
                std::min<int64_t>(kPanel, cols - p * kPanel));
    }
}
#endif

// The widest tile of panels a row count takes, for the path built.
constexpr int panels_for_rows(int rows) {
#if defined(INFLIGHT_HAVE_INT8_DOTS_VNNI)
  return rows == 1 ? 4 : 2;
#elif defined(INFLIGHT_HAVE_INT8_DOTS_AVX2)
  return rows == 1 ? 2 : 1;
#else
  return 1;
#endif
}

template <int Rows, int Panels, int Bits, bool Mins, class Out>
void run_tile(const QuantizedRows& x, const Weights& w, int64_t first_panel, const float* bias, Out* out, int64_t ldo,
              int64_t cols, const uint8_t* prefetch, int64_t line_begin, int64_t line_end) {
#if defined(INFLIGHT_HAVE_INT8_DOTS_VNNI)
  vnni_tile<Rows, Panels, Bits, Mins>(x, w, first_panel, bias, out, ldo, cols, prefetch, line_begin, line_end);
#elif defined(INFLIGHT_HAVE_INT8_DOTS_AVX2)
  avx2_tile<Rows, Panels, Bits, Mins>(x, w, first_panel, bias, out, ldo, cols, prefetch, line_begin, line_end);
#else
  scalar_rows<Bits, Mins>(x, Rows, w, first_panel, bias, out, ldo, cols);
#endif
}

// Rows [0, rows) of a row block against panels [first_panel, first_panel + panels): tiles of up
// to 4 rows, each against the widest tile of panels its row count takes, the last few panels one
// by one. The tiles share out the asking for the next item's panels (`prefetch`) into L2.
template <int Bits, bool Mins, class Out>
void run_item(const QuantizedRows& x, int64_t rows, const Weights& w, int64_t first_panel, int64_t panels,
              const float* bias, Out* out, int64_t ldo, int64_t cols, const uint8_t* prefetch) {
  const int64_t lines = prefetch != nullptr ? panels * w.panel_bytes / kLineBytes : 0;
  for (int64_t first = 0; first < rows; first += 4) {
    const QuantizedRows tile_rows = x.from(first);
    Out* tile_out = out + first * ldo;
    const auto run = [&](auto rows_in_tile) {
      constexpr int kRows = decltype(rows_in_tile)::value, kPanels = panels_for_rows(kRows);
      // The prefetches go with the first tile of rows only (the others find the panels in cache).
      const int64_t calls = panels / kPanels + panels % kPanels;
      int64_t call = 0;
      for (int64_t p = 0; p < panels; ++call) {
        const int64_t begin = first == 0 ? call * lines / calls : 0, end = first == 0 ? (call + 1) * lines / calls : 0;
        const float* b = bias != nullptr ? bias + p * kPanel : nullptr;
        if (panels - p >= kPanels) {
          run_tile<kRows, kPanels, Bits, Mins>(tile_rows, w, first_panel + p, b, tile_out + p * kPanel, ldo,
                                               cols - p * kPanel, prefetch, begin, end);
          p += kPanels;
        } else {
          run_tile<kRows, 1, Bits, Mins>(tile_rows, w, first_panel + p, b, tile_out + p * kPanel, ldo,
                                         cols - p * kPanel, prefetch, begin, end);
          p += 1;
        }
      }
    };
    switch (std::min<int64_t>(4, rows - first)) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
  }
}

// ---- AMX-INT8 ---------------------------------------------------------------------------------
//
// From kTileMinRows rows (a prefill, a large batch) on a Xeon with AMX: the same integers, summed
// by tdpbsud (x's signed bytes against int4's unsigned ones) or tdpbssd (int8's signed ones), each
// group's sums stored from the tiles and run through the same float steps in the same order, so
// the same bits as the vector paths. Tiles 0-1: x's rows 0-15 and 16-31 of a pass; 2-3: two
// panels' next k's, as 4-byte quads of each column (the vector paths' int8 line, or an int4
// line's low and high nibbles as two quads); 4-7: their int32 sums over one group. Items are
// pairs of panels: each is unpacked once a call into a buffer of the core's own, then run against
// every pass of 32 rows of x (zero rows past M).

// Below it the vector path is as fast or faster (2-core AMX Xeon, two of Llama-3.2-1B's gate|up and
// two of its down projections, bf16 x: at 16 rows vpdpbusd 5.9-8.9 ms against the tiles' 7.7-14.7,
// at 32 even, at 64 the tiles 1.05-2.0x faster; from 64 rows int4 g128 and int8 per channel run
// 1.2-1.8x the bf16 tiles on the de-quantized weight, int4 g32 0.5-0.7x, bound by its float steps
// once a group of 32).
constexpr int64_t kTileMinRows = 32;

struct TileShape {
  int64_t k;        // k's a dot product takes: 64, or a group's size where smaller
  int64_t width;    // x's and the unpacked panels' k's: whole groups of whole dot products
  int64_t group_k;  // k's a group spans in that width
};

// The tile shape for w, or k 0 where the tiles cannot take its groups (a size past 64 and no
// multiple of it).
TileShape tile_shape(const Weights& w, int64_t per_line) {
  if (w.groups == 1) {
    const int64_t width = (w.lines * per_line + 63) / 64 * 64;
    return {64, width, width};
  }
  const int64_t group_k = w.lines_per_group * per_line;
  const int64_t k = group_k % 64 == 0 ? 64 : (group_k < 64 ? group_k : 0);
  return {k, w.groups * group_k, group_k};
}

// Panel `panel`'s k's [0, width) as quads (4 bytes a column, 64 bytes a quad), zero past its lines.
template <int Bits>
void unpack_panel(const Weights& w, int64_t panel, int64_t width, uint8_t* dst) {
  const uint8_t* q = w.q + panel * w.panel_bytes;
  if (Bits == 8) {
    std::memcpy(dst, q, w.lines * kLineBytes);
    std::memset(dst + w.lines * kLineBytes, 0, (width / 4 - w.lines) * kLineBytes);
    return;
  }
  for (int64_t j = 0; j < w.lines; ++j) {
    const uint8_t* line = q + j * kLineBytes;
    uint8_t* low = dst + 2 * j * kLineBytes;
    uint8_t* high = low + kLineBytes;
    for (int i = 0; i < kLineBytes; ++i) low[i] = line[i] & 0xF, high[i] = line[i] >> 4;
  }
  std::memset(dst + 2 * w.lines * kLineBytes, 0, (width / 4 - 2 * w.lines) * kLineBytes);
}

template <class Tiles, int Bits, bool Mins, class Out>
void tiles_gemm(const QuantizedRows& x, int64_t m, const Weights& w, int64_t num_panels, const TileShape& shape,
                const float* bias, Out* out, int64_t n) {
  using inflight_cpu::kTileRows;
  const int64_t passes = (m + 2 * kTileRows - 1) / (2 * kTileRows), pairs = (num_panels + 1) / 2;
  const int64_t dots_per_group = shape.group_k / shape.k;
  const int64_t threads = m * n * shape.width < kMinParallelMacs ? 1 : std::min<int64_t>(at::get_num_threads(), pairs);
#pragma omp parallel num_threads(threads)
  {
    inflight_cpu::TileConfig config;
    config.rows[0] = config.rows[1] = kTileRows;
    config.bytes_per_row[0] = config.bytes_per_row[1] = static_cast<uint16_t>(shape.k);
    config.rows[2] = config.rows[3] = static_cast<uint8_t>(shape.k / 4);
    config.bytes_per_row[2] = config.bytes_per_row[3] = kLineBytes;
    for (int t = 4; t < 8; ++t) config.rows[t] = kTileRows, config.bytes_per_row[t] = kLineBytes;
    AMX_CONFIGURE(&config);
    std::vector<uint8_t> panels(2 * shape.width * kPanel);
    alignas(64) int32_t dots[4][kTileRows][kPanel];  // tile 4 + t: rows of half t / 2, panel t % 2
    alignas(64) float acc[2 * kTileRows][2 * kPanel];
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      // A pair of one panel (the last of an odd count) runs it twice and stores its first half.
      const int64_t first = 2 * pair, second = std::min(first + 1, num_panels - 1);
      const uint8_t* b[2] = {panels.data(), panels.data() + shape.width * kPanel};
      unpack_panel<Bits>(w, first, shape.width, panels.data());
      unpack_panel<Bits>(w, second, shape.width, panels.data() + shape.width * kPanel);
      const int64_t col = first * kPanel, cols = std::min<int64_t>(second > first ? 2 * kPanel : kPanel, n - col);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t row0 = pass * 2 * kTileRows;
        const int8_t* xa = x.q + row0 * x.ld;
        std::memset(acc, 0, sizeof acc);
        for (int64_t g = 0; g < w.groups; ++g) {
          AMX_ZERO(4);
          AMX_ZERO(5);
          AMX_ZERO(6);
          AMX_ZERO(7);
          for (int64_t d = 0; d < dots_per_group; ++d) {
            const int64_t k0 = g * shape.group_k + d * shape.k;
            AMX_LOAD(0, xa + k0, x.ld);
            AMX_LOAD(1, xa + kTileRows * x.ld + k0, x.ld);
            AMX_LOAD(2, b[0] + k0 * kPanel, kLineBytes);
            AMX_LOAD(3, b[1] + k0 * kPanel, kLineBytes);
            if (Bits == 4) {
              AMX_DP_SU(4, 0, 2);
              AMX_DP_SU(5, 0, 3);
              AMX_DP_SU(6, 1, 2);
              AMX_DP_SU(7, 1, 3);
            } else {
              AMX_DP_SS(4, 0, 2);
              AMX_DP_SS(5, 0, 3);
              AMX_DP_SS(6, 1, 2);
              AMX_DP_SS(7, 1, 3);
            }
          }
          AMX_STORE(4, dots[0], kLineBytes);
          AMX_STORE(5, dots[1], kLineBytes);
          AMX_STORE(6, dots[2], kLineBytes);
          AMX_STORE(7, dots[3], kLineBytes);
          float scale[2][kPanel], min[2][kPanel];
          for (int p = 0; p < 2; ++p)
            for (int c = 0; c < kPanel; ++c) {
              const int64_t panel_group = (p == 0 ? first : second) * w.groups + g;
              scale[p][c] = w.scales.value(panel_group, c);
              min[p][c] = Mins ? w.mins.value(panel_group, c) : 0.f;
            }
          for (int64_t r = 0; r < 2 * kTileRows; ++r) {
            const float t = x.scale(row0 + r, g), min_factor = x.min_factor(row0 + r, g);
            for (int p = 0; p < 2; ++p) {
              const int32_t* dot = dots[(r / kTileRows) * 2 + p][r % kTileRows];
              float* a = acc[r] + p * kPanel;
#if defined(__AVX512F__)
              // Written out: g++ left the loop below unvectorised without mins (2x slower there).
              __m512 sums = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(scale[p]), _mm512_set1_ps(t)),
                                            _mm512_cvtepi32_ps(_mm512_loadu_si512(dot)), _mm512_loadu_ps(a));
              if (Mins) sums = _mm512_fmadd_ps(_mm512_loadu_ps(min[p]), _mm512_set1_ps(min_factor), sums);
              _mm512_storeu_ps(a, sums);
#else
              for (int c = 0; c < kPanel; ++c) {
                a[c] = std::fma(scale[p][c] * t, static_cast<float>(dot[c]), a[c]);
                if (Mins) a[c] = std::fma(min[p][c], min_factor, a[c]);
              }
#endif
            }
          }
        }
        for (int64_t r = 0; r < std::min<int64_t>(2 * kTileRows, m - row0); ++r)
          store_row(acc[r], bias != nullptr ? bias + col : nullptr, out + (row0 + r) * n + col, cols);
      }
    }
    AMX_RELEASE();
  }
}

template <int Bits, bool Mins, class In>
at::Tensor gemm(const at::Tensor& x, const Weights& w, int64_t num_panels, int64_t group_size, const float* bias,
                int64_t n) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const TileShape shape = tile_shape(w, k_per_line(Bits));
  const bool tiles = m >= kTileMinRows && shape.k > 0 && inflight_cpu::tiles_built() && inflight_cpu::amx_permitted();
  // The tiles read whole dot products of x, and passes of 32 rows (zero rows past M).
  const int64_t padded_k = tiles ? shape.width : w.lines * k_per_line(Bits);
  const int64_t rows_held = tiles ? (m + 31) / 32 * 32 : m;
  // The quantized rows, their scales, min factors and sums in one buffer (one allocation a call,
  // not four: a decode step makes ~100 of these calls). quantize_row writes every byte of rows
  // [0, m); only the tiles' padding rows past m are zeroed.
  const int64_t q_bytes = (rows_held * padded_k + 63) / 64 * 64, values = rows_held * w.groups;
  at::Tensor held = at::empty({q_bytes + 3 * values * 4}, x.options().dtype(at::kChar));
  int8_t* qp = held.data_ptr<int8_t>();
  float* sp = reinterpret_cast<float*>(qp + q_bytes);
  float* mp = sp + values;
  int32_t* gp = reinterpret_cast<int32_t*>(mp + values);
  if (rows_held > m) {
    std::memset(qp + m * padded_k, 0, (rows_held - m) * padded_k);
    for (float* v : {sp, mp}) std::fill(v + m * w.groups, v + values, 0.f);
    std::fill(gp + m * w.groups, gp + values, 0);
  }
  const In* xp = x.data_ptr<In>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * ldx, k, padded_k, group_size, w.groups, qp + r * padded_k, sp + r * w.groups,
                   mp + r * w.groups, gp + r * w.groups);
  });
  const QuantizedRows rows{qp, padded_k, sp, mp, gp, w.groups};
  In* op = out.data_ptr<In>();
  if (tiles) {
    inflight_cpu::with_tiles([&](auto tile_kind) {
      tiles_gemm<decltype(tile_kind), Bits, Mins>(rows, m, w, num_panels, shape, bias, op, n);
    });
    return out;
  }
  // Row blocks whose quantized x stays in L2 as the block's panels stream past it.
  const int64_t block_rows = std::max<int64_t>(4, kRowBlockBytes / padded_k / 4 * 4);
  const int64_t group_panels = panels_for_rows(1);
  const int64_t panel_groups = (num_panels + group_panels - 1) / group_panels;
  const int64_t items = (m + block_rows - 1) / block_rows * panel_groups;
  const auto panels_of = [&](int64_t item) -> const uint8_t* {
    return item >= 0 ? w.q + item % panel_groups * group_panels * w.panel_bytes : nullptr;
  };
  const auto run_items = [&](int64_t begin, int64_t end, int64_t after) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_row = item / panel_groups * block_rows, first_panel = item % panel_groups * group_panels;
      const int64_t panels = std::min(group_panels, num_panels - first_panel), col = first_panel * kPanel;
      run_item<Bits, Mins>(rows.from(first_row), std::min(m, first_row + block_rows) - first_row, w, first_panel,
                           panels, bias != nullptr ? bias + col : nullptr, op + first_row * n + col, n,
                           std::min(panels * kPanel, n - col), panels_of(item + 1 < end ? item + 1 : after));
    }
  };
  run_gemm_items(items, m * n * k, at::get_num_threads(), run_items);
  return out;
}

}  // namespace

const char* int8_dots_path() {
#if defined(INFLIGHT_HAVE_INT8_DOTS_VNNI)
  return "avx512_vnni";
#elif defined(INFLIGHT_HAVE_INT8_DOTS_AVX2)
  return "avx2";
#else
  return "plain";
#endif
}

std::vector<at::Tensor> pack_int8_dot_panels(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                                             int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_int8_dot_panels: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_int8_dot_panels: q must be int8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(group_size > 0, "pack_int8_dot_panels: group_size must be positive, not ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size, per_line = k_per_line(bits);
  TORCH_CHECK(groups == 1 || group_size % per_line == 0, "pack_int8_dot_panels: ", bits,
              "-bit groups must be a multiple of ", per_line, " inputs (or one group), not ", group_size);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups && scales.scalar_type() == at::kFloat,
              "pack_int8_dot_panels: scales must be float32 [", n, ", ", groups, "]");
  const bool has_mins = mins.has_value() && mins->defined();
  if (has_mins)
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat,
                "pack_int8_dot_panels: mins must be float32 [", n, ", ", groups, "]");
  if (bits == 4)
    TORCH_CHECK(q.numel() == 0 || (q.min().item<int>() >= 0 && q.max().item<int>() <= 15),
                "pack_int8_dot_panels: 4-bit q must hold 0..15");
  const int64_t lines = (k + per_line - 1) / per_line;
  at::Tensor padded = at::zeros({panels * kPanel, lines * per_line}, q.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
  at::Tensor packed;
  if (bits == 8) {
    // [P, 16, lines, 4] -> [P, lines, 16, 4]: each column's 4 k's of a line side by side.
    packed = padded.view({panels, kPanel, lines, 4}).permute({0, 2, 1, 3}).contiguous().view(at::kByte);
  } else {
    at::Tensor nibbles = padded.view(at::kByte).view({panels, kPanel, lines, 2, 4}).permute({0, 2, 1, 3, 4});
    packed = nibbles.select(3, 0).bitwise_or(nibbles.select(3, 1).bitwise_left_shift(4)).contiguous();
  }
  std::vector<at::Tensor> result{packed.view({panels, lines, kLineBytes}),
                                 inflight_cpu::pack_group_values(scales.contiguous(), panels)};
  if (has_mins) result.push_back(inflight_cpu::pack_group_values(mins->contiguous(), panels));
  return result;
}

at::Tensor int8_dot_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                         std::optional<at::Tensor> bias, int64_t n, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "int8_dot_gemm: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_dot_gemm: x [M, K] in float32 or bfloat16");
  const int64_t k = x.size(1), per_line = k_per_line(bits), lines = (k + per_line - 1) / per_line;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kLineBytes && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int8_dot_gemm: q panels from pack_int8_dot_panels");
  TORCH_CHECK(q.size(1) == lines, "int8_dot_gemm: x has ", k, " columns, the ", bits, "-bit weight's panels ",
              q.size(1) * per_line);
  const int64_t num_panels = q.size(0);
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel, "int8_dot_gemm: n does not match the panels");
  TORCH_CHECK(group_size > 0, "int8_dot_gemm: group_size must be positive");
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(groups == 1 || group_size % per_line == 0, "int8_dot_gemm: ", bits, "-bit groups must be a multiple of ",
              per_line, " inputs (or one group), not ", group_size);
  const bool has_mins = mins.has_value() && mins->defined();
  const GroupValues scale_values = inflight_cpu::group_values_of(scales, num_panels, groups, group_size, "int8_dot_gemm",
                                                                 "scales", "pack_int8_dot_panels");
  const GroupValues min_values = has_mins ? inflight_cpu::group_values_of(*mins, num_panels, groups, group_size,
                                                                          "int8_dot_gemm", "mins", "pack_int8_dot_panels")
                                          : GroupValues{nullptr, false};
  if (x.stride(1) != 1 || x.stride(0) < k) x = x.contiguous();
  const at::Tensor bias_float = inflight_cpu::float_bias(bias, n, x.scalar_type(), "int8_dot_gemm");
  const float* bias_data = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  const Weights w{q.data_ptr<uint8_t>(), q.stride(0), scale_values, min_values, groups, lines,
                  groups == 1 ? lines : group_size / per_line};
  const auto typed = [&](auto in) {
    using In = decltype(in);
    if (bits == 4)
      return has_mins ? gemm<4, true, In>(x, w, num_panels, group_size, bias_data, n)
                      : gemm<4, false, In>(x, w, num_panels, group_size, bias_data, n);
    return has_mins ? gemm<8, true, In>(x, w, num_panels, group_size, bias_data, n)
                    : gemm<8, false, In>(x, w, num_panels, group_size, bias_data, n);
  };
  return x.scalar_type() == at::kFloat ? typed(float{}) : typed(c10::BFloat16{});
}
