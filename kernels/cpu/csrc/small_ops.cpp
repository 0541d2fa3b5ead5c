// Small fused ops. RMSNorm and residual-add + RMSNorm, rounding like the reference: the normalized
// value is cast to the input dtype before the weight multiplies it (both in that dtype). RoPE.
#include <sys/mman.h>
#include <cmath>
#include <cstdlib>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include "ops.h"

namespace moetune {

namespace {

inline float round_to(float v, at::ScalarType t) {
  if (t == at::kBFloat16) return (float)c10::BFloat16(v);
  if (t == at::kHalf) return (float)c10::Half(v);
  return v;
}

// out = w · rms_normalized(x), row by row; x, out float32 [T, D], w float32 [D].
void norm_rows(const float* x, const float* w, float* out, int64_t T, int64_t D, double eps, at::ScalarType t) {
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x + r * D;
      __m512 acc = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= D; k += 16) { __m512 v = _mm512_loadu_ps(xr + k); acc = _mm512_fmadd_ps(v, v, acc); }
      float ss = hsum(acc);
      for (; k < D; ++k) ss += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(ss / (float)D + (float)eps);
      for (k = 0; k < D; ++k) out[r * D + k] = round_to(w[k] * round_to(xr[k] * inv, t), t);
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t D = x.size(-1), T = x.numel() / std::max<int64_t>(D, 1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor wf = weight.to(x.scalar_type()).to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(xf);
  norm_rows(xf.data_ptr<float>(), wf.data_ptr<float>(), out.data_ptr<float>(), T, D, eps, x.scalar_type());
  return out.to(x.scalar_type());
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps) {
  at::Tensor summed = residual.add(x);
  return {rms_norm(summed, weight, eps), summed};
}

// Rotary embedding, x [T, H, P], cos/sin [T, P/2]; pairs (x[2i], x[2i+1]) when interleave, else
// (x[i], x[i + P/2]); written de-interleaved [rotated firsts | rotated seconds], in x's dtype.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2),
              "rope: x [T, H, P], cos/sin [T, P/2]");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), cf = cos.to(at::kFloat).contiguous(),
                   sf = sin.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2), half = P / 2;
  at::Tensor out = at::empty({T, H, P}, at::kFloat);
  const float *xp = xf.data_ptr<float>(), *cp = cf.data_ptr<float>(), *sp = sf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * H, 16, [&](int64_t b, int64_t e) {
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / H;
      const float* xr = xp + th * P;
      float* o = op + th * P;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = interleave ? xr[2 * i] : xr[i], x2 = interleave ? xr[2 * i + 1] : xr[i + half];
        const float c = cp[t * half + i], s = sp[t * half + i];
        const float a = x1 * c, b2 = x2 * s, d = x2 * c, f = x1 * s;
        o[i] = a - b2;
        o[half + i] = d + f;
      }
    }
  });
  return out.to(x.scalar_type());
}

// Uninitialized uint8 storage of `nbytes`, 2 MiB aligned and advised for transparent huge pages
// (MADV_HUGEPAGE; THP "madvise" mode is the common default): weights streamed from DRAM then cost
// one TLB entry per 2 MiB instead of per 4 KiB. Where the kernel refuses the advice the memory is
// still valid, with small pages. Freed with the tensor.
at::Tensor huge_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "huge_empty: negative size");
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t size = std::max<size_t>(kHuge, (size_t(nbytes) + kHuge - 1) / kHuge * kHuge);
  void* p = std::aligned_alloc(kHuge, size);
  TORCH_CHECK(p, "huge_empty: out of memory allocating ", size, " bytes");
  madvise(p, size, MADV_HUGEPAGE);  // advice only: an error leaves ordinary pages
  return at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace moetune
