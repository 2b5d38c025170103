// Quantized KV rows (kernels/kv_store.py's KVQuantDtype): each (token, KV head) row of the
// cache stored as one byte a value, int8 or fp8 (e4m3fn, e5m2), with one float32 scale,
// value = decode(q) * scale, scale = max|row| / kMax. The RoPE-and-store quantizes with
// `quantize_row` (layer_ops.cpp); the attention decodes with `decode_lanes`, one decoder per
// format for every vector width: the vectorised kernels (paged_attention.cpp) widen a cache
// row's codes in registers and apply the row's scale once per row, the plain loops through
// `dequantize_row`.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace inflight_cpu {

typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
template <int L>
using FloatLanes = std::conditional_t<L == 8, f32x8, f32x16>;
template <int L>
using BitLanes = std::conditional_t<L == 8, u32x8, u32x16>;
template <int L>
using HalfBitLanes = std::conditional_t<L == 8, u16x8, u16x16>;

// fp8 with kExp exponent and kMan mantissa bits. Decoding goes through float16, whose format
// each fp8 one sits inside: `half_bits` moves a code's bits, sign-extended to 16 (what one
// vpmovsxbw does to 8 or 16 codes), under float16's (one expression for a scalar and for vector
// lanes), and float16 -> float32 is one instruction per 8 or 16 values
// (F16C's vcvtph2ps) or, one at a time, a 256-entry table; both are exact, subnormals included.
template <int kExp, int kMan, uint8_t kMaxCode>
struct Fp8Format {
  static constexpr int kBias = (1 << (kExp - 1)) - 1;
  static constexpr uint8_t kNanCode = 0x7F;  // e4m3fn's only NaN, and one of e5m2's

  // Round to nearest even, saturating at the largest finite value (torch's cast of the value
  // clamped to [-max, max], to the bit); NaN stays NaN. Integer arithmetic only, so no compiler
  // flag changes it.
  static uint8_t encode(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (bits >> 24) & 0x80;
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return sign | kNanCode;
    if (magnitude >= max_bits()) return sign | kMaxCode;
    if (magnitude < 0x00800000u) return sign;  // float32 subnormals: far below half fp8's smallest
    const int exponent = int(magnitude >> 23) - 127 + kBias;  // biased as fp8's, were x normal there
    const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    // Below fp8's normals the significand loses one more bit per binade (a subnormal result).
    const int shift = 23 - kMan + (exponent < 1 ? 1 - exponent : 0);
    if (shift > 24) return sign;  // under half the smallest subnormal: zero
    uint32_t rounded = significand >> shift;
    const uint32_t rest = significand & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (rounded & 1u))) ++rounded;
    // A normal result's implicit bit (and a carry out of the mantissa) lands in the exponent.
    const uint32_t code = exponent >= 1 ? (uint32_t(exponent - 1) << kMan) + rounded : rounded;
    return sign | uint8_t(code);
  }

  static uint32_t max_bits() {
    const uint32_t code = kMaxCode;
    const uint32_t exponent = (code >> kMan) - kBias + 127, mantissa = code & ((1u << kMan) - 1);
    return (exponent << 23) | (mantissa << (23 - kMan));
  }
};

struct Fp8E4m3 : Fp8Format<4, 3, 0x7E> {  // largest 448
  static constexpr float kMax = 448.f;
  // Exponent and mantissa under float16's, sign on top: float16's bias 15 against e4m3's 7 makes
  // that the value / 2^8, for normals and subnormals alike. (0x7F, e4m3fn's NaN, which the encoder
  // never writes, reads as 480.) Shifted by 7, the sign-extended code has its sign in bits 15 and
  // 14: bit 14 cleared, bit 15 is the sign.
  static constexpr float kHalfFactor = 256.f;
  template <typename U>
  static U half_bits(U extended) {
    return (extended << 7) & 0xBFFF;
  }
};

struct Fp8E5m2 : Fp8Format<5, 2, 0x7B> {  // largest 57344
  static constexpr float kMax = 57344.f;
  static constexpr float kHalfFactor = 1.f;
  template <typename U>
  static U half_bits(U extended) {
    return extended << 8;  // e5m2 is float16's top byte (the sign extension shifts out)
  }
};

// The cache element C of a quantized cache (int8_t, c10::Float8_e4m3fn, c10::Float8_e5m2):
// kMax, encode(x / scale), decode(q) (decode(q) * scale is the value) and kLaneFactor (what
// `decode_lanes` leaves out of decode(q): a power of two).
template <typename C>
struct KvQuant {
  static constexpr bool kQuantized = false;
};

template <>
struct KvQuant<int8_t> {
  static constexpr bool kQuantized = true;
  static constexpr float kMax = 127.f;
  static constexpr float kLaneFactor = 1.f;
  static int8_t encode(float x) { return static_cast<int8_t>(std::clamp(std::nearbyint(x), -kMax, kMax)); }
  static float decode(int8_t q) { return static_cast<float>(q); }
};

