// Paged decode attention on the CPU: one new query token per sequence, keys and values read
// in place from the paged KV cache (no gather into a padded copy, no padding at all).
//
// One task per sequence. A position's K (or V) row holds every KV head contiguously; the
// work goes KV head by KV head and block by block, so the piece of the cache in use (one
// head's rows of one block, a few KB) stays in L1 while every query head of the group
// (GQA: query head h reads KV head h / (Hq / Hkv)) uses it. Scores for the whole context
// are kept (Hq x L floats, tens of KB), then softmax, then the V pass. Accumulation is
// float32 whatever the cache dtype.
//
// Head sizes that are a multiple of 16 (64, 80, 96, 128: every Llama-family model we know)
// take the vector path: GCC's portable vector extensions, 16 floats a vector (one AVX-512
// register, two AVX2 ones), with a query head's vectors and its output accumulators held
// in registers across a block's rows. That path was 3-4x the plain loops' speed here; the
// plain loops remain for any other head size.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vhalfbits __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vwordbits __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// Unaligned vector loads and stores (memcpy of a fixed size is one instruction at -O3).
template <typename T>
inline vfloat load_vector(const T* src) {
  float wide[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) wide[i] = static_cast<float>(src[i]);
  vfloat v;
  std::memcpy(&v, wide, sizeof v);
  return v;
}

