// A quantized weight's group scales and mins as the panel GEMMs hold them (gemm_quant.cpp,
// gemm_int8_dots.cpp): per 16-column panel and group, 16 values in float16 where every value
// survives the round trip (GGUF's d and m, Q4_0's -8d), else float32.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "prefetch.h"

namespace inflight_cpu {

constexpr int64_t kQuantPanel = 16;

// One panel's scales or mins for one group: 16 values in float16 or float32.
struct GroupValues {
  const void* base;  // [P, groups, 16]; nullptr: none (symmetric weights have no mins)
  bool half;
  const void* at(int64_t panel_group) const {
    return static_cast<const char*>(base) + panel_group * kQuantPanel * (half ? 2 : 4);
  }
  float value(int64_t panel_group, int c) const {
    return half ? static_cast<float>(static_cast<const c10::Half*>(at(panel_group))[c])
                : static_cast<const float*>(at(panel_group))[c];
  }
};

// A tile's scales and mins sit apart from its panels' lines, one line (or half of one) per panel
// and group: streams too sparse for the hardware prefetcher, so every group's end waited on
// memory for them (a quarter of the int4 + int8 activations tile's time in a 1B decode step, by
// perf). At group g a tile asks for group g + kGroupValuesAhead's, at its first group for the
// first ones too.
constexpr int64_t kGroupValuesAhead = 2;

__attribute__((always_inline)) inline void prefetch_group_values(const GroupValues& scales, const GroupValues& mins,
                                                                 int64_t first_panel, int panels, int64_t groups,
                                                                 int64_t g) {
  const int64_t first = g == 0 ? 0 : g + kGroupValuesAhead, last = std::min(groups - 1, g + kGroupValuesAhead);
  for (int p = 0; p < panels; ++p)
    for (int64_t ahead = first; ahead <= last; ++ahead) {
      prefetch_l2(scales.at((first_panel + p) * groups + ahead));
      if (mins.base != nullptr) prefetch_l2(mins.at((first_panel + p) * groups + ahead));
    }
}

#if defined(__AVX2__) && defined(__F16C__)
// One panel's 16 values for one group as two 8-float vectors.
inline void group_values_avx2(const GroupValues& v, int64_t panel_group, __m256 (&out)[2]) {
  if (v.half) {
    const __m128i* h = static_cast<const __m128i*>(v.at(panel_group));
    out[0] = _mm256_cvtph_ps(_mm_loadu_si128(h));
    out[1] = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
  } else {
    const float* f = static_cast<const float*>(v.at(panel_group));
    out[0] = _mm256_loadu_ps(f);
    out[1] = _mm256_loadu_ps(f + 8);
  }
}
#endif

#if defined(__AVX512F__)
// One panel's 16 values for one group as one 16-float vector.
inline __m512 group_values_avx512(const GroupValues& v, int64_t panel_group) {
  return v.half ? _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(v.at(panel_group))))
                : _mm512_loadu_ps(static_cast<const float*>(v.at(panel_group)));
}
#endif

// A GEMM's packed scales or mins [P, groups, 16] (float16 or float32), checked as `op` takes them
// (`packer`: the function that makes them), as GroupValues.
inline GroupValues group_values_of(const at::Tensor& v, int64_t panels, int64_t groups, int64_t group_size,
                                   const char* op, const char* name, const char* packer) {
  TORCH_CHECK(v.dim() == 3 && v.size(0) == panels && v.size(1) == groups && v.size(2) == kQuantPanel &&
                  v.is_contiguous() && (v.scalar_type() == at::kHalf || v.scalar_type() == at::kFloat),
              op, ": ", name, " from ", packer, " for ", groups, " groups of ", group_size);
  return {v.data_ptr(), v.scalar_type() == at::kHalf};
}

// A GEMM's optional bias [N] in `dtype`, as float32 (undefined where absent).
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n, at::ScalarType dtype, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype, op, ": bias [N] in ", dtype);
  return bias->to(at::kFloat).contiguous();
}

// values [N, groups] float32 as [P, groups, 16], in float16 where that is exact, padded with zeros.
inline at::Tensor pack_group_values(const at::Tensor& values, int64_t panels) {
  const int64_t n = values.size(0), groups = values.size(1);
  const at::Tensor as_half = values.to(at::kHalf);
  const bool exact = as_half.to(at::kFloat).equal(values);
  at::Tensor padded = at::zeros({panels * kQuantPanel, groups}, values.options().dtype(exact ? at::kHalf : at::kFloat));
  padded.narrow(0, 0, n).copy_(exact ? as_half : values);
  return padded.view({panels, kQuantPanel, groups}).transpose(1, 2).contiguous();
}

}  // namespace inflight_cpu
