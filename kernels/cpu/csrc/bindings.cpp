// Python bindings of the moetune CPU kernels (AVX-512F/BW/VL/DQ).
#include <torch/csrc/utils/pybind.h>
#include "ops.h"

namespace moetune {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave);
double read_seconds(const at::Tensor& buf);
double read_seconds_streams(const at::Tensor& buf, int64_t streams, int64_t prefetch_bytes);
double fma_gflops(int64_t iters);
double int16_madd_gops(int64_t iters);
at::Tensor huge_empty(int64_t nbytes);
std::string amx_status();
at::Tensor amx_linear_raw(const at::Tensor& x_act, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                          bool emulate, int64_t k_block, bool direct, int64_t n_group, int64_t m_block);
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, const at::Tensor& cache, const at::Tensor& rows,
                       const at::Tensor& slots, const Knobs& knobs);
at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                       int64_t kv_len, double scale, const Knobs& knobs);
double read_seconds_method(const at::Tensor& buf, int64_t streams, int64_t lines, int64_t prefetch_bytes,
                           bool nontemporal);
double vnni_int8_gops(int64_t iters);
double bf16_dot_gflops(int64_t iters);
double amx_peak_gops(int64_t iters, bool int8);
at::Tensor tile_linear_raw(const at::Tensor& x_act, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                           int64_t engine, int64_t k_block, bool direct, int64_t n_group, int64_t m_block);
void bind_runner(pybind11::module_& m);  // runner.cpp: the decode-layer runner (graph_mode=cpp)
}  // namespace moetune

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using moetune::Knobs;
  // The per-call knobs by name (kernels/cpu_knobs.py without "cpu_"); string choices as enums whose
  // member names are the choice strings. kernels/cpu checks at import that these match the
  // declarations exactly (a mismatch cannot load).
  py::enum_<moetune::Fp8Method>(m, "Fp8Method")
      .value("vector", moetune::kFp8Vector).value("lut", moetune::kFp8Lut).value("widen", moetune::kFp8Widen);
  py::enum_<moetune::Bf16Method>(m, "Bf16Method")
      .value("widen", moetune::kBf16Widen).value("split", moetune::kBf16Split)
      .value("split256", moetune::kBf16Split256).value("auto", moetune::kBf16MethodAuto);
  py::enum_<moetune::TileRows>(m, "TileRows")
      .value("adjacent", moetune::kTileAdjacent).value("spread", moetune::kTileSpread);
  py::enum_<moetune::MoeGemmExperts>(m, "MoeGemmExperts")
      .value("grouped", moetune::kMoeGrouped).value("each", moetune::kMoeEach);
  py::enum_<moetune::MicroOrder>(m, "MicroOrder")
      .value("groups", moetune::kOrderGroups).value("tiles", moetune::kOrderTiles)
      .value("tiles_next", moetune::kOrderTilesNext);
  py::enum_<moetune::PrefetchHint>(m, "PrefetchHint")
      .value("t0", moetune::kPrefetchT0).value("t1", moetune::kPrefetchT1).value("t2", moetune::kPrefetchT2)
      .value("none", moetune::kPrefetchNone);
  py::enum_<moetune::PrefillPrefetch>(m, "PrefillPrefetch")
      .value("same", moetune::kPrefillSame).value("t0", moetune::kPrefillT0).value("t1", moetune::kPrefillT1)
      .value("t2", moetune::kPrefillT2).value("none", moetune::kPrefillNone);
  py::enum_<moetune::AttnIsa>(m, "AttnIsa")
      .value("auto", moetune::kAttnIsaAuto).value("avx512", moetune::kAttnIsaAvx512)
      .value("avx512bf16", moetune::kAttnIsaDot)
      .value("amx", moetune::kAttnIsaAmx);
  py::enum_<moetune::AttnF32Form>(m, "AttnF32Form")
      .value("auto", moetune::kAttnFormAuto).value("transpose", moetune::kAttnTranspose)
      .value("lanes", moetune::kAttnLanes).value("packed", moetune::kAttnPacked);
  py::enum_<moetune::AttnPrefetch>(m, "AttnPrefetch")
      .value("t0", moetune::kAttnPrefetchT0).value("t1", moetune::kAttnPrefetchT1).value("t2", moetune::kAttnPrefetchT2)
      .value("none", moetune::kAttnPrefetchNone).value("auto", moetune::kAttnPrefetchAuto);
  py::enum_<moetune::Int4Method>(m, "Int4Method")
      .value("float", moetune::kInt4Float).value("int16", moetune::kInt4Int16).value("int8", moetune::kInt4Int8);
  py::enum_<moetune::Int8Isa>(m, "Int8Isa")
      .value("auto", moetune::kInt8IsaAuto).value("avx512", moetune::kInt8IsaAvx512).value("vnni", moetune::kInt8IsaVnni).value("maddubs", moetune::kInt8IsaMaddubs);
  py::enum_<moetune::Bf16Isa>(m, "Bf16Isa")
      .value("auto", moetune::kBf16IsaAuto).value("avx512", moetune::kBf16IsaAvx512)
      .value("avx512bf16", moetune::kBf16IsaDot);
  py::enum_<moetune::Bf16Gemm>(m, "Bf16Gemm")
      .value("auto", moetune::kBf16GemmAuto).value("unpack", moetune::kBf16GemmUnpack)
      .value("onednn", moetune::kBf16GemmOnednn).value("avx512bf16", moetune::kBf16GemmDot)
      .value("amx", moetune::kBf16GemmAmx);
  py::enum_<moetune::UnpackGemm>(m, "UnpackGemm")
      .value("auto", moetune::kUnpackGemmAuto).value("blas", moetune::kUnpackGemmBlas).value("fma", moetune::kUnpackGemmFma);
  py::enum_<moetune::Fp8Gemm>(m, "Fp8Gemm")
      .value("auto", moetune::kFp8GemmAuto).value("unpack", moetune::kFp8GemmUnpack)
      .value("onednn", moetune::kFp8GemmOnednn).value("avx512bf16", moetune::kFp8GemmDot)
      .value("amx", moetune::kFp8GemmAmx);
  py::enum_<moetune::Int8Gemm>(m, "Int8Gemm")
      .value("auto", moetune::kInt8GemmAuto).value("unpack", moetune::kInt8GemmUnpack)
      .value("vnni", moetune::kInt8GemmVnni)
      .value("maddubs", moetune::kInt8GemmMaddubs)
      .value("amx", moetune::kInt8GemmAmx);
  py::enum_<moetune::Int4Gemm>(m, "Int4Gemm")
      .value("auto", moetune::kInt4GemmAuto).value("unpack", moetune::kInt4GemmUnpack)
      .value("vnni", moetune::kInt4GemmVnni)
      .value("maddubs", moetune::kInt4GemmMaddubs).value("amx", moetune::kInt4GemmAmx);
  py::class_<Knobs>(m, "Knobs", "the per-call cpu knobs (build with kernels.cpu.make_knobs)")
      .def(py::init<>())
      .def_readwrite("micro_rows", &Knobs::micro_rows)
      .def_readwrite("micro_tokens", &Knobs::micro_tokens)
      .def_readwrite("micro_wide", &Knobs::micro_wide)
      .def_readwrite("linear_block_n", &Knobs::linear_block_n)
      .def_readwrite("moe_block_n", &Knobs::moe_block_n)
      .def_readwrite("moe_int4_tasks", &Knobs::moe_int4_tasks)
      .def_readwrite("gemm_min_tokens", &Knobs::gemm_min_tokens)
      .def_readwrite("gemm_block_n", &Knobs::gemm_block_n)
      .def_readwrite("fp8_method", &Knobs::fp8_method)
      .def_readwrite("bf16_method", &Knobs::bf16_method)
      .def_readwrite("tile_rows", &Knobs::tile_rows)
      .def_readwrite("micro_order", &Knobs::micro_order)
      .def_readwrite("int4_method", &Knobs::int4_method)
      .def_readwrite("task_chunk", &Knobs::task_chunk)
      .def_readwrite("amx_min_tokens", &Knobs::amx_min_tokens)
      .def_readwrite("amx_k_block", &Knobs::amx_k_block)
      .def_readwrite("amx_direct_max_tokens", &Knobs::amx_direct_max_tokens)
      .def_readwrite("amx_fp8_direct_max_tokens", &Knobs::amx_fp8_direct_max_tokens)
      .def_readwrite("int4_r16_amx_min_tokens", &Knobs::int4_r16_amx_min_tokens)
      .def_readwrite("amx_n_group", &Knobs::amx_n_group)
      .def_readwrite("amx_m_block", &Knobs::amx_m_block)
      .def_readwrite("dot_gemm_min_tokens", &Knobs::dot_gemm_min_tokens)
      .def_readwrite("bf16_gemm_min_tokens", &Knobs::bf16_gemm_min_tokens)
      .def_readwrite("r16_onednn_min_tokens", &Knobs::r16_onednn_min_tokens)
      .def_readwrite("r16_bf16_tokens", &Knobs::r16_bf16_tokens)
      .def_readwrite("r16_bf16_one_group", &Knobs::r16_bf16_one_group)
      .def_readwrite("r16_tile_blocks", &Knobs::r16_tile_blocks)
      .def_readwrite("moe_gemm_experts", &Knobs::moe_gemm_experts)
      .def_readwrite("prefetch_ahead", &Knobs::prefetch_ahead)
      .def_readwrite("r16_int4_prefetch_ahead", &Knobs::r16_int4_prefetch_ahead)
      .def_readwrite("k_block", &Knobs::k_block)
      .def_readwrite("prefetch_hint", &Knobs::prefetch_hint)
      .def_readwrite("prefill_prefetch_hint", &Knobs::prefill_prefetch_hint)
      .def_readwrite("prefill_prefetch_ahead", &Knobs::prefill_prefetch_ahead)
      .def_readwrite("r16_rows", &Knobs::r16_rows)
      .def_readwrite("r16_int4_rows", &Knobs::r16_int4_rows)
      .def_readwrite("r16_fp8_rows", &Knobs::r16_fp8_rows)
      .def_readwrite("r16_int8_rows", &Knobs::r16_int8_rows)
      .def_readwrite("r16_prefill_rows", &Knobs::r16_prefill_rows)
      .def_readwrite("r16_tokens", &Knobs::r16_tokens)
      .def_readwrite("r16_next_prefetch", &Knobs::r16_next_prefetch)
      .def_readwrite("int8_isa", &Knobs::int8_isa)
      .def_readwrite("bf16_isa", &Knobs::bf16_isa)
      .def_readwrite("bf16_gemm", &Knobs::bf16_gemm)
      .def_readwrite("fp8_gemm", &Knobs::fp8_gemm)
      .def_readwrite("int8_gemm", &Knobs::int8_gemm)
      .def_readwrite("int4_gemm", &Knobs::int4_gemm)
      .def_readwrite("unpack_gemm", &Knobs::unpack_gemm)
      .def_readwrite("attn_head_fold", &Knobs::attn_head_fold)
      .def_readwrite("attn_kv_splits", &Knobs::attn_kv_splits)
      .def_readwrite("attn_decode_kv_block", &Knobs::attn_decode_kv_block)
      .def_readwrite("attn_extend_q_block", &Knobs::attn_extend_q_block)
      .def_readwrite("attn_extend_kv_block", &Knobs::attn_extend_kv_block)
      .def_readwrite("attn_blas_rows", &Knobs::attn_blas_rows)
      .def_readwrite("attn_blas_kv_block", &Knobs::attn_blas_kv_block)
      .def_readwrite("attn_isa", &Knobs::attn_isa)
      .def_readwrite("attn_f32_form", &Knobs::attn_f32_form)
      .def_readwrite("attn_prefetch", &Knobs::attn_prefetch)
      .def("check", &Knobs::check, "raise when a field is unset or out of range");
  m.def("detected_features", &moetune::detected_features, "bits of the dot-product ISA cpuid reports: 1 VNNI, 2 AVX512-BF16, 4 AMX");
  m.def("usable_features", &moetune::usable_features, "detected_features() under the feature mask");
  m.def("feature_mask", &moetune::feature_mask);
  m.def("set_feature_mask", &moetune::set_feature_mask, "lower the features dispatch may use (process-wide)");
  m.def("emulated_features", &moetune::emulated_features);
  m.def("set_emulated_features", &moetune::set_emulated_features,
        "run these features' variants on their C++ models (VNNI 1, AVX512-BF16 2; process-wide)");
  m.def("last_variant", &moetune::used_variants, "the instruction variants the calling thread's last op used");
  m.def("read_seconds_method", &moetune::read_seconds_method,
        "the read as interleaved streams, lines per step, prefetch distance, non-temporal loads");
  m.def("vnni_int8_gops", &moetune::vnni_int8_gops);
  m.def("bf16_dot_gflops", &moetune::bf16_dot_gflops);
  m.def("amx_peak_gops", &moetune::amx_peak_gops);
  m.def("linear", &moetune::linear, "y[T, N] float32 = x · Wᵀ for a weight in any format");
  m.def("fused_moe", &moetune::fused_moe, "fused MoE (grouped by expert, SiLU fused), float32 [T, D]");
  m.def("silu_and_mul", &moetune::silu_and_mul, "[..., 2I] -> SiLU(gate) * up [..., I], float32 inside, in the input dtype");
  m.def("rms_norm", &moetune::rms_norm);
  m.def("add_rms_norm", &moetune::add_rms_norm);
  m.def("rope", &moetune::rope, "rotary embedding, de-interleaved output, x.dtype");
  m.def("attn_decode", &moetune::attn_decode,
        "flash decoding over a paged cache (heads folded, KV splits), optional fused cache write; float32");
  m.def("attn_extend", &moetune::attn_extend, "causal extend attention over a paged/dense K/V; float32");
  m.def("read_seconds", &moetune::read_seconds, "seconds to stream-read a float32 buffer with every thread");
  m.def("read_seconds_streams", &moetune::read_seconds_streams,
        "the same read as interleaved streams per thread with software prefetch (the kernels' pattern)");
  m.def("fma_gflops", &moetune::fma_gflops);
  m.def("int16_madd_gops", &moetune::int16_madd_gops);
  m.def("amx_status", &moetune::amx_status, "why AMX tiles cannot run here; empty when they can");
  m.def("amx_linear_raw", &moetune::amx_linear_raw,
        "x_act float32 [M, K] · w[N, K]ᵀ (bf16 or int8 bytes) on AMX tiles, or their C++ emulation; raw products; "
        "k_block: bytes of K per pass (0: all of K); direct: the weight rows read as tiles in place (no packing); "
        "n_group: 32-column blocks per task; m_block: rows per chunk (0: all)",
        py::arg("x_act"), py::arg("fmt"), py::arg("w"), py::arg("N"), py::arg("K"), py::arg("emulate"),
        py::arg("k_block") = 0, py::arg("direct") = false, py::arg("n_group") = 1, py::arg("m_block") = 0);
  m.def("tile_linear_raw", &moetune::tile_linear_raw,
        "amx_linear_raw on a tile engine: 0 AMX, 1 its model, 2 AVX-512 dot-product tiles, 3 their model",
        py::arg("x_act"), py::arg("fmt"), py::arg("w"), py::arg("N"), py::arg("K"), py::arg("engine"),
        py::arg("k_block") = 0, py::arg("direct") = false, py::arg("n_group") = 1, py::arg("m_block") = 0);
  moetune::bind_runner(m);
  m.def("huge_empty", &moetune::huge_empty, "uninitialized uint8 [nbytes], 2 MiB aligned, advised for huge pages");
}
