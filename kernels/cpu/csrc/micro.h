// Register-blocked microkernels for few tokens (decode GEMV and small GEMM): R weight rows × MT
// tokens, full K, weights converted in registers and each 32-element chunk used for all MT tokens.
#pragma once
#include "common.h"

namespace moetune {

// Activations of one call: float32 rows [*, ld] zero-padded to a multiple of 128 (float formats),
// or int16 per-token quantized rows with their scales (INT8); gsum [*, gld]: per-group sums of the
// float rows (INT4 zero points).
struct Act {
  const float* xf = nullptr;
  const int16_t* xq = nullptr;
  const float* xs = nullptr;
  const float* gsum = nullptr;
  const float* gsumq = nullptr;  // INT4 integer path: per-group sums of the int16 activations
  const int8_t* xb = nullptr;    // INT4 int8 path: per-group int8 rows, permuted per 128 (see micro_int4b_dp)
  const float* xbs = nullptr;    // ... their per-(token, group) scales [*, gld]
  const float* gsb = nullptr;    // ... and per-(token, group) sums of the dequantized int8 activations
  const float* xp = nullptr;     // FP8 widen path: float rows × 2^60, permuted per 64 (fp8_widen_order)
  const uint8_t* xu = nullptr;   // INT8 dot paths: the int8 rows + 128 as uint8 (VNNI), or as they are (maddubs)
  const uint16_t* xh = nullptr;  // BF16 dot path: bf16 rows (FP8: × 2^60, permuted per 64, micro_dot.inc)
  const float* xd = nullptr;     // BF16 split path: float rows de-interleaved per 32 (micro_bf16s)
  int64_t ld = 0, gld = 0;
};

// out[m * R + r] = Σ_k x[tok[m], k] · W[r0 + r·tile_stride, k] (real values; tile_row). Rows past N
// repeat the last row (the caller drops them); tok holds MT activation-row indices. `next`: the row
// tile the caller reads after this one (row r at next + r · tile_stride · row_bytes, same row length),
// prefetched while this one is read.
using MicroFn = void (*)(const WeightView&, int64_t r0, const Act&, const int64_t* tok, float* out,
                         const uint8_t* next);

MicroFn get_micro(int fmt, int rows, int tokens);  // nullptr for an unsupported combination
// One translation unit per format instantiates its microkernels (parallel compilation).
MicroFn get_micro_f32(int rows, int tokens);
MicroFn get_micro_bf16(int rows, int tokens);
MicroFn get_micro_int8(int rows, int tokens);
MicroFn get_micro_fp8(int rows, int tokens);
MicroFn get_micro_int4(int rows, int tokens);
MicroFn get_micro_int4i(int rows, int tokens);
MicroFn get_micro_fp8w(int rows, int tokens);
MicroFn get_micro_int4b(int rows, int tokens);
MicroFn get_micro_bf16s(int rows, int tokens);
MicroFn get_micro_bf16y(int rows, int tokens);
// The dot-product variants (micro_dot.inc): fmt is one of kInt8Dp .. kFp8DpModel
MicroFn get_micro_int8_dot(int fmt, int rows, int tokens);
MicroFn get_micro_int4_dot(int fmt, int rows, int tokens);
MicroFn get_micro_bf16_dot(int fmt, int rows, int tokens);
MicroFn get_micro_fp8_dot(int fmt, int rows, int tokens);
// Wide tiles (knob cpu_micro_wide): `tokens` (6, 8 or 12) tokens × wide_rows(tokens) rows, for the BF16 and
// INT8 dot-product variants (kBF16Dp / kBF16DpModel / kInt8Dp / kInt8DpModel); nullptr for any other.
MicroFn get_micro_bf16_dot_wide(int fmt, int tokens);
MicroFn get_micro_int8_dot_wide(int fmt, int tokens);
constexpr int wide_rows(int tokens) { return tokens == 6 ? 4 : 2; }

// r16 experts (kBF16R16, micro_r16.cpp): out[m * ldo + r] for the tile's 16 · blocks rows from row r0
// (a multiple of 16) and `tokens` activation rows tok[0..tokens): per bf16 pair one 64-byte load per
// 16-row block, each token's pair broadcast, the products into 16-row accumulators (no horizontal sum).
// policy: kDotBf16 (vdpbf16ps against bf16 activations A.xh), kDotBf16Model (its C++ model; the caller
// sets MXCSR DAZ + FTZ), or kDotNone (float32 FMAs on the pair's two halves against float activations
// A.xf: exact products, any CPU). Step p prefetches, as W.prefetch_hint says, line p of each block's
// stream at pf (block b's at pf + b · 16 · row_bytes).
constexpr int kR16MaxTokens = 12, kR16MaxAcc = 24;
using R16Fn = void (*)(const WeightView&, int64_t r0, const Act&, const int64_t* tok, float* out, int64_t ldo,
                       const uint8_t* pf);
// blocks 1..4, tokens 1..kR16MaxTokens, blocks · tokens ≤ kR16MaxAcc (the accumulators); nullptr otherwise
R16Fn get_micro_r16(int policy, int blocks, int tokens);
// The same tiles for INT8 weights in r16 (kInt8R16): per unit of 4 int8 one 64-byte load per block, each token's
// 4 activation bytes (A.xu) broadcast; policy kDotVnni (vpdpbusd on x + 128, minus 128·Σw after), kDotVnniModel
// (its C++ model) or kDotMaddubs (vpmaddubsw on |w| and x signed by w). The integer sums are exact, so the
// result equals micro_int8_dp's on the row-major weight bit for bit: (float)Σ · x scale · row scale.
R16Fn get_micro_r16_int8(int policy, int blocks, int tokens);
// INT4 (groups of 128) in r16 (kInt4R16): per unit the block's 4 bytes of 8 nibbles, low and high nibbles against
// the token's int8 activations (A.xb, micro_int4b_dp's order) broadcast 4 at a time, int32 sums per group, then
// out += sum · (scale · x scale) − scale·zero · x group sum, 16 rows at once (the caller zeroes out first, the
// tile adds to it). policy kDotVnni, kDotVnniModel or kDotMaddubs (vpmaddubsw, exact for nibbles).
R16Fn get_micro_r16_int4(int policy, int blocks, int tokens);
// FP8 in r16 (kFp8R16): per unit the block's 4 bytes per row turned into two vectors of bf16 pairs in registers
// (micro_fp8_dp's value · 2^-120 bits: rows 4j, 4j+1 in one, 4j+2, 4j+3 in the other, per 128-bit lane j) against
// each token's 4 activations (A.xh: bf16 · 2^60, in order) broadcast as 64 bits, on vdpbf16ps (kDotBf16) or its
// model (kDotBf16Model, DAZ + FTZ set by the caller); per scale group the lanes' pairs summed into rows and
// scaled into out (zeroed by the caller). kDotNone: each byte to float32 exactly (denormals as kFp8's vector
// method reads them) against float activations (A.xf), by float32 FMAs. blocks · tokens ≤ kR16Fp8MaxAcc.
constexpr int kR16Fp8MaxAcc = 12;
R16Fn get_micro_r16_fp8(int policy, int blocks, int tokens);

// Row r of the register tile that starts at row r0: W.tile_stride rows apart (1: adjacent; micro_sweep
// spreads them with cpu_tile_rows=spread); past the last row, the last row (a partial tile).
inline int64_t tile_row(const WeightView& W, int64_t r0, int r) {
  const int64_t rr = r0 + r * W.tile_stride;
  return rr < W.N ? rr : W.N - 1;
}

// Row r of the tile the caller reads next, which starts at `next` and is laid out as this one: its
// prefetch target.
inline const uint8_t* next_tile_row(const WeightView& W, const uint8_t* next, int r) {
  return next + r * W.tile_stride * W.row_bytes;
}

// Bytes of one weight row holding k elements, per format.
template <int F>
constexpr int64_t row_offset(int64_t k) {
  return F == kF32 ? k * 4 : F == kBF16 ? k * 2 : F == kInt4 ? k / 2 : k;
}

// Software prefetch of the weight rows, one 64-byte line per line the tile reads (a step reading less
// than a line, INT8/FP8: 32 bytes, INT4: 16 or 32, skips the others: a prefetch that finds its line
// already in flight still takes a fill-buffer lookup, and those stall once every buffer is busy).
// W.prefetch_dist (knob cpu_prefetch_ahead): each row's own line that many bytes ahead (at most a
// row), and past the row's end the same place in the next tile's rows (`next_row`: the rows the caller
// reads after this tile, so the jump to another matrix, expert or task is prefetched too); a row no
// longer than the distance therefore prefetches the next tile's line at the offset it reads, as 0 does.
// The next tile is a whole tile ahead: right for short rows (2 KiB INT8: 5 % faster than 1 KiB ahead),
// but 4 rows × 7 KiB ahead on DeepSeek-V3's gate/up overran L1 (22 GB/s against 28, docs/cpu_kernels.md).
template <int F, class T>
inline void prefetch_row(const T* row, const uint8_t* next_row, int64_t k, const WeightView& W) {
  const int64_t off = row_offset<F>(k);
  if (off & 63) return;
  // the distance (at most a row) is set once per weight (make_weight): the loop keeps one conditional
  // move and no branch
  const int64_t at = off + W.prefetch_dist;
  const uint8_t* p = at < W.row_bytes ? reinterpret_cast<const uint8_t*>(row) + at : next_row + (at - W.row_bytes);
  // prefetcht0 as inline assembly: GCC 12 silently dropped _mm_prefetch of this address (chosen between
  // two rows) from the dot-product kernels' loops (objdump: no prefetch left in micro_int8_dp). The
  // address goes in a register ("r"), not as a memory operand ("m"): with a memory operand GCC kept
  // the multi-token kernels' accumulators in memory and stored every one of them on each step.
  // W.prefetch_hint (knob cpu_prefetch_hint): into L1 (t0), L2 (t1), L3 / L2 (t2), or no prefetch; the
  // branch is the same on every step (predicted)
  // (float32 rows: a step reads two lines, so both are prefetched)
#define MOETUNE_PREFETCH(ins)                                                   \
  do {                                                                          \
    asm volatile(ins " (%0)" : : "r"(p));                                       \
    if constexpr (F == kF32) asm volatile(ins " 64(%0)" : : "r"(p));            \
  } while (0)
  switch (W.prefetch_hint) {
    case kPrefetchT0: MOETUNE_PREFETCH("prefetcht0"); break;
    case kPrefetchT1: MOETUNE_PREFETCH("prefetcht1"); break;
    case kPrefetchT2: MOETUNE_PREFETCH("prefetcht2"); break;
    default: break;
  }
#undef MOETUNE_PREFETCH
}

template <int F, int R, int MT>
void micro_float(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                 const uint8_t* next) {
  const uint8_t* row[R];
  const float* srow[R];  // this row's scales (FP8: its block row's), hoisted out of the K loop
  const float* zrow[R];
  const float* x[MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t rr = tile_row(W, r0, r);
    row[r] = W.w + rr * W.row_bytes;
    if constexpr (F == kFp8) srow[r] = W.scale + (rr / W.block_n) * W.scale_ld;
    if constexpr (F == kInt4) srow[r] = W.scale + rr * W.scale_ld, zrow[r] = W.zero ? W.zero + rr * W.scale_ld : nullptr;
  }
  const uint8_t* nrow[R];
  for (int r = 0; r < R; ++r) nrow[r] = next_tile_row(W, next, r);
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) x[m] = A.xf + tok[m] * A.ld;
  __m512 acc[R][MT];
  float corr[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) { acc[r][m] = _mm512_setzero_ps(); corr[r][m] = 0.f; }
  const int64_t K = W.K;
  const int64_t gsz = W.group > 0 ? W.group : ((K + 31) / 32) * 32;
  const int64_t kend = F == kInt4 ? ((K + gsz - 1) / gsz) * gsz : K;
  for (int64_t kb = 0, g = 0; kb < kend; kb += gsz, ++g) {
    const int64_t ke = kb + gsz < kend ? kb + gsz : kend;
    __m512 part[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) part[r][m] = _mm512_setzero_ps();
    for (int64_t k = kb; k < ke; k += 32) {
      __m512 xa[MT], xb[MT];
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) { xa[m] = _mm512_loadu_ps(x[m] + k); xb[m] = _mm512_loadu_ps(x[m] + k + 16); }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 a, b;
        prefetch_row<F>(row[r], nrow[r], k, W);
        Loader<F>::load(W, row[r], k, ke - k, a, b);
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) part[r][m] = _mm512_fmadd_ps(b, xb[m], _mm512_fmadd_ps(a, xa[m], part[r][m]));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (F == kFp8) {
        const __m512 s = _mm512_set1_ps(srow[r][g]);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(part[r][m], s, acc[r][m]);
      } else if constexpr (F == kInt4) {
        const float s = srow[r][g], z = int4_zero(zrow[r], g);
        for (int m = 0; m < MT; ++m) {
          acc[r][m] = _mm512_fmadd_ps(part[r][m], _mm512_set1_ps(s), acc[r][m]);
          corr[r][m] += s * z * A.gsum[tok[m] * A.gld + g];
        }
      } else {
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_add_ps(part[r][m], acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum(acc[r][m]) - corr[r][m];
}

// INT8 weights × int16 activations (per-token quantized, |q| ≤ 127): vpmaddwd sums adjacent
// products exactly into int32; the result is scaled by the token's and the row's scales.
template <int R, int MT>
void micro_int8(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                const uint8_t* next) {
  const int8_t* row[R];
  const int16_t* x[MT];
  for (int r = 0; r < R; ++r) row[r] = (const int8_t*)(W.w + tile_row(W, r0, r) * W.row_bytes);
  for (int m = 0; m < MT; ++m) x[m] = A.xq + tok[m] * A.ld;
  const uint8_t* nrow[R];
  for (int r = 0; r < R; ++r) nrow[r] = next_tile_row(W, next, r);
  __m512i acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
  const int64_t K = W.K;
  // whole chunks, then the masked tail (as micro_bf16s)
  auto step = [&](int64_t k, __mmask32 tail) __attribute__((always_inline)) {
    __m512i xv[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_si512((const void*)(x[m] + k));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      prefetch_row<kInt8>(row[r], nrow[r], k, W);
      const __m256i b = tail ? _mm256_maskz_loadu_epi8(tail, row[r] + k) : _mm256_loadu_si256((const __m256i*)(row[r] + k));
      const __m512i w = _mm512_cvtepi8_epi16(b);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_add_epi32(acc[r][m], _mm512_madd_epi16(w, xv[m]));
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, 0);
  if (k < K) step(k, tail_mask32(K - k));
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      const int64_t rr = tile_row(W, r0, r);
      out[m * R + r] = (float)_mm512_reduce_add_epi32(acc[r][m]) * A.xs[tok[m]] * W.scale[rr];
    }
}

// INT4 weights × int16 activations (per-token quantized to ±32767, stored per 64 elements in the
// order [0–15, 32–47, 16–31, 48–63] so that 32 packed bytes, widened to 32 int16 lanes, give the low
// nibbles against the first half and the high nibbles against the second): vpmaddwd products summed
// exactly in int32 per scale group, converted once per group and scaled. The zero point is
// subtracted once per row at the end, Σ_g scale·zero·(group sum of the int16 activations), as a
// vector dot product over the groups. The next tile's scale and zero rows are prefetched with its
// weights (they are separate short streams the hardware does not follow).
// The row tile of an INT4 integer microkernel: weight, scale and zero rows of rows r0..r0+R (past
// N: the last row), the next tile's weight rows, and a prefetch of the next tile's scale / zero rows
// when it is the next rows of this matrix (short streams the hardware does not follow).
template <int R>
struct Int4Tile {
  const uint8_t* row[R];
  const uint8_t* nrow[R];
  const float* srow[R];
  const float* zrow[R];
  Int4Tile(const WeightView& W, int64_t r0, const uint8_t* next) {
    for (int r = 0; r < R; ++r) {
      const int64_t rr = tile_row(W, r0, r);
      row[r] = W.w + rr * W.row_bytes;
      nrow[r] = next_tile_row(W, next, r);
      srow[r] = W.scale + rr * W.scale_ld;
      zrow[r] = W.zero ? W.zero + rr * W.scale_ld : nullptr;  // none: symmetric, every zero point 8
    }
    // a later tile of this matrix (the next R rows, or with spread tiles the next row of each stream), as
    // far ahead as the weight rows' prefetch reaches (cpu_prefetch_ahead, at most a row: 1 or 2 tiles; fused
    // MoE T=1, INT4 small on the AMX VM, 2 threads: 1 tile ahead x1.40 INT8's speed, 2-8 tiles x1.45-1.49)
    const int64_t ahead = 1 + W.prefetch_dist / std::max<int64_t>(1, W.row_bytes);
    const int64_t n0 = W.tile_stride > 1 ? r0 + ahead : r0 + ahead * R;
    for (int r = 0; r < R; ++r) {
      const float* ns = W.scale + (n0 + r * W.tile_stride) * W.scale_ld;
      const float* nz = W.zero ? W.zero + (n0 + r * W.tile_stride) * W.scale_ld : nullptr;
      for (int64_t o = 0; o < W.scale_ld; o += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(ns + o), _MM_HINT_T0);
        if (nz) _mm_prefetch(reinterpret_cast<const char*>(nz + o), _MM_HINT_T0);
      }
    }
  }
  // Σ_g scale·zero·gsum[g] of row r over G groups: the zero point's share of the product
  float zero_term(int r, const float* gsum, int64_t G) const {
    __m512 c = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 mk = tail_mask16(G - g);
      const __m512 z = zrow[r] ? _mm512_maskz_loadu_ps(mk, zrow[r] + g) : _mm512_maskz_mov_ps(mk, _mm512_set1_ps(8.f));
      c = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, srow[r] + g), z),
                          _mm512_maskz_loadu_ps(mk, gsum + g), c);
    }
    return hsum(c);
  }
};

