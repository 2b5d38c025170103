// Paged attention on the CPU over a ragged batch: decodes and prefill chunks, keys and
// values taken from the paged KV cache with no padding.
//
// One task per run of up to 16 consecutive query tokens of one sequence (a decode is a run of
// one), over every KV head, or over one KV head when there are too few runs to keep the cores
// busy (a batch of a few decodes). A task scores every token of the run against its context's
// rows where they lie in the scattered blocks, asking for the blocks ahead as it goes (KvBlocks);
// softmax; then the same for the values. Scores for the whole prefix are kept (heads x len
// floats per token). Accumulation is float32 whatever the cache dtype. A quantized cache's codes
// (int8, fp8) are widened to float32 lanes in the compute loops' registers (an fp8 block that
// several tokens read is widened once, to bfloat16, first); each row's scale multiplies its dot
// product (a score) and its probability (a value row's weight) once, so the cache moves a quarter
// of float32's bytes through the core; int8 keys are scored as integers against the query
// rounded to int16 (score_tile_int8). A run's tokens share each block's loads from memory but not
// the arithmetic, where a GEMM-based kernel would share each load among a tile of queries: long
// chunks at long contexts are faster in SDPA, and kernels/paged_attention.py sends those there
// (unless the engine runs batch-invariant).
//
// A decode step reads every cached K and V byte of the batch once, so the memory side sets the
// pace:
// - the blocks ahead asked for, each twice (KvBlocks): the compute loops alone keep too few loads
//   in flight, and memory idles while they compute;
// - QK scores 8 rows at a time: 8 independent dot-product accumulators (no FMA latency
//   chain), folded into 8 scores by one transposing reduction (hadd: 9 instructions for 8
//   rows, where a horizontal sum per row costs ~6 each);
// - the query heads of a GQA group share each K and V row load (and its bf16 widening): up to
//   3 heads per pass with AVX-512, one with AVX2's 16 registers;
// - the V pass keeps the heads' outputs in registers across a block's rows;
// - vectors of 8 floats (AVX2) or 16 (AVX-512; kernels/paged_attention.py picks the machine's
//   widest, `lanes`), the 16-lane sums folded to 8 before the reduction.
// In every path a token's reduction order depends on its context length only, never on the
// batch, the run or the task it is in (the engine's batch invariance).
// The plain loops remain for any other head size.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "prefetch.h"

