// The AVX-512 instructions the kernels use, modelled on AVX2 + FMA + F16C: the C++ model of AVX-512
// that the extension's AVX2 build (kernels/cpu_build.py, build "avx2") is compiled against, so that
// the same kernel source runs on a CPU without AVX-512 (AMD Zen 2/3, Intel client cores) and the
// AVX-512 kernel logic is tested on every machine, as amx.cpp's tile model and dot.h's VNNI / BF16
// models do for those instructions.
//
// Force-included (-include) before every source file of the AVX2 build only: after <immintrin.h>,
// each 512-bit type and each intrinsic the sources name is redirected by a macro to its model here.
// A 512-bit register is a pair of 256-bit halves (lo = elements [0, n/2), hi = the rest); every
// model gives the instruction's result exactly, in the instruction's own order of operations where
// it rounds (reductions follow GCC's _mm512_reduce_* trees, FMAs stay fused, -ffp-contract=off
// keeps the rest). Masked loads never touch a masked-off element (a tail at the end of a mapping
// must not fault); their partial forms copy the selected elements through a small buffer.
// Limits, checked where they apply: _mm512_scalef_ps takes finite exponents (the callers pass
// rounded integers); nothing here models AVX-512's embedded rounding or exception suppression
// beyond what the AVX2 forms do.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace moetune_avx2 {

#define MT_A static inline __attribute__((always_inline))

struct m512 { __m256 lo, hi; };
struct m512i { __m256i lo, hi; };
struct m512d { __m256d lo, hi; };

// ---- masks: k bits → a vector of all-ones / all-zeros 32-bit lanes, and back
MT_A __m256i lanes32(unsigned k8) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(k8 & 0xFF)), sel), sel);
}
MT_A unsigned bits32(__m256i v) { return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(v)); }

// n elements of esz bytes at p, those whose bit is set in k, into the zeroed buffer buf
MT_A void masked_copy_in(uint8_t* buf, const void* p, uint64_t k, int n, int esz) {
  const uint8_t* s = static_cast<const uint8_t*>(p);
  if ((k & (k + 1)) == 0) {  // a low run of ones (a tail): one copy
    std::memcpy(buf, s, (size_t)__builtin_popcountll(k) * esz);
    return;
  }
  for (int i = 0; i < n; ++i)
    if ((k >> i) & 1) std::memcpy(buf + i * esz, s + i * esz, esz);
}
MT_A void masked_copy_out(void* p, const uint8_t* buf, uint64_t k, int n, int esz) {
  uint8_t* d = static_cast<uint8_t*>(p);
  if ((k & (k + 1)) == 0) {
    std::memcpy(d, buf, (size_t)__builtin_popcountll(k) * esz);
    return;
  }
  for (int i = 0; i < n; ++i)
    if ((k >> i) & 1) std::memcpy(d + i * esz, buf + i * esz, esz);
}
MT_A uint64_t full_mask(int n) { return n >= 64 ? ~0ull : ((1ull << n) - 1); }

// ---- set, load, store
MT_A m512 mm512_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
MT_A m512i mm512_setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
MT_A m512 mm512_set1_ps(float a) { const __m256 v = _mm256_set1_ps(a); return {v, v}; }
MT_A m512i mm512_set1_epi32(int a) { const __m256i v = _mm256_set1_epi32(a); return {v, v}; }
MT_A m512i mm512_set1_epi16(short a) { const __m256i v = _mm256_set1_epi16(a); return {v, v}; }
MT_A m512i mm512_set1_epi64(long long a) { const __m256i v = _mm256_set1_epi64x(a); return {v, v}; }
MT_A m512i mm512_set1_epi8(char a) { const __m256i v = _mm256_set1_epi8(a); return {v, v}; }
MT_A m512i mm512_set_epi16(short e31, short e30, short e29, short e28, short e27, short e26, short e25, short e24,
                           short e23, short e22, short e21, short e20, short e19, short e18, short e17, short e16,
                           short e15, short e14, short e13, short e12, short e11, short e10, short e9, short e8,
                           short e7, short e6, short e5, short e4, short e3, short e2, short e1, short e0) {
  return {_mm256_set_epi16(e15, e14, e13, e12, e11, e10, e9, e8, e7, e6, e5, e4, e3, e2, e1, e0),
          _mm256_set_epi16(e31, e30, e29, e28, e27, e26, e25, e24, e23, e22, e21, e20, e19, e18, e17, e16)};
}