template <int R, int MT>
void micro_int4i(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                 const uint8_t* next) {
  const Int4Tile<R> tl(W, r0, next);
  const int16_t* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = A.xq + tok[m] * A.ld;
  const int64_t gsz = W.group, G = (W.K + gsz - 1) / gsz;
  const __m512i nib = _mm512_set1_epi16(0x0F);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0, kb = 0; g < G; ++g, kb += gsz) {
    __m512i part[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) part[r][m] = _mm512_setzero_si512();
    for (int64_t k = kb; k < kb + gsz; k += 64) {
      __m512i xl[MT], xh[MT];
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        xl[m] = _mm512_loadu_si512((const void*)(x[m] + k));
        xh[m] = _mm512_loadu_si512((const void*)(x[m] + k + 32));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        prefetch_row<kInt4>(tl.row[r], tl.nrow[r], k, W);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(tl.row[r] + k / 2)));
        const __m512i wl = _mm512_and_si512(v, nib), wh = _mm512_srli_epi16(v, 4);
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m)
          part[r][m] = _mm512_add_epi32(part[r][m], _mm512_add_epi32(_mm512_madd_epi16(wl, xl[m]),
                                                                     _mm512_madd_epi16(wh, xh[m])));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 sv = _mm512_set1_ps(tl.srow[r][g]);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][m]), sv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m)
      out[m * R + r] = (hsum(acc[r][m]) - tl.zero_term(r, A.gsumq + tok[m] * A.gld, G)) * A.xs[tok[m]];
}

