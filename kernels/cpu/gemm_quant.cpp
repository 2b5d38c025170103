// GEMMs of float activations against int8 and int4 weights (kernels/quantized.py's format),
// packed once into 16-column panels and de-quantized in registers: out[M, N] = x[M, K] W^T
// (+ bias), x and out float32.
//
// Numerics. The weight is w = fl(fl(scale * q) + min) (kernels/quantized.py: two roundings, no
// fused multiply-add; `QuantizedWeight.dequantize()` computes the same), and every output element
// is then ONE chain of fused multiply-adds over k in order, from zero, then + bias, exactly as
// the float panel GEMM (gemm.cpp) runs it: so the result is the float panel GEMM's on the
// de-quantized weight, to the bit, a row's result never depends on the other rows (batch
// invariance), and the AVX2, AVX-512 and scalar paths give the same bits.
// The build's -funsafe-math-optimizations lets g++ contract a product and a sum into a fused
// multiply-add (its intrinsics are plain vector arithmetic to it): the pragma below forbids that
// in this file, and tests/kernels/test_linear_quant.py checks the bits.
//
// Layout (pack_quant_panels). Panel p holds output columns 16p..16p+15 (columns past N: q, scale
// and min 0, so w = 0):
// - int8: q [P, K, 16], one 16-byte row per k;
// - int4: q [P, ceil(K / 2), 16], one 16-byte row per pair of k's, byte c = q[c, 2j] | q[c, 2j+1] << 4
//   (a weight's two k's are one load; an odd K's last high nibbles are 0);
// - scales and mins [P, groups, 16], in float16 where every value converts to float16 and back
//   exactly (GGUF's d and m, Q4_0's -8d, Q8_0's d), else float32 (Q4_K's d * sc, AWQ's -s * z).
// So a Q4_0/Q4_1 weight costs 4 + 32/32 = 5 bits, Q8_0's 8 + 16/32 = 8.5, int4 with float32
// scale and min per 128 4.5.
//
// Kernels. De-quantizing costs more instructions than the multiply-adds it feeds at a few rows,
// so it is paid once for as many rows as possible:
// - row blocks of 1-4 rows (decode) de-quantize in registers: for each k (a pair of k's for int4)
//   a tile loads its panels' integers once, widens and converts them, multiplies by the group's
//   scales and adds its mins (held for the whole group) and runs every row's multiply-adds on
//   them. One row runs against two panels at once (AVX2; four on AVX-512), so that four chains of
//   sums interleave instead of two waiting on the FMA latency;
// - larger row blocks de-quantize one panel's next 256 k's once into a 16 KB buffer (L1), and every
//   tile of the block's rows (6 on AVX2, 12 on AVX-512, as gemm.cpp) runs the float panel GEMM's
//   loop on it, its sums carried from one 256 k's to the next through memory (exact);
// - kIsaNone: plain C++ (std::fma; what a CPU without AVX2 and FMA would run: slow, and kept for
//   correctness; kernels/linear.py de-quantizes per call with torch instead there);
// - kIsaAmx: bfloat16 x on the AMX tiles (a bf16 model on a Xeon with AMX). Each item is two
//   panels: de-quantized as above, rounded to bfloat16 (as torch rounds) into gemm.cpp's bf16
//   panel layout in a buffer of the core's own, once a call, then run against every row of x
//   with gemm.cpp's tile loop. So its result is gemm.cpp's AMX GEMM on dequantize().bfloat16(),
//   to the bit, at every row count: a row's bits depend on its own x only, as on the other paths.
//   A decode's one row pays the de-quantizing as the register path does; from 32 rows on the
//   tiles' multiply-adds cost next to nothing, where the vector paths' FMAs bound them.
// - kIsaAvx512Bf16: bfloat16 x on vdpbf16ps where there are no tiles, as kIsaAmx: each two panels
//   de-quantized to bfloat16 once a call, then gemm.cpp's vdpbf16ps tiles (panel_gemm's isa 3 bits
//   on dequantize().bfloat16(), at every row count), outside the batch-invariant mode;
// - kQuantBf16Dots (bfloat16 x, AVX512-BF16): the bf16 dots below, every call of a bf16 model
//   without tiles in the batch-invariant mode, and a decode's few rows outside it; numerics of
//   their own (the group's scale applied to the sums).
// Work is split over the cores by (row block, group of panels) in chunks taken as cores come
// free, as gemm.cpp splits it, and the tiles ask for the next item's panels into L2 as they go.
//
// Measured on a 2-core AVX2 EPYC (Zen 3, KVM) that other sessions' jobs shared (load average
// 6.3 on its 2 cores), so one thread, best of 3 windows: GFLOP/s, and at M = 1 the weight's GB/s
// (its packed bytes, read once a call), against the float32 panel GEMM on the same shape
// (client/bench/quant_gemm.py --threads 1, bench/results/avx2/quant_gemm.json; formats there: int8
// per channel; q8_0 int8 g32 float16 scales; q4_1 int4 g32 float16 scale and min; int4_g128 float32).
// SmolLM2-135M's weights (the first four shapes, 1-7 MB in float32) sit in the L3 cache, where the
// float GEMM reads ~30 GB/s and de-quantizing bounds the quantized ones at one row (the same
// GFLOP/s); Llama-3.2-1B's (the last two, 64 MB) stream from memory, where one row runs 2.5-4.9x
// faster quantized. From 32 rows on (de-quantized once per 256 k's) the quantized GEMMs ran at
// 75-150% of the float rate; single figures moved by 10-20% between runs on the shared machine.
//   N x K       M      float32         int8         q8_0         q4_1    int4_g128
//  960 x 576     1   15.2 / 30.4  15.4 /  7.8  10.9 /  5.8  11.3 /  3.5  17.5 /  5.0
//  960 x 576     8   45.0         41.2         43.0         30.8         29.4
//  960 x 576    32   66.3         49.9         52.4         48.9         52.6
//  960 x 576   256   59.2         58.4         59.1         56.1         74.7
//  576 x 576     1   13.7 / 27.4  16.7 /  8.4  17.3 /  9.2  15.2 /  4.8  15.5 /  4.4
//  576 x 576     8   46.8         29.0         27.8         28.8         38.8
//  576 x 576    32   62.8         58.1         48.0         49.7         51.0
//  576 x 576   256   64.4         68.0         59.3         56.2         59.3
// 3072 x 576     1   16.4 / 32.8  15.5 /  7.8  14.3 /  7.6  13.9 /  4.3  14.1 /  4.0
// 3072 x 576     8   46.0         40.1         37.3         39.7         40.8
// 3072 x 576    32   77.6         74.2         73.7         58.8         73.7
// 3072 x 576   256   69.3         62.2         65.2         57.7         76.0
//  576 x 1536    1   16.7 / 33.3  16.6 /  8.3  21.8 / 11.6  13.1 /  4.1  12.1 /  3.4
//  576 x 1536    8   39.6         29.4         37.8         35.6         30.1
//  576 x 1536   32   60.9         54.0         54.0         53.4         53.3
//  576 x 1536  256   61.6         58.9         58.9         75.0         73.9
// 8192 x 2048    1    4.9 /  9.9  22.1 / 11.1  12.2 /  6.5  13.7 /  4.3  14.9 /  4.2
// 8192 x 2048    8   29.8         36.7         36.7         39.5         34.2
// 8192 x 2048   32   41.9         48.5         47.9         49.8         50.3
// 8192 x 2048  256   57.1         69.3         65.9         69.3         63.2
// 2048 x 8192    1    4.5 /  9.1  15.4 /  7.7  15.1 /  8.0  19.1 /  6.0  21.9 /  6.1
// 2048 x 8192    8   19.0         29.9         34.8         41.0         41.1
// 2048 x 8192   32   28.2         37.7         39.0         46.5         47.6
// 2048 x 8192  256   28.2         41.2         42.4         34.7         35.8

#include <ATen/core/Tensor.h>
#include <ATen/ops/bitwise_left_shift.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "prefetch.h"
#include "quant_values.h"
#include "work_split.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// After the headers: only this file's functions. w = scale * q then + min, never fused.
#pragma GCC optimize("fp-contract=off")