MT_A m512 mm512_loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
MT_A m512 mm512_load_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_load_ps(f), _mm256_load_ps(f + 8)};
}
MT_A void mm512_storeu_ps(void* p, m512 a) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, a.lo), _mm256_storeu_ps(f + 8, a.hi);
}
MT_A void mm512_store_ps(void* p, m512 a) {
  float* f = static_cast<float*>(p);
  _mm256_store_ps(f, a.lo), _mm256_store_ps(f + 8, a.hi);
}
MT_A m512i mm512_loadu_si512(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
MT_A m512i mm512_load_si512(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_load_si256(v), _mm256_load_si256(v + 1)};
}
MT_A m512i mm512_stream_load_si512(const void* p) {  // vmovntdqa: 256-bit form twice
  __m256i* v = const_cast<__m256i*>(static_cast<const __m256i*>(p));
  return {_mm256_stream_load_si256(v), _mm256_stream_load_si256(v + 1)};
}
MT_A void mm512_storeu_si512(void* p, m512i a) {
  __m256i* v = static_cast<__m256i*>(p);
  _mm256_storeu_si256(v, a.lo), _mm256_storeu_si256(v + 1, a.hi);
}
MT_A void mm512_store_si512(void* p, m512i a) {
  __m256i* v = static_cast<__m256i*>(p);
  _mm256_store_si256(v, a.lo), _mm256_store_si256(v + 1, a.hi);
}

