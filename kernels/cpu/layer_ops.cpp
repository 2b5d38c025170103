// The small per-layer operations of a decoder layer, one pass each over a few KB of
// activations: RMSNorm (with the residual add) and RoPE plus the KV-cache store. As torch
// operations they are ~25 separate ops per layer (a temporary and a dispatch each, ~10 us
// apiece at batch 32), more time than their arithmetic.
//
// Numerics follow the torch references (kernels/rms_norm.py, rotary.py, kv_store.py), which
// follow Hugging Face: float32 arithmetic, rounded to the activations' dtype exactly where
// HF rounds (the residual sum, the normalised value, each RoPE product and sum). RoPE and
// the store are bit-identical to the references, and so is RMSNorm: a row's squares are
// added up in the order of torch's own sum (`torch_order_sum_of_squares`).
// Hence no contraction into FMAs and no reassociation in this file, whatever cpu_ext.py's
// flags allow the attention kernel.
#pragma GCC optimize("no-unsafe-math-optimizations", "fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sum.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "elementwise.h"
#include "kv_quant.h"
#include "ops.h"

namespace {

using inflight_cpu::kRowsPerTask;
using inflight_cpu::round_to;

// sum(h[i]^2) added up exactly as torch's CPU sum adds up a contiguous row of floats (its
// cascade sum, aten/src/ATen/native/cpu/SumKernel.cpp), so that RMSNorm's mean of squares is
// HF's to the bit. It is also fast: a sequential sum, one chain of dependent adds, rounds
// differently now and then and makes RMSNorm with the residual add 3x slower (2-core AVX2
// EPYC, width 576: 241 against 75 us at 512 rows, 21 against 8.5 at 32).
// The order: the row as vectors of kLanes floats (single floats when the row is shorter than
// one vector); the vectors as rows of 4, four running sums (one per column); the rows in
// chunks of 2^p (p = max(4, ceil(log2(rows)) / 4)), each chunk's sums passed up a ladder of
// 3 more levels, level j taking level j - 1's every 2^(j p) rows; the last partial chunk,
// then the levels, into the first level; the leftover vectors into the first column, the
// other columns into it in turn; last a scalar total: the elements past the last whole
// vector first, then the lanes in order. (kSquares false: the plain sum, for the probe below.)
template <int64_t kLanes, bool kSquares = true>
float torch_order_sum_of_squares(const float* h, int64_t n) {
  using Lanes = std::array<float, kLanes>;
  constexpr int64_t kColumns = 4, kLevels = 4;
  const int64_t vectors = n / kLanes, rows = vectors / kColumns;
  int64_t ceil_log2_rows = 1;
  while (rows > 2 && (int64_t{1} << ceil_log2_rows) < rows) ++ceil_log2_rows;
  const int64_t power = std::max<int64_t>(4, ceil_log2_rows / kLevels), chunk = int64_t{1} << power;
  const auto term = [](float v) { return kSquares ? v * v : v; };
  const auto add_terms = [&](Lanes& sum, int64_t vector) {
    const float* v = h + vector * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) sum[l] += term(v[l]);
  };
  const auto add = [](Lanes& sum, const Lanes& other) {
    for (int64_t l = 0; l < kLanes; ++l) sum[l] += other[l];
  };
  Lanes level[kLevels][kColumns] = {};
  int64_t row = 0;
  while (row + chunk <= rows) {
    for (const int64_t end = row + chunk; row < end; ++row)
      for (int64_t c = 0; c < kColumns; ++c) add_terms(level[0][c], row * kColumns + c);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t c = 0; c < kColumns; ++c) {
        add(level[j][c], level[j - 1][c]);
        level[j - 1][c] = Lanes{};
      }
      if (row & ((chunk - 1) << (j * power))) break;
    }
  }
  for (; row < rows; ++row)
    for (int64_t c = 0; c < kColumns; ++c) add_terms(level[0][c], row * kColumns + c);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t c = 0; c < kColumns; ++c) add(level[0][c], level[j][c]);
  Lanes& first = level[0][0];
  for (int64_t vector = rows * kColumns; vector < vectors; ++vector) add_terms(first, vector);
  for (int64_t c = 1; c < kColumns; ++c) add(first, level[0][c]);
  float sum = 0.f;
  for (int64_t i = vectors * kLanes; i < n; ++i) sum += term(h[i]);
  for (int64_t l = 0; l < kLanes; ++l) sum += first[l];
  return sum;
}

