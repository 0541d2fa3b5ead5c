// Vector math shared by the kernels: e^x on x ≤ 0, SiLU, SiLU(gate) · up.
#pragma once
#include "common.h"

namespace moetune {

// e^x for float32 lanes, x ≤ 0 (attention: scores minus the running max; silu512: −|g|): 2^n · p(r), r = x − n·ln2,
// degree-6 polynomial; relative error ≈ 2e-7. Below −87 the result is ~1e-38, not 0 (masked lanes
// are zeroed by the caller).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// SiLU(g) = g · σ(g), σ from e = e^(−|g|) ≤ 1 (no overflow): 1 / (1 + e) for g ≥ 0, e / (1 + e) below; within
// a few float32 ulps of g / (1 + e^(−g)) (exp512's error), ±0 at ±0.
inline __m512 silu512(__m512 g) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
  const __m512 e = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
  const __m512 num = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_castps_si512(one), neg, _mm512_castps_si512(e)));
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}

// out[i] = SiLU(g[i]) · u[i] for n float32 values (16 lanes at a time, the tail masked).
inline void silu_mul_f32(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu512(gv), uv));
  }
}

}  // namespace moetune