template <typename Format, typename Storage>
struct Fp8KvQuant : Format {
  static constexpr bool kQuantized = true;
  static constexpr float kLaneFactor = Format::kHalfFactor;
  static Storage encode(float x) { return Storage(Format::encode(x), Storage::from_bits()); }
  static float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }
  static inline const std::array<float, 256> kDecode = [] {
    std::array<float, 256> table{};
    for (int code = 0; code < 256; ++code)
      table[code] = half_to_float(Format::half_bits(uint16_t(int8_t(code)))) * Format::kHalfFactor;
    return table;
  }();
  static float decode(Storage q) { return kDecode[q.x]; }
};

template <>
struct KvQuant<c10::Float8_e4m3fn> : Fp8KvQuant<Fp8E4m3, c10::Float8_e4m3fn> {};
template <>
struct KvQuant<c10::Float8_e5m2> : Fp8KvQuant<Fp8E5m2, c10::Float8_e5m2> {};

template <typename C>
constexpr bool kIsQuantizedKv = KvQuant<C>::kQuantized;

// One row into a quantized cache row and its scale, as kernels/kv_store.py's quantize_kv_rows:
// scale = max|x| / kMax, each value encode(x / scale).
template <typename C>
inline void quantize_row(const float* x, C* q, float* scale, int64_t n) {
  float peak = 0.f;
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(x[i]));
  const float s = peak / KvQuant<C>::kMax;
  const float divisor = s > 0.f ? s : 1.f;
  for (int64_t i = 0; i < n; ++i) q[i] = KvQuant<C>::encode(x[i] / divisor);
  *scale = s;
}

// L codes (8 or 16) as float32 lanes, each decode(q) / kLaneFactor, exactly: int8 widened
// (vpmovsxbd, vcvtdq2ps), fp8 through float16 (vpmovsxbw, half_bits, F16C's vcvtph2ps).
// A row's values are these lanes times scale * kLaneFactor (a power of two times the scale, so
// the same bits as decode(q) * scale).
template <int L, typename C>
inline FloatLanes<L> decode_lanes(const C* src) {
  static_assert(L == 8 || L == 16, "vectors of 8 or 16 floats");
  using Q = KvQuant<C>;
  if constexpr (std::is_same_v<C, int8_t>) {
#if defined(__AVX512F__)
    if constexpr (L == 16) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#endif
#if defined(__AVX2__)
    if constexpr (L == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
#endif
  } else {
#if defined(__AVX512F__)
    if constexpr (L == 16) {
      const u16x16 extended = u16x16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
      return _mm512_cvtph_ps(__m256i(Q::half_bits(extended)));
    }
#endif
#if defined(__AVX2__) && defined(__F16C__)
    if constexpr (L == 8) {
      const u16x8 extended = u16x8(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
      return _mm256_cvtph_ps(__m128i(Q::half_bits(extended)));
    }
#endif
  }
  // A build without these instructions: one code at a time.
  FloatLanes<L> lanes;
  for (int i = 0; i < L; ++i) lanes[i] = Q::decode(src[i]) * (1.f / Q::kLaneFactor);
  return lanes;
}

// n codes (a multiple of L) as bfloat16 bits, each decode_lanes' float exactly: a decoded code
// has at most 7 significant bits (int8's 127; fp8's 4 or 3), which bfloat16's 8 hold, so the
// float's low 16 bits are zero and dropping them loses nothing. A bfloat16 load of the result
// gives decode_lanes' very lanes: a row widened once serves many reads at a bfloat16 row's cost.
template <int L, typename C>
inline void decode_to_bfloat16(const C* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += L) {
    const HalfBitLanes<L> bits =
        __builtin_convertvector(reinterpret_cast<BitLanes<L>>(decode_lanes<L>(src + i)) >> 16, HalfBitLanes<L>);
    std::memcpy(dst + i, &bits, sizeof bits);
  }
}

// dst[i] = decode(src[i]) * scale, float32, for the plain loops; the same bits whichever loop
// below takes an element, and as the vectorised kernels' lanes times scale * kLaneFactor.
template <typename C>
inline void dequantize_row(const C* src, float* dst, int64_t n, float scale) {
  using Q = KvQuant<C>;
  const float factor = scale * Q::kLaneFactor;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const f32x16 values = decode_lanes<16>(src + i) * factor;
    std::memcpy(dst + i, &values, sizeof values);
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const f32x8 values = decode_lanes<8>(src + i) * factor;
    std::memcpy(dst + i, &values, sizeof values);
  }
  for (; i < n; ++i) dst[i] = Q::decode(src[i]) * scale;
}

// The cache element of a quantized cache's dtype: f(a null C*), true; false for any other dtype.
template <typename F>
inline bool dispatch_quantized_kv(c10::ScalarType type, F&& f) {
  switch (type) {
    case c10::ScalarType::Char:
      f(static_cast<int8_t*>(nullptr));
      return true;
    case c10::ScalarType::Float8_e4m3fn:
      f(static_cast<c10::Float8_e4m3fn*>(nullptr));
      return true;
    case c10::ScalarType::Float8_e5m2:
      f(static_cast<c10::Float8_e5m2*>(nullptr));
      return true;
    default:
      return false;
  }
}

inline bool is_quantized_kv(c10::ScalarType type) {
  return dispatch_quantized_kv(type, [](auto*) {});
}

}  // namespace inflight_cpu
