// Python bindings of the moetune CPU kernels (AVX-512F/BW/VL/DQ).
#include <torch/csrc/utils/pybind.h>
#include "ops.h"

namespace moetune {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave);
double read_seconds(const at::Tensor& buf);
double fma_gflops(int64_t iters);
double int16_madd_gops(int64_t iters);
}  // namespace moetune

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &moetune::linear, "y[T, N] float32 = x · Wᵀ for a weight in any format");
  m.def("fused_moe", &moetune::fused_moe, "fused MoE (grouped by expert, SiLU fused), float32 [T, D]");
  m.def("rms_norm", &moetune::rms_norm);
  m.def("add_rms_norm", &moetune::add_rms_norm);
  m.def("rope", &moetune::rope, "rotary embedding, de-interleaved output, x.dtype");
  m.def("read_seconds", &moetune::read_seconds, "seconds to stream-read a float32 buffer with every thread");
  m.def("fma_gflops", &moetune::fma_gflops);
  m.def("int16_madd_gops", &moetune::int16_madd_gops);
}
