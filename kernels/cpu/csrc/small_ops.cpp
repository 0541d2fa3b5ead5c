// Small fused ops. RMSNorm and residual-add + RMSNorm, rounding like the reference: the normalized
// value is cast to the input dtype before the weight multiplies it (both in that dtype). RoPE. SiLU(gate) · up.
#include <sys/mman.h>
#include <cmath>
#include <cstdlib>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include "ops.h"
#include "vmath.h"

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

inline __m512 load_bf16x16(const uint16_t* p) { return Loader<kBF16>::cvt(_mm256_loadu_si256((const __m256i*)p)); }
inline float bf16_at(const uint16_t* p, int64_t k) { return (float)c10::BFloat16(p[k], c10::BFloat16::from_bits()); }

// norm_rows on bf16 rows read and written as bf16, in the same float operations (the sum of squares in
// the same order, every rounding RNE as c10::BFloat16's): bitwise its result on finite values, without the
// float32 copies of x and out. With `res` (add_rms_norm): each row is res + x rounded to bf16 first (as
// torch's bf16 add), written to `sum`, and normalized.
void norm_rows_bf16(const uint16_t* x, const uint16_t* res, const float* w, uint16_t* sum, uint16_t* out, int64_t T,
                    int64_t D, double eps) {
  const int64_t D16 = D & ~int64_t(15);
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* xr = x + r * D;
      if (res) {  // sum row = bf16(res + x), then the norm reads it
        const uint16_t* rr = res + r * D;
        uint16_t* sr = sum + r * D;
        for (int64_t k = 0; k < D16; k += 16)
          _mm256_storeu_si256((__m256i*)(sr + k), bf16x16(_mm512_add_ps(load_bf16x16(rr + k), load_bf16x16(xr + k))));
        for (int64_t k = D16; k < D; ++k) sr[k] = c10::BFloat16(bf16_at(rr, k) + bf16_at(xr, k)).x;
        xr = sr;
      }
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < D16; k += 16) {
        const __m512 v = load_bf16x16(xr + k);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      float ss = hsum(acc);
      for (int64_t k = D16; k < D; ++k) ss += bf16_at(xr, k) * bf16_at(xr, k);
      const float inv = 1.f / std::sqrt(ss / (float)D + (float)eps);
      const __m512 vi = _mm512_set1_ps(inv);
      uint16_t* o = out + r * D;
      for (int64_t k = 0; k < D16; k += 16) {
        const __m512 n = Loader<kBF16>::cvt(bf16x16(_mm512_mul_ps(load_bf16x16(xr + k), vi)));
        _mm256_storeu_si256((__m256i*)(o + k), bf16x16(_mm512_mul_ps(_mm512_loadu_ps(w + k), n)));
      }
      for (int64_t k = D16; k < D; ++k) o[k] = c10::BFloat16(w[k] * (float)c10::BFloat16(bf16_at(xr, k) * inv)).x;
    }
  });
}

// bf16 rows take the vector path (a NaN there is a bf16 value's or an operation's, whose low 16 bits are
// zero, so bf16x16's rounding keeps it a NaN)
bool bf16_rows(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 && x.is_contiguous(); }

}  // namespace

inline const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
inline uint16_t* bf16_ptr(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// The bf16-row norm of x (+ residual, written to *summed): the output
static at::Tensor norm_bf16(const at::Tensor& x, const at::Tensor* residual, at::Tensor* summed, const at::Tensor& weight,
                     double eps) {
  const int64_t D = x.size(-1), T = x.numel() / std::max<int64_t>(D, 1);
  const at::Tensor wf = weight.to(x.scalar_type()).to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(x);
  if (summed) *summed = at::empty_like(x);
  norm_rows_bf16(bf16_ptr(x), residual ? bf16_ptr(*residual) : nullptr, wf.data_ptr<float>(),
                 summed ? bf16_ptr(*summed) : nullptr, bf16_ptr(out), T, D, eps);
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (bf16_rows(x)) return norm_bf16(x, nullptr, nullptr, weight, eps);
  const int64_t D = x.size(-1), T = x.numel() / std::max<int64_t>(D, 1);
  at::Tensor wf = weight.to(x.scalar_type()).to(at::kFloat).contiguous();
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(xf);
  norm_rows(xf.data_ptr<float>(), wf.data_ptr<float>(), out.data_ptr<float>(), T, D, eps, x.scalar_type());
  return out.to(x.scalar_type());
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps) {
  if (bf16_rows(x) && bf16_rows(residual) && x.sizes() == residual.sizes()) {
    at::Tensor summed;
    at::Tensor out = norm_bf16(x, &residual, &summed, weight, eps);
    return {out, summed};
  }
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

// [..., 2I] → [..., I] = SiLU(gate) · up (the first half of the last dim is the gate), float32 inside, in
// gate_up's dtype (float32 or bfloat16, rounded to nearest even): the reference's operations, with SiLU's
// e^x from exp512 (a few float32 ulps from torch's). bf16 rows are read and written as bf16.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const auto dt = gate_up.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "silu_and_mul: float32 or bfloat16");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_and_mul: an even last dim");
  const at::Tensor x = gate_up.contiguous();
  const int64_t I = x.size(-1) / 2, T = I ? x.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  if (!T || !I) return out;
  const bool bf = dt == at::kBFloat16;
  const uint8_t* src = (const uint8_t*)x.data_ptr();
  uint8_t* dst = (uint8_t*)out.data_ptr();
  const int64_t es = bf ? 2 : 4;
  // rows per task: ≥ 16 K elements (a row of a few thousand runs with its neighbours on one thread)
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t b, int64_t e) {
    std::vector<float> g(bf ? 2 * I : 0);
    for (int64_t r = b; r < e; ++r) {
      if (!bf) {
        const float* xr = (const float*)(src + r * 2 * I * es);
        silu_mul_f32(xr, xr + I, I, (float*)(dst + r * I * es));
        continue;
      }
      const uint16_t* xr = (const uint16_t*)(src + r * 2 * I * es);
      uint16_t* o = (uint16_t*)(dst + r * I * es);
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = tail_mask16(I - i);
        const __m512 gv = Loader<kBF16>::cvt(_mm256_maskz_loadu_epi16(m, xr + i));
        const __m512 uv = Loader<kBF16>::cvt(_mm256_maskz_loadu_epi16(m, xr + I + i));
        _mm256_mask_storeu_epi16(o + i, m, bf16x16(_mm512_mul_ps(silu512(gv), uv)));
      }
    }
  });
  return out;
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
