// The C++ CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <tuple>
#include <vector>

// lanes: the vector width, 8 (AVX2) or 16 (AVX-512, where attention_lanes() says it is built);
// head sizes that are no multiple of it run the 8-lane (or the plain) loops.
// k_scale/v_scale: with int8 or fp8 caches (kernels/kv_store.py's QuantizedKV), each row's float32
// scale [num_blocks, block_size, Hkv]; caches and scales may have any block stride.
// window: each token sees its last `window` positions (0: all); softcap: Gemma 2's tanh cap on
// the scores (0: none).
at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, at::Tensor cu_seqlens_q, double scale, int64_t lanes,
                           std::optional<at::Tensor> k_scale = std::nullopt,
                           std::optional<at::Tensor> v_scale = std::nullopt, int64_t window = 0,
                           double softcap = 0.0);

int64_t attention_lanes();

// huge_pages.cpp: `bytes` zeroed bytes (uint8) on transparent huge pages, for the KV pool.
at::Tensor huge_page_zeros(int64_t bytes);

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);

at::Tensor rotary_store_kv(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor value,
                           at::Tensor cos_sin_cache, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
                           bool is_neox, std::optional<at::Tensor> k_scale = std::nullopt,
                           std::optional<at::Tensor> v_scale = std::nullopt);

at::Tensor silu_and_mul(at::Tensor x);

// gemm.cpp: GEMM against a weight packed into 16-column panels, one path per instruction set
// (`isa`: 1 AVX2 float32, 2 AVX-512 float32, 3 AVX512-BF16 bfloat16, 4 AMX bfloat16; 0: none
// built). gemm_isa: the best path built; gemm_vector_isa: the best without AMX tiles;
// request_amx_permission: asks Linux for the tiles (once a process), whether it lent them
// (false where AMX is not built); use_tile_model: the tile paths (isa 4) run on a software model
// of the tile instructions from now on, in any build (amx.h; for tests, never for serving).
int64_t gemm_isa();
int64_t gemm_vector_isa();
bool request_amx_permission();
void use_tile_model();

at::Tensor pack_panels(at::Tensor weight, int64_t isa);

at::Tensor panel_gemm(at::Tensor x, at::Tensor panels, std::optional<at::Tensor> bias, int64_t n, int64_t isa);

// panel_gemm's isa 3 tiles on `rows` rows of bfloat16 x against one or two bfloat16 panels in
// pack_panels' layout (`panel_elems` apart, K = k), storing `cols` columns of out (ldo apart):
// gemm_quant.cpp runs it on panels it de-quantized. Builds without AVX512-BF16 refuse it.
void bf16_panel_rows(const c10::BFloat16* x, int64_t ldx, int64_t rows, const c10::BFloat16* panels,
                     int64_t panel_elems, int64_t num_panels, int64_t k, const float* bias, c10::BFloat16* out,
                     int64_t ldo, int64_t cols);

// gemm_quant.cpp: float32 x against int8 or int4 weights (kernels/quantized.py's q, scales, mins),
// packed once into 16-column panels (returns q panels, scales, and mins where given) and
// de-quantized in registers; the float panel GEMM's bits on the de-quantized weight. isa: 0 plain
// C++, 1 AVX2, 2 AVX-512; for bfloat16 x (and bias), 3 (AVX512-BF16) and 4 (the AMX tiles): panel_gemm's
// bits of that isa on the de-quantized weight rounded to bfloat16; 6, int4 only, for bfloat16 x:
// vdpbf16ps on integers exact in bfloat16 (int4 q as 1 + q / 16), each group's scale and min
// applied to its sums (bits of its own); 5, x float32 or bfloat16: x quantized to int8 in blocks of
// the weight's groups, on integer dot products (gemm_int8_dots.cpp, its own layout). quant_gemm_isa: the best of 0-4 built;
// quant_bf16_built: whether 3 and 6 are.
int64_t quant_gemm_isa();
bool quant_bf16_built();
constexpr int64_t kQuantBf16Dots = 6;  // quant_panel_gemm's isa of the bf16 dot products
// quant_panel_gemm's isas from this one on take x as it is; those below it, float32.
constexpr int64_t kQuantFirstBf16Isa = 3;
// quant_panel_gemm's (and pack_quant_panels') isa 5, which they hand to the two below: int8
// activations (out in x's dtype) on the best instruction set the build has (int8_dots_path:
// "avx512_vnni", "avx2" or "plain").
constexpr int64_t kQuantInt8Dots = 5;
const char* int8_dots_path();
std::vector<at::Tensor> pack_int8_dot_panels(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                                             int64_t bits, int64_t group_size);
at::Tensor int8_dot_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                         std::optional<at::Tensor> bias, int64_t n, int64_t bits, int64_t group_size);

std::vector<at::Tensor> pack_quant_panels(at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                                          int64_t bits, int64_t group_size, int64_t isa);

at::Tensor quant_panel_gemm(at::Tensor x, at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins,
                            std::optional<at::Tensor> bias, int64_t n, int64_t bits, int64_t group_size, int64_t isa);

// threads.cpp: the CPUs each thread of the calling thread's OpenMP team may run on, and
// pinning that team's thread i to cpus[i] (as many CPUs as at::get_num_threads()); the team's
// thread ids, the caller's first.
std::vector<std::vector<int64_t>> openmp_team_cpus();