// INT4 weights × int8 activations (the "int8" INT4 method, as llama.cpp's Q4 × Q8): activations
// quantized per token and scale group (128) to int8 (|q| ≤ 127, scale amax / 127), stored per 128
// elements as [the 64 meeting low nibbles | the 64 meeting high nibbles] so that 64 packed bytes (128
// weights) give their low nibbles against the first half and the high nibbles against the second. Each
// group's integer sum is scaled by weight scale × activation scale; the zero point is subtracted at the
// end through the groups' sums of the dequantized int8 activations. The kernel is micro_int4b_dp
// (micro_dot.inc): on VNNI, on its C++ model, or on vpmaddubsw + vpmaddwd where no VNNI runs.

// FP8 E4M3 by 16-bit lanes ("widen"): 64 weight bytes are interleaved with zero bytes (vpunpck*bw),
// putting each byte in the high half of a 16-bit lane; an arithmetic shift by 4 and a mask leave
// bfloat16 bits whose exponent field is the E4M3 exponent unchanged, i.e. the exact value × 2^-120
// (±0 stays ±0; NaN reads as 480 as in the other methods). E4M3 denormals become float32 denormals,
// which the FMA units take through a microcode assist (measured: 12× slower on random bytes), so the
// kernel runs with MXCSR.DAZ set (by micro_sweep, once per sweep) and reads them as zero: an error
// below 2^-6 of a quantization unit (|w| < block max / 28672), the "no denormal handling" the format
// allows. The two bfloat16 halves of each 32-bit lane become float32 by a shift (low half) and a
// mask (high half). That is 5 integer instructions per 32 weights instead of 10,
// and one shuffle instead of four. The lane order this produces is fixed per 64 elements, so the
// activations are permuted the same way once per call (fp8_widen_order) and scaled by 2^60; the
// block's partial sum is scaled by its block scale × 2^60. Products stay normal floats unless
// |weight · activation| < 2^-66 of a block scale unit; activations must stay below 2^67.
constexpr float kFp8WidenActScale = 0x1p60f, kFp8WidenOutScale = 0x1p60f;

