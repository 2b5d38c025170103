// The C++ CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// lanes: the vector width, 8 (AVX2) or 16 (AVX-512, where attention_lanes() says it is built);
// head sizes that are no multiple of it run the 8-lane (or the plain) loops.
at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, at::Tensor cu_seqlens_q, double scale, int64_t lanes);

int64_t attention_lanes();

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);

at::Tensor rotary_store_kv(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor value,
                           at::Tensor cos_sin_cache, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                           bool is_neox);

at::Tensor silu_and_mul(at::Tensor x);

// gemm.cpp: GEMM against a weight packed into 16-column panels, one path per instruction set
// (`isa`: 1 AVX2 float32, 2 AVX-512 float32, 3 AVX512-BF16 bfloat16; 0: none built).
int64_t gemm_isa();

at::Tensor pack_panels(at::Tensor weight, int64_t isa);

at::Tensor panel_gemm(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias, int64_t n, int64_t isa);