namespace {

// As gemm.cpp (and kernels/cpu_ext.py's Isa) number them.
enum Isa : int64_t { kIsaNone = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Bf16 = 3, kIsaAmx = 4 };

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBytes = 16;  // one packed row of a panel: 16 int8's, or 16 pairs of nibbles
constexpr int64_t kRowBlockBytes = 256 * 1024;

using inflight_cpu::GroupValues;

struct Packed {
  const uint8_t* q;
  int64_t panel_bytes;  // bytes of one panel's q
  GroupValues scales, mins;  // mins.base nullptr: none
  int64_t groups, group_size, k;
};

// ---- the scalar path ------------------------------------------------------------------------

template <int Bits>
inline int q_at(const uint8_t* panel, int64_t k, int c) {
  if (Bits == 8) return static_cast<int8_t>(panel[k * kRowBytes + c]);
  const uint8_t byte = panel[(k / 2) * kRowBytes + c];
  return k % 2 == 0 ? byte & 0xF : byte >> 4;
}

template <int Bits>
void scalar_rows(const float* x, int64_t ldx, int64_t rows, const Packed& w, int64_t panel, const float* bias,
                 float* out, int64_t ldo, int64_t cols) {
  const uint8_t* q = w.q + panel * w.panel_bytes;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t j = 0; j < w.groups; ++j) {
      float s[kPanel], m[kPanel];
      for (int c = 0; c < kPanel; ++c) {
        s[c] = w.scales.value(panel * w.groups + j, c);
        m[c] = w.mins.base != nullptr ? w.mins.value(panel * w.groups + j, c) : 0.f;
      }
      const int64_t k_end = std::min(w.k, (j + 1) * w.group_size);
      for (int64_t k = j * w.group_size; k < k_end; ++k) {
        const float a = x[r * ldx + k];
        for (int c = 0; c < kPanel; ++c) {
          float wc = s[c] * static_cast<float>(q_at<Bits>(q, k, c));
          if (w.mins.base != nullptr) wc = wc + m[c];
          acc[c] = std::fma(a, wc, acc[c]);
        }
      }
    }
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = bias != nullptr ? acc[c] + bias[c] : acc[c];
  }
}

// ---- the vector paths -------------------------------------------------------------------------

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INFLIGHT_HAVE_AVX2 1
// A path supplies: its float and integer vectors (kVectors of each per 16 columns), a group's
// 16 scales or mins, a row of int8's or of nibble pairs widened to 32-bit integers, the
// de-quantization, the broadcast and the multiply-add, and the store.
struct Avx2 {
  using Vec = __m256;
  using IVec = __m256i;
  static constexpr int kVectors = 2;
  static constexpr int kMaxRows = 6;
  // Up to 4 rows de-quantize in registers; one row against two panels, for four independent
  // sums (with more panels the group's scales, the weights and the sums outgrow the 16 registers).
  static constexpr int kDirectRows = 4;
  static constexpr int panels_for_rows(int rows) { return rows == 1 ? 2 : 1; }
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* w) { return _mm256_loadu_ps(w); }
  static void group_values(const GroupValues& v, int64_t panel_group, Vec (&out)[kVectors]) {
    inflight_cpu::group_values_avx2(v, panel_group, out);
  }
  static void ints8(const uint8_t* row, IVec (&q)[kVectors]) {
    q[0] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
    q[1] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8)));
  }
  static void ints4(const uint8_t* row, IVec (&lo)[kVectors], IVec (&hi)[kVectors]) {
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int v = 0; v < kVectors; ++v) {
      const __m256i pairs = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v)));
      lo[v] = _mm256_and_si256(pairs, mask);
      hi[v] = _mm256_srli_epi32(pairs, 4);
    }
  }
  static Vec weight(IVec q, Vec s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(q), s); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  static Vec madd(Vec acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static void to_floats(const Vec (&line)[kVectors], float* dst) {
    _mm256_storeu_ps(dst, line[0]);
    _mm256_storeu_ps(dst + 8, line[1]);
  }
  static void store(const Vec (&line)[kVectors], const float* bias, float* dst) {
    for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_ps(dst + 8 * v, bias != nullptr ? _mm256_add_ps(line[v], _mm256_loadu_ps(bias + 8 * v)) : line[v]);
  }
};
#endif

#if defined(__AVX512F__)
#define INFLIGHT_HAVE_AVX512 1
struct Avx512 {
  using Vec = __m512;
  using IVec = __m512i;
  static constexpr int kVectors = 1;
  static constexpr int kMaxRows = 12;
  static constexpr int kDirectRows = 4;
  static constexpr int panels_for_rows(int rows) { return rows == 1 ? 4 : 2; }
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* w) { return _mm512_loadu_ps(w); }
  static void group_values(const GroupValues& v, int64_t panel_group, Vec (&out)[kVectors]) {
    out[0] = inflight_cpu::group_values_avx512(v, panel_group);
  }
  static void ints8(const uint8_t* row, IVec (&q)[kVectors]) {
    q[0] = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  }
  static void ints4(const uint8_t* row, IVec (&lo)[kVectors], IVec (&hi)[kVectors]) {
    const __m512i pairs = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    lo[0] = _mm512_and_si512(pairs, _mm512_set1_epi32(0xF));
    hi[0] = _mm512_srli_epi32(pairs, 4);
  }
  static Vec weight(IVec q, Vec s) { return _mm512_mul_ps(_mm512_cvtepi32_ps(q), s); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static Vec madd(Vec acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static void to_floats(const Vec (&line)[kVectors], float* dst) { _mm512_storeu_ps(dst, line[0]); }
  static void store(const Vec (&line)[kVectors], const float* bias, float* dst) {
    _mm512_storeu_ps(dst, bias != nullptr ? _mm512_add_ps(line[0], _mm512_loadu_ps(bias)) : line[0]);
  }
};
#endif

// Calls fn(k, w) for k in [k_begin, k_end) in order, w[p][v] the weights of panels
// first_panel .. first_panel + Panels - 1 at k, de-quantized with their group's scales (and mins)
// held for the whole group, and ask(row) after each packed row read (a k's for int8, a pair's for
// int4). Inlined with its callers' lambdas: their sums then live in registers, not on the stack.
template <class V, int Panels, int Bits, bool Mins, class Fn, class Ask>
__attribute__((always_inline)) inline void for_each_k(const Packed& w, int64_t first_panel, int64_t k_begin, int64_t k_end, Fn&& fn, Ask&& ask) {
  using Vec = typename V::Vec;
  using IVec = typename V::IVec;
  constexpr int kV = V::kVectors;
  const uint8_t* q = w.q + first_panel * w.panel_bytes;
  for (int64_t j = k_begin / w.group_size; j * w.group_size < k_end; ++j) {
    Vec s[Panels][kV], m[Panels][kV], wk[Panels][kV];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      V::group_values(w.scales, (first_panel + p) * w.groups + j, s[p]);
      if (Mins) V::group_values(w.mins, (first_panel + p) * w.groups + j, m[p]);
    }
    const auto dequantize = [&](const IVec (&qi)[Panels][kV]) __attribute__((always_inline)) {
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p)
        for (int v = 0; v < kV; ++v) {
          wk[p][v] = V::weight(qi[p][v], s[p][v]);
          if (Mins) wk[p][v] = V::add(wk[p][v], m[p][v]);
        }
    };
    int64_t k = std::max(k_begin, j * w.group_size);
    const int64_t end = std::min(k_end, (j + 1) * w.group_size);
    if (Bits == 8) {
      for (; k < end; ++k) {
        IVec qi[Panels][kV];
#pragma GCC unroll 8
        for (int p = 0; p < Panels; ++p) V::ints8(q + p * w.panel_bytes + k * kRowBytes, qi[p]);
        dequantize(qi);
        fn(k, wk);
        ask(k);
      }
    } else {
      IVec lo[Panels][kV], hi[Panels][kV];
      const auto load = [&](int64_t pair) __attribute__((always_inline)) {
#pragma GCC unroll 8
        for (int p = 0; p < Panels; ++p) V::ints4(q + p * w.panel_bytes + pair * kRowBytes, lo[p], hi[p]);
      };
      if (k % 2 != 0 && k < end) {  // a group that starts on a pair's second k (odd group sizes)
        load(k / 2);
        dequantize(hi);
        fn(k, wk);
        ++k;
      }
      for (; k + 1 < end; k += 2) {
        load(k / 2);
        dequantize(lo);
        fn(k, wk);
        dequantize(hi);
        fn(k + 1, wk);
        ask(k / 2);
      }
      if (k < end) {  // a group that ends on a pair's first k
        load(k / 2);
        dequantize(lo);
        fn(k, wk);
      }
    }
  }
}

// Stores a tile's sums for one panel (`cols` of its 16 columns), + bias.
template <class V>
inline void store_line(const typename V::Vec (&line)[V::kVectors], const float* bias, float* out, int64_t cols) {
  if (cols == kPanel) return V::store(line, bias, out);
  alignas(64) float sums[kPanel];
  V::to_floats(line, sums);
  for (int64_t c = 0; c < cols; ++c) out[c] = bias != nullptr ? sums[c] + bias[c] : sums[c];
}

