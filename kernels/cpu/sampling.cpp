// Running sums of float32 rows for the sampler's inverse-CDF draw, bit-identical to torch.cumsum
// on the CPU: each row is summed left to right in double, and every partial sum is rounded to
// float. torch runs that as one scalar loop per row, each add waiting on the one before (~3
// cycles an element: 0.85 ms for 32 rows x 49k on two cores). Here eight rows share one vector
// of eight doubles: an 8 x 8 tile of floats is transposed so that one vector holds a column of
// the eight rows, the column is added to the running sums (one add for eight rows), and the
// rounded sums are transposed back. Every row still adds its own elements in its own order, so
// the result is torch's to the bit. Without AVX-512, kernels/sampling.py calls torch's own.
// No contraction and no reassociation here, whatever cpu_ext.py's flags allow elsewhere: the
// order of the adds is the result.
#pragma GCC optimize("no-unsafe-math-optimizations", "fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

// One row, as torch does it.
void cumsum_row(const float* x, float* out, int64_t begin, int64_t end, double& sum) {
  for (int64_t i = begin; i < end; ++i) {
    sum += static_cast<double>(x[i]);
    out[i] = static_cast<float>(sum);
  }
}

#if defined(__AVX512F__)
constexpr int64_t kRows = 8;

// rows[r] (8 floats each) -> columns[c] = {rows[0][c], ..., rows[7][c]}.
inline void transpose_8x8(__m256 (&v)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  v[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  v[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  v[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  v[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  v[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  v[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  v[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Eight consecutive rows of n floats.
void cumsum_8_rows(const float* x, float* out, int64_t n) {
  __m512d sums = _mm512_setzero_pd();
  const int64_t whole = n / 8 * 8;
  for (int64_t c = 0; c < whole; c += 8) {
    __m256 tile[8];
    for (int r = 0; r < 8; ++r) tile[r] = _mm256_loadu_ps(x + r * n + c);
    transpose_8x8(tile);
    for (int j = 0; j < 8; ++j) {
      sums = _mm512_add_pd(sums, _mm512_cvtps_pd(tile[j]));
      tile[j] = _mm512_cvtpd_ps(sums);
    }
    transpose_8x8(tile);
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + r * n + c, tile[r]);
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, sums);
  for (int r = 0; r < 8; ++r) cumsum_row(x + r * n, out + r * n, whole, n, lanes[r]);
}
#endif

// Top-p's cut without a sort. A token is in the nucleus when the probabilities larger than
// its own sum to less than top_p; the smallest probability in it is the row's threshold.
// Non-negative floats order as their bit patterns do, so buckets of leading bits are ranges
// of probability: one pass sums each bucket's mass, a walk down from the largest bucket finds
// the one the cut falls in, and only that bucket's probabilities (split once more by the next
// bits where it holds many) are sorted. Sums are in double, each bucket's in the row's order.
constexpr int kCoarseShift = 20;                      // exponent and 3 mantissa bits:
constexpr int kCoarseBuckets = 1 << (31 - kCoarseShift);  // 2048 (the sign bit is cleared)
constexpr int kFineShift = 8, kFineBuckets = 1 << 12;  // the next 12 bits
constexpr size_t kSortAtMost = 256;                    // a bucket this small is sorted as it is

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits & 0x7fffffffu;  // -0.0 is 0.0
}

// The bucket, among `mass`'s, in which the running sum from the top (starting at `above`)
// reaches `target`; `above` becomes the mass of the buckets over it. -1: it never does.
int64_t bucket_of_cut(const std::vector<double>& mass, double target, double& above) {
  for (int64_t b = static_cast<int64_t>(mass.size()) - 1; b >= 0; --b) {
    if (mass[b] > 0.0 && above + mass[b] >= target) return b;
    above += mass[b];
  }
  return -1;
}

float nucleus_threshold(const float* probs, int64_t n, double top_p) {
  std::vector<double> mass(kCoarseBuckets, 0.0);
  for (int64_t i = 0; i < n; ++i) mass[bits_of(probs[i]) >> kCoarseShift] += static_cast<double>(probs[i]);
  double above = 0.0;
  const int64_t coarse = bucket_of_cut(mass, top_p, above);
  if (coarse < 0) {  // the whole row sums to less than top_p: every token stays
    return *std::min_element(probs, probs + n, [](float a, float b) { return bits_of(a) < bits_of(b); });
  }
  std::vector<float> members;
  for (int64_t i = 0; i < n; ++i)
    if ((bits_of(probs[i]) >> kCoarseShift) == static_cast<uint32_t>(coarse)) members.push_back(probs[i]);
  if (members.size() > kSortAtMost) {
    std::vector<double> fine(kFineBuckets, 0.0);
    for (float p : members) fine[(bits_of(p) >> kFineShift) & (kFineBuckets - 1)] += static_cast<double>(p);
    double fine_above = above;
    const int64_t cut = bucket_of_cut(fine, top_p, fine_above);
    if (cut >= 0) {
      above = fine_above;
      std::vector<float> narrowed;
      for (float p : members)
        if (((bits_of(p) >> kFineShift) & (kFineBuckets - 1)) == static_cast<uint32_t>(cut)) narrowed.push_back(p);
      members.swap(narrowed);
    }
  }
  std::sort(members.begin(), members.end(), [](float a, float b) { return bits_of(a) > bits_of(b); });
  // Down the sorted bucket, a run of equal probabilities at a time: each run is in while the
  // mass above it is under top_p.
  float threshold = members.front();
  double sum = above;
  for (size_t i = 0; i < members.size() && sum < top_p;) {
    threshold = members[i];
    for (; i < members.size() && bits_of(members[i]) == bits_of(threshold); ++i) sum += static_cast<double>(members[i]);
  }
  return threshold;
}

}  // namespace

at::Tensor keep_nucleus_(at::Tensor probs, at::Tensor top_p) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous() && probs.size(1) > 0,
              "keep_nucleus_: probs [rows, n] float32, contiguous, n > 0");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == probs.size(0) && top_p.scalar_type() == at::kDouble,
              "keep_nucleus_: top_p [rows] float64");
  const int64_t rows = probs.size(0), n = probs.size(1);
  float* pp = probs.data_ptr<float>();
  const double* tp = top_p.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (tp[r] >= 1.0) continue;
      float* row = pp + r * n;
      const float threshold = nucleus_threshold(row, n, tp[r]);
      for (int64_t i = 0; i < n; ++i) row[i] = row[i] < threshold ? 0.0f : row[i];
    }
  });
  return probs;
}

at::Tensor cumsum_rows(at::Tensor x, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "cumsum_rows: x [rows, n] float32, contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "cumsum_rows: out like x");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t grouped = 0;  // rows summed eight to a vector; the rest (and all, without AVX-512) one by one
#if defined(__AVX512F__)
  grouped = rows / kRows * kRows;
  at::parallel_for(0, grouped / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) cumsum_8_rows(xp + g * kRows * n, op + g * kRows * n, n);
  });
#endif
  for (int64_t r = grouped; r < rows; ++r) {
    double sum = 0.0;
    cumsum_row(xp + r * n, op + r * n, 0, n, sum);
  }
  return out;
}
