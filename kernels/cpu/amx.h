// The AMX tiles, shared by the bfloat16 panel GEMM (gemm.cpp) and the quantized ones
// (gemm_quant.cpp; gemm_int8_dots.cpp's int8 tiles): the tile configuration, the tile shapes the
// kernels use, and two ways to run the tile instructions, which a kernel takes as its `Tiles` type:
// - HardwareTiles, the instructions themselves, where the build has them
//   (INFLIGHT_HAVE_AMX_HARDWARE) and Linux lends the process the tiles (`amx_permitted`);
// - TileModel, a software model of them, in every build: what the tests run the tile kernels on
//   where the CPU has no AMX (INFLIGHT_CPU_AMX_EMULATE=1, kernels/cpu_ext.py), chosen for the
//   whole process by `use_tile_model()` before its first GEMM. Never for serving: scalar code.
// One build has both, so testing the tile kernels on the model costs no second compile.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AMX_INT8__)
#define INFLIGHT_HAVE_AMX_HARDWARE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace inflight_cpu {

// The tile configuration `ldtilecfg` reads: palette 1, then each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// The tile instructions as the Intel SDM defines them, on a thread's 8 tiles of 16 x 64 bytes.
// Each operation refuses the shapes the hardware refuses (#UD), so a wrong configuration fails here.
namespace amx_model {
inline thread_local TileConfig config;
inline thread_local bool configured = false;
inline thread_local uint8_t tiles[8][16][64];

inline void configure(const TileConfig* c) {
  TORCH_CHECK(c->palette == 1, "AMX model: palette ", int(c->palette));
  for (int t = 0; t < 8; ++t)
    TORCH_CHECK(c->rows[t] <= 16 && c->bytes_per_row[t] <= 64, "AMX model: tile ", t, " larger than 16 x 64 bytes");
  config = *c;
  configured = true;
  std::memset(tiles, 0, sizeof tiles);
}
inline void release() { configured = false; }
inline void check(int t) { TORCH_CHECK(configured && t >= 0 && t < 8, "AMX model: tile ", t, " used unconfigured"); }
inline void zero(int t) {
  check(t);
  std::memset(tiles[t], 0, sizeof tiles[t]);
}
inline void load(int t, const void* base, int64_t stride) {
  check(t);
  std::memset(tiles[t], 0, sizeof tiles[t]);
  for (int r = 0; r < config.rows[t]; ++r)
    std::memcpy(tiles[t][r], static_cast<const char*>(base) + r * stride, config.bytes_per_row[t]);
}
inline void store(int t, void* base, int64_t stride) {
  check(t);
  for (int r = 0; r < config.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, tiles[t][r], config.bytes_per_row[t]);
}
inline float bf16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}
// tdpbf16ps c, a, b: c[m][n] += sum over pairs p of a[m][p].lo * b[p][n].lo + a[m][p].hi * b[p][n].hi.
// Every element by the same scalar fused multiply-adds: vectorised, the loop's peeled iterations
// contracted the products differently from its vector body, and a row's sums then depended on
// where in the tile it landed, as they do on no hardware.
__attribute__((optimize("no-tree-vectorize"))) inline void dpbf16ps(int c, int a, int b) {
  check(c), check(a), check(b);
  const int rows = config.rows[a], pairs = config.bytes_per_row[a] / 4, cols = config.bytes_per_row[c] / 4;
  TORCH_CHECK(config.rows[c] == rows && config.rows[b] == pairs && config.bytes_per_row[b] == config.bytes_per_row[c],
              "AMX model: tdpbf16ps shapes disagree (c ", int(config.rows[c]), "x", config.bytes_per_row[c], ", a ",
              rows, "x", config.bytes_per_row[a], ", b ", int(config.rows[b]), "x", config.bytes_per_row[b], ")");
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < cols; ++n) {
      float sum;
      std::memcpy(&sum, &tiles[c][m][4 * n], sizeof sum);
      for (int p = 0; p < pairs; ++p) {
        sum = std::fma(bf16_at(&tiles[a][m][4 * p]), bf16_at(&tiles[b][p][4 * n]), sum);
        sum = std::fma(bf16_at(&tiles[a][m][4 * p + 2]), bf16_at(&tiles[b][p][4 * n + 2]), sum);
      }
      std::memcpy(&tiles[c][m][4 * n], &sum, sizeof sum);
    }
}
// tdpbsud / tdpbssd c, a, b: c[m][n] (int32) += sum over k of a[m][k] (signed bytes) times
// b[k / 4][4n + k % 4] (unsigned bytes for tdpbsud, signed for tdpbssd).
template <bool SignedB>
void dpbs_d(int c, int a, int b) {
  check(c), check(a), check(b);
  const int rows = config.rows[a], k = config.bytes_per_row[a], cols = config.bytes_per_row[c] / 4;
  TORCH_CHECK(config.rows[c] == rows && config.rows[b] * 4 == k && config.bytes_per_row[b] == config.bytes_per_row[c],
              "AMX model: tdpbs", SignedB ? "s" : "u", "d shapes disagree");
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < cols; ++n) {
      int32_t sum;
      std::memcpy(&sum, &tiles[c][m][4 * n], sizeof sum);
      for (int i = 0; i < k; ++i) {
        const uint8_t w = tiles[b][i / 4][4 * n + i % 4];
        sum += static_cast<int8_t>(tiles[a][m][i]) * (SignedB ? static_cast<int32_t>(static_cast<int8_t>(w)) : w);
      }
      std::memcpy(&tiles[c][m][4 * n], &sum, sizeof sum);
    }
}
}  // namespace amx_model

