// What the row-wise kernels that follow torch's numerics (layer_ops.cpp, activation.cpp)
// share.
#pragma once

#include <cstdint>

namespace inflight_cpu {

// The value as the activations' dtype holds it (a no-op for float32).
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Rows at a time per task: small enough to spread a decode batch over the cores, large
// enough that a task outweighs its scheduling.
constexpr int64_t kRowsPerTask = 8;

}  // namespace inflight_cpu
