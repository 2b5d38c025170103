// Paged decode attention on the CPU: one new query token per sequence, keys and values read
// in place from the paged KV cache (no gather into a padded copy, no padding at all).
//
// One task per sequence: a position's K (or V) row holds every KV head contiguously, so
// each row is read once, whole, by one core, and a block (block_size rows) is one
// contiguous run read front to back; all query heads of the sequence use each row while it
// is in L1 (GQA: query head h reads KV head h / (Hq / Hkv)). Scores for the whole context
// are kept (Hq x L floats, tens of KB), then softmax, then the V pass. Memory traffic is
// the cost; accumulation is float32 whatever the cache dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::copy(src, src + n, dst);
}

// bfloat16 is the top half of a float32: widening by a shift vectorises, c10's scalar
// conversion (with its NaN handling) does not.
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* wide = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) wide[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables, const int64_t* seq_lens,
            float* out, int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t row_width = num_kv_heads * head_dim;  // one position: every KV head, contiguous
  const int64_t block_stride = block_size * row_width;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(num_q_heads * head_dim), row(row_width), acc(num_q_heads * head_dim), scores;
    std::vector<float> denominators(num_q_heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      load_row(q + seq * num_q_heads * head_dim, query.data(), num_q_heads * head_dim);
      for (float& x : query) x *= scale;
      scores.resize(num_q_heads * len);

      // Whole blocks in order: each is one contiguous run of memory, read front to back.
      for (int64_t pos = 0; pos < len; ++pos) {
        load_row(k_cache + table[pos / block_size] * block_stride + (pos % block_size) * row_width, row.data(),
                 row_width);
        for (int64_t h = 0; h < num_q_heads; ++h) {
          const float* qh = query.data() + h * head_dim;
          const float* kh = row.data() + (h / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
          scores[h * len + pos] = dot;
        }
      }

      for (int64_t h = 0; h < num_q_heads; ++h) {
        float* s = scores.data() + h * len;
        float peak = s[0];  // built with -ffinite-math-only (kernels/cpu_ext.py): no infinities here
        for (int64_t pos = 1; pos < len; ++pos) peak = std::max(peak, s[pos]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - peak);
          total += s[pos];
        }
        denominators[h] = total;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        load_row(v_cache + table[pos / block_size] * block_stride + (pos % block_size) * row_width, row.data(),
                 row_width);
        for (int64_t h = 0; h < num_q_heads; ++h) {
          const float p = scores[h * len + pos];
          const float* vh = row.data() + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      float* o = out + seq * num_q_heads * head_dim;
      for (int64_t h = 0; h < num_q_heads; ++h) {
        const float inverse = 1.f / denominators[h];
        for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = acc[h * head_dim + d] * inverse;
      }
    }
  });
}

}  // namespace

// query [B, Hq, D] in the cache's dtype; caches [num_blocks, block_size, Hkv, D] contiguous;
// block_tables int32 [B, max_blocks]; seq_lens int64 [B] (>= 1). Returns float32 [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables int32, seq_lens int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty(query.sizes(), query.options().dtype(torch::kFloat32));
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs,
                     num_q_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
