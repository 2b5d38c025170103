// A Llama-family decoder layer in one call from Python: the same kernels, in the same order, as
// backend/models/llama.py's modules call them one by one (RMSNorm with the residual add, the
// fused q|k|v projection, RoPE with the KV store, paged attention, the output projection, the
// second RMSNorm, the fused gate|up projection, SiLU-and-mul, the down projection), and with
// LoRA adapters each projection's per-segment deltas as kernels/lora.py's CPU path adds them, so
// the two give the same bits. What it saves is the Python between them: nn.Module calls, the
// kernel wrappers' checks and no-op conversions, ~120 us a layer on a 2-core AVX512-BF16 EPYC
// (SmolLM2-135M: 3.6 ms of a 13 ms decode step at batch 1, 5 ms of a 44 ms step at batch 32),
// and with 4 adapters in a step the ~1,300 small GEMM calls' Python (W1 with 4 rank-8 adapters
// and base went from 0.65x to 0.86x the all-base output tokens/s, float32).

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

// After the headers: only this file's functions. The experts' outputs are scaled, rounded and
// summed as ATen's mul and index_add_ do, never fused into one rounding.
#pragma GCC optimize("fp-contract=off")

namespace {

at::Tensor project(const Projection& p, const at::Tensor& x) {
  if (p.bits != 0) {  // int8/int4 weights: bf16 as it is on vdpbf16ps, the tiles and the bf16 dots; else float32
    // A call of a few rows runs the path beside (linear()'s rule): the bf16 dots as they are, the
    // float32 vector path widened as an upcast weight is.
    const int64_t isa = p.isa_for(x.size(0));
    const bool widen = isa < kQuantFirstBf16Isa;
    // The bias in the dtype of the path's input (kept in the main path's).
    const auto dtype = widen ? at::kFloat : x.scalar_type();
    const std::optional<at::Tensor> bias = p.bias.has_value() ? std::optional(p.bias->to(dtype)) : p.bias;
    if (!widen) return quant_panel_gemm(x, p.panels, p.scales, p.mins, bias, p.n, p.bits, p.group_size, isa);
    return quant_panel_gemm(x.to(at::kFloat), p.panels, p.scales, p.mins, bias, p.n, p.bits, p.group_size, isa)
        .to(x.scalar_type());
  }
  // A bf16 weight's call of a few rows on vdpbf16ps beside the tiles (linear()'s rule).
  const int64_t isa = p.isa_for(x.size(0));
  if (!p.upcast) return panel_gemm(x, p.panels, p.bias, p.n, isa);
  // A bfloat16 weight packed as its float32 upcast (kernels/linear.py): widen the input, round
  // the output once.
  return panel_gemm(x.to(at::kFloat), p.panels, p.bias, p.n, isa).to(x.scalar_type());
}

// The projection, plus each LoRA segment's delta as kernels/lora.py's lora_delta_cpu adds it:
// per segment a shrink, then per slice an expand added into its columns.
at::Tensor project(const Projection& p, const std::optional<LoraProjection>& lora, const at::Tensor& x,
                   const StepMeta& meta) {
  at::Tensor y = project(p, x);
  if (!lora.has_value()) return y;
  const int64_t rank = lora->rank;
  for (size_t g = 0; g < meta.seg_adapter.size(); ++g) {
    const int64_t start = meta.seg_indptr[g], count = meta.seg_indptr[g + 1] - start, adapter = meta.seg_adapter[g];
    if (count == 0) continue;
    const at::Tensor shrunk = project(lora->a[adapter], x.narrow(0, start, count));
    for (size_t s = 0; s < lora->slice_offsets.size(); ++s) {
      const Projection& b = lora->b[adapter][s];
      y.narrow(0, start, count)
          .narrow(1, lora->slice_offsets[s], b.n)
          .add_(project(b, shrunk.narrow(1, static_cast<int64_t>(s) * rank, rank)));
    }
  }
  return y;
}

std::vector<int64_t> to_vector(const std::optional<at::Tensor>& values) {
  if (!values.has_value()) return {};
  const at::Tensor v = values->to(at::kLong).contiguous();
  return std::vector<int64_t>(v.data_ptr<int64_t>(), v.data_ptr<int64_t>() + v.numel());
}

}  // namespace

StepMeta::StepMeta(at::Tensor positions, at::Tensor cos_sin_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                   at::Tensor seq_lens, at::Tensor cu_seqlens_q, std::optional<at::Tensor> seg_indptr,
                   std::optional<at::Tensor> seg_adapter)
    : positions(std::move(positions)),
      cos_sin_cache(std::move(cos_sin_cache)),
      slot_mapping(std::move(slot_mapping)),
      block_tables(std::move(block_tables)),
      seq_lens(std::move(seq_lens)),
      cu_seqlens_q(std::move(cu_seqlens_q)),
      seg_indptr(to_vector(seg_indptr)),
      seg_adapter(to_vector(seg_adapter)) {
  TORCH_CHECK(this->seg_adapter.empty() ? this->seg_indptr.size() <= 1
                                        : this->seg_indptr.size() == this->seg_adapter.size() + 1,
              "StepMeta: seg_indptr holds one more entry than seg_adapter");
}