// Decode-sized row blocks: Rows rows against Panels adjacent panels, de-quantized in registers
// (once for the tile's rows), over all of K. At one row, several panels give the multiply-adds
// independent chains to interleave (one panel's two chains wait on the FMA latency). `prefetch`:
// the next item's panels (nullptr: none), whose 64-byte lines [line_begin, line_end) this tile asks
// for into L2, one a packed row, so that memory sees a steady stream.
// One k of a direct tile: the panels' integers de-quantized, then each row's multiply-adds.
template <class V, int Rows, int Panels, bool Mins>
__attribute__((always_inline)) inline void direct_step(typename V::Vec (&acc)[Rows][Panels][V::kVectors],
                                                       const float* x, int64_t ldx,
                                                       const typename V::IVec (&qi)[Panels][V::kVectors],
                                                       const typename V::Vec (&s)[Panels][V::kVectors],
                                                       const typename V::Vec (&m)[Panels][V::kVectors]) {
  using Vec = typename V::Vec;
  constexpr int kV = V::kVectors;
  Vec wk[Panels][kV];
#pragma GCC unroll 8
  for (int p = 0; p < Panels; ++p)
    for (int v = 0; v < kV; ++v) {
      wk[p][v] = V::weight(qi[p][v], s[p][v]);
      if (Mins) wk[p][v] = V::add(wk[p][v], m[p][v]);
    }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    const Vec a = V::broadcast(x + r * ldx);
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p)
      for (int v = 0; v < kV; ++v) acc[r][p][v] = V::madd(acc[r][p][v], a, wk[p][v]);
  }
}

template <class V, int Panels>
__attribute__((always_inline)) inline void ints4_rows(const uint8_t* q, int64_t panel_bytes, int64_t pair,
                                                      typename V::IVec (&lo)[Panels][V::kVectors],
                                                      typename V::IVec (&hi)[Panels][V::kVectors]) {
#pragma GCC unroll 8
  for (int p = 0; p < Panels; ++p) V::ints4(q + p * panel_bytes + pair * kRowBytes, lo[p], hi[p]);
}

template <class V, int Rows, int Panels, int Bits, bool Mins>
void direct_tile(const float* x, int64_t ldx, const Packed& w, int64_t first_panel, const float* bias, float* out,
                 int64_t ldo, int64_t cols, const uint8_t* prefetch, int64_t line_begin, int64_t line_end) {
  using Vec = typename V::Vec;
  using IVec = typename V::IVec;
  constexpr int kV = V::kVectors;
  Vec acc[Rows][Panels][kV];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p)
      for (int v = 0; v < kV; ++v) acc[r][p][v] = V::zero();
  // for_each_k's loop, written out here, its steps functions rather than lambdas: with the sums
  // captured by a lambda, g++ kept them in memory, loaded and stored every step (4x slower at one row).
  const uint8_t* q = w.q + first_panel * w.panel_bytes;
  int64_t line = line_begin;
  for (int64_t j = 0; j < w.groups; ++j) {
    inflight_cpu::prefetch_group_values(w.scales, w.mins, first_panel, Panels, w.groups, j);
    Vec s[Panels][kV], m[Panels][kV];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      V::group_values(w.scales, (first_panel + p) * w.groups + j, s[p]);
      if (Mins) V::group_values(w.mins, (first_panel + p) * w.groups + j, m[p]);
    }
    int64_t k = j * w.group_size;
    const int64_t end = std::min(w.k, k + w.group_size);
    if (Bits == 8) {
      for (; k < end; ++k) {
        IVec qi[Panels][kV];
#pragma GCC unroll 8
        for (int p = 0; p < Panels; ++p) V::ints8(q + p * w.panel_bytes + k * kRowBytes, qi[p]);
        direct_step<V, Rows, Panels, Mins>(acc, x + k, ldx, qi, s, m);
        if (line < line_end) inflight_cpu::prefetch_l2(prefetch + 64 * line++);
      }
    } else {
      IVec lo[Panels][kV], hi[Panels][kV];
      if (k % 2 != 0 && k < end) {
        ints4_rows<V, Panels>(q, w.panel_bytes, k >> 1, lo, hi);
        direct_step<V, Rows, Panels, Mins>(acc, x + k, ldx, hi, s, m);
        ++k;
      }
      for (; k + 1 < end; k += 2) {
        ints4_rows<V, Panels>(q, w.panel_bytes, k >> 1, lo, hi);
        direct_step<V, Rows, Panels, Mins>(acc, x + k, ldx, lo, s, m);
        direct_step<V, Rows, Panels, Mins>(acc, x + k + 1, ldx, hi, s, m);
        if (line < line_end) inflight_cpu::prefetch_l2(prefetch + 64 * line++);
      }
      if (k < end) {
        ints4_rows<V, Panels>(q, w.panel_bytes, k >> 1, lo, hi);
        direct_step<V, Rows, Panels, Mins>(acc, x + k, ldx, lo, s, m);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      // A copy: with the sums' own address taken, g++ stored them to memory every step.
      Vec line[kV];
      for (int v = 0; v < kV; ++v) line[v] = acc[r][p][v];
      if (p * kPanel < cols)
        store_line<V>(line, bias != nullptr ? bias + p * kPanel : nullptr, out + r * ldo + p * kPanel,
                      std::min<int64_t>(kPanel, cols - p * kPanel));
    }
}

// Larger row blocks: one panel's weights for kChunk k's at a time, de-quantized once into a
// buffer (L1), then every tile of the block's rows runs the float panel GEMM's loop on them:
// Rows rows, the sums carried from chunk to chunk in `sums` (exact: stored and loaded as
// floats), so each is still one chain over k in order.
constexpr int64_t kChunk = 256;

template <class V, int Rows>
void buffered_tile(const float* x, int64_t ldx, const float* weights, int64_t steps, float* sums, bool first,
                   bool last, const float* bias, float* out, int64_t ldo, int64_t cols) {
  using Vec = typename V::Vec;
  constexpr int kV = V::kVectors;
  constexpr int64_t kVectorElems = kPanel / kV;
  Vec acc[Rows][kV];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = first ? V::zero() : V::load(sums + r * kPanel + v * kVectorElems);
  for (int64_t k = 0; k < steps; ++k) {
    Vec wk[kV];
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) wk[v] = V::load(weights + k * kPanel + v * kVectorElems);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const Vec a = V::broadcast(x + r * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < kV; ++v) acc[r][v] = V::madd(acc[r][v], a, wk[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    if (last) {
      store_line<V>(acc[r], bias, out + r * ldo, cols);
    } else {
      V::to_floats(acc[r], sums + r * kPanel);
    }
  }
}

template <class V>
struct BufferedTiles {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, float*, bool, bool, const float*, float*, int64_t,
                      int64_t);
  template <int... Rows>
  static constexpr auto make(std::integer_sequence<int, Rows...>) {
    return std::array<Fn, sizeof...(Rows) + 1>{nullptr, buffered_tile<V, Rows + 1>...};
  }
  static constexpr auto kTiles = make(std::make_integer_sequence<int, V::kMaxRows>{});
};

// One work item: the rows [0, rows) of x (a row block) against the panels [first_panel,
// first_panel + panels), their `cols` columns; `prefetch`: the next item's panels or nullptr.
using ItemFn = void (*)(const float* x, int64_t ldx, int64_t rows, const Packed& w, int64_t first_panel,
                        int64_t panels, const float* bias, float* out, int64_t ldo, int64_t cols,
                        const uint8_t* prefetch, std::vector<float>& sums);

// Calls tile(std::integral_constant<int, P>{}, p, line_begin, line_end) over an item's panels
// [0, panels): Panels adjacent ones at a time, the last few one by one. Each call gets an equal
// share [line_begin, line_end) of the 64-byte lines of the next item's panels (`prefetch`; none
// where nullptr) to ask for into L2 as it goes.
template <int Panels, class Tile>
__attribute__((always_inline)) inline void for_each_panel_tile(const Packed& w, int64_t panels,
                                                               const uint8_t* prefetch, Tile&& tile) {
  const int64_t lines = prefetch != nullptr ? (panels * w.panel_bytes + 63) / 64 : 0;
  const int64_t calls = panels / Panels + panels % Panels;
  int64_t call = 0;
  for (int64_t p = 0; p < panels; ++call) {
    const int64_t line_begin = call * lines / calls, line_end = (call + 1) * lines / calls;
    if (panels - p >= Panels) {
      tile(std::integral_constant<int, Panels>{}, p, line_begin, line_end);
      p += Panels;
    } else {
      tile(std::integral_constant<int, 1>{}, p, line_begin, line_end);
      p += 1;
    }
  }
}

template <class V, int Rows, int Bits, bool Mins>
void direct_rows(const float* x, int64_t ldx, const Packed& w, int64_t first_panel, int64_t panels, const float* bias,
                 float* out, int64_t ldo, int64_t cols, const uint8_t* prefetch) {
  for_each_panel_tile<V::panels_for_rows(Rows)>(w, panels, prefetch, [&](auto tile_panels, int64_t p, int64_t line_begin,
                                                                         int64_t line_end) {
    const int64_t col = p * kPanel;
    direct_tile<V, Rows, decltype(tile_panels)::value, Bits, Mins>(
        x, ldx, w, first_panel + p, bias != nullptr ? bias + col : nullptr, out + col, ldo, cols - col, prefetch,
        line_begin, line_end);
  });
}

