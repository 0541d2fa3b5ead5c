// Python bindings of the moetune CPU kernels (AVX-512F/BW/VL/DQ).
#include <torch/csrc/utils/pybind.h>
#include "ops.h"

namespace moetune {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
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
                          bool emulate);
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, const at::Tensor& cache, const at::Tensor& rows,
                       const at::Tensor& slots, std::vector<int64_t> knobs);
at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                       int64_t kv_len, double scale, std::vector<int64_t> knobs);
}  // namespace moetune

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &moetune::linear, "y[T, N] float32 = x · Wᵀ for a weight in any format");
  m.def("fused_moe", &moetune::fused_moe, "fused MoE (grouped by expert, SiLU fused), float32 [T, D]");
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
        "x_act float32 [M, K] · w[N, K]ᵀ (bf16 or int8 bytes) on AMX tiles, or their C++ emulation; raw products");
  m.def("huge_empty", &moetune::huge_empty, "uninitialized uint8 [nbytes], 2 MiB aligned, advised for huge pages");
}