DecoderLayer::DecoderLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, Projection qkv, Projection o,
                           std::optional<Projection> gate_up, std::optional<Projection> down, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double scale, std::optional<at::Tensor> q_norm,
                           std::optional<at::Tensor> k_norm, bool is_neox, int64_t lanes,
                           std::vector<std::optional<LoraProjection>> lora, int64_t window,
                           std::optional<MoeExperts> experts)
    : input_norm_(std::move(input_norm)),
      post_norm_(std::move(post_norm)),
      eps_(eps),
      qkv_(std::move(qkv)),
      o_(std::move(o)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      experts_(std::move(experts)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      scale_(scale),
      q_norm_(std::move(q_norm)),
      k_norm_(std::move(k_norm)),
      is_neox_(is_neox),
      lanes_(lanes),
      window_(window) {
  TORCH_CHECK(window >= 0, "DecoderLayer: window is 0 (off) or positive");
  TORCH_CHECK(gate_up_.has_value() == down_.has_value() && gate_up_.has_value() != experts_.has_value(),
              "DecoderLayer: an MLP of gate_up and down, or experts");
  lora_ = std::move(lora);
  lora_.resize(4);
  for (const auto& projection : lora_) {
    if (!projection.has_value()) continue;
    TORCH_CHECK(projection->a.size() == projection->b.size(), "DecoderLayer: LoRA a and b per adapter");
    for (const auto& slices : projection->b)
      TORCH_CHECK(slices.size() == projection->slice_offsets.size(), "DecoderLayer: one LoRA b per slice");
  }
  TORCH_CHECK(qkv_.n == (num_heads + 2 * num_kv_heads) * head_dim, "DecoderLayer: qkv projection of ", qkv_.n,
              " columns for ", num_heads, " + 2 x ", num_kv_heads, " heads of ", head_dim);
  TORCH_CHECK(q_norm_.has_value() == k_norm_.has_value(), "DecoderLayer: q_norm and k_norm come together");
}

std::tuple<at::Tensor, at::Tensor> DecoderLayer::forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                                         at::Tensor k_cache, at::Tensor v_cache,
                                                         const StepMeta& meta, std::optional<at::Tensor> k_scale,
                                                         std::optional<at::Tensor> v_scale) const {
  const int64_t tokens = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  at::Tensor normed, sum;
  if (residual.has_value()) {
    std::tie(normed, sum) = add_rms_norm(hidden, *residual, input_norm_, eps_);
  } else {
    sum = hidden;
    normed = rms_norm(hidden, input_norm_, eps_);
  }
  for (const int64_t adapter : meta.seg_adapter)
    for (const auto& projection : lora_)
      TORCH_CHECK(!projection.has_value() || adapter < static_cast<int64_t>(projection->a.size()),
                  "DecoderLayer: LoRA adapter ", adapter, " is not loaded");
  const at::Tensor qkv = project(qkv_, lora_[0], normed, meta);
  at::Tensor q = qkv.narrow(1, 0, q_size).reshape({tokens, num_heads_, head_dim_});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).reshape({tokens, num_kv_heads_, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({tokens, num_kv_heads_, head_dim_});
  if (q_norm_.has_value()) {
    q = rms_norm(q, *q_norm_, eps_);
    k = rms_norm(k, *k_norm_, eps_);
  }
  q = rotary_store_kv(meta.positions, q, k, v, meta.cos_sin_cache, k_cache, v_cache, meta.slot_mapping, is_neox_,
                      k_scale, v_scale);
  const at::Tensor attention = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                               meta.cu_seqlens_q, scale_, lanes_, k_scale, v_scale, window_);
  const at::Tensor o = project(o_, lora_[1], attention.reshape({tokens, q_size}), meta);
  std::tie(normed, sum) = add_rms_norm(o, sum, post_norm_, eps_);
  if (experts_.has_value()) return {experts_->forward(normed), sum};
  return {project(*down_, lora_[3], silu_and_mul(project(*gate_up_, lora_[2], normed, meta)), meta), sum};
}

MoeExperts::MoeExperts(Projection router, std::vector<Projection> gate_up, std::vector<Projection> down,
                       int64_t top_k, bool renormalize, bool float32_weights)
    : router_(std::move(router)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      top_k_(top_k),
      renormalize_(renormalize),
      float32_weights_(float32_weights) {
  TORCH_CHECK(gate_up_.size() == down_.size() && !gate_up_.empty(), "MoeExperts: one gate_up and one down per expert");
  TORCH_CHECK(top_k_ >= 1 && top_k_ <= static_cast<int64_t>(gate_up_.size()), "MoeExperts: top_k ", top_k_,
              " outside 1..", gate_up_.size());
}

at::Tensor MoeExperts::forward(at::Tensor x) const {
  const int64_t tokens = x.size(0), experts = static_cast<int64_t>(gate_up_.size());
  const at::Tensor probs = at::softmax(project(router_, x).to(at::kFloat), -1);
  auto [weights, chosen] = at::topk(probs, top_k_, -1);
  if (renormalize_) weights = weights / weights.sum(-1, true);
  if (!float32_weights_) weights = weights.to(x.scalar_type());
  // Each expert's rows in token order, as torch.where(chosen == expert) lists them (a token is
  // routed to an expert at most once, so the order changes no row's sum).
  const at::Tensor chosen_cpu = chosen.contiguous();
  const int64_t* ids = chosen_cpu.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(experts), slots(experts);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t s = 0; s < top_k_; ++s) {
      rows[ids[t * top_k_ + s]].push_back(t);
      slots[ids[t * top_k_ + s]].push_back(s);
    }
  std::vector<int64_t> active;
  int64_t largest = 0;
  for (int64_t e = 0; e < experts; ++e)
    if (!rows[e].empty()) {
      active.push_back(e);
      largest = std::max<int64_t>(largest, static_cast<int64_t>(rows[e].size()));
    }
  // Each expert's rows of x gathered, through its SwiGLU MLP (its GEMMs are the modules' calls).
  const at::Tensor xc = x.contiguous();
  const int64_t hidden = xc.size(1), row_bytes = hidden * static_cast<int64_t>(xc.element_size());
  std::vector<at::Tensor> outputs(experts);
  auto run_expert = [&](int64_t e) {
    const int64_t n = static_cast<int64_t>(rows[e].size());
    at::Tensor gathered = at::empty({n, hidden}, xc.options());
    const char* from = static_cast<const char*>(xc.data_ptr());
    char* to = static_cast<char*>(gathered.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * row_bytes, from + rows[e][i] * row_bytes, row_bytes);
    outputs[e] = project(down_[e], silu_and_mul(project(gate_up_[e], gathered))).contiguous();
  };
  // A step of many tokens routes a few rows to each of many experts: each expert's GEMMs are
  // then too small to split over the cores without the cores waiting on each other at every one,
  // so the cores take whole experts side by side, each GEMM on one core (the MoE block 1.5-1.8x
  // faster at 32-256 tokens, qwen3-moe-small bf16, 2-core AMX Xeon). With fewer experts than two
  // a core, or an expert holding more than a core's share of the rows (a prefill routed
  // unevenly), the experts run one after another, each split over the cores, so that no core is
  // left with most of the work. Either way every row's GEMMs are the same calls on the same rows,
  // and the sums below run in expert order: the same bits.
  const int64_t threads = at::get_num_threads();
  const int64_t routed = tokens * top_k_;
  if (threads > 1 && static_cast<int64_t>(active.size()) >= 2 * threads && largest * threads <= routed) {
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < static_cast<int64_t>(active.size()); ++i) {
      try {
        run_expert(active[i]);
      } catch (...) {
#pragma omp critical
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
  } else {
    for (int64_t e : active) run_expert(e);
  }
  // Each row's outputs scaled by its weight and summed in expert order, each product and each sum
  // rounded once to x's dtype: the modules' `y * weight` and index_add_, without an ATen call per
  // expert.
  at::Tensor out = at::zeros_like(xc);
  const at::Tensor routing_weights = weights.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "MoeExperts", [&] {
    using Math = at::opmath_type<scalar_t>;  // what ATen computes scalar_t's mul and add in
    scalar_t* sums = out.data_ptr<scalar_t>();
    for (int64_t e : active) {
      const scalar_t* y = outputs[e].data_ptr<scalar_t>();
      for (size_t i = 0; i < rows[e].size(); ++i) {
        const int64_t t = rows[e][i], at_slot = t * top_k_ + slots[e][i];
        const Math w = float32_weights_ ? static_cast<Math>(routing_weights.data_ptr<float>()[at_slot])
                                        : static_cast<Math>(routing_weights.data_ptr<scalar_t>()[at_slot]);
        scalar_t* sum = sums + t * hidden;
        const scalar_t* row = y + static_cast<int64_t>(i) * hidden;
        for (int64_t c = 0; c < hidden; ++c)
          sum[c] = static_cast<scalar_t>(static_cast<Math>(sum[c]) +
                                         static_cast<Math>(static_cast<scalar_t>(static_cast<Math>(row[c]) * w)));
      }
    }
  });
  return out;
}