namespace {

// Keys are scored 8 at a time (one transposing reduction folds 8 rows' sums into 8 scores),
// over vectors of 8 floats (AVX2) or 16 (AVX-512): `kLanes` below is the vector width the
// scores and reductions work in, `L` a kernel's own.
constexpr int64_t kTileRows = 8;
constexpr int64_t kLanes = 8;
template <int L>
struct VectorOf;
template <>
struct VectorOf<8> {
  typedef float type __attribute__((vector_size(8 * sizeof(float))));
};
template <>
struct VectorOf<16> {
  typedef float type __attribute__((vector_size(16 * sizeof(float))));
};
template <int L>
using vec = typename VectorOf<L>::type;
using vfloat = vec<8>;
typedef uint16_t vhalfbits __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vwordbits __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// Unaligned vector loads and stores (memcpy of a fixed size is one instruction at -O3).
template <int L, typename T>
inline vec<L> load_vector(const T* src) {
  float wide[L];
  for (int64_t i = 0; i < L; ++i) wide[i] = static_cast<float>(src[i]);
  vec<L> v;
  std::memcpy(&v, wide, sizeof v);
  return v;
}

template <int L>
inline vec<L> load_vector(const float* src) {
  vec<L> v;
  std::memcpy(&v, src, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widening is a zero-extending load and a shift (the
// generic vector code compiled to a lane-by-lane sequence: bf16 attention ran at 0.4x float32's
// speed on half the bytes; c10's scalar conversion, with its NaN handling, does not vectorise).
template <int L>
inline vec<L> load_vector(const c10::BFloat16* src) {
#if defined(__AVX512F__)
  if constexpr (L == 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
#endif
#if defined(__AVX2__)
  if constexpr (L == 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
#endif
  if constexpr (L == 8) {
    vhalfbits bits;
    std::memcpy(&bits, src, sizeof bits);
    const vwordbits wide = __builtin_convertvector(bits, vwordbits) << 16;
    vfloat v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
  } else {
    return load_vector<L, c10::BFloat16>(src);
  }
}

template <int L>
inline void store_vector(float* dst, vec<L> v) {
  std::memcpy(dst, &v, sizeof v);
}

// The 16 lanes' sums as 8: lane i + lane i + 8.
inline vfloat fold_to_8(vec<16> v) {
#if defined(__AVX512F__)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  vfloat low, high;  // no AVX-512: the two halves of the generic 16-lane vector
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  return low + high;
#endif
}

// out[r] = the sum of the lanes of rows[r], for 8 rows at once: of float32 lanes (the scores) or
// of int32 ones (int8_key_dots' exact sums).
#if defined(__AVX2__)
inline __m256 pairwise_sums(__m256 a, __m256 b) { return _mm256_hadd_ps(a, b); }
inline __m256i pairwise_sums(__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }
// Each 128-bit half of a, beside the same half of b, summed: a.low + a.high, b.low + b.high.
inline __m256 add_halves(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256i add_halves(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

template <typename V>
inline V sum_lanes_of_8(const V (&rows)[kLanes]) {
  const V pair01 = pairwise_sums(rows[0], rows[1]), pair23 = pairwise_sums(rows[2], rows[3]);
  const V pair45 = pairwise_sums(rows[4], rows[5]), pair67 = pairwise_sums(rows[6], rows[7]);
  // Each 128-bit half now holds rows 0-3 (and 4-7) summed over that half's lanes.
  return add_halves(pairwise_sums(pair01, pair23), pairwise_sums(pair45, pair67));
}
#else
inline vfloat sum_lanes_of_8(const vfloat (&rows)[kLanes]) {
  vfloat out;
  for (int64_t r = 0; r < kLanes; ++r) {
    float total = 0.f;
    for (int64_t i = 0; i < kLanes; ++i) total += rows[r][i];
    out[r] = total;
  }
  return out;
}
#endif

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* wide = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// softmax's first half, in place over one head's scores of a token, or of one part of a token's
// positions (a context split in parts, attend's kPartPositions): the `len` scores become
// exp(s - peak), those before `skip` (outside the sliding window) 0, the others soft-capped first
// (softcap > 0: tanh(s / softcap) * softcap, Gemma 2). Returns {peak, total}, total 0 when the
// window leaves none of them.
inline std::pair<float, float> part_softmax(float* s, int64_t len, int64_t skip, float softcap) {
  skip = std::min(skip, len);
  std::fill(s, s + skip, 0.f);
  s += skip;
  len -= skip;
  if (len == 0) return {0.f, 0.f};
  if (softcap > 0.f)
    for (int64_t pos = 0; pos < len; ++pos) s[pos] = std::tanh(s[pos] / softcap) * softcap;
  float peak = s[0];  // built with -ffinite-math-only (kernels/cpu_ext.py): no infinities here
  for (int64_t pos = 1; pos < len; ++pos) peak = std::max(peak, s[pos]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t pos = 0; pos < len; ++pos) {
    s[pos] = std::exp(s[pos] - peak);
    total += s[pos];
  }
  return {peak, total};
}

// A token that sees `len` positions, the last `window` of them (0: all): its scores in place
// become the softmax's probabilities, 0 before the window.
inline void softmax(float* s, int64_t len, int64_t window, float softcap) {
  const int64_t skip = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const float inverse = 1.f / part_softmax(s, len, skip, softcap).second;
  for (int64_t pos = skip; pos < len; ++pos) s[pos] *= inverse;
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  // From one block to the next, in cache elements and in scales (quantized caches: a block's
  // rows and their scales share its bytes, kernels/kv_store.py's QuantizedKV).
  int64_t block_stride, scale_block_stride;
  // Each token sees only its last `window` positions (0: all); scores soft-capped (0: not).
  int64_t window = 0;
  float softcap = 0.f;
  int64_t group() const { return num_q_heads / num_kv_heads; }
  int64_t row_width() const { return num_kv_heads * head_dim; }  // one position: every KV head
};

// L values of a cache row as float32 lanes: a float cache's own, a quantized cache's codes
// widened in registers without the row's scale (kv_quant.h's decode_lanes), which the compute
// loops apply once per row (a score's dot product, a value row's weight).
template <int L, typename C>
inline vec<L> load_row_lanes(const C* src) {
  if constexpr (inflight_cpu::kIsQuantizedKv<C>)
    return inflight_cpu::decode_lanes<L>(src);
  else
    return load_vector<L>(src);
}

// Query heads of one GQA group scored and summed together, so that each K and V row is
// loaded (and, for bf16, widened) once for all of them: as many as the registers hold, the
// group's 3 dot-product tiles of 8 rows plus the queries with AVX-512's 32 registers, one with
// AVX2's 16. Each head's sums run in the same order as one head alone, so the result does not
// depend on how many heads share the pass.
template <int L, int kVectors>
constexpr int kHeadsPerPass = (L == 16 && kVectors <= 8) ? 3 : 1;

// Scores of `kHeads` query heads (`q`, [kHeads, head_dim] float32) against the keys at `rows`,
// written to scores + h * scores_stride + [0, valid). A quantized cache's dot products
// (kScaled; its rows as stored, or widened to bfloat16 by decode_to_bfloat16) are multiplied by
// their rows' `row_factors` (scale * kLaneFactor).
template <typename C, int L, int kVectors, int kHeads, bool kScaled = inflight_cpu::kIsQuantizedKv<C>>
inline void score_tile(const C* const (&rows)[kTileRows], const float (&row_factors)[kTileRows], const float* q,
                       float* scores, int64_t scores_stride, int64_t valid) {
  constexpr int64_t kHeadDim = kVectors * L;
  vec<L> dots[kHeads][kTileRows] = {};
  for (int j = 0; j < kVectors; ++j) {
    vec<L> qj[kHeads];
    for (int h = 0; h < kHeads; ++h) qj[h] = load_vector<L>(q + h * kHeadDim + j * L);
    for (int64_t i = 0; i < kTileRows; ++i) {
      const vec<L> key = load_row_lanes<L>(rows[i] + j * L);
      for (int h = 0; h < kHeads; ++h) dots[h][i] += qj[h] * key;
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    vfloat tile;
    if constexpr (L == 16) {
      vfloat folded[kTileRows];
      for (int64_t i = 0; i < kTileRows; ++i) folded[i] = fold_to_8(dots[h][i]);
      tile = sum_lanes_of_8(folded);
    } else {
      tile = sum_lanes_of_8(dots[h]);
    }
    if constexpr (kScaled) tile *= load_vector<8>(row_factors);
    float* s = scores + h * scores_stride;
    if (valid == kTileRows)
      store_vector<8>(s, tile);
    else
      for (int64_t i = 0; i < valid; ++i) s[i] = tile[i];
  }
}

// int8 keys are scored as integers: each query row (a token's head, already times the softmax
// scale) rounded to int16 against a power-of-two scale, `query_scale` (peak / 2^e in
// [16384, 32768), so 15 bits for its largest value), each dot product of the int16 query and
// the row's int8 codes summed exactly in int32 (pmaddwd: two products a lane), then
// float(sum) * query_scale * the row's factor. The products take a quarter of float32's
// instructions (int8 codes widen to int16 in one), the sums are exact, so their order is free
// (the 8- and 16-lane kernels give the same bits), and scaling by a power of two is exact: a
// score differs from float32's on the de-quantized row only by the query's rounding, at most
// 2^-15 of its head's largest value a component (a bfloat16 query's own is 2^-9).
constexpr float kQueryMax = 32767.f;

// The row's int16 values into `out`; returns its scale (0 for a zero row).
inline float round_query_to_int16(const float* q, int16_t* out, int64_t n) {
  float peak = 0.f;
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(q[i]));
  if (peak == 0.f) {
    std::fill(out, out + n, int16_t{0});
    return 0.f;
  }
  int exponent;
  std::frexp(peak, &exponent);  // peak = m * 2^exponent, m in [0.5, 1)
  const float scale = std::ldexp(1.f, exponent - 15), inverse = std::ldexp(1.f, 15 - exponent);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<int16_t>(std::clamp(std::nearbyint(q[i] * inverse), -kQueryMax, kQueryMax));
  return scale;
}

// The int32 dot products of 8 rows' codes and `kHeads` int16 queries, of head_dim values each
// (a multiple of 8): sums[h][i].
template <int kHeads>
inline void int8_key_dots(const int8_t* const (&rows)[kTileRows], const int16_t* q, int64_t head_dim,
                          int32_t (&sums)[kHeads][kTileRows]) {
#if defined(__AVX2__)
  __m256i acc[kHeads][kTileRows];
  for (int h = 0; h < kHeads; ++h)
    for (int64_t i = 0; i < kTileRows; ++i) acc[h][i] = _mm256_setzero_si256();
  int64_t d = 0;
  for (; d + 16 <= head_dim; d += 16) {
    __m256i qd[kHeads];
    for (int h = 0; h < kHeads; ++h) qd[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + h * head_dim + d));
    for (int64_t i = 0; i < kTileRows; ++i) {
      const __m256i key = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + d)));
      for (int h = 0; h < kHeads; ++h) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        acc[h][i] = _mm256_dpwssd_epi32(acc[h][i], key, qd[h]);
#else
        acc[h][i] = _mm256_add_epi32(acc[h][i], _mm256_madd_epi16(key, qd[h]));
#endif
      }
    }
  }
  if (d < head_dim) {  // the last 8 values
    for (int h = 0; h < kHeads; ++h) {
      const __m128i qd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h * head_dim + d));
      for (int64_t i = 0; i < kTileRows; ++i) {
        const __m128i key = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[i] + d)));
        acc[h][i] = _mm256_add_epi32(acc[h][i], _mm256_zextsi128_si256(_mm_madd_epi16(key, qd)));
      }
    }
  }
  for (int h = 0; h < kHeads; ++h)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[h]), sum_lanes_of_8(acc[h]));
