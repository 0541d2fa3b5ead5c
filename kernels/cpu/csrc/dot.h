// The dot-product instructions of the microkernel variants (micro_dot.inc), each as an instruction
// policy: the native one (the intrinsic, in a function compiled for that instruction only, run only
// where cpuid reports it: isa.cpp) and a C++ model of its exact semantics on AVX-512F/BW, run on
// every machine so that the kernel logic around the instruction is tested everywhere (as amx.cpp's
// tile model).
#pragma once
#include <type_traits>
#include "common.h"

#ifdef MOETUNE_AVX2_BUILD
// the AVX2 build (avx512_model.h) runs no AVX-512 instruction: the "native" policies are compiled as
// their models (isa.cpp never selects them there: detected_features() reports no VNNI, no BF16)
#define MOETUNE_TARGET_VNNI
#define MOETUNE_TARGET_BF16
#else
#define MOETUNE_TARGET_VNNI __attribute__((target("avx512vnni")))
#define MOETUNE_TARGET_BF16 __attribute__((target("avx512bf16")))
#endif
#define MOETUNE_INLINE inline __attribute__((always_inline))

namespace moetune {

// vpdpbusd: per 32-bit lane i, acc[i] += Σ_{j<4} u8(a[4i+j]) · s8(b[4i+j]) (exact, int32 wrap-around).
#ifndef MOETUNE_AVX2_BUILD
struct VnniHw {
  // inline assembly rather than the intrinsic: GCC 12 copies the accumulator out and back around
  // every _mm512_dpbusd_epi32 in a loop (two register moves per instruction on the vector ports,
  // measured in the prefill GEMM's objdump); the tied "+v" operand keeps it in place
  MOETUNE_TARGET_VNNI static MOETUNE_INLINE __m512i dpbusd(__m512i acc, __m512i a_u8, __m512i b_s8) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a_u8), "v"(b_s8));
    return acc;
  }
};

#endif

// The model: even and odd bytes widened to 16-bit lanes (a zero-extended, b sign-extended) and
// multiplied pairwise by vpmaddwd (products ≤ 255·128, pair sums exact in int32).
struct VnniModel {
  static MOETUNE_INLINE __m512i dpbusd(__m512i acc, __m512i a_u8, __m512i b_s8) {
    const __m512i lo8 = _mm512_set1_epi16(0x00FF);
    const __m512i a_even = _mm512_and_si512(a_u8, lo8), a_odd = _mm512_srli_epi16(a_u8, 8);
    const __m512i b_even = _mm512_srai_epi16(_mm512_slli_epi16(b_s8, 8), 8), b_odd = _mm512_srai_epi16(b_s8, 8);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(a_even, b_even));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a_odd, b_odd));
  }
};

// vdpbf16ps: per 32-bit lane i, acc[i] += a.bf16[2i+1]·b.bf16[2i+1], then += a.bf16[2i]·b.bf16[2i],
// in float32 (each product exact, each add rounded to nearest even), denormal inputs read as zero and
// denormal results flushed to zero, whatever MXCSR says.
#ifndef MOETUNE_AVX2_BUILD
struct Bf16Hw {
  MOETUNE_TARGET_BF16 static MOETUNE_INLINE __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
    asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));  // as VnniHw::dpbusd
    return acc;
  }
};

#endif

// The model: the odd and even halves of each lane as float32 (a mask, a shift), multiplied and
// added in that order; the caller runs it with MXCSR.DAZ and FTZ set (micro_sweep), which gives the
// instruction's denormal handling.
struct Bf16Model {
  static MOETUNE_INLINE __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 a_odd = _mm512_castsi512_ps(_mm512_and_si512(a, hi)), b_odd = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
    const __m512 a_even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), b_even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(a_odd, b_odd));
    return _mm512_add_ps(acc, _mm512_mul_ps(a_even, b_even));
  }
};

// vpmaddubsw + vpmaddwd (AVX-512BW, and AVX2 through avx512_model.h): the INT4 kernel's two dot products
// of one group step (micro_int4b_dp's nibbles_dot) where no VNNI runs. The unsigned side is a nibble
// (≤ 15), so each byte pair sums to at most 2·15·127 = 3810 and the two pairs' int16 sum to 7620: no
// saturation, the same int32 lanes as two vpdpbusd, in 5 instructions instead of 2 (the model takes 16).
struct MaddubsNibbles {};

// vpmaddubsw with the sign trick (as llama.cpp's AVX2 Q8_0 dot): INT8 weights w against int8 activations x
// (|x| ≤ 127) as |w| (unsigned) · (x negated where w < 0), byte pairs summed into int16 (≤ 2·128·127 =
// 32512: no saturation), widened to int32 by vpmaddwd with ones: the same int32 lanes as vpdpbusd on
// x + 128 minus 128·Σw, exact, for CPUs without VNNI (micro_int8_dp, cpu_int8_isa=maddubs).
struct MaddubsSigned {
  // x negated where w < 0 (lanes where w = 0 keep x or become 0: |w| = 0 multiplies them)
  static MOETUNE_INLINE __m512i sign(__m512i x, __m512i w) {
#ifdef MOETUNE_AVX2_BUILD
    return {_mm256_sign_epi8(x.lo, w.lo), _mm256_sign_epi8(x.hi, w.hi)};  // vpsignb: AVX2 only
#else
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
#endif
  }
  static MOETUNE_INLINE __m512i abs(__m512i w) {
#ifdef MOETUNE_AVX2_BUILD
    return {_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi)};
#else
    return _mm512_abs_epi8(w);
#endif
  }
  // acc + Σ of 4 products per 32-bit lane, from |w| and sign(x, w)
  static MOETUNE_INLINE __m512i dot(__m512i acc, __m512i w_abs, __m512i x_signed) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, x_signed), _mm512_set1_epi16(1)));
  }
};

#ifdef MOETUNE_AVX2_BUILD
struct VnniHw : VnniModel {};
struct Bf16Hw : Bf16Model {};
#endif

// rows × tokens instantiations of one dot-product kernel (rows 4 or 8, tokens 1, 2 or 4)
#define MOETUNE_DOT_PICK(NS, KERNEL, P, rows, tokens)                                  \
  switch ((rows) * 10 + (tokens)) {                                                     \
    case 41: return NS::KERNEL<P, 4, 1>;                                                \
    case 42: return NS::KERNEL<P, 4, 2>;                                                \
    case 44: return NS::KERNEL<P, 4, 4>;                                                \
    case 81: return NS::KERNEL<P, 8, 1>;                                                \
    case 82: return NS::KERNEL<P, 8, 2>;                                                \
    case 84: return NS::KERNEL<P, 8, 4>;                                                \
  }                                                                                     \
  return nullptr;

// the wide tiles of micro_wide (tokens 6, 8 or 12, on wide_rows(tokens) rows: micro.h), BF16 and INT8 on VNNI only
#define MOETUNE_DOT_PICK_WIDE(NS, KERNEL, P, tokens)                                  \
  switch (tokens) {                                                                     \
    case 6: return NS::KERNEL<P, wide_rows(6), 6>;                                      \
    case 8: return NS::KERNEL<P, wide_rows(8), 8>;                                      \
    case 12: return NS::KERNEL<P, wide_rows(12), 12>;                                   \
  }                                                                                     \
  return nullptr;

}  // namespace moetune