// masked 32-bit loads and stores: vmaskmovps / vpmaskmovd (fault-free on masked-off lanes)
MT_A m512 mm512_maskz_loadu_ps(__mmask16 k, const void* p) {
  const float* f = static_cast<const float*>(p);
  if (k == 0xFFFF) return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  return {_mm256_maskload_ps(f, lanes32(k)), _mm256_maskload_ps(f + 8, lanes32(k >> 8))};
}
MT_A m512 mm512_mask_loadu_ps(m512 src, __mmask16 k, const void* p) {
  const m512 v = mm512_maskz_loadu_ps(k, p);
  return {_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(lanes32(k))),
          _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(lanes32(k >> 8)))};
}
MT_A void mm512_mask_storeu_ps(void* p, __mmask16 k, m512 a) {
  float* f = static_cast<float*>(p);
  if (k == 0xFFFF) { _mm256_storeu_ps(f, a.lo), _mm256_storeu_ps(f + 8, a.hi); return; }
  _mm256_maskstore_ps(f, lanes32(k), a.lo);
  _mm256_maskstore_ps(f + 8, lanes32(k >> 8), a.hi);
}
MT_A m512i mm512_maskz_loadu_epi32(__mmask16 k, const void* p) {
  const int* q = static_cast<const int*>(p);
  if (k == 0xFFFF) return mm512_loadu_si512(p);
  return {_mm256_maskload_epi32(q, lanes32(k)), _mm256_maskload_epi32(q + 8, lanes32(k >> 8))};
}
// byte and word granules: whole loads when every element is selected, else through a buffer
MT_A m512i mm512_maskz_loadu_epi8(__mmask64 k, const void* p) {
  if (k == ~0ull) return mm512_loadu_si512(p);
  alignas(32) uint8_t b[64] = {};
  masked_copy_in(b, p, k, 64, 1);
  return mm512_load_si512(b);
}
MT_A m512i mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  if (k == 0xFFFFFFFFu) return mm512_loadu_si512(p);
  alignas(32) uint8_t b[64] = {};
  masked_copy_in(b, p, k, 32, 2);
  return mm512_load_si512(b);
}
MT_A __m256i mm256_maskz_loadu_epi8(__mmask32 k, const void* p) {
  if (k == 0xFFFFFFFFu) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint8_t b[32] = {};
  masked_copy_in(b, p, k, 32, 1);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
MT_A __m256i mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
  if (k == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint8_t b[32] = {};
  masked_copy_in(b, p, k, 16, 2);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
MT_A __m128i mm_maskz_loadu_epi8(__mmask16 k, const void* p) {
  if (k == 0xFFFF) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  alignas(16) uint8_t b[16] = {};
  masked_copy_in(b, p, k, 16, 1);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
}
MT_A void mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  if (k == 0xFFFF) { _mm256_storeu_si256(static_cast<__m256i*>(p), a); return; }
  alignas(32) uint8_t b[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(b), a);
  masked_copy_out(p, b, k, 16, 2);
}

// ---- float arithmetic
MT_A m512 mm512_add_ps(m512 a, m512 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
MT_A m512 mm512_sub_ps(m512 a, m512 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
MT_A m512 mm512_mul_ps(m512 a, m512 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
MT_A m512 mm512_div_ps(m512 a, m512 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
MT_A m512 mm512_max_ps(m512 a, m512 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
MT_A m512 mm512_min_ps(m512 a, m512 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
MT_A m512 mm512_fmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
MT_A m512 mm512_fnmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
MT_A m512 mm512_abs_ps(m512 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
// vrndscaleps: round(x · 2^M) · 2^-M, M = imm[7:4]; imm[3:0] as vroundps's (mode, MXCSR, no-exception)
MT_A m512 mm512_roundscale_ps(m512 a, const int imm) {
  if ((imm >> 4) == 0) return {_mm256_round_ps(a.lo, imm & 0xF), _mm256_round_ps(a.hi, imm & 0xF)};
  const __m256 up = _mm256_set1_ps((float)(1 << (imm >> 4))), down = _mm256_set1_ps(1.f / (float)(1 << (imm >> 4)));
  return {_mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a.lo, up), imm & 0xF), down),
          _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a.hi, up), imm & 0xF), down)};
}
// vscalefps for finite b: a · 2^floor(b), applied as two exact powers of two (each in the normal
// range), so the product rounds once unless the result is denormal
MT_A __m256 scalef8(__m256 a, __m256 b) {
  __m256i n = _mm256_cvtps_epi32(_mm256_floor_ps(_mm256_max_ps(_mm256_min_ps(b, _mm256_set1_ps(300.f)),
                                                                _mm256_set1_ps(-300.f))));
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  const __m256 inrange = _mm256_cmp_ps(_mm256_set1_ps(-253.f), _mm256_floor_ps(b), _CMP_LE_OQ);
  const __m256 big = _mm256_cmp_ps(_mm256_floor_ps(b), _mm256_set1_ps(254.f), _CMP_GT_OQ);
  __m256 r = _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
  r = _mm256_and_ps(r, inrange);  // 2^-253 and below: every float32 scales to ±0
  const __m256 inf = _mm256_or_ps(_mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u))),
                                  _mm256_set1_ps(__builtin_inff()));
  const __m256 zero = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ);
  return _mm256_blendv_ps(r, _mm256_blendv_ps(inf, a, zero), big);
}
MT_A m512 mm512_scalef_ps(m512 a, m512 b) { return {scalef8(a.lo, b.lo), scalef8(a.hi, b.hi)}; }