#else
  for (int h = 0; h < kHeads; ++h)
    for (int64_t i = 0; i < kTileRows; ++i) {
      int32_t total = 0;
      for (int64_t d = 0; d < head_dim; ++d) total += int32_t(q[h * head_dim + d]) * int32_t(rows[i][d]);
      sums[h][i] = total;
    }
#endif
}

// score_tile for int8 keys: `q` the kHeads int16 query rows, `query_scales` theirs.
template <int kHeads>
inline void score_tile_int8(const int8_t* const (&rows)[kTileRows], const float (&row_factors)[kTileRows],
                            const int16_t* q, const float* query_scales, int64_t head_dim, float* scores,
                            int64_t scores_stride, int64_t valid) {
  typedef int32_t vint __attribute__((vector_size(kTileRows * sizeof(int32_t))));
  static_assert(sizeof(vint) == sizeof(vfloat), "a tile's sums convert lane for lane");
  int32_t sums[kHeads][kTileRows];
  int8_key_dots<kHeads>(rows, q, head_dim, sums);
  const vfloat factors = load_vector<8>(row_factors);
  for (int h = 0; h < kHeads; ++h) {
    // A power of two times the factor is exact, so the products' order is immaterial. One
    // vector conversion, not 8 scalar ones (g++ 12 left the loop over lanes scalar).
    vint sum;
    std::memcpy(&sum, sums[h], sizeof(sum));
    const vfloat tile = __builtin_convertvector(sum, vfloat) * query_scales[h] * factors;
    float* s = scores + h * scores_stride;
    if (valid == kTileRows) {  // a fixed count: one vector (a count of `valid` was a rep movs)
      store_vector<8>(s, tile);
    } else {
      for (int64_t i = 0; i < valid; ++i) s[i] = tile[i];
    }
  }
}

// out[h] += sum over the block's `count` rows of p[h][r] * value row r, for `kHeads` heads
// (`out` [kHeads, head_dim] float32, `p` the first head's probabilities at the block's start);
// a quantized row's weight (kScaled, as score_tile) is p[h][r] * row_factors[r] (scale * kLaneFactor).
template <typename C, int L, int kVectors, int kHeads, bool kScaled = inflight_cpu::kIsQuantizedKv<C>>
inline void accumulate_values(const C* values, const float* row_factors, int64_t row_width, int64_t count,
                              const float* p, int64_t scores_stride, float* out) {
  constexpr int64_t kHeadDim = kVectors * L;
  vec<L> acc[kHeads][kVectors];
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kVectors; ++j) acc[h][j] = load_vector<L>(out + h * kHeadDim + j * L);
  for (int64_t r = 0; r < count; ++r) {
    float weight[kHeads];
    for (int h = 0; h < kHeads; ++h) {
      weight[h] = p[h * scores_stride + r];
      if constexpr (kScaled) weight[h] *= row_factors[r];
    }
    for (int j = 0; j < kVectors; ++j) {
      const vec<L> value = load_row_lanes<L>(values + r * row_width + j * L);
      for (int h = 0; h < kHeads; ++h) acc[h][j] += weight[h] * value;
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kVectors; ++j) store_vector<L>(out + h * kHeadDim + j * L, acc[h][j]);
}

// Calls body(std::integral_constant<int, n>{}, first_head) for the group's heads in passes of
// up to kMax heads.
template <int kMax, typename Body>
inline void for_head_passes(int64_t group, Body&& body) {
  static_assert(kMax >= 1 && kMax <= 3, "the remainder below is one pass of 1 or 2 heads");
  int64_t g = 0;
  for (; g + kMax <= group; g += kMax) body(std::integral_constant<int, kMax>{}, g);
  if constexpr (kMax > 1) {
    if (group - g == 1) body(std::integral_constant<int, 1>{}, g);
    if constexpr (kMax > 2)
      if (group - g == 2) body(std::integral_constant<int, 2>{}, g);
  }
}

// A task's share of the work: `num_tokens` consecutive query tokens of one sequence (a decode is
// a run of one), over KV heads [head_begin, head_end). `first_len` is the first token's context
// length; token i of the run sees first_len + i keys. part_end > 0: the tokens' contexts are
// split (attend's kPartPositions), and the task computes their part [part_begin, part_end)
// unnormalised, with each row's softmax peak and total, for attend to merge.
struct Task {
  int64_t seq, first_token, num_tokens, first_len, head_begin, head_end;
  int64_t part_begin = 0, part_end = 0;
  int64_t slot = -1;  // a part's: its first token's row in attend's part results
};