template <class V, int Bits, bool Mins>
void vector_item(const float* x, int64_t ldx, int64_t rows, const Packed& w, int64_t first_panel, int64_t panels,
                 const float* bias, float* out, int64_t ldo, int64_t cols, const uint8_t* prefetch,
                 std::vector<float>& sums) {
  static_assert(V::kDirectRows == 4, "direct_rows below covers 1 to 4 rows");
  switch (rows) {
    case 1:
      return direct_rows<V, 1, Bits, Mins>(x, ldx, w, first_panel, panels, bias, out, ldo, cols, prefetch);
    case 2:
      return direct_rows<V, 2, Bits, Mins>(x, ldx, w, first_panel, panels, bias, out, ldo, cols, prefetch);
    case 3:
      return direct_rows<V, 3, Bits, Mins>(x, ldx, w, first_panel, panels, bias, out, ldo, cols, prefetch);
    case 4:
      return direct_rows<V, 4, Bits, Mins>(x, ldx, w, first_panel, panels, bias, out, ldo, cols, prefetch);
    default:
      break;
  }
  constexpr int64_t kRows = V::kMaxRows;
  // As few tiles as the registers allow, of equal height (gemm.cpp: the same bits whatever the tile).
  const int64_t tiles = (rows + kRows - 1) / kRows, tile_rows = (rows + tiles - 1) / tiles;
  const int64_t chunks = (w.k + kChunk - 1) / kChunk;
  if (chunks > 1 && static_cast<int64_t>(sums.size()) < rows * kPanel) sums.resize(rows * kPanel);
  alignas(64) float weights[kChunk * kPanel];
  const int64_t lines = prefetch != nullptr ? (panels * w.panel_bytes + 63) / 64 : 0;
  int64_t line = 0;
  const auto ask = [&](int64_t) __attribute__((always_inline)) {
    if (line < lines) inflight_cpu::prefetch_l2(prefetch + 64 * line++);
  };
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t col = p * kPanel, panel_cols = std::min(kPanel, cols - col);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k_begin = c * kChunk, k_end = std::min(w.k, k_begin + kChunk);
      for_each_k<V, 1, Bits, Mins>(
          w, first_panel + p, k_begin, k_end,
          [&](int64_t k, const typename V::Vec (&wk)[1][V::kVectors]) __attribute__((always_inline)) {
            V::to_floats(wk[0], weights + (k - k_begin) * kPanel);
          },
          ask);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = t * tile_rows, count = std::min(tile_rows, rows - first);
        BufferedTiles<V>::kTiles[count](x + first * ldx + k_begin, ldx, weights, k_end - k_begin,
                                        sums.data() + first * kPanel, c == 0, c == chunks - 1,
                                        bias != nullptr ? bias + col : nullptr, out + first * ldo + col, ldo,
                                        panel_cols);
      }
    }
  }
}

template <int Bits>
void scalar_item(const float* x, int64_t ldx, int64_t rows, const Packed& w, int64_t first_panel, int64_t panels,
                 const float* bias, float* out, int64_t ldo, int64_t cols, const uint8_t*, std::vector<float>&) {
  for (int64_t p = 0; p < panels; ++p)
    scalar_rows<Bits>(x, ldx, rows, w, first_panel + p, bias != nullptr ? bias + p * kPanel : nullptr,
                      out + p * kPanel, ldo, std::min(kPanel, cols - p * kPanel));
}

// call(bits, mins) with the weight's format as compile-time constants (std::integral_constant<int,
// 8 or 4>, std::bool_constant): the one place a kernel's template is picked from them.
template <class Call>
auto with_format(int64_t bits, bool mins, const Call& call) {
  using Int8 = std::integral_constant<int, 8>;
  using Int4 = std::integral_constant<int, 4>;
  if (bits == 8) return mins ? call(Int8{}, std::true_type{}) : call(Int8{}, std::false_type{});
  return mins ? call(Int4{}, std::true_type{}) : call(Int4{}, std::false_type{});
}

template <class V>
ItemFn pick_item(int64_t bits, bool mins) {
  return with_format(bits, mins, [](auto b, auto m) -> ItemFn { return vector_item<V, b.value, m.value>; });
}


// A GEMM's work items: (row block of `block_rows` rows, group of `group_panels` panels), row block
// first (a core keeps its x rows in cache and streams panels past them).
struct WorkItem {
  int64_t first_row, rows, first_panel, panels, col, cols;
};

struct WorkGrid {
  int64_t m, n, num_panels, block_rows, group_panels;
  int64_t groups() const { return (num_panels + group_panels - 1) / group_panels; }
  int64_t items() const { return (m + block_rows - 1) / block_rows * groups(); }
  WorkItem at(int64_t item) const {
    const int64_t first_row = item / groups() * block_rows, first_panel = item % groups() * group_panels;
    const int64_t panels = std::min(group_panels, num_panels - first_panel), col = first_panel * kPanel;
    return {first_row, std::min(m, first_row + block_rows) - first_row, first_panel, panels, col,
            std::min(panels * kPanel, n - col)};
  }
  // The panels of item `item` (-1: none), which the tiles of the item before it ask for.
  const uint8_t* panels_of(const Packed& w, int64_t item) const {
    return item >= 0 ? w.q + item % groups() * group_panels * w.panel_bytes : nullptr;
  }
  // Runs run(begin, end, after) over every item: on this thread for a GEMM of fewer than
  // kMinParallelMacs multiply-adds, else over the cores in shrinking chunks; `after` is the item the
  // core takes next once [begin, end) is done (-1: none known).
  template <class Run>
  void run(int64_t k, const Run& run_items) const {
    run_gemm_items(items(), m * n * k, at::get_num_threads(), run_items);
  }
};

// Items are (row block, group of `group_panels` panels): as many as a one-row tile takes, so that
// a decode's few panels still make enough items to share out evenly over the cores.
at::Tensor gemm(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias, int64_t n,
                ItemFn item_fn, int64_t max_rows, int64_t group_panels) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t block_rows =
      std::max<int64_t>(max_rows, kRowBlockBytes / (k * int64_t(sizeof(float))) / max_rows * max_rows);
  const WorkGrid grid{m, n, num_panels, block_rows, group_panels};
  grid.run(k, [&](int64_t begin, int64_t end, int64_t after) {
    std::vector<float> sums;
    for (int64_t item = begin; item < end; ++item) {
      const WorkItem it = grid.at(item);
      item_fn(xp + it.first_row * ldx, ldx, it.rows, w, it.first_panel, it.panels,
              bias != nullptr ? bias + it.col : nullptr, op + it.first_row * n + it.col, n, it.cols,
              grid.panels_of(w, item + 1 < end ? item + 1 : after), sums);
    }
  });
  return out;
}

// ---- the AMX path: bfloat16 activations on the tiles ----------------------------------------

using inflight_cpu::kAmxRows;
using inflight_cpu::kTileBytes;
using inflight_cpu::kTileK;
using inflight_cpu::kTileRows;
using inflight_cpu::TileConfig;

// Pairs [pair_begin, pair_end) of panel `panel`'s k's, de-quantized as the float paths de-quantize
// them (w = scale * q, then + min), rounded to bfloat16 as torch rounds (to nearest, ties to
// even), in pack_panels' bfloat16 layout (a 64-byte row a pair: each column's two k's side by
// side) from dst on; zeros from K on. So the tiles below compute gemm.cpp's AMX GEMM on
// `dequantize().bfloat16()`, to the bit.
template <int Bits>
void dequantize_pairs_scalar(const Packed& w, int64_t panel, int64_t pair_begin, int64_t pair_end, uint16_t* dst) {
  const uint8_t* q = w.q + panel * w.panel_bytes;
  for (int64_t k = 2 * pair_begin; k < 2 * pair_end; ++k)
    for (int c = 0; c < kPanel; ++c) {
      float v = 0.f;
      if (k < w.k) {
        const int64_t g = panel * w.groups + k / w.group_size;
        v = w.scales.value(g, c) * static_cast<float>(q_at<Bits>(q, k, c));
        if (w.mins.base != nullptr) v = v + w.mins.value(g, c);
      }
      dst[(k / 2 - pair_begin) * 2 * kPanel + 2 * c + k % 2] = c10::BFloat16(v).x;
    }
}