// The vector width of torch's float sum on this machine, found by asking torch: 8 or 16 lanes.
// Not its CPU capability: torch 2.13 reports AVX512 on AVX-512 machines yet sums in 8 lanes
// there, its AVX2 kernel (ATen compiles a kernel for AVX-512 only where it opts in).
// Probes of signed values of many magnitudes, until one rounds differently in the two orders.
int64_t torch_sum_lanes() {
  static const int64_t lanes = [] {
    std::vector<float> probe(1000);
    const int64_t n = static_cast<int64_t>(probe.size());
    uint32_t state = 12345;
    for (int attempt = 0; attempt < 64; ++attempt) {
      for (float& v : probe) {
        state = state * 1664525u + 1013904223u;
        const float magnitude = std::ldexp(static_cast<float>(state >> 8) / 16777216.f, static_cast<int>(state % 16) - 8);
        v = state & 1 ? magnitude : -magnitude;
      }
      const float torch_sum = at::sum(at::from_blob(probe.data(), {n}, at::kFloat)).item<float>();
      const bool eight = torch_order_sum_of_squares<8, false>(probe.data(), n) == torch_sum;
      const bool sixteen = torch_order_sum_of_squares<16, false>(probe.data(), n) == torch_sum;
      if (eight != sixteen) return eight ? int64_t{8} : int64_t{16};
      if (!eight) break;
    }
    TORCH_WARN("rms_norm: torch's float sum follows neither the 8- nor the 16-lane order here; results differ "
               "from torch's in the last bit now and then");
    return int64_t{8};
  }();
  return lanes;
}

float torch_order_sum_of_squares(const float* h, int64_t n, int64_t lanes) {
  if (n < lanes) return torch_order_sum_of_squares<1>(h, n);
  return lanes == 16 ? torch_order_sum_of_squares<16>(h, n) : torch_order_sum_of_squares<8>(h, n);
}

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum_out, int64_t rows, int64_t width,
                   float eps) {
  const int64_t lanes = torch_sum_lanes();  // here, not first inside the parallel region
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row_values(width);
    float* __restrict__ h = row_values.data();
    for (int64_t row = begin; row < end; ++row) {
      const T* __restrict__ xr = x + row * width;
      if (residual != nullptr) {
        const T* __restrict__ rr = residual + row * width;
        T* __restrict__ sr = sum_out + row * width;
        for (int64_t i = 0; i < width; ++i) h[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        for (int64_t i = 0; i < width; ++i) sr[i] = static_cast<T>(h[i]);
      } else {
        for (int64_t i = 0; i < width; ++i) h[i] = static_cast<float>(xr[i]);
      }
      const float inverse_rms = 1.f / std::sqrt(torch_order_sum_of_squares(h, width, lanes) / static_cast<float>(width) + eps);
      T* __restrict__ o = out + row * width;
      for (int64_t i = 0; i < width; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(h[i] * inverse_rms));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x [..., H], weight [H]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t width = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            nullptr, x.numel() / width, width, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  x = x.contiguous();
  residual = residual.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const int64_t width = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), x.numel() / width, width,
                            static_cast<float>(eps));
  });
  return {out, sum};
}

namespace {

// Rotates one head (`head_dim` values at `src`, written to `dst`): neox pairs (i, i + half),
// GPT-J pairs (2i, 2i + 1); dimensions past the rotary ones are copied. Each product and
// each sum rounded to T, as HF's `q * cos + rotate_half(q) * sin` in the activations' dtype.
// The layout is a template parameter so that the neox loop, two contiguous halves, vectorises.
template <bool kNeox, typename T>
inline void rotate_head(const T* __restrict__ src, T* __restrict__ dst, const float* __restrict__ cos,
                        const float* __restrict__ sin, int64_t half, int64_t head_dim) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = kNeox ? i : 2 * i, b = kNeox ? i + half : 2 * i + 1;
    const float x1 = static_cast<float>(src[a]), x2 = static_cast<float>(src[b]);
    const float c = cos[i], s = sin[i];
    dst[a] = static_cast<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    dst[b] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
  for (int64_t d = 2 * half; d < head_dim; ++d) dst[d] = src[d];
}

// C: the cache's element, T or a quantized one (kv_quant.h: each row quantized, its scale at k_scale/v_scale
// [block, offset, head]). Block strides in elements of the cache and of the scales.
template <bool kNeox, typename T, typename C>
void rotary_store(const int64_t* positions, const T* query, const T* key, const T* value, const float* cos_sin,
                  C* k_cache, C* v_cache, float* k_scale, float* v_scale, const int64_t* slots, T* query_out,
                  int64_t num_tokens, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                  int64_t query_stride, int64_t key_stride, int64_t value_stride, int64_t block_size,
                  int64_t cache_block_stride, int64_t scale_block_stride) {
  constexpr bool kQuantized = inflight_cpu::kIsQuantizedKv<C>;
  const int64_t half = rotary_dim / 2;
  const int64_t kv_width = num_kv_heads * head_dim;
  at::parallel_for(0, num_tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(half), sin(half), row(kQuantized ? head_dim : 0);
    std::vector<T> rotated(kQuantized ? head_dim : 0);
    for (int64_t t = begin; t < end; ++t) {
      // HF casts cos and sin to the activations' dtype before use.
      const float* cs = cos_sin + positions[t] * rotary_dim;
      for (int64_t i = 0; i < half; ++i) {
        cos[i] = round_to<T>(cs[i]);
        sin[i] = round_to<T>(cs[half + i]);
      }
      for (int64_t h = 0; h < num_q_heads; ++h)
        rotate_head<kNeox>(query + t * query_stride + h * head_dim, query_out + (t * num_q_heads + h) * head_dim,
                           cos.data(), sin.data(), half, head_dim);
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token: nothing to store
      const int64_t offset = (slot / block_size) * cache_block_stride + (slot % block_size) * kv_width;
      const T* v = value + t * value_stride;
      if constexpr (kQuantized) {
        const int64_t scale_offset = (slot / block_size) * scale_block_stride + (slot % block_size) * num_kv_heads;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          // The rotated key in T first, as the reference rotates then quantizes.
          rotate_head<kNeox>(key + t * key_stride + h * head_dim, rotated.data(), cos.data(), sin.data(), half,
                             head_dim);
          for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(rotated[d]);
          inflight_cpu::quantize_row(row.data(), k_cache + offset + h * head_dim, k_scale + scale_offset + h, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(v[h * head_dim + d]);
          inflight_cpu::quantize_row(row.data(), v_cache + offset + h * head_dim, v_scale + scale_offset + h, head_dim);
        }
      } else {
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head<kNeox>(key + t * key_stride + h * head_dim, k_cache + offset + h * head_dim, cos.data(),
                             sin.data(), half, head_dim);
        std::copy(v, v + kv_width, v_cache + offset);
      }
    }
  });
}