// Position in a 64-element chunk of the activation that float32 lane p of vector v (0..3) meets.
constexpr int fp8_widen_order(int v, int p) { return 16 * (p / 4) + 2 * (p % 4) + (v & 1) + 8 * (v >> 1); }

template <int R, int MT>
void micro_fp8w(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                const uint8_t* next) {
  const uint8_t* row[R];
  const float* srow[R];
  const float* x[MT];
  for (int r = 0; r < R; ++r) {
    const int64_t rr = tile_row(W, r0, r);
    row[r] = W.w + rr * W.row_bytes;
    srow[r] = W.scale + (rr / W.block_n) * W.scale_ld;
  }
  for (int m = 0; m < MT; ++m) x[m] = A.xp + tok[m] * A.ld;
  const int64_t K = W.K, gsz = W.group;
  const uint8_t* nrow[R];
  for (int r = 0; r < R; ++r) nrow[r] = next_tile_row(W, next, r);
  const __m512i zero = _mm512_setzero_si512(), keep = _mm512_set1_epi32((int)0x87F087F0u),
                hi = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t kb = 0, g = 0; kb < K; kb += gsz, ++g) {
    const int64_t ke = kb + gsz < K ? kb + gsz : K;
    __m512 part[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) part[r][m] = _mm512_setzero_ps();
    for (int64_t k = kb; k < ke; k += 64) {
      __m512 xv[MT][4];
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < 4; ++v) xv[m][v] = _mm512_loadu_ps(x[m] + k + 16 * v);
      const bool full = k + 64 <= K;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        prefetch_row<kFp8>(row[r], nrow[r], k, W);
        const __m512i b = full ? _mm512_loadu_si512((const void*)(row[r] + k))
                               : _mm512_maskz_loadu_epi8((__mmask64)((~0ull) >> (64 - (K - k))), row[r] + k);
        const __m512i lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(zero, b), 4), keep);
        const __m512i up = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(zero, b), 4), keep);
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), w1 = _mm512_castsi512_ps(_mm512_and_si512(lo, hi));
        const __m512 w2 = _mm512_castsi512_ps(_mm512_slli_epi32(up, 16)), w3 = _mm512_castsi512_ps(_mm512_and_si512(up, hi));
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m)
          part[r][m] = _mm512_fmadd_ps(w3, xv[m][3], _mm512_fmadd_ps(w2, xv[m][2],
                       _mm512_fmadd_ps(w1, xv[m][1], _mm512_fmadd_ps(w0, xv[m][0], part[r][m]))));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(srow[r][g] * kFp8WidenOutScale);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(part[r][m], s, acc[r][m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum(acc[r][m]);
}

// The operands of a split BF16 tile (micro_bf16s, micro_bf16y): its R weight rows, the next tile's rows (their
// prefetch targets) and its MT tokens' de-interleaved activation rows.
template <int R, int MT>
struct SplitTile {
  const uint16_t* row[R];
  const uint8_t* nrow[R];
  const float* x[MT];
  SplitTile(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, const uint8_t* next) {
    for (int r = 0; r < R; ++r) {
      row[r] = reinterpret_cast<const uint16_t*>(W.w + tile_row(W, r0, r) * W.row_bytes);
      nrow[r] = next_tile_row(W, next, r);
    }
    for (int m = 0; m < MT; ++m) x[m] = A.xd + tok[m] * A.ld;
  }
};

// BF16 by split lanes ("split", cpu_bf16_method): a 64-byte load holds 32 bf16, two per 32-bit lane; the
// even element of each pair becomes float32 by a shift left by 16, the odd one by masking the low half
// away: 2 integer instructions and 1 load per 32 weights, where widening each bf16 to its own lane takes
// 4 and 2 (a vpmovzxwd, on the FMA ports' shuffle unit, per 16). The activations are de-interleaved to
// match once per call (per 32: the 16 even, then the 16 odd; Act::xd). Exact products, float32 sums: the
// same value as widen up to the order of the additions.
template <int R, int MT>
void micro_bf16s(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                 const uint8_t* next) {
  const SplitTile<R, MT> tl(W, r0, A, tok, next);
  const uint16_t* const* row = tl.row;
  const uint8_t* const* nrow = tl.nrow;
  const float* const* x = tl.x;
  const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t K = W.K;
  // whole chunks, then the masked tail (a load chosen per chunk inside one loop made GCC keep the
  // accumulators on the stack); a chunk is one 64-byte line
  auto step = [&](int64_t k, __mmask32 tail) __attribute__((always_inline)) {
    __m512 xe[MT], xo[MT];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) xe[m] = _mm512_loadu_ps(x[m] + k), xo[m] = _mm512_loadu_ps(x[m] + k + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      prefetch_row<kBF16>(row[r], nrow[r], k, W);
      const __m512i w = tail ? _mm512_maskz_loadu_epi16(tail, row[r] + k) : _mm512_loadu_si512((const void*)(row[r] + k));
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), wo = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(wo, xo[m], _mm512_fmadd_ps(we, xe[m], acc[r][m]));
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, 0);
  if (k < K) step(k, tail_mask32(K - k));
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum(acc[r][m]);
}