#if defined(INFLIGHT_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// Two k's a step, each column's pair side by side as the tiles want them: the integers are
// interleaved (int8: the two k's rows byte by byte; int4: a byte's low and high nibble, which
// are already the pair), converted in that order against scales and mins spread to match, and
// `vcvtne2ps2bf16` rounds the 32 values into one 64-byte row of the layout, in order. That
// instruction rounds as torch does except that it flushes denormals, which no de-quantized
// weight is (a float16 scale times a nonzero integer is at least 6e-8; zero is exact).
template <int Bits, bool Mins>
void dequantize_pairs(const Packed& w, int64_t panel, int64_t pair_begin, int64_t pair_end, uint16_t* dst) {
  if (w.group_size % 2 != 0 && w.groups > 1) return dequantize_pairs_scalar<Bits>(w, panel, pair_begin, pair_end, dst);
  const uint8_t* q = w.q + panel * w.panel_bytes;
  const __m512i spread_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i spread_hi = _mm512_add_epi32(spread_lo, _mm512_set1_epi32(8));
  const int64_t vector_end = std::min(pair_end, w.k / 2);  // pairs whose two k's are both < K
  // A group's pairs: [g * size / 2, (g + 1) * size / 2) (even sizes; one group of any size).
  const int64_t pairs_per_group = w.groups == 1 ? w.k : w.group_size / 2;
  for (int64_t j = pair_begin; j < vector_end;) {
    const int64_t g = j / pairs_per_group, end = std::min(vector_end, (g + 1) * pairs_per_group);
    __m512 s[1], m[1] = {_mm512_setzero_ps()};
    Avx512::group_values(w.scales, panel * w.groups + g, s);
    if (Mins) Avx512::group_values(w.mins, panel * w.groups + g, m);
    const __m512 s_lo = _mm512_permutexvar_ps(spread_lo, s[0]), s_hi = _mm512_permutexvar_ps(spread_hi, s[0]);
    const __m512 m_lo = _mm512_permutexvar_ps(spread_lo, m[0]), m_hi = _mm512_permutexvar_ps(spread_hi, m[0]);
    for (; j < end; ++j) {
      __m128i lo, hi;
      if (Bits == 8) {
        const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * j * kRowBytes));
        const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (2 * j + 1) * kRowBytes));
        lo = _mm_unpacklo_epi8(even, odd), hi = _mm_unpackhi_epi8(even, odd);
      } else {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kRowBytes));
        const __m128i nibble = _mm_set1_epi8(0xF);
        const __m128i even = _mm_and_si128(bytes, nibble), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        lo = _mm_unpacklo_epi8(even, odd), hi = _mm_unpackhi_epi8(even, odd);
      }
      const __m512i q_lo = Bits == 8 ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
      const __m512i q_hi = Bits == 8 ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
      __m512 w_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(q_lo), s_lo), w_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(q_hi), s_hi);
      if (Mins) w_lo = _mm512_add_ps(w_lo, m_lo), w_hi = _mm512_add_ps(w_hi, m_hi);
      _mm512_storeu_si512(dst + (j - pair_begin) * 2 * kPanel, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
  }
  // An odd K's last pair (its second k zero), and the zeros past K.
  const int64_t rest = std::max(pair_begin, vector_end);
  if (rest < pair_end) dequantize_pairs_scalar<Bits>(w, panel, rest, pair_end, dst + (rest - pair_begin) * 2 * kPanel);
}
#else
template <int Bits, bool Mins>
void dequantize_pairs(const Packed& w, int64_t panel, int64_t pair_begin, int64_t pair_end, uint16_t* dst) {
  dequantize_pairs_scalar<Bits>(w, panel, pair_begin, pair_end, dst);
}
#endif

// gemm.cpp's AMX GEMM (tiles 0-1: x's rows 0-15 and 16-31 of a pass; 2-3: two panels' 32 k's;
// 4-7: their sums), each output element the tiles' sums over k in order of 32-k tiles from zero,
// on panels de-quantized into buffers of the thread's own. Items are groups of two panels.
// - At most 32 rows (decode): one pass, each tile of k de-quantized one tile ahead of the tiles
//   that read it (two halves of 2 KB, in L1), and the tiles configured to x's own rows, so that a
//   row costs the tiles one row of work rather than 16.
// - More rows: each panel de-quantized whole, once a call, then run against every pass of 32 rows.
// x is copied once, zero-padded, with a row stride off a multiple of 4 KB (16 rows of one tile
// 4 KB apart would share one set of L1).
template <class Tiles, int Bits, bool Mins>
at::Tensor gemm_amx(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias, int64_t n) {
  using In = c10::BFloat16;
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t k_tiles = (k + kTileK - 1) / kTileK, padded_k = k_tiles * kTileK, pairs = padded_k / 2;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const bool one_pass = m <= kAmxRows;
  const int64_t passes = (m + kAmxRows - 1) / kAmxRows, groups = (num_panels + 1) / 2;
  const int64_t x_stride = padded_k + kTileK;  // elements
  at::Tensor padded_x = at::zeros({one_pass ? m : passes * kAmxRows, x_stride}, x.options());
  padded_x.narrow(1, 0, k).narrow(0, 0, m).copy_(x);
  const In* xp = reinterpret_cast<const In*>(padded_x.data_ptr());
  In* op = reinterpret_cast<In*>(out.data_ptr());
  const int64_t ldx = x_stride * int64_t(sizeof(In));
  // Rows of x (and of the sums) in tiles 0 and 1 of a pass; 0: tile 1 left out.
  const int64_t rows0 = one_pass ? std::min(m, kTileRows) : kTileRows;
  const int64_t rows1 = one_pass ? std::max<int64_t>(m - kTileRows, 0) : kTileRows;
  const int64_t threads = m * n * k < kMinParallelMacs ? 1 : std::min<int64_t>(at::get_num_threads(), groups);
#pragma omp parallel num_threads(threads)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = kTileBytes;
    config.rows[2] = config.rows[3] = kTileK / 2;
    config.rows[0] = config.rows[4] = config.rows[5] = static_cast<uint8_t>(rows0);
    config.rows[1] = config.rows[6] = config.rows[7] = static_cast<uint8_t>(rows1);
    if (rows1 == 0) config.bytes_per_row[1] = config.bytes_per_row[6] = config.bytes_per_row[7] = 0;  // unused
    AMX_CONFIGURE(&config);
    std::vector<uint16_t> weights(one_pass ? 2 * 2 * kTileK * kPanel : 2 * padded_k * kPanel);
    alignas(64) float sums[kAmxRows][2 * kPanel];
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      // A group of one panel (the last of an odd count) runs it in both B tiles: n ends within
      // its 16 columns, so the second tile's sums are never stored.
      const bool pair = 2 * g + 1 < num_panels;
      const int64_t panel_elems = one_pass ? kTileK * kPanel : padded_k * kPanel;  // of a panel's buffer
      const uint16_t* b[2] = {weights.data(), weights.data() + (pair ? panel_elems : 0)};
      if (!one_pass) {
        dequantize_pairs<Bits, Mins>(w, 2 * g, 0, pairs, weights.data());
        if (pair) dequantize_pairs<Bits, Mins>(w, 2 * g + 1, 0, pairs, weights.data() + panel_elems);
      }
      const int64_t col = 2 * g * kPanel, cols = std::min<int64_t>(2 * kPanel, n - col);
      for (int64_t pass = 0; pass < passes; ++pass) {
        const In* xb = xp + pass * kAmxRows * x_stride;
        AMX_ZERO(4);
        AMX_ZERO(5);
        if (rows1 > 0) {
          AMX_ZERO(6);
          AMX_ZERO(7);
        }
        // One pass: tile t + 1 is de-quantized into the other half of the buffer while the tiles
        // read tile t's (a tile load right behind the stores that wrote its bytes waits for them).
        const auto dequantize_tile = [&](int64_t t) {
          uint16_t* dst = weights.data() + (t % 2) * 2 * panel_elems;
          const int64_t first = t * kTileK / 2, last = first + kTileK / 2;
          dequantize_pairs<Bits, Mins>(w, 2 * g, first, last, dst);
          if (pair) dequantize_pairs<Bits, Mins>(w, 2 * g + 1, first, last, dst + panel_elems);
        };
        if (one_pass) dequantize_tile(0);
        for (int64_t t = 0; t < k_tiles; ++t) {
          const int64_t at = one_pass ? (t % 2) * 2 * panel_elems : t * kTileK * kPanel;
          if (one_pass && t + 1 < k_tiles) dequantize_tile(t + 1);
          AMX_LOAD(0, xb + t * kTileK, ldx);
          AMX_LOAD(2, b[0] + at, kTileBytes);
          AMX_LOAD(3, b[1] + at, kTileBytes);
          AMX_DP(4, 0, 2);
          AMX_DP(5, 0, 3);
          if (rows1 > 0) {
            AMX_LOAD(1, xb + kTileRows * x_stride + t * kTileK, ldx);
            AMX_DP(6, 1, 2);
            AMX_DP(7, 1, 3);
          }
        }
        AMX_STORE(4, &sums[0][0], sizeof sums[0]);
        AMX_STORE(5, &sums[0][kPanel], sizeof sums[0]);
        if (rows1 > 0) {
          AMX_STORE(6, &sums[kTileRows][0], sizeof sums[0]);
          AMX_STORE(7, &sums[kTileRows][kPanel], sizeof sums[0]);
        }
        const int64_t first_row = pass * kAmxRows, rows = std::min(kAmxRows, m - first_row);
        for (int64_t r = 0; r < rows; ++r) {
          In* o = op + (first_row + r) * n + col;
          for (int64_t c = 0; c < cols; ++c) o[c] = In(bias != nullptr ? sums[r][c] + bias[col + c] : sums[r][c]);
        }
      }
    }
    AMX_RELEASE();
  }
  return out;
}

