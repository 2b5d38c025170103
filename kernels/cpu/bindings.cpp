#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "ops.h"

// The kernels run without the GIL, as torch's own ops do: in the Triton stub the response
// thread builds and sends responses (Python) while the engine thread computes, instead of
// waiting for each kernel to return (through tritonserver at concurrency 32 the engine lost
// a quarter of its in-process throughput while it held the GIL through every kernel).
const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, kNoGil, pybind11::arg("query"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("cu_seqlens_q"), pybind11::arg("scale"), pybind11::arg("lanes"),
        pybind11::arg("k_scale") = std::nullopt, pybind11::arg("v_scale") = std::nullopt,
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0,
        "Paged attention over a ragged batch of decodes and prefill chunks");
  m.def("attention_lanes", &attention_lanes, "The widest vectors paged_attention is built for here (8 or 16)");
  m.def("huge_page_zeros", &huge_page_zeros, kNoGil, pybind11::arg("bytes"),
        "`bytes` zeroed bytes (uint8) on transparent huge pages, for the KV pool and the packed weights");
  m.def("rms_norm", &rms_norm, kNoGil, "RMSNorm, HF's roundings");
  m.def("add_rms_norm", &add_rms_norm, kNoGil, "RMSNorm of x + residual; returns (normed, x + residual)");
  m.def("silu_and_mul", &silu_and_mul, kNoGil, "silu(gate) * up of a gated MLP");
  m.def("gemm_isa", &gemm_isa, "The best instruction set panel_gemm is built with here (0: none)");
  m.def("gemm_vector_isa", &gemm_vector_isa, "The best instruction set panel_gemm is built with here, AMX aside");
  m.def("request_amx_permission", &request_amx_permission,
        "Ask Linux for the AMX tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM); whether it was lent");
  m.def("use_tile_model", &use_tile_model,
        "From now on the AMX paths run on a software model of the tile instructions, on any CPU (tests only)");
  m.def("pack_panels", &pack_panels, kNoGil, "A weight [N, K] as 16-column panels for panel_gemm's instruction set isa");
  m.def("panel_gemm", &panel_gemm, kNoGil, "x [M, K] times the packed weight's transpose, plus an optional bias");
  m.def("quant_gemm_isa", &quant_gemm_isa, "The best instruction set quant_panel_gemm is built with here (0: plain C++)");
  m.def("quant_bf16_built", &quant_bf16_built,
        "Whether quant_panel_gemm has its vdpbf16ps paths here (bfloat16 activations: isa 3, the de-quantized "
        "weight, and 6, the bf16 dots)");
  m.def("int8_dots_path", &int8_dots_path,
        "The instruction set quant_panel_gemm's int8 activations (isa 5) run on here: avx512_vnni, avx2 or plain");
  m.def("pack_quant_panels", &pack_quant_panels, kNoGil, pybind11::arg("q"), pybind11::arg("scales"),
        pybind11::arg("mins"), pybind11::arg("bits"), pybind11::arg("group_size"), pybind11::arg("isa"),
        "int8/int4 weights [N, K] with their group scales and mins as 16-column panels: [q, scales(, mins)]");
  m.def("quant_panel_gemm", &quant_panel_gemm, kNoGil, pybind11::arg("x"), pybind11::arg("q"),
        pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::arg("bits"), pybind11::arg("group_size"), pybind11::arg("isa"),
        "x [M, K] (float32; bfloat16 on the tiles) times the packed quantized weight's transpose, plus an optional bias");
  m.def("openmp_team_cpus", &openmp_team_cpus, "The CPUs each thread of the calling thread's OpenMP team may run on");
  m.def("bind_openmp_team", &bind_openmp_team, "Pin thread i of the calling thread's OpenMP team to cpus[i]; the team's thread ids");
  m.def("cumsum_rows", &cumsum_rows, kNoGil, "Running sums along each float32 row into out, torch.cumsum's bits");
  m.def("keep_nucleus_", &keep_nucleus_, kNoGil, "Zero, in place, each row's probabilities outside its top-p nucleus");
  m.def("rotary_store_kv", &rotary_store_kv, kNoGil, pybind11::arg("positions"), pybind11::arg("query"),
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("cos_sin_cache"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("slot_mapping"), pybind11::arg("is_neox"),
        pybind11::arg("k_scale") = std::nullopt, pybind11::arg("v_scale") = std::nullopt,
        "RoPE on query and key, key and value into the paged cache (int8 and fp8 caches: quantized, with scales)");
  pybind11::class_<Projection>(m, "Projection", "A projection's packed weight, for DecoderLayer")
      .def(pybind11::init([](at::Tensor panels, std::optional<at::Tensor> bias, int64_t n, int64_t isa, bool upcast,
                             int64_t vector_rows, int64_t vector_isa) {
             Projection p{panels, bias, n, isa, upcast};
             p.vector_rows = vector_rows, p.vector_isa = vector_isa;
             return p;
           }),
           pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("isa"),
           pybind11::arg("upcast"), pybind11::arg("vector_rows") = 0, pybind11::arg("vector_isa") = 0)
      .def_readonly("vector_rows", &Projection::vector_rows)
      .def_readonly("vector_isa", &Projection::vector_isa)
      .def_static(
          "quantized",
          [](at::Tensor q, at::Tensor scales, std::optional<at::Tensor> mins, int64_t bits, int64_t group_size,
             std::optional<at::Tensor> bias, int64_t n, int64_t isa, bool upcast, int64_t vector_rows,
             int64_t vector_isa) {
            TORCH_CHECK(bits == 4 || bits == 8, "Projection.quantized: bits must be 4 or 8, not ", bits);
            Projection p{q, bias, n, isa, upcast};
            p.bits = bits, p.group_size = group_size, p.scales = scales, p.mins = mins;
            p.vector_rows = vector_rows, p.vector_isa = vector_isa;
            return p;
          },
          pybind11::arg("q"), pybind11::arg("scales"), pybind11::arg("mins"), pybind11::arg("bits"),
          pybind11::arg("group_size"), pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("isa"),
          pybind11::arg("upcast"), pybind11::arg("vector_rows") = 0, pybind11::arg("vector_isa") = 0,
          "A quantized weight's packed panels (pack_quant_panels), for DecoderLayer");
  pybind11::class_<LoraProjection>(m, "LoraProjection", "Every LoRA adapter's weights for one projection")
      .def(pybind11::init<std::vector<Projection>, std::vector<std::vector<Projection>>, std::vector<int64_t>,
                          int64_t>(),
           pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("slice_offsets"), pybind11::arg("rank"));
  pybind11::class_<StepMeta>(m, "StepMeta", "What every layer of a step shares, for DecoderLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          std::optional<at::Tensor>, std::optional<at::Tensor>>(),
           pybind11::arg("positions"), pybind11::arg("cos_sin_cache"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("cu_seqlens_q"),
           pybind11::arg("seg_indptr"), pybind11::arg("seg_adapter"));
  pybind11::class_<DecoderLayer>(m, "DecoderLayer", "A Llama-family decoder layer in one call")
      .def(pybind11::init<at::Tensor, at::Tensor, double, Projection, Projection, std::optional<Projection>,
                          std::optional<Projection>, int64_t, int64_t, int64_t, double, std::optional<at::Tensor>,
                          std::optional<at::Tensor>, bool, int64_t, std::vector<std::optional<LoraProjection>>, int64_t,
                          std::optional<MoeExperts>>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("eps"), pybind11::arg("qkv"),
           pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"), pybind11::arg("q_norm"),
           pybind11::arg("k_norm"), pybind11::arg("is_neox"), pybind11::arg("lanes"), pybind11::arg("lora"),
           pybind11::arg("window") = 0, pybind11::arg("experts") = std::nullopt)
      .def("forward", &DecoderLayer::forward, kNoGil, pybind11::arg("hidden"), pybind11::arg("residual"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("meta"),
           pybind11::arg("k_scale") = std::nullopt, pybind11::arg("v_scale") = std::nullopt);
  pybind11::class_<MoeExperts>(m, "MoeExperts", "A mixture-of-experts MLP in one call")
      .def(pybind11::init<Projection, std::vector<Projection>, std::vector<Projection>, int64_t, bool, bool>(),
           pybind11::arg("router"), pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("top_k"),
           pybind11::arg("renormalize"), pybind11::arg("float32_weights"))
      .def("forward", &MoeExperts::forward, kNoGil);
}