// One row group of micro_bf16y over K elements [kb, ke) (multiples of 16; past K, the row's last elements
// come from a zero-padded copy): RG rows × MT tokens of accumulators. Per 16 weights of a row, one 32-byte
// load: the even elements by a shift left by 16, the odd ones by masking the low half away, against the
// activations' even and odd elements (Act::xd: per 32, the 16 even, then the 16 odd: this chunk's half h
// meets xd + 8h and xd + 16 + 8h). MT = 1: both halves of each load at once (2 FMAs per load); MT ≥ 2: the
// even halves of all RG rows against the MT even activation vectors, then the odd halves (each row loaded
// again, from L1), so that RG·MT accumulators + MT activation vectors + 3 stay in AVX2's 16 registers.
// Every accumulator sees even-then-odd per chunk, in K order, whatever RG and MT.
template <int RG, int MT>
__attribute__((always_inline)) inline void bf16y_rows(const uint16_t* const* row, const uint8_t* const* nrow,
                                                       const float* const* x, int64_t kb, int64_t ke,
                                                       const WeightView& W, __m256 (&acc)[RG][MT]) {
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  const int64_t K = W.K, full = K & ~int64_t(15), kf = ke < full ? ke : full;
  // 16 weights of each row at rp[r] (element k of the row), against the activations of this 16: even ones at
  // xd + xi, odd ones at xd + xi + 16 (xi: k's 32-chunk + 8 for its second half); pf: prefetch this row's line
  auto step = [&](int64_t k, int64_t xi, const uint16_t* const* rp, bool pf) __attribute__((always_inline)) {
    if constexpr (MT == 1) {
      const __m256 xe = _mm256_loadu_ps(x[0] + xi), xo = _mm256_loadu_ps(x[0] + xi + 16);
#pragma GCC unroll 8
      for (int r = 0; r < RG; ++r) {
        if (pf) prefetch_row<kBF16>(row[r], nrow[r], k, W);
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r]));
        acc[r][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), xe, acc[r][0]);
        acc[r][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, hi)), xo, acc[r][0]);
      }
    } else {
      __m256 xv[MT];
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x[m] + xi);
#pragma GCC unroll 8
      for (int r = 0; r < RG; ++r) {
        if (pf) prefetch_row<kBF16>(row[r], nrow[r], k, W);
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r])), 16));
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(we, xv[m], acc[r][m]);
      }
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x[m] + xi + 16);
#pragma GCC unroll 8
      for (int r = 0; r < RG; ++r) {
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r])), hi));
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(wo, xv[m], acc[r][m]);
      }
    }
  };
  const uint16_t* rp[RG];
  int64_t k = kb;  // kb: a multiple of 32 (cpu_k_block is)
  for (; k + 32 <= kf; k += 32) {  // whole 64-byte chunks: one prefetch per row
#pragma GCC unroll 8
    for (int r = 0; r < RG; ++r) rp[r] = row[r] + k;
    step(k, k, rp, true);
#pragma GCC unroll 8
    for (int r = 0; r < RG; ++r) rp[r] = row[r] + k + 16;
    step(k + 16, k + 8, rp, false);
  }
  if (k < kf) {  // a last whole 16 (kf = K rounded down to 16)
#pragma GCC unroll 8
    for (int r = 0; r < RG; ++r) rp[r] = row[r] + k;
    step(k, k, rp, true);
    k += 16;
  }
  if (ke > full && full < K) {  // the row's last K % 16 elements, zero-padded (the activations are zero there)
    alignas(32) uint16_t tail[RG][16] = {};
    for (int r = 0; r < RG; ++r) {
      std::memcpy(tail[r], row[r] + full, (K - full) * sizeof(uint16_t));
      rp[r] = tail[r];
    }
    step(full, (full & ~int64_t(31)) + ((full & 16) >> 1), rp, false);
  }
}