at::Tensor amx_gemm(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias, int64_t n,
                    int64_t bits, bool mins) {
  return inflight_cpu::with_tiles([&](auto tiles) {
    return with_format(bits, mins, [&](auto b, auto m) {
      return gemm_amx<decltype(tiles), b.value, m.value>(x, w, num_panels, bias, n);
    });
  });
}

// ---- bfloat16 activations on vdpbf16ps, where there are no tiles ----------------------------
//
// A bf16 model's quantized weight on a CPU with AVX512-BF16 and no AMX (AVX-512 EPYCs, or a Xeon
// whose kernel refused the tiles), outside the batch-invariant mode (kernels/linear.py): each item
// is two panels, de-quantized and rounded to bfloat16 as the tiles' path does it (dequantize_pairs)
// into gemm.cpp's bf16 panel layout in a buffer of the core's own, once a call, then every row of
// x runs gemm.cpp's vdpbf16ps tiles on it. So its result is panel_gemm's isa 3 on
// dequantize().bfloat16(), to the bit, at every row count. The multiply-adds are vdpbf16ps's, two
// k's an instruction, and de-quantizing is paid once a call: from 32 rows on it runs groups of 32
// 1.1-1.4x faster than the bf16 dots below, whose group sums cost more the smaller the groups.
#if defined(INFLIGHT_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFLIGHT_HAVE_BF16 1
template <int Bits, bool Mins>
at::Tensor gemm_bf16_dequantized(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias,
                                 int64_t n) {
  using In = c10::BFloat16;
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2, panel_elems = pairs * 2 * kPanel;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const In* xp = x.data_ptr<In>();
  In* op = out.data_ptr<In>();
  const int64_t groups = (num_panels + 1) / 2;
  const auto run = [&](int64_t begin, int64_t end, int64_t /*after*/) {
    // Kept from call to call: a fresh buffer would take fresh pages, page faults and all.
    thread_local std::vector<uint16_t> weights;
    if (weights.size() < size_t(2 * panel_elems)) weights.resize(2 * panel_elems);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t panels = std::min<int64_t>(2, num_panels - 2 * g), col = 2 * g * kPanel;
      for (int64_t p = 0; p < panels; ++p)
        dequantize_pairs<Bits, Mins>(w, 2 * g + p, 0, pairs, weights.data() + p * panel_elems);
      bf16_panel_rows(xp, x.stride(0), m, reinterpret_cast<const In*>(weights.data()), panel_elems, panels, k,
                      bias != nullptr ? bias + col : nullptr, op + col, n, std::min<int64_t>(panels * kPanel, n - col));
    }
  };
  run_gemm_items(groups, m * n * k, at::get_num_threads(), run);
  return out;
}

at::Tensor bf16_gemm(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias, int64_t n,
                     int64_t bits, bool mins) {
  return with_format(bits, mins, [&](auto b, auto m) {
    return gemm_bf16_dequantized<b.value, m.value>(x, w, num_panels, bias, n);
  });
}
#endif

// ---- bf16 dot products: int8 and int4 weights against bfloat16 activations ------------------
//
// A bf16 model's quantized weight where vdpbf16ps runs and the batch-invariant mode wants one path
// for every row count (a CPU with AVX512-BF16 and no tiles), and a decode's few rows outside that
// mode, beside the tiles or the de-quantized panels (kernels/linear.py). The float paths spend ~10 instructions a 32
// weights de-quantizing (widen, convert, scale, add the min) before the multiply-adds, which bounds
// a decode's one row below the memory's speed (2-core AMX Xeon: 10-14 GB/s of int4 against a copy
// bandwidth of ~20), and from 32 rows on their two FMAs a weight a row bound them. Here the scale
// and min leave the inner loop:
//   out[r, c] = sum over groups g of  scale[g, c] * D[r, g, c] + min[g, c] * X[r, g]  (+ bias),
//   D[r, g, c] = sum over k in g of x[r, k] * q[k, c],   X[r, g] = sum over k in g of x[r, k],
// the same real number as x times the de-quantized weight. Each pair of k's of a panel becomes two
// bfloat16 factors that `vdpbf16ps` multiplies with the row's pair of x (products exact, sums in
// float32) once for all the rows of a tile: an int8 through float32 (8 instructions a 32 weights),
// exact; an int4 q as 1 + q / 16, exact too, by bit operations (2 instructions with VBMI, below),
// so a group's sums are D' = X + D / 16 and the scale multiplies 16 (D' - X). The offset makes the
// float32 sums' rounding errors ~3x those of summing x q (terms 16 (1 + q / 16) against q: 23.5
// against 7.5 for the mean q), far below the output's rounding to bfloat16. So the bits are this
// path's own, neither the float path's nor the tiles'; a row's depend on that row only, whatever
// tile it runs in. Groups of an even size (a pair of k's never straddles two), or one group (per
// output channel; an odd K's last pair padded with zeros in x as in q).
// Tiles: one row against four panels (four independent chains of dot products), more rows two
// panels at a time in tiles of up to 12 rows, as gemm.cpp's vdpbf16ps tiles, whose group sums
// leave the registers to the dot products and pass through L1 once a group.
#if defined(INFLIGHT_HAVE_BF16)

constexpr int kDotMaxRows = 12;

// Whether a format's dot products need each group's sum of x: for its mins, and int4's for the
// offset of its factors (1 + q / 16).
template <int Bits, bool Mins>
constexpr bool kGroupSums = Mins || Bits == 4;

// One call's rows of x as pairs (uint32: a pair of bfloat16's), and each row's sums of x over
// each group (kGroupSums): [rows][groups].
struct Bf16Rows {
  const uint32_t* pairs;
  int64_t ld_pairs;
  const float* group_sums;
  int64_t groups;
};

// int4: each nibble q becomes the bfloat16 1 + q / 16 (0x3F80 | q << 3: the nibble in the top four
// bits of the mantissa) by bit operations, where a table lookup (vpermw) costs a shuffle, what the
// loop waited on (one core of a 2-core AVX512-BF16 EPYC, a 2048 x 2048 int4 weight in L3, one
// row: 138-156 us a call through the table, 122-126 so). With VBMI, a pair's 16 bytes are
// broadcast to the four 128-bit lanes (a load, no shuffle) and vpmultishiftqb cuts each word's
// nibble out of its own qword. A qword holds bytes 0-7 or 8-15 of the pair only, so lane L = 2i + e
// holds column 8 (i % 2) + 2 (i / 2) + e, [0, 1, 8, 9, 2, 3, 10, 11, ...]: a tile's dot products
// come out in that order and go back to the columns' once a group (kLaneOfColumn).
#if defined(__AVX512VBMI__)
// Per qword i: the bit offsets that put its two columns' low and high nibbles at bits 3-6 of the
// words' low bytes (rotating within the qword; the bits around them are masked off).
alignas(64) constexpr uint8_t kNibbleOffsets[64] = {
    61, 0, 1,  0, 5,  0, 9,  0, 61, 0, 1,  0, 5,  0, 9,  0, 13, 0, 17, 0, 21, 0, 25, 0, 13, 0, 17, 0, 21, 0, 25, 0,
    29, 0, 33, 0, 37, 0, 41, 0, 29, 0, 33, 0, 37, 0, 41, 0, 45, 0, 49, 0, 53, 0, 57, 0, 45, 0, 49, 0, 53, 0, 57, 0};
// Column c's lane, for vpermps to put the dot products back in column order.
alignas(64) constexpr int32_t kLaneOfColumn[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
#endif

// Pair j of a panel as bfloat16 factors: lane c = (q[2j][c], q[2j + 1][c]) for int8; for int4
// (1 + q[2j][c] / 16, 1 + q[2j + 1][c] / 16), lanes permuted with VBMI (above).
template <int Bits>
__attribute__((always_inline)) inline __m512i pair_factors(const uint8_t* panel, int64_t j, int64_t k) {
  if (Bits == 4) {
    // (word & 0x0078) | 0x3F80 as one vpternlogd: (A & B) | C.
    const __m512i mask = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
#if defined(__AVX512VBMI__)
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + j * kRowBytes)));
    return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(_mm512_load_si512(kNibbleOffsets), bytes), mask,
                                     one, 0xEA);