// The rows of a task's KV heads in the paged cache, read where they lie. Each block asks for the
// lines of the next two blocks of the stream the task reads (its keys' blocks, then its values',
// then the next task's first keys), so that every block is asked for twice: asked for once, a
// block's lines arrived late, most likely the prefetches of a burst dropped while the core's miss
// buffers are full (bf16, 8k context, batch 32, 2-core AVX512-BF16 EPYC: one window read 14-16
// GB/s, two 19-23). Reading in place this way took 0.71-0.90x the time of copying each task's
// rows into a buffer of its own first and computing on the copy, and int8 0.79-0.98x (batch 1, 8
// and 32, contexts 256 and 8k, the two kernels alternating in one process).
template <typename C>
struct KvBlocks {
  const C* cache;
  const int32_t* table;
  int64_t block_stride, block_size, row_width, column, width;  // the task's columns of a row
  const float* scales = nullptr;  // quantized caches: [block][row][KV head]
  int64_t scale_block_stride = 0, head_dim = 0;

  const C* rows(int64_t b) const { return cache + table[b] * block_stride + column; }
  const float* row_scales(int64_t b) const { return scales + table[b] * scale_block_stride + column / head_dim; }

  static void prefetch(const void* p, int64_t bytes) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) inflight_cpu::prefetch_l2(c + off);
  }
  void prefetch_block(int64_t b, int64_t rows_in_block) const {
    const C* src = rows(b);
    if (width == row_width) {
      prefetch(src, rows_in_block * row_width * int64_t(sizeof(C)));
    } else {
      for (int64_t r = 0; r < rows_in_block; ++r) prefetch(src + r * row_width, width * int64_t(sizeof(C)));
    }
    if constexpr (inflight_cpu::kIsQuantizedKv<C>)
      prefetch(scales + table[b] * scale_block_stride, rows_in_block * (row_width / head_dim) * int64_t(sizeof(float)));
  }
};