// BF16 by split lanes on 256-bit registers ("split256", cpu_bf16_method; auto in the AVX2 build): micro_bf16s's
// arithmetic on the same de-interleaved activations, written for AVX2's 16 ymm registers (native in both
// builds; the AVX2 build's micro_bf16s holds its R × MT zmm accumulators as 2 × R × MT ymm: 32 for a 4 × 4
// tile, spilled on every chunk). A tile keeps at most 8 accumulators: RG = min(R, 8 / MT) rows at a time;
// where RG < R (4 × 4, 8 × 2, 8 × 4) the row groups take turns over K blocks of W.k_block elements
// (cpu_k_block), each group's accumulators parked in memory between its blocks while the block's
// activations stay in L1. The result is the same bits for every R, MT and block (each accumulator's
// operations and their order do not depend on them).
template <int R, int MT>
void micro_bf16y(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out,
                 const uint8_t* next) {
  constexpr int RG = R < 8 / MT ? R : 8 / MT, P = R / RG;
  const SplitTile<R, MT> tl(W, r0, A, tok, next);
  const uint16_t* const* row = tl.row;
  const uint8_t* const* nrow = tl.nrow;
  const float* const* x = tl.x;
  const int64_t kend = (W.K + 15) & ~int64_t(15), kstep = P == 1 ? kend : W.k_block;  // one tile-wide pass if it fits
  // (not zero-initialized: the first block starts from zero registers; a `= {}` here compiled to a rep stos
  // that took 14 % of the kernel's samples on K = 256 rows, perf on a Zen 3)
  alignas(32) float park[P][RG][MT][8];
  for (int64_t kb = 0; kb < kend; kb += kstep) {
    const int64_t ke = kb + kstep < kend ? kb + kstep : kend;
#pragma GCC unroll 1
    for (int p = 0; p < P; ++p) {
      __m256 acc[RG][MT];
      for (int r = 0; r < RG; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = kb ? _mm256_load_ps(park[p][r][m]) : _mm256_setzero_ps();
      bf16y_rows<RG, MT>(row + p * RG, nrow + p * RG, x, kb, ke, W, acc);
      for (int r = 0; r < RG; ++r)
        for (int m = 0; m < MT; ++m) _mm256_store_ps(park[p][r][m], acc[r][m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum8(_mm256_load_ps(park[r / RG][r % RG][m]));
}

// The (rows, tokens) instantiations of one format: rows 4 or 8, tokens 1, 2 or 4.
template <int F, int R>
MicroFn pick_tokens(int tokens) {
  if constexpr (F == kInt8) {
    switch (tokens) { case 1: return micro_int8<R, 1>; case 2: return micro_int8<R, 2>; case 4: return micro_int8<R, 4>; }
  } else if constexpr (F == kInt4i) {
    switch (tokens) { case 1: return micro_int4i<R, 1>; case 2: return micro_int4i<R, 2>; case 4: return micro_int4i<R, 4>; }
  } else if constexpr (F == kBF16s) {
    switch (tokens) { case 1: return micro_bf16s<R, 1>; case 2: return micro_bf16s<R, 2>; case 4: return micro_bf16s<R, 4>; }
  } else if constexpr (F == kBF16y) {
    switch (tokens) { case 1: return micro_bf16y<R, 1>; case 2: return micro_bf16y<R, 2>; case 4: return micro_bf16y<R, 4>; }
  } else if constexpr (F == kFp8w) {
    switch (tokens) { case 1: return micro_fp8w<R, 1>; case 2: return micro_fp8w<R, 2>; case 4: return micro_fp8w<R, 4>; }
  } else {
    switch (tokens) { case 1: return micro_float<F, R, 1>; case 2: return micro_float<F, R, 2>; case 4: return micro_float<F, R, 4>; }
  }
  return nullptr;
}

template <int F>
MicroFn pick_rows(int rows, int tokens) {
  switch (rows) { case 4: return pick_tokens<F, 4>(tokens); case 8: return pick_tokens<F, 8>(tokens); }
  return nullptr;
}

}  // namespace moetune