MT_A m512 mm512_cvtepi32_ps(m512i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
MT_A m512i mm512_cvtps_epi32(m512 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
MT_A m512 mm512_castsi512_ps(m512i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
MT_A m512i mm512_castps_si512(m512 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
MT_A m512d mm512_castps_pd(m512 a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
MT_A m512 mm512_castpd_ps(m512d a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
MT_A m512i mm512_castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }  // upper half: undefined there, zero here

// per-128-bit-lane shuffles: the halves hold lanes (0, 1) and (2, 3), so each half is its own AVX2 op
MT_A m512 mm512_unpacklo_ps(m512 a, m512 b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
MT_A m512 mm512_unpackhi_ps(m512 a, m512 b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
MT_A m512d mm512_unpacklo_pd(m512d a, m512d b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
MT_A m512d mm512_unpackhi_pd(m512d a, m512d b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
#define MT_I2(op, name)                                                             \
  MT_A m512i mm512_##name(m512i a, m512i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
MT_I2(_mm256_unpacklo_epi8, unpacklo_epi8)
MT_I2(_mm256_unpackhi_epi8, unpackhi_epi8)
MT_I2(_mm256_unpacklo_epi32, unpacklo_epi32)
MT_I2(_mm256_unpackhi_epi32, unpackhi_epi32)
MT_I2(_mm256_unpacklo_epi64, unpacklo_epi64)
MT_I2(_mm256_unpackhi_epi64, unpackhi_epi64)
MT_I2(_mm256_and_si256, and_si512)
MT_I2(_mm256_or_si256, or_si512)
MT_I2(_mm256_xor_si256, xor_si512)
MT_I2(_mm256_add_epi32, add_epi32)
MT_I2(_mm256_sub_epi32, sub_epi32)
MT_I2(_mm256_add_epi16, add_epi16)
MT_I2(_mm256_madd_epi16, madd_epi16)
MT_I2(_mm256_maddubs_epi16, maddubs_epi16)
#undef MT_I2
MT_A m512i mm512_slli_epi32(m512i a, const unsigned n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
MT_A m512i mm512_srli_epi32(m512i a, const unsigned n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
MT_A m512i mm512_slli_epi16(m512i a, const unsigned n) { return {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
MT_A m512i mm512_srli_epi16(m512i a, const unsigned n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
MT_A m512i mm512_srai_epi16(m512i a, const unsigned n) { return {_mm256_srai_epi16(a.lo, n), _mm256_srai_epi16(a.hi, n)}; }
MT_A m512i mm512_srai_epi32(m512i a, const unsigned n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }

// vshuff32x4 / vshufi32x4: result lanes 0, 1 from a's lanes imm[1:0], imm[3:2]; lanes 2, 3 from b's
// imm[5:4], imm[7:6]. A lane index 0..3 over (lo, hi) is vperm2f128's selector over (x = lo, y = hi).
MT_A m512 mm512_shuffle_f32x4(m512 a, m512 b, const int imm) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, (imm & 3) | (((imm >> 2) & 3) << 4)),
          _mm256_permute2f128_ps(b.lo, b.hi, ((imm >> 4) & 3) | (((imm >> 6) & 3) << 4))};
}
// vshufps: per 128-bit lane, a's elements imm[1:0], imm[3:2] then b's imm[5:4], imm[7:6] (vshufps ymm per half)
MT_A m512 mm512_shuffle_ps(m512 a, m512 b, const int imm) {
  return {_mm256_shuffle_ps(a.lo, b.lo, imm), _mm256_shuffle_ps(a.hi, b.hi, imm)};
}
MT_A m512i mm512_shuffle_i32x4(m512i a, m512i b, const int imm) {
  return {_mm256_permute2x128_si256(a.lo, a.hi, (imm & 3) | (((imm >> 2) & 3) << 4)),
          _mm256_permute2x128_si256(b.lo, b.hi, ((imm >> 4) & 3) | (((imm >> 6) & 3) << 4))};
}
// vpermt2w: result word i = (idx[i] bit 5 ? b : a)[idx[i] & 31]
MT_A m512i mm512_permutex2var_epi16(m512i a, m512i idx, m512i b) {
  alignas(32) uint16_t t[64], ix[32], r[32];
  mm512_store_si512(t, a), mm512_store_si512(t + 32, b), mm512_store_si512(ix, idx);
  for (int i = 0; i < 32; ++i) r[i] = t[ix[i] & 63];
  return mm512_load_si512(r);
}
// vpermw: result element i = a[idx[i] & 31]
MT_A m512i mm512_permutexvar_epi16(m512i idx, m512i a) {
  alignas(32) uint16_t t[32], ix[32], r[32];
  mm512_store_si512(t, a), mm512_store_si512(ix, idx);
  for (int i = 0; i < 32; ++i) r[i] = t[ix[i] & 31];
  return mm512_load_si512(r);
}
// vptestmw: bit i set where a[i] & b[i] != 0; vpaddw with a zeroing mask
MT_A __mmask32 mm512_test_epi16_mask(m512i a, m512i b) {
  alignas(32) uint16_t x[32], y[32];
  mm512_store_si512(x, a), mm512_store_si512(y, b);
  uint32_t k = 0;
  for (int i = 0; i < 32; ++i) k |= (uint32_t)((x[i] & y[i]) != 0) << i;
  return (__mmask32)k;
}
MT_A m512i mm512_maskz_add_epi16(__mmask32 k, m512i a, m512i b) {
  alignas(32) uint16_t x[32], y[32];
  mm512_store_si512(x, a), mm512_store_si512(y, b);
  for (int i = 0; i < 32; ++i) x[i] = (k >> i) & 1 ? (uint16_t)(x[i] + y[i]) : 0;
  return mm512_load_si512(x);
}
// vinserti64x4: b into the upper (imm = 1) or lower (0) 256 bits of a
MT_A m512i mm512_inserti64x4(m512i a, __m256i b, const int imm) { return imm ? m512i{a.lo, b} : m512i{b, a.hi}; }
// vpermt2ps: result element i = (idx[i] bit 4 ? b : a)[idx[i] & 15]
MT_A m512 mm512_permutex2var_ps(m512 a, m512i idx, m512 b) {
  alignas(32) float t[32], r[16];
  alignas(32) uint32_t ix[16];
  _mm256_store_ps(t, a.lo), _mm256_store_ps(t + 8, a.hi), _mm256_store_ps(t + 16, b.lo), _mm256_store_ps(t + 24, b.hi);
  mm512_store_si512(ix, idx);
  for (int i = 0; i < 16; ++i) r[i] = t[ix[i] & 31];
  return {_mm256_load_ps(r), _mm256_load_ps(r + 8)};
}
// vbroadcastf32x4: the 4 floats of a in every 128-bit lane
MT_A m512 mm512_broadcast_f32x4(__m128 a) { const __m256 v = _mm256_set_m128(a, a); return {v, v}; }

// ---- widening and narrowing conversions
MT_A m512i mm512_cvtepi8_epi32(__m128i a) { return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
MT_A m512i mm512_cvtepu8_epi32(__m128i a) { return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))}; }
MT_A m512i mm512_cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
MT_A m512i mm512_cvtepi8_epi16(__m256i a) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1))};
}
MT_A m512i mm512_cvtepu8_epi16(__m256i a) {
  return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1))};
}
// vpmovdw: each int32 truncated to its low 16 bits (the low halves, masked, pack without saturating)
MT_A __m256i mm512_cvtepi32_epi16(m512i a) {
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i p = _mm256_packus_epi32(_mm256_and_si256(a.lo, low), _mm256_and_si256(a.hi, low));
  return _mm256_permute4x64_epi64(p, 0xD8);
}
MT_A void mm512_mask_cvtepi32_storeu_epi16(void* p, __mmask16 k, m512i a) {
  const __m256i v = mm512_cvtepi32_epi16(a);
  if (k == 0xFFFF) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); return; }
  alignas(32) uint8_t b[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(b), v);
  masked_copy_out(p, b, k, 16, 2);
}
// vpmovdb: each int32 truncated to its low byte
MT_A void mm512_mask_cvtepi32_storeu_epi8(void* p, __mmask16 k, m512i a) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i lo = _mm256_shuffle_epi8(a.lo, pick), hi = _mm256_shuffle_epi8(a.hi, pick);
  alignas(16) uint32_t b[4] = {(uint32_t)_mm256_extract_epi32(lo, 0), (uint32_t)_mm256_extract_epi32(lo, 4),
                               (uint32_t)_mm256_extract_epi32(hi, 0), (uint32_t)_mm256_extract_epi32(hi, 4)};
  if (k == 0xFFFF) { std::memcpy(p, b, 16); return; }
  masked_copy_out(p, reinterpret_cast<const uint8_t*>(b), k, 16, 1);
}