// Scratch buffers only ever grow: resizing up and down would zero their new parts on every task.
template <typename T>
inline void grow(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

// One task, head_dim = kVectors * L (vectors of L floats). `q` points at the first token's row
// of queries [num_q_heads, head_dim]; `out` receives each token's query heads of the task's KV
// heads as float32, [num_tokens][heads_in_task * group][head_dim]; a part of a split context's
// (Task::part_end) unnormalised, with `stats` [num_tokens][heads_in_task * group] {peak, total}. Every token is computed as if
// alone: its scores, softmax and value sums run in the order its context length sets, whatever
// tokens and heads share the task.
// C: the cache's element, T or a quantized one (then k_scale and v_scale hold each row's scale).
template <typename T, typename C, int L, int kVectors>
void attend_task_vectorised(const T* q, const C* k_cache, const C* v_cache, const float* k_scale,
                            const float* v_scale, const int32_t* table, const Task& task, const Task* next,
                            const int32_t* next_table, float* out, float* stats, const Shape& shape, float scale,
                            std::vector<float>& query, std::vector<float>& scores) {
  constexpr int64_t kHeadDim = kVectors * L;
  constexpr int kMaxHeads = kHeadsPerPass<L, kVectors>;
  const int64_t group = shape.group(), row_width = shape.row_width(), block_size = shape.block_size;
  const int64_t num_heads = task.head_end - task.head_begin, heads_width = num_heads * group * kHeadDim;
  const int64_t width = num_heads * kHeadDim;  // the task's columns of a cache row
  const int64_t max_len = task.first_len + task.num_tokens - 1;
  const bool split = task.part_end > 0;
  // The positions the task reads, [part_begin, context_end), and their blocks [begin_block, end_block).
  const int64_t context_end = split ? std::min(task.part_end, max_len) : max_len;
  const int64_t begin_block = task.part_begin / block_size;
  const int64_t end_block = (context_end + block_size - 1) / block_size, num_blocks = end_block - begin_block;
  const int64_t scores_stride = (context_end - task.part_begin + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t token_scores = num_heads * group * scores_stride;  // one token's rows of scores

  grow(query, task.num_tokens * heads_width);
  grow(scores, task.num_tokens * token_scores);
  float* const query_data = query.data();
  float* const scores_data = scores.data();
  for (int64_t t = 0; t < task.num_tokens; ++t)
    for (int64_t g = 0; g < num_heads * group; ++g)
      for (int j = 0; j < kVectors; ++j)
        store_vector<L>(query_data + t * heads_width + g * kHeadDim + j * L,
                        load_vector<L>(q + t * shape.num_q_heads * kHeadDim + task.head_begin * group * kHeadDim +
                                       g * kHeadDim + j * L) *
                            scale);

  // int8 keys: each token's query rows also as int16, with their scales (round_query_to_int16).
  constexpr bool kIntegerKeys = std::is_same_v<C, int8_t>;
  thread_local std::vector<int16_t> query16;
  thread_local std::vector<float> query16_scales;
  if constexpr (kIntegerKeys) {
    grow(query16, task.num_tokens * heads_width);
    grow(query16_scales, task.num_tokens * num_heads * group);
    for (int64_t row = 0; row < task.num_tokens * num_heads * group; ++row)
      query16_scales[row] = round_query_to_int16(query_data + row * kHeadDim, query16.data() + row * kHeadDim, kHeadDim);
  }

  const KvBlocks<C> keys{k_cache, table, shape.block_stride, block_size, row_width, task.head_begin * kHeadDim,
                         width,   k_scale, shape.scale_block_stride, kHeadDim};
  KvBlocks<C> values = keys;
  values.cache = v_cache;
  values.scales = v_scale;
  KvBlocks<C> next_keys = keys;
  int64_t next_begin = 0, next_end = 0, next_len = 0;
  if (next != nullptr) {
    next_keys.table = next_table;
    next_keys.column = next->head_begin * kHeadDim;
    next_keys.width = (next->head_end - next->head_begin) * kHeadDim;
    next_len = next->first_len + next->num_tokens - 1;
    if (next->part_end > 0) next_len = std::min(next_len, next->part_end);
    next_begin = next->part_begin / block_size;
    next_end = (next_len + block_size - 1) / block_size;
  }
  // Block i of the task's stream (keys, then values, then the next task's keys) asks for blocks
  // i + 1 and i + 2 (KvBlocks).
  const auto ask_ahead = [&](int64_t i) {
    for (int64_t j = i + 1; j <= i + 2; ++j) {
      if (j < num_blocks) {
        const int64_t b = begin_block + j;
        keys.prefetch_block(b, std::min(block_size, context_end - b * block_size));
      } else if (j < 2 * num_blocks) {
        const int64_t b = begin_block + j - num_blocks;
        values.prefetch_block(b, std::min(block_size, context_end - b * block_size));
      } else if (next != nullptr && next_begin + j - 2 * num_blocks < next_end) {
        const int64_t b = next_begin + j - 2 * num_blocks;
        next_keys.prefetch_block(b, std::min(block_size, next_len - b * block_size));
      }
    }
  };

  // A quantized block's row scales, [task's KV head][row], each times kLaneFactor (what the
  // compute loops multiply a row's dot product or probability by).
  constexpr bool kQuantized = inflight_cpu::kIsQuantizedKv<C>;
  thread_local std::vector<float> block_factors;
  if constexpr (kQuantized) grow(block_factors, num_heads * block_size);
  float* const factors = block_factors.data();
  const auto load_factors = [&](const KvBlocks<C>& blocks, int64_t b, int64_t rows) {
    if constexpr (kQuantized) {
      const float* s = blocks.row_scales(b);
      const int64_t heads = row_width / kHeadDim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t r = 0; r < rows; ++r)
          factors[h * block_size + r] = s[r * heads + h] * inflight_cpu::KvQuant<C>::kLaneFactor;
    }
  };

  // An fp8 block's codes take more work to widen in registers than a bfloat16 row (float16's
  // conversion beside the shifts): with several tokens to read each row, the block is widened
  // once into bfloat16 (decode_to_bfloat16: the same lanes, so the same bits), which its tokens
  // read at a bfloat16 row's cost. int8's codes widen as cheaply as bfloat16's; a decode reads
  // each row once.
  constexpr bool kWidensFp8 = kQuantized && !std::is_same_v<C, int8_t>;
  thread_local std::vector<c10::BFloat16> widened;
  if constexpr (kWidensFp8) grow(widened, block_size * width);
  c10::BFloat16* const widened_data = widened.data();
  // Calls body(rows, row_stride, t, count) for each token t of the task that sees block b, `count`
  // of the block's rows; `rows` its task's columns, in the cache (rows row_stride apart) or widened.
  const auto for_tokens_seeing_block = [&](const KvBlocks<C>& blocks, int64_t b, auto&& body) {
    const int64_t first = b * block_size;
    const auto each_token = [&](const auto* rows, int64_t row_stride) {
      for (int64_t t = 0; t < task.num_tokens; ++t) {
        const int64_t len = std::min(task.first_len + t, context_end);
        if (first < len) body(rows, row_stride, t, std::min(block_size, len - first));
      }
    };
    if constexpr (kWidensFp8) {
      if (task.num_tokens > 1) {
        uint16_t* wide = reinterpret_cast<uint16_t*>(widened_data);
        for (int64_t r = 0; r < std::min(block_size, context_end - first); ++r)
          inflight_cpu::decode_to_bfloat16<L>(blocks.rows(b) + r * row_width, wide + r * width, width);
        each_token(static_cast<const c10::BFloat16*>(widened_data), width);
        return;
      }
    }
    each_token(blocks.rows(b), row_width);
  };

  for (int64_t b = begin_block; b < end_block; ++b) {
    const int64_t first = b * block_size;
    ask_ahead(b - begin_block);
    if constexpr (kQuantized) load_factors(keys, b, std::min(block_size, context_end - first));
    for_tokens_seeing_block(keys, b, [&](const auto* block_rows, int64_t row_stride, int64_t t, int64_t count) {
      using R = std::remove_cv_t<std::remove_pointer_t<decltype(block_rows)>>;
      for (int64_t r0 = 0; r0 < count; r0 += kTileRows) {
        int64_t tile_rows[kTileRows];  // a partial tile repeats the last row; its extra scores are dropped
        for (int64_t i = 0; i < kTileRows; ++i) tile_rows[i] = std::min(r0 + i, count - 1);
        const int64_t valid = std::min(kTileRows, count - r0);
        for (int64_t h = 0; h < num_heads; ++h) {
          const R* head_rows[kTileRows];
          float row_factors[kTileRows] = {};
          for (int64_t i = 0; i < kTileRows; ++i) {
            head_rows[i] = block_rows + tile_rows[i] * row_stride + h * kHeadDim;
            if constexpr (kQuantized) row_factors[i] = factors[h * block_size + tile_rows[i]];
          }
          for_head_passes<kMaxHeads>(group, [&](auto heads, int64_t g) {
            const int64_t row = h * group + g;
            float* tile_scores = scores_data + t * token_scores + row * scores_stride + (first - task.part_begin) + r0;
            if constexpr (kIntegerKeys) {
              score_tile_int8<decltype(heads)::value>(head_rows, row_factors, query16.data() + t * heads_width + row * kHeadDim,
                                                      query16_scales.data() + t * num_heads * group + row, kHeadDim,
                                                      tile_scores, scores_stride, valid);
            } else {
              score_tile<R, L, kVectors, decltype(heads)::value, kQuantized>(
                  head_rows, row_factors, query_data + t * heads_width + row * kHeadDim, tile_scores, scores_stride,
                  valid);
            }
          });
        }
      }
    });
  }

  for (int64_t t = 0; t < task.num_tokens; ++t)
    for (int64_t row = 0; row < num_heads * group; ++row) {
      float* token_row = scores_data + t * token_scores + row * scores_stride;
      const int64_t len = task.first_len + t;
      if (!split) {
        softmax(token_row, len, shape.window, shape.softcap);
        continue;
      }
      const int64_t skip = shape.window > 0 ? std::max<int64_t>(0, len - shape.window - task.part_begin) : 0;
      const auto [peak, total] = part_softmax(token_row, std::min(len, context_end) - task.part_begin, skip, shape.softcap);
      stats[(t * num_heads * group + row) * 2] = peak;
      stats[(t * num_heads * group + row) * 2 + 1] = total;
    }

  std::fill(out, out + task.num_tokens * heads_width, 0.f);
  for (int64_t b = begin_block; b < end_block; ++b) {
    const int64_t first = b * block_size;
    ask_ahead(num_blocks + b - begin_block);
    if constexpr (kQuantized) load_factors(values, b, std::min(block_size, context_end - first));
    for_tokens_seeing_block(values, b, [&](const auto* block_rows, int64_t row_stride, int64_t t, int64_t count) {
      using R = std::remove_cv_t<std::remove_pointer_t<decltype(block_rows)>>;
      for (int64_t h = 0; h < num_heads; ++h) {
        for_head_passes<kMaxHeads>(group, [&](auto heads, int64_t g) {
          const int64_t row = h * group + g;
          accumulate_values<R, L, kVectors, decltype(heads)::value, kQuantized>(
              block_rows + h * kHeadDim, factors + h * block_size, row_stride, count,
              scores_data + t * token_scores + row * scores_stride + (first - task.part_begin), scores_stride,
              out + t * heads_width + row * kHeadDim);
        });
      }
    });
  }
}

// Any head size: one token, every head, plain loops over the head dimension.
template <typename T, typename C>
void attend_token_scalar(const T* q, const C* k_cache, const C* v_cache, const float* k_scale, const float* v_scale,
                         const int32_t* table, int64_t len, float* out, const Shape& shape, float scale, float* scores,
                         std::vector<float>& row) {
  const int64_t head_dim = shape.head_dim, group = shape.group(), row_width = shape.row_width();
  const int64_t block_size = shape.block_size, block_stride = shape.block_stride;
  // Position pos's row of every KV head into `row`, as float32 (quantized rows de-quantized).
  const auto load_position = [&](const C* cache, const float* scales, int64_t pos) {
    const C* src = cache + table[pos / block_size] * block_stride + (pos % block_size) * row_width;
    if constexpr (inflight_cpu::kIsQuantizedKv<C>) {
      const float* s = scales + table[pos / block_size] * shape.scale_block_stride + (pos % block_size) * shape.num_kv_heads;
      for (int64_t h = 0; h < shape.num_kv_heads; ++h)
        inflight_cpu::dequantize_row(src + h * head_dim, row.data() + h * head_dim, head_dim, s[h]);
    } else {
      load_row(src, row.data(), row_width);
    }
  };
  std::vector<float> query(shape.num_q_heads * head_dim);
  load_row(q, query.data(), query.size());
  for (float& x : query) x *= scale;
  if constexpr (std::is_same_v<C, int8_t>) {  // scored as the vectorised kernels score int8 keys
    std::vector<int16_t> query16(query.size());
    std::vector<float> query_scales(shape.num_q_heads);
    for (int64_t h = 0; h < shape.num_q_heads; ++h)
      query_scales[h] = round_query_to_int16(query.data() + h * head_dim, query16.data() + h * head_dim, head_dim);
    for (int64_t pos = 0; pos < len; ++pos) {
      const int64_t block = table[pos / block_size], slot = pos % block_size;
      const int8_t* src = k_cache + block * block_stride + slot * row_width;
      const float* row_scales = k_scale + block * shape.scale_block_stride + slot * shape.num_kv_heads;
      for (int64_t h = 0; h < shape.num_q_heads; ++h) {
        const int16_t* qh = query16.data() + h * head_dim;
        const int8_t* kh = src + (h / group) * head_dim;
        int32_t dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += int32_t(qh[d]) * int32_t(kh[d]);
        scores[h * len + pos] = static_cast<float>(dot) * query_scales[h] * row_scales[h / group];
      }
    }
  } else {
    for (int64_t pos = 0; pos < len; ++pos) {
      load_position(k_cache, k_scale, pos);
      for (int64_t h = 0; h < shape.num_q_heads; ++h) {
        const float* qh = query.data() + h * head_dim;
        const float* kh = row.data() + (h / group) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
        scores[h * len + pos] = dot;
      }
    }
  }
  for (int64_t h = 0; h < shape.num_q_heads; ++h) softmax(scores + h * len, len, shape.window, shape.softcap);
  std::fill(out, out + shape.num_q_heads * head_dim, 0.f);
  for (int64_t pos = 0; pos < len; ++pos) {
    load_position(v_cache, v_scale, pos);
    for (int64_t h = 0; h < shape.num_q_heads; ++h) {
      const float p = scores[h * len + pos];
      const float* vh = row.data() + (h / group) * head_dim;
      float* o = out + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * vh[d];
    }
  }
}

template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Every query token attends to its own causal prefix of its sequence's cache, so a prefill
// chunk's token is computed exactly like a decode over a shorter context: one code path for
// decodes, prefill chunks and mixed batches, and one parallel loop over tasks. A task is a run of
// up to kRunTokens consecutive tokens of one sequence, which share each block's loads from memory, over
// every KV head, or over one KV head where there are too few runs to keep the cores busy (a batch
// of a few decodes). Tasks differ in length (contexts vary, and a chunk's later tokens see more),
// hence OpenMP's dynamic schedule rather than at::parallel_for's equal ranges.
constexpr int64_t kRunTokens = 16;
// A run's scores stay under this many bytes (runs are shorter at long contexts).
constexpr int64_t kRunScoresBytes = 1 << 20;
// A token that sees more positions than this has its context split in parts of this many, each
// a task of its own, merged in order (each part's softmax peak and total) once all are done: a
// few long sequences then keep every core busy (one sequence's three KV heads over two cores left
// one idle a third of the time). Whether and where a context is split depends on its length
// alone, never on the batch, so a token gets the same bits in any batch and as part of a chunk.
// A multiple of every block size.
constexpr int64_t kPartPositions = 2048;

template <typename T, typename C>
void attend(const T* q, const C* k_cache, const C* v_cache, const float* k_scale, const float* v_scale,
            const int32_t* block_tables, const int32_t* seq_lens,
            const int32_t* cu_seqlens_q, int64_t num_seqs, int64_t num_tokens, T* out, const Shape& shape,
            float scale, int64_t lanes) {
  const int64_t token_width = shape.num_q_heads * shape.head_dim, group = shape.group();
  const int64_t max_len = shape.max_blocks * shape.block_size;
  const int64_t threads = at::get_num_threads();
  const auto table = [&](int64_t seq) { return block_tables + seq * shape.max_blocks; };
  // The kernel for head_dim = VECTORS * LANES, over every task.
  const auto run_vectorised = [&](auto kernel) {
    std::vector<Task> tasks;
    // Tokens whose context is split: their first part's slot, and their part count (the other
    // parts' slots follow, a run's tokens apart).
    struct SplitToken {
      int64_t token, slot, parts, slot_stride;
    };
    std::vector<SplitToken> split_tokens;
    int64_t slots = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t first = cu_seqlens_q[seq], count = cu_seqlens_q[seq + 1] - first;
      const int64_t first_len = seq_lens[seq] - count + 1;
      const int64_t run = std::clamp<int64_t>(
          kRunScoresBytes / (int64_t(sizeof(float)) * shape.num_q_heads * std::max<int64_t>(seq_lens[seq], 1)), 1,
          kRunTokens);
      for (int64_t i = 0; i < count;) {
        // A run's tokens all have the same number of parts.
        const int64_t len = first_len + i, parts = (len + kPartPositions - 1) / kPartPositions;
        const int64_t n = std::min({run, count - i, parts * kPartPositions - len + 1});
        if (parts == 1) {
          tasks.push_back({seq, first + i, n, len, 0, shape.num_kv_heads});
        } else {
          for (int64_t t = 0; t < n; ++t) split_tokens.push_back({first + i + t, slots + t, parts, n});
          for (int64_t j = 0; j < parts; ++j)
            tasks.push_back({seq, first + i, n, len, 0, shape.num_kv_heads, j * kPartPositions,
                             (j + 1) * kPartPositions, slots + j * n});
          slots += parts * n;
        }
        i += n;
      }
    }
    if (int64_t(tasks.size()) < 2 * threads && shape.num_kv_heads > 1) {
      std::vector<Task> split;
      for (const Task& task : tasks)
        for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
          split.push_back(task);
          split.back().head_begin = h;
          split.back().head_end = h + 1;
        }
      tasks.swap(split);
    }
    // The parts' results: [slot][num_q_heads][head_dim] unnormalised, [slot][num_q_heads] {peak, total}.
    std::vector<float> part_out(slots * token_width), part_stats(slots * shape.num_q_heads * 2);
    const int64_t num_tasks = tasks.size();
    std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
    {
      // Kept from call to call (a step calls once per layer): freed and allocated again, they
      // would take fresh pages from the kernel, page faults and all, every time.
      thread_local std::vector<float> query, scores, result, stats;
      // Tasks are taken as cores come free, each core claiming its next task before it starts
      // one, so that it can ask for that task's first keys while it finishes this one.
      int64_t mine = claimed.fetch_add(1, std::memory_order_relaxed);
      while (mine < num_tasks) {
        const int64_t following = claimed.fetch_add(1, std::memory_order_relaxed);
        const Task& task = tasks[mine];
        const Task* next = following < num_tasks ? &tasks[following] : nullptr;
        const int64_t heads_width = (task.head_end - task.head_begin) * group * shape.head_dim;
        const int64_t rows = (task.head_end - task.head_begin) * group;
        grow(result, task.num_tokens * heads_width);
        grow(stats, task.num_tokens * rows * 2);
        kernel(q + task.first_token * token_width, k_cache, v_cache, k_scale, v_scale, table(task.seq), task, next,
               next != nullptr ? table(next->seq) : nullptr, result.data(), stats.data(), shape, scale, query, scores);
        const int64_t head_offset = task.head_begin * group * shape.head_dim;
        for (int64_t t = 0; t < task.num_tokens; ++t) {
          if (task.slot < 0) {
            store_row(result.data() + t * heads_width, out + (task.first_token + t) * token_width + head_offset,
                      heads_width);
          } else {
            std::copy_n(result.data() + t * heads_width, heads_width,
                        part_out.data() + (task.slot + t) * token_width + head_offset);
            std::copy_n(stats.data() + t * rows * 2, rows * 2,
                        part_stats.data() + ((task.slot + t) * shape.num_q_heads + task.head_begin * group) * 2);
          }
        }
        mine = following;
      }
    }
    // Each split token's parts, merged in order: out = sum_j e^(peak_j - peak) out_j /
    // sum_j e^(peak_j - peak) total_j. (No team is started for a batch without split contexts:
    // this runs once a layer.)
    if (split_tokens.empty()) return;
#pragma omp parallel num_threads(threads)
    {
      thread_local std::vector<float> merged;
      grow(merged, token_width);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < int64_t(split_tokens.size()); ++i) {
        const SplitToken& split = split_tokens[i];
        for (int64_t h = 0; h < shape.num_q_heads; ++h) {
          const auto stat = [&](int64_t j, int k) {
            return part_stats[((split.slot + j * split.slot_stride) * shape.num_q_heads + h) * 2 + k];
          };
          // The last part holds the token's own position, so it always counts.
          float peak = stat(split.parts - 1, 0);
          for (int64_t j = 0; j + 1 < split.parts; ++j)
            if (stat(j, 1) > 0.f) peak = std::max(peak, stat(j, 0));
          float total = 0.f;
          float* o = merged.data() + h * shape.head_dim;
          std::fill(o, o + shape.head_dim, 0.f);
          for (int64_t j = 0; j < split.parts; ++j) {
            if (stat(j, 1) == 0.f) continue;  // wholly before the sliding window
            const float weight = std::exp(stat(j, 0) - peak);
            total += weight * stat(j, 1);
            const float* part = part_out.data() + (split.slot + j * split.slot_stride) * token_width + h * shape.head_dim;
            for (int64_t d = 0; d < shape.head_dim; ++d) o[d] += weight * part[d];
          }
          const float inverse = 1.f / total;
          for (int64_t d = 0; d < shape.head_dim; ++d) o[d] *= inverse;
        }
        store_row(merged.data(), out + split.token * token_width, token_width);
      }
    }
  };