// The kernels' `Tiles` type: which of the two runs their tile instructions.
struct TileModel {
  static constexpr bool kHardware = false;
};

// In a kernel templated on `class Tiles`. The tile numbers are literals: the instructions take
// them as immediates (GCC's intrinsics paste them into the register names).
#if defined(INFLIGHT_HAVE_AMX_HARDWARE)
struct HardwareTiles {
  static constexpr bool kHardware = true;
};
#define INFLIGHT_AMX_EITHER(hardware, model) \
  do {                                       \
    if constexpr (Tiles::kHardware) {        \
      hardware;                              \
    } else {                                 \
      model;                                 \
    }                                        \
  } while (0)
#else
#define INFLIGHT_AMX_EITHER(hardware, model) model
#endif
#define AMX_CONFIGURE(config) INFLIGHT_AMX_EITHER(_tile_loadconfig(config), inflight_cpu::amx_model::configure(config))
#define AMX_RELEASE() INFLIGHT_AMX_EITHER(_tile_release(), inflight_cpu::amx_model::release())
#define AMX_ZERO(t) INFLIGHT_AMX_EITHER(_tile_zero(t), inflight_cpu::amx_model::zero(t))
#define AMX_LOAD(t, base, stride) \
  INFLIGHT_AMX_EITHER(_tile_loadd(t, base, stride), inflight_cpu::amx_model::load(t, base, stride))
#define AMX_STORE(t, base, stride) \
  INFLIGHT_AMX_EITHER(_tile_stored(t, base, stride), inflight_cpu::amx_model::store(t, base, stride))
#define AMX_DP(c, a, b) INFLIGHT_AMX_EITHER(_tile_dpbf16ps(c, a, b), inflight_cpu::amx_model::dpbf16ps(c, a, b))
// Signed bytes of a (x) against unsigned (SU) or signed (SS) bytes of b, into int32 sums.
#define AMX_DP_SU(c, a, b) INFLIGHT_AMX_EITHER(_tile_dpbsud(c, a, b), inflight_cpu::amx_model::dpbs_d<false>(c, a, b))
#define AMX_DP_SS(c, a, b) INFLIGHT_AMX_EITHER(_tile_dpbssd(c, a, b), inflight_cpu::amx_model::dpbs_d<true>(c, a, b))

// Rows and k's of one tile: 16 rows of 64 bytes, 32 bf16 k's of x a row, 16 pairs of k's of a
// panel (its 16 columns side by side, as pack_panels lays them), or 16 float sums a row.
constexpr int64_t kTileRows = 16, kTileK = 32, kTileBytes = 64;
constexpr int64_t kAmxRows = 2 * kTileRows;  // x rows a pass: tiles 0 and 1

// Set once, before the first GEMM, by use_tile_model() (ops.h), for the process's life.
inline bool tile_model_in_use = false;

// Whether the tile paths can run here: on the model once chosen, else on the hardware.
inline bool tiles_built() {
#if defined(INFLIGHT_HAVE_AMX_HARDWARE)
  return true;
#else
  return tile_model_in_use;
#endif
}

// Linux lends a process the tiles' 8 KB of state only when asked (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
// Asked once: the answer holds for the process's life. The model needs no permission.
inline bool amx_permitted() {
  if (tile_model_in_use) return true;
#if defined(INFLIGHT_HAVE_AMX_HARDWARE)
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
#else
  return false;
#endif
}

// body(Tiles{}) with the tiles this process runs: the model where chosen, else the hardware.
// Only called where tiles_built().
template <class Body>
decltype(auto) with_tiles(Body&& body) {
#if defined(INFLIGHT_HAVE_AMX_HARDWARE)
  if (!tile_model_in_use) return body(HardwareTiles{});
#endif
  return body(TileModel{});
}

}  // namespace inflight_cpu