// ---- masks and blends on 32-bit lanes
MT_A __mmask16 mm512_cmp_ps_mask(m512 a, m512 b, const int pred) {
  return (__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, pred)) |
                     (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, pred)) << 8));
}
MT_A __mmask16 mm512_test_epi32_mask(m512i a, m512i b) {
  const __m256i z = _mm256_setzero_si256();
  const unsigned lo = bits32(_mm256_cmpeq_epi32(_mm256_and_si256(a.lo, b.lo), z));
  const unsigned hi = bits32(_mm256_cmpeq_epi32(_mm256_and_si256(a.hi, b.hi), z));
  return (__mmask16)(~(lo | (hi << 8)) & 0xFFFF);
}
MT_A m512i mm512_mask_mov_epi32(m512i src, __mmask16 k, m512i a) {
  return {_mm256_blendv_epi8(src.lo, a.lo, lanes32(k)), _mm256_blendv_epi8(src.hi, a.hi, lanes32(k >> 8))};
}
MT_A m512i mm512_mask_add_epi32(m512i src, __mmask16 k, m512i a, m512i b) {
  return mm512_mask_mov_epi32(src, k, {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)});
}
MT_A m512 mm512_maskz_mov_ps(__mmask16 k, m512 a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes32(k))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes32(k >> 8)))};
}

