// SiLU-and-mul of a gated MLP, out = silu(gate) * up, one pass over [T, 2I] -> [T, I].
//
// As torch ops (F.silu on the gate half, then a multiply) it is two passes and a
// temporary: 220 us at 144 rows on a 2-core EPYC, 150 here; 21 us at one row, 5 here.
// Numerics are torch's, bit for bit in float32 (the unit tests compare with ==), because
// the engine's greedy output must equal HF's token for token: g / (1 + exp(-g)) with
// SLEEF's expf (the one torch's AVX2 kernel calls; glibc's vector expf is 1.4x faster
// but differs in the last bit for 1 in 5 values), then times `up`, each step rounded.
// Other dtypes: silu in float32, rounded to the dtype, times `up`, rounded, as torch does.
// No reassociation, reciprocal or contraction here, whatever cpu_ext.py's flags allow.
#pragma GCC optimize("no-unsafe-math-optimizations", "fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "elementwise.h"
#include "ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);  // in libtorch_cpu, which this module links
#endif

namespace {

using inflight_cpu::round_to;

// torch's tail: glibc's scalar expf; a vectorised loop here would call libmvec's, which
// differs in the last bit.
__attribute__((optimize("no-tree-vectorize"))) void silu_scalar(const float* gate, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i]));
}

// out[i] = silu(gate[i]) in float32, as torch's AVX2 kernel computes it (8 lanes at a time
// with SLEEF, then the tail).
void silu_sleef(const float* gate, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(out + i, _mm256_div_ps(g, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(g, sign)))));
  }
#endif
  silu_scalar(gate + i, out + i, n - i);
}

using SiluFn = void (*)(const float*, float*, int64_t);

// Which of the two torch runs here, found by asking torch (its CPU capability does not say:
// torch 2.13 reports AVX512 on AVX-512 machines and runs its AVX2 kernel, SLEEF's, there;
// ATEN_CPU_CAPABILITY=default runs glibc's expf on every element). The probe's values span
// the range where the two differ in the last bit now and then.
SiluFn torch_silu() {
  static const SiluFn fn = [] {
    std::vector<float> probe(4096), sleef(probe.size()), scalar(probe.size());
    for (size_t i = 0; i < probe.size(); ++i) probe[i] = -20.f + 40.f * static_cast<float>(i) / probe.size();
    const int64_t n = static_cast<int64_t>(probe.size());
    const at::Tensor expected = at::silu(at::from_blob(probe.data(), {n}, at::kFloat)).contiguous();
    silu_sleef(probe.data(), sleef.data(), n);
    silu_scalar(probe.data(), scalar.data(), n);
    const auto same = [&](const std::vector<float>& got) {
      return std::memcmp(got.data(), expected.data_ptr<float>(), n * sizeof(float)) == 0;
    };
    if (same(sleef)) return silu_sleef;
    if (same(scalar)) return silu_scalar;
    TORCH_WARN("silu_and_mul: torch's SiLU matches neither SLEEF's nor glibc's expf here; results differ from "
               "torch's in the last bit");
    return silu_sleef;
  }();
  return fn;
}

// Columns per task, at least: a long row is cut in slices of this many, rows shorter than it are
// taken together. A decode's one row of a wide MLP (8192 columns, Llama-3.2-1B) took ~15 us on
// one core. A multiple of SLEEF's 8 lanes, so that every column takes the same path (and bits) as
// in one pass over its row.
constexpr int64_t kColumnsPerTask = 2048;

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t width) {
  const SiluFn silu = torch_silu();  // here, not first inside the parallel region
  const int64_t slices = std::max<int64_t>(1, (width + kColumnsPerTask - 1) / kColumnsPerTask);
  const int64_t slice_width = slices == 1 ? width : kColumnsPerTask;
  const int64_t pieces_per_task = (kColumnsPerTask + slice_width - 1) / std::max<int64_t>(slice_width, 1);
  at::parallel_for(0, rows * slices, pieces_per_task, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(slice_width), activated(slice_width);
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t row = piece / slices, column = piece % slices * slice_width;
      const int64_t count = std::min(slice_width, width - column);
      const T* gate_in = x + row * 2 * width + column;
      const T* up = gate_in + width;
      T* o = out + row * width + column;
      if constexpr (std::is_same_v<T, float>) {
        silu(gate_in, activated.data(), count);
        for (int64_t i = 0; i < count; ++i) o[i] = activated[i] * up[i];
      } else {
        for (int64_t i = 0; i < count; ++i) gate[i] = static_cast<float>(gate_in[i]);
        silu(gate.data(), activated.data(), count);
        for (int64_t i = 0; i < count; ++i)
          o[i] = static_cast<T>(round_to<T>(activated[i]) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

// x [..., 2I] contiguous in its last dimension; returns [..., I].
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: x [..., 2I]");
  x = x.contiguous();
  const int64_t width = x.size(-1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), width ? x.numel() / (2 * width) : 0,
                                width);
  });
  return out;
}