#define INFLIGHT_VECTORISED(LANES, VECTORS)                          \
  case VECTORS:                                                      \
    run_vectorised(attend_task_vectorised<T, C, LANES, VECTORS>);    \
    return;
#if defined(__AVX512F__)
  if (lanes == 16 && shape.head_dim % 16 == 0) {
    switch (shape.head_dim / 16) {
      INFLIGHT_VECTORISED(16, 1)
      INFLIGHT_VECTORISED(16, 2)
      INFLIGHT_VECTORISED(16, 4)
      INFLIGHT_VECTORISED(16, 5)
      INFLIGHT_VECTORISED(16, 6)
      INFLIGHT_VECTORISED(16, 8)
      INFLIGHT_VECTORISED(16, 16)
    }
  }
#endif
  switch (shape.head_dim % kLanes == 0 ? shape.head_dim / kLanes : 0) {
    INFLIGHT_VECTORISED(8, 2)
    INFLIGHT_VECTORISED(8, 3)
    INFLIGHT_VECTORISED(8, 4)
    INFLIGHT_VECTORISED(8, 8)
    INFLIGHT_VECTORISED(8, 10)
    INFLIGHT_VECTORISED(8, 12)
    INFLIGHT_VECTORISED(8, 16)
    INFLIGHT_VECTORISED(8, 32)
#undef INFLIGHT_VECTORISED
    default: {
      std::vector<int64_t> token_seq(num_tokens), token_len(num_tokens);  // len: keys the token attends to
      for (int64_t seq = 0; seq < num_seqs; ++seq) {
        const int64_t first = cu_seqlens_q[seq], count = cu_seqlens_q[seq + 1] - first;
        for (int64_t i = 0; i < count; ++i) {
          token_seq[first + i] = seq;
          token_len[first + i] = seq_lens[seq] - count + i + 1;
        }
      }
#pragma omp parallel num_threads(threads)
      {
        std::vector<float> scores(shape.num_q_heads * max_len), row(shape.row_width()), result(token_width);
#pragma omp for schedule(dynamic, 1)
        for (int64_t token = 0; token < num_tokens; ++token) {
          attend_token_scalar(q + token * token_width, k_cache, v_cache, k_scale, v_scale, table(token_seq[token]),
                              token_len[token], result.data(), shape, scale, scores.data(), row);
          store_row(result.data(), out + token * token_width, token_width);
        }
      }
    }
  }
}

}  // namespace