template <>
inline vfloat load_vector<float>(const float* src) {
  vfloat v;
  std::memcpy(&v, src, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widening is a shift (c10's scalar conversion,
// with its NaN handling, does not vectorise).
template <>
inline vfloat load_vector<c10::BFloat16>(const c10::BFloat16* src) {
  vhalfbits bits;
  std::memcpy(&bits, src, sizeof bits);
  const vwordbits wide = __builtin_convertvector(bits, vwordbits) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline void store_vector(float* dst, vfloat v) { std::memcpy(dst, &v, sizeof v); }

typedef int32_t vlanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// A halving tree of shuffles (GCC does not turn a loop over the lanes into one).
inline float sum_lanes(vfloat v) {
  v += __builtin_shuffle(v, vlanes{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v += __builtin_shuffle(v, vlanes{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vlanes{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v += __builtin_shuffle(v, vlanes{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return v[0];
}

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

// In place over one head's scores: exp(s - max); returns the sum.
inline float softmax_numerators(float* s, int64_t len) {
  float peak = s[0];  // built with -ffinite-math-only (kernels/cpu_ext.py): no infinities here
  for (int64_t pos = 1; pos < len; ++pos) peak = std::max(peak, s[pos]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t pos = 0; pos < len; ++pos) {
    s[pos] = std::exp(s[pos] - peak);
    total += s[pos];
  }
  return total;
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t group() const { return num_q_heads / num_kv_heads; }
  int64_t row_width() const { return num_kv_heads * head_dim; }  // one position: every KV head
  int64_t block_stride() const { return block_size * row_width(); }
};

// A block's rows of one KV head as float32: in place for a float32 cache, else widened
// once into `buffer` (so a GQA group's query heads do not each widen them again).
template <typename T, int kVectors>
inline const float* block_rows(const T* rows, int64_t row_width, int64_t count, float* buffer, int64_t* stride) {
  if constexpr (std::is_same_v<T, float>) {
    *stride = row_width;
    return rows;
  } else {
    for (int64_t r = 0; r < count; ++r)
      for (int j = 0; j < kVectors; ++j)
        store_vector(buffer + (r * kVectors + j) * kLanes, load_vector(rows + r * row_width + j * kLanes));
    *stride = kVectors * kLanes;
    return buffer;
  }
}

// Calls visit(kv_head, first, count, rows, stride) for every KV head and every block of a
// sequence's context: `count` positions from `first`, the head's rows as float32 (block_rows).
template <typename T, int kVectors, typename Visit>
inline void for_each_head_block(const T* cache, const int32_t* table, int64_t len, const Shape& shape, float* buffer,
                                Visit visit) {
  const int64_t block_size = shape.block_size, num_blocks = (len + block_size - 1) / block_size;
  for (int64_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) {
    const T* head = cache + kv_head * kVectors * kLanes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t first = b * block_size, count = std::min(block_size, len - first);
      int64_t stride;
      const float* rows = block_rows<T, kVectors>(head + table[b] * shape.block_stride(), shape.row_width(), count,
                                                  buffer, &stride);
      visit(kv_head, first, count, rows, stride);
    }
  }
}

// One sequence, head_dim = kVectors * 16. `scores` holds num_q_heads * len floats, `buffer`
// block_size * head_dim.
template <typename T, int kVectors>
void decode_sequence_vectorised(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                                float* out, const Shape& shape, float scale, float* scores, float* buffer) {
  const int64_t group = shape.group();
  for (int64_t h = 0; h < shape.num_q_heads; ++h)
    for (int j = 0; j < kVectors; ++j)
      store_vector(out + (h * kVectors + j) * kLanes, load_vector(q + (h * kVectors + j) * kLanes) * scale);

  for_each_head_block<T, kVectors>(k_cache, table, len, shape, buffer,
                                   [&](int64_t kv_head, int64_t first, int64_t count, const float* keys, int64_t stride) {
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      vfloat query[kVectors];  // the scaled query, parked in `out` until the V pass
      for (int j = 0; j < kVectors; ++j) query[j] = load_vector(out + (h * kVectors + j) * kLanes);
      float* s = scores + h * len + first;
      for (int64_t r = 0; r < count; ++r) {
        const float* key = keys + r * stride;
        vfloat dot = query[0] * load_vector(key);
        for (int j = 1; j < kVectors; ++j) dot += query[j] * load_vector(key + j * kLanes);
        s[r] = sum_lanes(dot);
      }
    }
  });

  for (int64_t h = 0; h < shape.num_q_heads; ++h) {
    float* s = scores + h * len;
    const float inverse = 1.f / softmax_numerators(s, len);
    for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inverse;
  }

  std::fill(out, out + shape.num_q_heads * kVectors * kLanes, 0.f);
  for_each_head_block<T, kVectors>(v_cache, table, len, shape, buffer,
                                   [&](int64_t kv_head, int64_t first, int64_t count, const float* values,
                                       int64_t stride) {
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      float* o = out + h * kVectors * kLanes;
      vfloat acc[kVectors];
      for (int j = 0; j < kVectors; ++j) acc[j] = load_vector(o + j * kLanes);
      const float* s = scores + h * len + first;
      for (int64_t r = 0; r < count; ++r)
        for (int j = 0; j < kVectors; ++j) acc[j] += s[r] * load_vector(values + r * stride + j * kLanes);
      for (int j = 0; j < kVectors; ++j) store_vector(o + j * kLanes, acc[j]);
    }
  });
}

// Any head size: the same order of work with plain loops over the head dimension.
template <typename T>
void decode_sequence_scalar(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                            float* out, const Shape& shape, float scale, float* scores, std::vector<float>& row) {
  const int64_t head_dim = shape.head_dim, group = shape.group(), row_width = shape.row_width();
  const int64_t block_size = shape.block_size, block_stride = shape.block_stride();
  std::vector<float> query(shape.num_q_heads * head_dim);
  load_row(q, query.data(), query.size());
  for (float& x : query) x *= scale;
  for (int64_t pos = 0; pos < len; ++pos) {
    load_row(k_cache + table[pos / block_size] * block_stride + (pos % block_size) * row_width, row.data(), row_width);
    for (int64_t h = 0; h < shape.num_q_heads; ++h) {
      const float* qh = query.data() + h * head_dim;
      const float* kh = row.data() + (h / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
      scores[h * len + pos] = dot;
    }
  }
  for (int64_t h = 0; h < shape.num_q_heads; ++h) {
    float* s = scores + h * len;
    const float inverse = 1.f / softmax_numerators(s, len);
    for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inverse;
  }
  std::fill(out, out + shape.num_q_heads * head_dim, 0.f);
  for (int64_t pos = 0; pos < len; ++pos) {
    load_row(v_cache + table[pos / block_size] * block_stride + (pos % block_size) * row_width, row.data(), row_width);
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
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
            T* out, int64_t num_seqs, const Shape& shape, float scale) {
  const int64_t token_width = shape.num_q_heads * shape.head_dim;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(shape.row_width()), buffer(shape.block_size * shape.head_dim), result(token_width);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = seq_lens[seq];
      scores.resize(shape.num_q_heads * len);
      const int32_t* table = block_tables + seq * shape.max_blocks;
      const T* query = q + seq * token_width;
      float* o = result.data();
#define INFLIGHT_VECTORISED(VECTORS)                                                                                 \
  case VECTORS:                                                                                                      \
    decode_sequence_vectorised<T, VECTORS>(query, k_cache, v_cache, table, len, o, shape, scale, scores.data(), \
                                           buffer.data());                                                    \
    break;
      switch (shape.head_dim % kLanes == 0 ? shape.head_dim / kLanes : 0) {
        INFLIGHT_VECTORISED(2)
        INFLIGHT_VECTORISED(4)
        INFLIGHT_VECTORISED(5)
        INFLIGHT_VECTORISED(6)
        INFLIGHT_VECTORISED(8)
        INFLIGHT_VECTORISED(16)
        default:
          decode_sequence_scalar(query, k_cache, v_cache, table, len, o, shape, scale, scores.data(), row);
      }
#undef INFLIGHT_VECTORISED
      T* destination = out + seq * token_width;
      for (int64_t i = 0; i < token_width; ++i) destination[i] = static_cast<T>(o[i]);
    }
  });
}

}  // namespace

// query [B, Hq, D] in the cache's dtype; caches [num_blocks, block_size, Hkv, D] contiguous;
// block_tables int32 [B, max_blocks]; seq_lens int32 [B] (>= 1). Returns [B, Hq, D] in the
// query's dtype.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens int32");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = at::empty(query.sizes(), query.options());
  const Shape shape{query.size(1), k_cache.size(2), query.size(2), k_cache.size(1), block_tables.size(1)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                     query.size(0), shape, static_cast<float>(scale));
  });
  return out;
}