// [T, H, D] with each token's heads contiguous (a view of the fused qkv projection is).
void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_store_kv: ", name, " must be [tokens, heads, head_dim] with each token's heads contiguous");
}

}  // namespace

// query [T, Hq, D], key and value [T, Hkv, D] (strided over tokens: views of qkv are fine),
// positions and slot_mapping int64 [T] (slot -1: do not store), cos_sin_cache float32
// [max_position, rotary_dim], caches [num_blocks, block_size, Hkv, D] with each block contiguous,
// in the activations' dtype or quantized (int8, float8_e4m3fn, float8_e5m2) with k_scale/v_scale
// float32 [num_blocks, block_size, Hkv]
// (kernels/kv_store.py's QuantizedKV: each row quantized as it is stored). Stores the rotated
// key and the value; returns the rotated query, [T, Hq, D] contiguous.
at::Tensor rotary_store_kv(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor value,
                           at::Tensor cos_sin_cache, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                           bool is_neox, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  check_heads(query, "query");
  check_heads(key, "key");
  check_heads(value, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(2) == query.size(2),
              "rotary_store_kv: query, key and value shapes disagree");
  const bool quantized = inflight_cpu::is_quantized_kv(k_cache.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2) && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) && k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "rotary_store_kv: caches must be [num_blocks, block_size, Hkv, D], each block contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type() &&
                  (quantized || (k_cache.scalar_type() == key.scalar_type() && v_cache.scalar_type() == key.scalar_type())) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "rotary_store_kv: activations and caches must share a dtype (or the caches be int8 or fp8)");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()), "rotary_store_kv: quantized caches come with scales");
  if (quantized)
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->dim() == 3 && k_scale->sizes() == v_scale->sizes() &&
                    k_scale->strides() == v_scale->strides() && k_scale->size(0) == k_cache.size(0) &&
                    k_scale->size(1) == k_cache.size(1) && k_scale->size(2) == k_cache.size(2) &&
                    k_scale->stride(2) == 1 && k_scale->stride(1) == k_scale->size(2),
                "rotary_store_kv: scales float32 [num_blocks, block_size, Hkv], each block contiguous");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) <= query.size(2) && cos_sin_cache.size(1) % 2 == 0,
              "rotary_store_kv: cos_sin_cache float32 [max_position, rotary_dim <= head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "rotary_store_kv: positions and slot_mapping int64");
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  cos_sin_cache = cos_sin_cache.contiguous();
  auto query_out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_store_kv", [&] {
    const auto run = [&](auto* k, auto* v, float* ks, float* vs, int64_t scale_block_stride) {
      using C = std::remove_pointer_t<decltype(k)>;
      const auto store = is_neox ? rotary_store<true, scalar_t, C> : rotary_store<false, scalar_t, C>;
      store(positions.data_ptr<int64_t>(), query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(),
            value.data_ptr<scalar_t>(), cos_sin_cache.data_ptr<float>(), k, v, ks, vs,
            slot_mapping.data_ptr<int64_t>(), query_out.data_ptr<scalar_t>(), query.size(0), query.size(1),
            key.size(1), query.size(2), cos_sin_cache.size(1), query.stride(0), key.stride(0), value.stride(0),
            k_cache.size(1), k_cache.stride(0), scale_block_stride);
    };
    const bool stored = inflight_cpu::dispatch_quantized_kv(k_cache.scalar_type(), [&](auto* element) {
      using C = std::remove_pointer_t<decltype(element)>;
      run(static_cast<C*>(k_cache.data_ptr()), static_cast<C*>(v_cache.data_ptr()), k_scale->data_ptr<float>(),
          v_scale->data_ptr<float>(), k_scale->stride(0));
    });
    if (!stored)
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), nullptr, nullptr, 0);
  });
  return query_out;
}