#else
    // Column c's byte into lane c, its low nibble moved to bits 3-6 and its high one to 19-22.
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + j * kRowBytes)));
    return _mm512_ternarylogic_epi32(_mm512_or_si512(_mm512_slli_epi32(bytes, 3), _mm512_slli_epi32(bytes, 15)), mask,
                                     one, 0xEA);
#endif
  }
  // The two k's rows byte by byte (an odd K's last k + 1 is zero), then through float32, whose
  // conversion to bfloat16 is exact for integers of 8 bits.
  const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 2 * j * kRowBytes));
  const __m128i odd = 2 * j + 1 < k ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (2 * j + 1) * kRowBytes))
                                    : _mm_setzero_si128();
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(even, odd)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(even, odd)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

template <int Bits, int Rows, int Panels, bool Mins>
void bf16_dot_tile(const Bf16Rows& x, const Packed& w, int64_t pairs, int64_t first_panel, const float* bias,
                   c10::BFloat16* out, int64_t ldo, int64_t cols, const uint8_t* prefetch, int64_t line_begin,
                   int64_t line_end) {
  alignas(64) float sums[Rows][Panels][kPanel] = {};
  const uint8_t* q = w.q + first_panel * w.panel_bytes;
  const int64_t pairs_per_group = w.groups == 1 ? pairs : w.group_size / 2;
  int64_t line = line_begin;
  for (int64_t g = 0; g < w.groups; ++g) {
    inflight_cpu::prefetch_group_values(w.scales, w.mins, first_panel, Panels, w.groups, g);
    __m512 dot[Rows][Panels];
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r)
      for (int p = 0; p < Panels; ++p) dot[r][p] = _mm512_setzero_ps();
    const int64_t end = std::min(pairs, (g + 1) * pairs_per_group);
    for (int64_t j = g * pairs_per_group; j < end; ++j) {
      __m512i factors[Panels];
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) factors[p] = pair_factors<Bits>(q + p * w.panel_bytes, j, w.k);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x.pairs[r * x.ld_pairs + j]));
#pragma GCC unroll 8
        for (int p = 0; p < Panels; ++p) dot[r][p] = _mm512_dpbf16_ps(dot[r][p], (__m512bh)factors[p], pair);
      }
      // As many lines of the next item's panels as a pair reads of this one's (int8: two rows).
#pragma GCC unroll 2
      for (int i = 0; i < (Bits == 8 ? 2 : 1); ++i)
        if (line < line_end) inflight_cpu::prefetch_l2(prefetch + 64 * line++);
    }
#if defined(__AVX512VBMI__)
    if (Bits == 4) {
      const __m512i lane_of_column = _mm512_load_si512(kLaneOfColumn);
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r)
        for (int p = 0; p < Panels; ++p) dot[r][p] = _mm512_permutexvar_ps(lane_of_column, dot[r][p]);
    }
#endif
    __m512 s[Panels][1], m[Panels][1];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      Avx512::group_values(w.scales, (first_panel + p) * w.groups + g, s[p]);
      // int4: D = 16 (D' - X), the 16 taken into the scale (exact, a power of two).
      if (Bits == 4) s[p][0] = _mm512_mul_ps(s[p][0], _mm512_set1_ps(16.0f));
      if (Mins) Avx512::group_values(w.mins, (first_panel + p) * w.groups + g, m[p]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 group_sum = kGroupSums<Bits, Mins> ? _mm512_set1_ps(x.group_sums[r * x.groups + g]) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) {
        const __m512 d = Bits == 4 ? _mm512_sub_ps(dot[r][p], group_sum) : dot[r][p];
        __m512 acc = _mm512_fmadd_ps(s[p][0], d, _mm512_load_ps(sums[r][p]));
        if (Mins) acc = _mm512_fmadd_ps(m[p][0], group_sum, acc);
        _mm512_store_ps(sums[r][p], acc);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels && p * kPanel < cols; ++p) {
      const int64_t n = std::min<int64_t>(kPanel, cols - p * kPanel);
      c10::BFloat16* o = out + r * ldo + p * kPanel;
      for (int64_t c = 0; c < n; ++c)
        o[c] = c10::BFloat16(bias != nullptr ? sums[r][p][c] + bias[p * kPanel + c] : sums[r][p][c]);
    }
}

using DotTileFn = void (*)(const Bf16Rows&, const Packed&, int64_t, int64_t, const float*, c10::BFloat16*, int64_t,
                           int64_t, const uint8_t*, int64_t, int64_t);

// bf16_dot_tile's instances for 1..kDotMaxRows rows ([0]: none).
template <int Bits, int Panels, bool Mins>
struct DotTiles {
  template <int... Rows>
  static constexpr auto make(std::integer_sequence<int, Rows...>) {
    return std::array<DotTileFn, sizeof...(Rows) + 1>{nullptr, bf16_dot_tile<Bits, Rows + 1, Panels, Mins>...};
  }
  static constexpr auto kTiles = make(std::make_integer_sequence<int, kDotMaxRows>{});
};

// A row block against panels [first_panel, first_panel + panels): one row four panels at a time,
// more rows two panels at a time in row tiles of equal height (32 rows: 11 + 11 + 10), the
// prefetch of the next item's panels shared out over the tiles.
template <int Bits, bool Mins>
void bf16_dot_item(const Bf16Rows& x, int64_t rows, const Packed& w, int64_t pairs, int64_t first_panel,
                   int64_t panels, const float* bias, c10::BFloat16* out, int64_t ldo, int64_t cols,
                   const uint8_t* prefetch) {
  if (rows == 1) {
    for_each_panel_tile<4>(w, panels, prefetch, [&](auto tile_panels, int64_t p, int64_t line_begin, int64_t line_end) {
      const int64_t col = p * kPanel;
      bf16_dot_tile<Bits, 1, decltype(tile_panels)::value, Mins>(x, w, pairs, first_panel + p,
                                                                bias != nullptr ? bias + col : nullptr, out + col, ldo,
                                                                cols - col, prefetch, line_begin, line_end);
    });
    return;
  }
  const int64_t tiles = (rows + kDotMaxRows - 1) / kDotMaxRows, tile_rows = (rows + tiles - 1) / tiles;
  for_each_panel_tile<2>(w, panels, prefetch, [&](auto tile_panels, int64_t p, int64_t line_begin, int64_t line_end) {
    const auto& table = DotTiles<Bits, decltype(tile_panels)::value, Mins>::kTiles;
    const int64_t col = p * kPanel, lines = line_end - line_begin;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t row = t * tile_rows;
      const Bf16Rows tile_x{x.pairs + row * x.ld_pairs, x.ld_pairs,
                            kGroupSums<Bits, Mins> ? x.group_sums + row * x.groups : nullptr, x.groups};
      table[std::min(tile_rows, rows - row)](tile_x, w, pairs, first_panel + p, bias != nullptr ? bias + col : nullptr,
                                             out + row * ldo + col, ldo, cols - col, prefetch,
                                             line_begin + t * lines / tiles, line_begin + (t + 1) * lines / tiles);
    }
  });
}

template <int Bits, bool Mins>
at::Tensor gemm_bf16_dots(at::Tensor x, const Packed& w, int64_t num_panels, const float* bias, int64_t n) {
  constexpr int64_t kGroupPanels = 4;
  const int64_t m = x.size(0), k = x.size(1), pairs = (k + 1) / 2;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  // Even columns, contiguous rows: each row a whole number of pairs.
  if (k % 2 != 0) x = at::constant_pad_nd(x, {0, 1});
  x = x.contiguous();
  at::Tensor group_sums;
  if (kGroupSums<Bits, Mins>) {
    // Each group's sum of x in float32: 16 lanes along k, then the lanes added (a row's own
    // order, whatever the other rows).
    group_sums = at::empty({m, w.groups}, x.options().dtype(at::kFloat));
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    float* sums = group_sums.data_ptr<float>();
    const auto widen = [](__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); };
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint16_t* row = xs + r * x.size(1) + g * w.group_size;
        const int64_t len = std::min(k, (g + 1) * w.group_size) - g * w.group_size;
        __m512 sum = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= len; i += 16) sum = _mm512_add_ps(sum, widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i))));
        if (i < len) sum = _mm512_add_ps(sum, widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << (len - i)) - 1), row + i)));
        sums[r * w.groups + g] = _mm512_reduce_add_ps(sum);
      }
  }
  const Bf16Rows rows{reinterpret_cast<const uint32_t*>(x.data_ptr()), x.size(1) / 2,
                      kGroupSums<Bits, Mins> ? group_sums.data_ptr<float>() : nullptr, w.groups};
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // Row blocks whose x stays in L2 while the block's panels stream past (as gemm.cpp's).
  const int64_t block_rows = std::max<int64_t>(kDotMaxRows, 2 * kRowBlockBytes / (4 * pairs) / kDotMaxRows * kDotMaxRows);
  const WorkGrid grid{m, n, num_panels, block_rows, kGroupPanels};
  grid.run(k, [&](int64_t begin, int64_t end, int64_t after) {
    for (int64_t item = begin; item < end; ++item) {
      const WorkItem it = grid.at(item);
      const Bf16Rows block_rows_x{rows.pairs + it.first_row * rows.ld_pairs, rows.ld_pairs,
                                  kGroupSums<Bits, Mins> ? rows.group_sums + it.first_row * w.groups : nullptr,
                                  w.groups};
      bf16_dot_item<Bits, Mins>(block_rows_x, it.rows, w, pairs, it.first_panel, it.panels,
                                bias != nullptr ? bias + it.col : nullptr, op + it.first_row * n + it.col, n, it.cols,
                                grid.panels_of(w, item + 1 < end ? item + 1 : after));
    }
  });
  return out;
}