// vgatherdps: the 256-bit form on each half
MT_A m512 mm512_i32gather_ps(m512i idx, const void* base, const int scale) {
  const float* f = static_cast<const float*>(base);
  return {_mm256_i32gather_ps(f, idx.lo, scale), _mm256_i32gather_ps(f, idx.hi, scale)};
}

// ---- reductions, in GCC's _mm512_reduce_* order: upper 256 op lower 256, then upper 128 op lower
// 128, then (2, 3, 0, 1) op itself, then element 0 op element 1
MT_A float mm512_reduce_add_ps(m512 a) {
  const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
MT_A float mm512_reduce_max_ps(m512 a) {
  const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const float x = _mm_cvtss_f32(t8), y = _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
  return x > y ? x : y;
}
MT_A int mm512_reduce_add_epi32(m512i a) {
  const __m256i t3 = _mm256_add_epi32(a.hi, a.lo);
  const __m128i t6 = _mm_add_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
  const __m128i t8 = _mm_add_epi32(t6, _mm_shuffle_epi32(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return (int)((unsigned)_mm_cvtsi128_si32(t8) + (unsigned)_mm_extract_epi32(t8, 1));
}

#undef MT_A
}  // namespace moetune_avx2

// The redirection: every 512-bit name the sources use, and the AVX512VL/BW masked forms on 128/256 bits.
#define __m512 moetune_avx2::m512
#define __m512i moetune_avx2::m512i
#define __m512d moetune_avx2::m512d
#define _mm512_setzero_ps moetune_avx2::mm512_setzero_ps
#define _mm512_setzero_si512 moetune_avx2::mm512_setzero_si512
#define _mm512_set1_ps moetune_avx2::mm512_set1_ps
#define _mm512_set1_epi32 moetune_avx2::mm512_set1_epi32
#define _mm512_set1_epi16 moetune_avx2::mm512_set1_epi16
#define _mm512_set1_epi64 moetune_avx2::mm512_set1_epi64
#define _mm512_set1_epi8 moetune_avx2::mm512_set1_epi8
#define _mm512_set_epi16 moetune_avx2::mm512_set_epi16
#define _mm512_loadu_ps moetune_avx2::mm512_loadu_ps
#define _mm512_load_ps moetune_avx2::mm512_load_ps
#define _mm512_storeu_ps moetune_avx2::mm512_storeu_ps
#define _mm512_store_ps moetune_avx2::mm512_store_ps
#define _mm512_loadu_si512 moetune_avx2::mm512_loadu_si512
#define _mm512_load_si512 moetune_avx2::mm512_load_si512
#define _mm512_stream_load_si512 moetune_avx2::mm512_stream_load_si512
#define _mm512_storeu_si512 moetune_avx2::mm512_storeu_si512
#define _mm512_store_si512 moetune_avx2::mm512_store_si512
#define _mm512_maskz_loadu_ps moetune_avx2::mm512_maskz_loadu_ps
#define _mm512_mask_loadu_ps moetune_avx2::mm512_mask_loadu_ps
#define _mm512_mask_storeu_ps moetune_avx2::mm512_mask_storeu_ps
#define _mm512_maskz_loadu_epi32 moetune_avx2::mm512_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi8 moetune_avx2::mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi16 moetune_avx2::mm512_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi8 moetune_avx2::mm256_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi16 moetune_avx2::mm256_maskz_loadu_epi16
#define _mm_maskz_loadu_epi8 moetune_avx2::mm_maskz_loadu_epi8
#define _mm256_mask_storeu_epi16 moetune_avx2::mm256_mask_storeu_epi16
#define _mm512_add_ps moetune_avx2::mm512_add_ps
#define _mm512_sub_ps moetune_avx2::mm512_sub_ps
#define _mm512_mul_ps moetune_avx2::mm512_mul_ps
#define _mm512_div_ps moetune_avx2::mm512_div_ps
#define _mm512_max_ps moetune_avx2::mm512_max_ps
#define _mm512_min_ps moetune_avx2::mm512_min_ps
#define _mm512_fmadd_ps moetune_avx2::mm512_fmadd_ps
#define _mm512_fnmadd_ps moetune_avx2::mm512_fnmadd_ps
#define _mm512_abs_ps moetune_avx2::mm512_abs_ps
#define _mm512_roundscale_ps moetune_avx2::mm512_roundscale_ps
#define _mm512_scalef_ps moetune_avx2::mm512_scalef_ps
#define _mm512_cvtepi32_ps moetune_avx2::mm512_cvtepi32_ps
#define _mm512_cvtps_epi32 moetune_avx2::mm512_cvtps_epi32
#define _mm512_castsi512_ps moetune_avx2::mm512_castsi512_ps
#define _mm512_castps_si512 moetune_avx2::mm512_castps_si512
#define _mm512_castps_pd moetune_avx2::mm512_castps_pd
#define _mm512_castpd_ps moetune_avx2::mm512_castpd_ps
#define _mm512_castsi256_si512 moetune_avx2::mm512_castsi256_si512
#define _mm512_unpacklo_ps moetune_avx2::mm512_unpacklo_ps
#define _mm512_unpackhi_ps moetune_avx2::mm512_unpackhi_ps
#define _mm512_unpacklo_pd moetune_avx2::mm512_unpacklo_pd
#define _mm512_unpackhi_pd moetune_avx2::mm512_unpackhi_pd
#define _mm512_unpacklo_epi8 moetune_avx2::mm512_unpacklo_epi8
#define _mm512_unpackhi_epi8 moetune_avx2::mm512_unpackhi_epi8
#define _mm512_unpacklo_epi32 moetune_avx2::mm512_unpacklo_epi32
#define _mm512_unpackhi_epi32 moetune_avx2::mm512_unpackhi_epi32
#define _mm512_unpacklo_epi64 moetune_avx2::mm512_unpacklo_epi64
#define _mm512_unpackhi_epi64 moetune_avx2::mm512_unpackhi_epi64
#define _mm512_and_si512 moetune_avx2::mm512_and_si512
#define _mm512_or_si512 moetune_avx2::mm512_or_si512
#define _mm512_xor_si512 moetune_avx2::mm512_xor_si512
#define _mm512_add_epi32 moetune_avx2::mm512_add_epi32
#define _mm512_sub_epi32 moetune_avx2::mm512_sub_epi32
#define _mm512_add_epi16 moetune_avx2::mm512_add_epi16
#define _mm512_madd_epi16 moetune_avx2::mm512_madd_epi16
#define _mm512_maddubs_epi16 moetune_avx2::mm512_maddubs_epi16
#define _mm512_slli_epi32 moetune_avx2::mm512_slli_epi32
#define _mm512_srli_epi32 moetune_avx2::mm512_srli_epi32
#define _mm512_slli_epi16 moetune_avx2::mm512_slli_epi16
#define _mm512_srli_epi16 moetune_avx2::mm512_srli_epi16
#define _mm512_srai_epi16 moetune_avx2::mm512_srai_epi16
#define _mm512_srai_epi32 moetune_avx2::mm512_srai_epi32
#define _mm512_shuffle_f32x4 moetune_avx2::mm512_shuffle_f32x4
#define _mm512_shuffle_i32x4 moetune_avx2::mm512_shuffle_i32x4
#define _mm512_shuffle_ps moetune_avx2::mm512_shuffle_ps
#define _mm512_permutex2var_epi16 moetune_avx2::mm512_permutex2var_epi16
#define _mm512_permutex2var_ps moetune_avx2::mm512_permutex2var_ps
#define _mm512_permutexvar_epi16 moetune_avx2::mm512_permutexvar_epi16
#define _mm512_test_epi16_mask moetune_avx2::mm512_test_epi16_mask
#define _mm512_maskz_add_epi16 moetune_avx2::mm512_maskz_add_epi16
#define _mm512_inserti64x4 moetune_avx2::mm512_inserti64x4
#define _mm512_broadcast_f32x4 moetune_avx2::mm512_broadcast_f32x4
#define _mm512_cvtepi8_epi32 moetune_avx2::mm512_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 moetune_avx2::mm512_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 moetune_avx2::mm512_cvtepu16_epi32
#define _mm512_cvtepi8_epi16 moetune_avx2::mm512_cvtepi8_epi16
#define _mm512_cvtepu8_epi16 moetune_avx2::mm512_cvtepu8_epi16
#define _mm512_cvtepi32_epi16 moetune_avx2::mm512_cvtepi32_epi16
#define _mm512_mask_cvtepi32_storeu_epi16 moetune_avx2::mm512_mask_cvtepi32_storeu_epi16
#define _mm512_mask_cvtepi32_storeu_epi8 moetune_avx2::mm512_mask_cvtepi32_storeu_epi8
#define _mm512_cmp_ps_mask moetune_avx2::mm512_cmp_ps_mask
#define _mm512_test_epi32_mask moetune_avx2::mm512_test_epi32_mask
#define _mm512_mask_mov_epi32 moetune_avx2::mm512_mask_mov_epi32
#define _mm512_mask_add_epi32 moetune_avx2::mm512_mask_add_epi32
#define _mm512_maskz_mov_ps moetune_avx2::mm512_maskz_mov_ps
#define _mm512_i32gather_ps moetune_avx2::mm512_i32gather_ps
#define _mm512_reduce_add_ps moetune_avx2::mm512_reduce_add_ps
#define _mm512_reduce_max_ps moetune_avx2::mm512_reduce_max_ps
#define _mm512_reduce_add_epi32 moetune_avx2::mm512_reduce_add_epi32