std::vector<int64_t> bind_openmp_team(std::vector<int64_t> cpus);

// decoder_layer.cpp: a Llama-family decoder layer in one call, the kernels above in the order
// backend/models/llama.py's modules call them.
struct Projection {
  at::Tensor panels;               // pack_panels' layout, or pack_quant_panels' q panels
  std::optional<at::Tensor> bias;  // in the dtype the GEMM computes in
  int64_t n;                       // output columns
  int64_t isa;
  bool upcast;  // a float32 GEMM on bfloat16 activations: the input is widened, the output rounded
                // (never on the tiles, which take bfloat16)
  // A quantized weight (quant_panel_gemm): bits 4 or 8, with its packed scales and mins; 0: float.
  int64_t bits = 0, group_size = 0;
  at::Tensor scales;
  std::optional<at::Tensor> mins;
  // Outside the batch-invariant mode (kernels/linear.py's PackedWeight), inputs of at most
  // vector_rows rows run the path vector_isa instead: a bf16 weight's vdpbf16ps beside the tiles; a
  // quantized weight's float32 vector path (input widened) or its bf16 dot products (input as it
  // is).
  int64_t vector_rows = 0, vector_isa = 0;
  // The path a call of `rows` rows takes (kernels/linear.py's PackedWeight.isa_for).
  int64_t isa_for(int64_t rows) const { return rows > 0 && rows <= vector_rows ? vector_isa : isa; }
};

// Every loaded LoRA adapter's weights for one projection (kernels/lora.py's layout): per
// adapter, the down-projection of every slice ([S * rank, K]) and each slice's up-projection
// ([n_s, rank], scaling folded in); slice s of the output starts at slice_offsets[s].
struct LoraProjection {
  std::vector<Projection> a;
  std::vector<std::vector<Projection>> b;
  std::vector<int64_t> slice_offsets;
  int64_t rank;
};

// What every layer of a step shares; the LoRA segments (kernels/lora.py's seg_indptr and
// seg_adapter) are empty in a step without adapters.
struct StepMeta {
  StepMeta(at::Tensor positions, at::Tensor cos_sin_cache, at::Tensor slot_mapping, at::Tensor block_tables,
           at::Tensor seq_lens, at::Tensor cu_seqlens_q, std::optional<at::Tensor> seg_indptr,
           std::optional<at::Tensor> seg_adapter);
  at::Tensor positions, cos_sin_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q;
  std::vector<int64_t> seg_indptr, seg_adapter;
};

// A mixture-of-experts MLP in one call (backend/models/llama.py's SparseMoeBlock: the same panel
// GEMM calls and the same roundings, so the same bits): the router's float32 softmax and top-k,
// optionally renormalised, the weights rounded to x's dtype unless `float32_weights`; then per
// expert one GEMM over the rows routed to it, SiLU-and-mul, the down GEMM; each row's outputs
// scaled by its weights and added into its sum in ascending expert order.
class MoeExperts {
 public:
  MoeExperts(Projection router, std::vector<Projection> gate_up, std::vector<Projection> down, int64_t top_k,
             bool renormalize, bool float32_weights);
  at::Tensor forward(at::Tensor x) const;

 private:
  Projection router_;
  std::vector<Projection> gate_up_, down_;
  int64_t top_k_;
  bool renormalize_, float32_weights_;
};

class DecoderLayer {
 public:
  // The MLP is either gate_up and down (SwiGLU) or routed `experts`.
  DecoderLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, Projection qkv, Projection o,
               std::optional<Projection> gate_up, std::optional<Projection> down, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale, std::optional<at::Tensor> q_norm,
               std::optional<at::Tensor> k_norm, bool is_neox, int64_t lanes,
               std::vector<std::optional<LoraProjection>> lora, int64_t window = 0,
               std::optional<MoeExperts> experts = std::nullopt);
  // (hidden, residual) after the layer; residual absent on the first layer.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             at::Tensor k_cache, at::Tensor v_cache, const StepMeta& meta,
                                             std::optional<at::Tensor> k_scale = std::nullopt,
                                             std::optional<at::Tensor> v_scale = std::nullopt) const;

 private:
  at::Tensor input_norm_, post_norm_;
  double eps_;
  Projection qkv_, o_;
  std::optional<Projection> gate_up_, down_;
  std::optional<MoeExperts> experts_;
  std::vector<std::optional<LoraProjection>> lora_;  // per projection: qkv, o, gate_up, down
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::optional<at::Tensor> q_norm_, k_norm_;
  bool is_neox_;
  int64_t lanes_;
  int64_t window_;  // sliding window: each token sees its last `window_` positions (0: all)
};

// sampling.cpp: out = x's running sums along each row, torch.cumsum's bits (x and out
// [rows, n] float32, contiguous).
at::Tensor cumsum_rows(at::Tensor x, at::Tensor out);

// sampling.cpp: zeroes, in place, the probabilities outside each row's top-p nucleus (the
// tokens whose larger probabilities sum to at least top_p[row], float64; rows with top_p 1
// are left alone).
at::Tensor keep_nucleus_(at::Tensor probs, at::Tensor top_p);