at::Tensor bf16_dots_gemm(const at::Tensor& x, const Packed& w, int64_t num_panels, const float* bias, int64_t n,
                          int64_t bits, bool mins) {
  return with_format(bits, mins, [&](auto b, auto m) { return gemm_bf16_dots<b.value, m.value>(x, w, num_panels, bias, n); });
}
#endif

int64_t best_isa() {
#if defined(INFLIGHT_HAVE_AVX512)
  return kIsaAvx512;
#elif defined(INFLIGHT_HAVE_AVX2)
  return kIsaAvx2;
#else
  return kIsaNone;
#endif
}

bool amx_built() { return inflight_cpu::tiles_built(); }

// vdpbf16ps: the de-quantized bf16 panels (isa 3) and the bf16 dots (kQuantBf16Dots).
bool bf16_built() {
#if defined(INFLIGHT_HAVE_BF16)
  return true;
#else
  return false;
#endif
}

// The vector paths up to the best built, vdpbf16ps's where built, and the tiles where built and,
// as gemm.cpp checks, permitted (a tile instruction without the permission kills the process).
void check_isa(const char* op, int64_t isa) {
  TORCH_CHECK((isa >= kIsaNone && isa <= best_isa()) || (isa == kIsaAmx && amx_built()) ||
                  ((isa == kIsaAvx512Bf16 || isa == kQuantBf16Dots) && bf16_built()),
              op, ": instruction set ", isa, " has no quantized path built here (float activations: up to ", best_isa(),
              bf16_built() ? "; bfloat16 activations: 3, vdpbf16ps on the de-quantized weight, and 6, int4 on "
                             "vdpbf16ps's bf16 dots" : "",
              amx_built() ? "; bfloat16 activations: 4, the AMX tiles" : "", "; int8 activations: 5)");
  TORCH_CHECK(isa != kIsaAmx || inflight_cpu::amx_permitted(), op,
              ": the kernel refused this process the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM)");
}

using inflight_cpu::pack_group_values;

}  // namespace

int64_t quant_gemm_isa() { return amx_built() ? int64_t(kIsaAmx) : bf16_built() ? int64_t(kIsaAvx512Bf16) : best_isa(); }

bool quant_bf16_built() { return bf16_built(); }

std::vector<at::Tensor> pack_quant_panels(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                                          int64_t bits, int64_t group_size, int64_t isa) {
  if (isa == kQuantInt8Dots) return pack_int8_dot_panels(q, scales, mins, bits, group_size);
  check_isa("pack_quant_panels", isa);
  TORCH_CHECK(bits == 4 || bits == 8, "pack_quant_panels: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quant_panels: q must be int8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(group_size > 0, "pack_quant_panels: group_size must be positive, not ", group_size);
  const int64_t groups = (k + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups &&
                  scales.scalar_type() == at::kFloat,
              "pack_quant_panels: scales must be float32 [", n, ", ", groups, "]");
  const bool has_mins = mins.has_value() && mins->defined();
  if (has_mins)
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat,
                "pack_quant_panels: mins must be float32 [", n, ", ", groups, "]");
  at::Tensor packed;
  if (bits == 8) {
    at::Tensor padded = at::zeros({panels * kPanel, k}, q.options());
    padded.narrow(0, 0, n).copy_(q);
    packed = padded.view({panels, kPanel, k}).transpose(1, 2).contiguous().view(at::kByte);
  } else {
    TORCH_CHECK(q.numel() == 0 || (q.min().item<int>() >= 0 && q.max().item<int>() <= 15),
                "pack_quant_panels: 4-bit q must hold 0..15");
    const int64_t pairs = (k + 1) / 2;
    at::Tensor padded = at::zeros({panels * kPanel, pairs * 2}, q.options().dtype(at::kByte));
    padded.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
    at::Tensor nibbles = padded.view({panels * kPanel, pairs, 2});
    at::Tensor bytes = at::bitwise_or(nibbles.select(2, 0), at::bitwise_left_shift(nibbles.select(2, 1), 4));
    packed = bytes.view({panels, kPanel, pairs}).transpose(1, 2).contiguous();
  }
  std::vector<at::Tensor> result{packed, pack_group_values(scales.contiguous(), panels)};
  if (has_mins) result.push_back(pack_group_values(mins->contiguous(), panels));
  return result;
}

at::Tensor quant_panel_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                            std::optional<at::Tensor> bias, int64_t n, int64_t bits, int64_t group_size,
                            int64_t isa) {
  if (isa == kQuantInt8Dots) return int8_dot_gemm(x, q, scales, mins, bias, n, bits, group_size);
  check_isa("quant_panel_gemm", isa);
  TORCH_CHECK(bits == 4 || bits == 8, "quant_panel_gemm: bits must be 4 or 8, not ", bits);
  // The tiles and the bf16 dot products take bfloat16 activations (and bias, as panel_gemm's
  // bfloat16 paths); the vector paths float32.
  const auto dtype = isa >= kQuantFirstBf16Isa ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "quant_panel_gemm: x [M, K] in ", dtype);
  const int64_t k = x.size(1);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kRowBytes && q.scalar_type() == at::kByte && q.is_contiguous(),
              "quant_panel_gemm: q panels from pack_quant_panels");
  const int64_t num_panels = q.size(0), packed_rows = bits == 8 ? k : (k + 1) / 2;
  TORCH_CHECK(q.size(1) == packed_rows, "quant_panel_gemm: x has ", k, " columns, the ", bits, "-bit weight's panels ",
              q.size(1), " packed rows");
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel, "quant_panel_gemm: n does not match the panels");
  TORCH_CHECK(group_size > 0, "quant_panel_gemm: group_size must be positive");
  const int64_t groups = (k + group_size - 1) / group_size;
  const bool has_mins = mins.has_value() && mins->defined();
  const GroupValues scale_values = inflight_cpu::group_values_of(scales, num_panels, groups, group_size, "quant_panel_gemm",
                                                                 "scales", "pack_quant_panels");
  const GroupValues min_values = has_mins ? inflight_cpu::group_values_of(*mins, num_panels, groups, group_size,
                                                                          "quant_panel_gemm", "mins", "pack_quant_panels")
                                          : GroupValues{nullptr, false};
  TORCH_CHECK(isa != kQuantBf16Dots || groups == 1 || group_size % 2 == 0,
              "quant_panel_gemm: the bf16 dot products (isa 6) take groups of an even size or one group, not ", group_size);
  if (x.stride(1) != 1 || x.stride(0) < k) x = x.contiguous();
  const at::Tensor bias_float = inflight_cpu::float_bias(bias, n, dtype, "quant_panel_gemm");
  const float* bias_data = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  const Packed w{q.data_ptr<uint8_t>(), q.stride(0), scale_values, min_values, groups, group_size, k};
  switch (isa) {
    case kIsaAmx:
      return amx_gemm(x, w, num_panels, bias_data, n, bits, has_mins);
#if defined(INFLIGHT_HAVE_BF16)
    case kIsaAvx512Bf16:
      return bf16_gemm(x, w, num_panels, bias_data, n, bits, has_mins);
    case kQuantBf16Dots:
      return bf16_dots_gemm(x, w, num_panels, bias_data, n, bits, has_mins);
#endif
#if defined(INFLIGHT_HAVE_AVX512)
    case kIsaAvx512:
      return gemm(x, w, num_panels, bias_data, n, pick_item<Avx512>(bits, has_mins), Avx512::kMaxRows,
                  Avx512::panels_for_rows(1));
#endif
#if defined(INFLIGHT_HAVE_AVX2)
    case kIsaAvx2:
      return gemm(x, w, num_panels, bias_data, n, pick_item<Avx2>(bits, has_mins), Avx2::kMaxRows,
                  Avx2::panels_for_rows(1));
#endif
    case kIsaNone:
      return gemm(x, w, num_panels, bias_data, n, bits == 8 ? scalar_item<8> : scalar_item<4>, 8, 1);
    default:
      TORCH_CHECK(false, "quant_panel_gemm: no kernel for instruction set ", isa);
  }
}