int64_t attention_lanes() {
#if defined(__AVX512F__)
  return 16;
#else
  return 8;
#endif
}

// query [T, Hq, D] in the cache's dtype, the new tokens of every sequence concatenated
// (sequence s owns rows cu_seqlens_q[s] : cu_seqlens_q[s + 1]); caches [num_blocks,
// block_size, Hkv, D], each block contiguous, already holding the new tokens' K and V: in the
// query's dtype, or quantized (int8, float8_e4m3fn, float8_e5m2) with k_scale/v_scale float32
// [num_blocks, block_size, Hkv] (each row de-quantized times its scale is the value; the query
// then float32, bfloat16 or float16); block_tables
// int32 [S, max_blocks]; seq_lens int32 [S], context length including the new tokens;
// cu_seqlens_q int32 [S + 1]; window: each token sees its last `window` positions (0: all);
// softcap: scores become tanh(s / softcap) * softcap before the softmax (0: unchanged).
// Returns [T, Hq, D] in the query's dtype.
at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, at::Tensor cu_seqlens_q, double scale, int64_t lanes,
                           std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale, int64_t window,
                           double softcap) {
  const bool quantized = inflight_cpu::is_quantized_kv(k_cache.scalar_type());
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "bad shapes");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (quantized || query.scalar_type() == k_cache.scalar_type()),
              "query and caches must share a dtype (or the caches be int8 or fp8)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.scalar_type() == at::kInt,
              "block_tables, seq_lens and cu_seqlens_q int32");
  TORCH_CHECK(cu_seqlens_q.numel() == seq_lens.numel() + 1 && block_tables.size(0) >= seq_lens.numel(),
              "one seq_lens entry and one block table row per sequence, one more cu_seqlens_q entry");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "each cache block must be contiguous");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()), "quantized caches come with scales, others without");
  if (quantized) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->dim() == 3 && k_scale->sizes() == v_scale->sizes() &&
                    k_scale->strides() == v_scale->strides() && k_scale->size(0) == k_cache.size(0) &&
                    k_scale->size(1) == k_cache.size(1) && k_scale->size(2) == k_cache.size(2) &&
                    k_scale->stride(2) == 1 && k_scale->stride(1) == k_scale->size(2),
                "scales float32 [num_blocks, block_size, Hkv], each block contiguous");
    TORCH_CHECK(query.scalar_type() != at::kDouble, "quantized caches take a float32, bfloat16 or float16 query");
  }
  TORCH_CHECK(lanes == 8 || (lanes == 16 && attention_lanes() == 16), "paged_attention: lanes ", lanes,
              " is not built for this machine (best: ", attention_lanes(), ")");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  cu_seqlens_q = cu_seqlens_q.contiguous();
  TORCH_CHECK(cu_seqlens_q[-1].item<int64_t>() == query.size(0), "cu_seqlens_q must end at the number of tokens");
  auto out = at::empty(query.sizes(), query.options());
  const Shape shape{query.size(1),        k_cache.size(2),    query.size(2),
                    k_cache.size(1),      block_tables.size(1), k_cache.stride(0),
                    quantized ? k_scale->stride(0) : 0, window, static_cast<float>(softcap)};
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap are 0 (off) or positive");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    const auto run = [&](const auto* k, const auto* v, const float* ks, const float* vs) {
      attend(query.data_ptr<scalar_t>(), k, v, ks, vs, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
             cu_seqlens_q.data_ptr<int32_t>(), seq_lens.numel(), query.size(0), out.data_ptr<scalar_t>(), shape,
             static_cast<float>(scale), lanes);
    };
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const bool attended = inflight_cpu::dispatch_quantized_kv(k_cache.scalar_type(), [&](auto* element) {
        using C = std::remove_pointer_t<decltype(element)>;
        run(static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
            k_scale->data_ptr<float>(), v_scale->data_ptr<float>());
      });
      if (attended) return;
    }
    run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), nullptr, nullptr);
  });
  return out;
}
