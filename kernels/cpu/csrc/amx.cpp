// AMX GEMM (Sapphire Rapids and later): BF16 weights × bf16 activations (TDPBF16PS, float32
// accumulation) and INT8 weights × int8 activations (TDPBSSD, exact int32 accumulation; our per-token
// activation quantization is symmetric, so signed × signed needs no compensation term).
//
// C[M, N] = A[M, K] · W[N, K]ᵀ with W in its checkpoint layout. Per parallel task, one block of 32
// weight rows is packed once into B tiles (each 16 × 64-byte tile row holds, for 16 output rows, the
// 4 bytes of W at one K position: a 16 × 16 transpose of 32-bit units) and then serves every 32-row
// block of A: 2 × 2 accumulator tiles (tmm0–3), two A tiles (tmm4–5) and two B tiles (tmm6–7). M, N
// and K are zero-padded to whole tiles. The packing is per call, like the unpack + BLAS path's, so it
// pays off from a few dozen rows on; the engine chooses AMX from `cpu_amx_min_tokens` rows. Weights in
// the r16 layout (kBF16R16 / kInt8R16) need no packing: each 16-row block's K tile of 64 bytes per row is
// already a B tile, 1 KiB in one piece (R16B). Both go through one loop nest (gemm_nest): groups of
// column blocks, chunks of rows and passes over K, the knobs cpu_amx_n_group / _m_block / _k_block.
//
// The same kernel is instantiated twice: on the tile instructions (compiled here with a function
// target attribute, executed only where cpuid reports AMX and Linux grants the tile state), and on a
// plain C++ emulation of the same tile registers and instructions, so that the packing, the
// blocking and the tails are tested on every machine (tests/test_amx.py).
// CPUs without AMX but with AVX512-VNNI / AVX512-BF16 run the same packed B blocks through a
// register-blocked dot-product kernel (gemm_dot: 8 × 32 accumulators in registers over the whole K).
// INT4 group weights have their own VNNI GEMM on that packing (gemm_int4: nibbles expanded to bytes
// while packing, int8 activations per (token, group), float32 accumulation per scale group), on the
// instruction and on its C++ model alike, and the same on AMX's tiles (gemm_int4_amx: a K pass per group).
#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include "dot.h"
#include "ops.h"
#include "amx_tiles.h"
#include "vmath.h"

namespace moetune {

namespace {

// The prefill GEMM of CPUs with AVX512-VNNI / AVX512-BF16 but no AMX, on the same packed B block as
// the tiles (pack_b: for each 4-byte K unit u, the 32 columns' 4 bytes in two 64-byte rows, at
// (u / 16)·2048 + (u % 16)·64 and 1024 further): a register-blocked kernel of 8 rows × 32 columns,
// 16 accumulators held in registers over the whole K, one broadcast of A's 4 bytes per row and unit
// against the two B vectors — TDPBSSD's / TDPBF16PS's lane definition, in the same order of units,
// so the result equals the tile engines'. INT8 runs vpdpbusd, unsigned × signed: A holds the
// activations + 128 and the write-back subtracts 128·Σ_k W[n, k] (WeightView::wsum). Defined twice: on
// the instructions (a function-level target) and on their C++ models (dot.h; the BF16 model under
// MXCSR.DAZ|FTZ, the instruction's denormal rule).
inline int32_t load_u32(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

#define MOETUNE_DOT_BLOCK(NAME, ATTR, VEC, ZERO, DP, STORE)                                           \
  ATTR void NAME(const uint8_t* a, int64_t kbytes, const uint8_t* b, void* c) {                     \
    VEC acc[8][2];                                                                                   \
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = ZERO;                                        \
    const int64_t units = kbytes / 4;                                                                \
    for (int64_t u = 0; u < units; ++u) {                                                            \
      const uint8_t* bu = b + (u / 16) * 2048 + (u % 16) * 64;                                       \
      const __m512i b0 = _mm512_load_si512((const void*)bu), b1 = _mm512_load_si512((const void*)(bu + 1024)); \
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {                                         \
        const __m512i av = _mm512_set1_epi32(load_u32(a + i * kbytes + 4 * u));                      \
        acc[i][0] = DP(acc[i][0], av, b0);                                                           \
        acc[i][1] = DP(acc[i][1], av, b1);                                                           \
      }                                                                                              \
    }                                                                                                \
    for (int i = 0; i < 8; ++i) {                                                                    \
      STORE(static_cast<uint8_t*>(c) + i * 128, acc[i][0]);                                          \
      STORE(static_cast<uint8_t*>(c) + i * 128 + 64, acc[i][1]);                                     \
    }                                                                                                \
  }
#define MOETUNE_STORE_I(p, v) _mm512_store_si512((void*)(p), v)
#define MOETUNE_STORE_F(p, v) _mm512_store_ps((float*)(p), v)
MOETUNE_DOT_BLOCK(dot_block_int8_hw, MOETUNE_TARGET_VNNI, __m512i, _mm512_setzero_si512(), VnniHw::dpbusd, MOETUNE_STORE_I)
MOETUNE_DOT_BLOCK(dot_block_int8_model, , __m512i, _mm512_setzero_si512(), VnniModel::dpbusd, MOETUNE_STORE_I)
MOETUNE_DOT_BLOCK(dot_block_bf16_hw, MOETUNE_TARGET_BF16, __m512, _mm512_setzero_ps(), Bf16Hw::dpbf16, MOETUNE_STORE_F)
MOETUNE_DOT_BLOCK(dot_block_bf16_model, , __m512, _mm512_setzero_ps(), Bf16Model::dpbf16, MOETUNE_STORE_F)
#undef MOETUNE_DOT_BLOCK
#undef MOETUNE_STORE_I
#undef MOETUNE_STORE_F

// The INT8 GEMM of CPUs without VNNI (cpu_int8_gemm=maddubs), on AVX2 instructions that every CPU the
// kernels run on has, over the same packed B block. Signed × signed through vpmaddubsw (unsigned ×
// signed bytes, pairs summed to int16) with llama.cpp's sign trick: the unsigned side is |w| (vpabsb,
// once per unit for all rows) and the signed side x with w's sign (vpsignb: −x where w < 0, 0 where
// w = 0), so each byte product is x·w exactly; with x ∈ [−127, 127] a pair is at most 2·128·127 = 32512
// and never saturates. vpmaddwd against ones then sums the pairs to int32: 32 products in four
// instructions, against 8 per float32 FMA. Register block: 2 rows × the 32 columns (8 accumulators,
// the 4 |w| vectors, w read again by vpsignb as a memory operand), over a K range, the int32 sums
// loaded from and stored to c (blocks of kMaddubsMBlock rows). A row holding −128 would be wrong
// (vpsignb cannot negate it): gemm_tiles_run refuses it.
constexpr int kMaddubsRows = 2, kMaddubsMBlock = 8;

void maddubs_block(const uint8_t* a, int64_t kbytes, int64_t u0, int64_t u1, const uint8_t* b, int32_t* c) {
  constexpr int R = kMaddubsRows;
  __m256i acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_load_si256((const __m256i*)(c + i * 32 + 8 * j));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t u = u0; u < u1; ++u) {
    const uint8_t* bu = b + (u / 16) * 2048 + (u % 16) * 64;
    const __m256i* bv[4] = {(const __m256i*)bu, (const __m256i*)(bu + 32), (const __m256i*)(bu + 1024),
                            (const __m256i*)(bu + 1056)};
    __m256i absb[4];
    for (int j = 0; j < 4; ++j) absb[j] = _mm256_abs_epi8(_mm256_load_si256(bv[j]));
    for (int i = 0; i < R; ++i) {
      const __m256i av = _mm256_set1_epi32(load_u32(a + i * kbytes + 4 * u));
      for (int j = 0; j < 4; ++j) {
        const __m256i sx = _mm256_sign_epi8(av, _mm256_load_si256(bv[j]));
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(absb[j], sx), ones));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) _mm256_store_si256((__m256i*)(c + i * 32 + 8 * j), acc[i][j]);
}

// Pack rows [n0, n0 + 32) of W (row_bytes bytes used of each, kbytes = the padded K in bytes) into
// B tiles: dst[kt][h] is 16 × 64 bytes, tile row kk holding for output row n0 + 16h + n the 4 bytes
// at byte offset 64·kt + 4·kk of that row (zeros past N or past the row's data).
void pack_b(const WeightView& W, int64_t n0, int64_t data_bytes, int64_t kbytes, uint8_t* dst) {
  const int64_t ktiles = kbytes / 64;
  // whole blocks: 16 × 16 transposes in registers for every K tile inside the rows' data; the
  // zero-padded tail tile (and blocks past N) take the byte loop below
  const int64_t full_kt = n0 + 32 <= W.N ? data_bytes / 64 : 0;
  // The 16 rows are 16 short streams (a row is a few KiB), too short for the hardware prefetchers to
  // ramp up: each row is prefetched kPackAhead bytes ahead of its transposes, and the second half's
  // rows from the first half's last tiles.
  constexpr int64_t kPackAhead = 512;
  for (int64_t h = 0; h < 2 && full_kt > 0; ++h) {
    const uint8_t* rows[16];
    for (int64_t n = 0; n < 16; ++n) rows[n] = W.w + (n0 + 16 * h + n) * W.row_bytes;
    for (int64_t kt = 0; kt < full_kt; ++kt) {
      const int64_t ahead = 64 * kt + kPackAhead;
      for (int64_t n = 0; n < 16; ++n)
        _mm_prefetch((const char*)(ahead < data_bytes ? rows[n] + ahead : rows[n] + 16 * W.row_bytes + ahead - data_bytes),
                     _MM_HINT_T0);
      transpose16_u32(rows, 64 * kt, dst + (kt * 2 + h) * 1024);
    }
  }
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t row = n0 + 16 * h + n;
      const uint8_t* src = row < W.N ? W.w + row * W.row_bytes : nullptr;
      for (int64_t kt = full_kt; kt < ktiles; ++kt) {
        uint8_t* tile = dst + (kt * 2 + h) * 1024;
        for (int64_t kk = 0; kk < 16; ++kk) {
          const int64_t off = 64 * kt + 4 * kk;
          uint8_t* d = tile + kk * 64 + 4 * n;
          if (src && off + 4 <= data_bytes) {
            std::memcpy(d, src + off, 4);
          } else {
            for (int64_t j = 0; j < 4; ++j) d[j] = src && off + j < data_bytes ? src[off + j] : 0;
          }
        }
      }
    }
}

// 32 scratch rows of kbytes bytes each (fmt's elements, zero-padded) laid out by pack_b at b.
void pack_scratch_b(const uint8_t* rows, int64_t kbytes, int fmt, uint8_t* b) {
  WeightView E;
  E.fmt = fmt;
  E.w = rows;
  E.row_bytes = kbytes;
  E.N = 32;
  E.K = fmt == kBF16 ? kbytes / 2 : kbytes;
  pack_b(E, 0, kbytes, kbytes, b);
}

// FP8 → bf16(value × s) for a block scale s by a table instead of a float32 multiply per value. fp8x16_to_f32's value is
// ±2^(e−7)·(1 + m/8) for every byte with a nonzero magnitude (its E4M3 denormals included), and float32's product and
// bf16's rounding (to nearest even) both commute with a power of two while every value stays normal, so
// bf16(value × s) = ±2^(e−7) · bf16((1 + m/8)·s): the 8 bf16 values T[m] = bf16((1 + m/8)·s) once per block and K
// tile, then per byte T[m] with e − 7 added to its exponent field, its sign flipped by the byte's sign, 0 for ±0 — bit
// for bit what fp8_row_bf16 computes. Fp8Bf16Lut::make refuses a scale for which that could fail (0, negative,
// denormal, infinite or NaN, or so small or large that a product could leave float32's normal range); those blocks
// take the float32 form (fp8_row32_bf16).
struct Fp8Bf16Lut {
  __m512i t;  // T[m] − (7 << 7) in every 16-bit lane i with i % 8 = m (vpermw reads an index's low 5 bits)
  static bool make(float s, Fp8Bf16Lut& out) {
    // the 8 products (1 + m/8)·s (1 + m/8 is exact in float32: one rounding, the kernel's), in 8 lanes
    const __m256i b = _mm256_castps_si256(
        _mm256_mul_ps(_mm256_setr_ps(1.f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f), _mm256_set1_ps(s)));
    const __m256i r = _mm256_srli_epi32(  // bf16x16's rounding
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))),
                         _mm256_set1_epi32(0x7FFF)),
        16);
    // every product ±2^(e−7)·p normal and finite for e ∈ [0, 15], before and after the rounding; s > 0 and normal
    const __m256i eb = _mm256_and_si256(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(0xFF));
    const __m256i er = _mm256_and_si256(_mm256_srli_epi32(r, 7), _mm256_set1_epi32(0xFF));
    const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), b),
                                        _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), eb),
                                                        _mm256_cmpgt_epi32(er, _mm256_set1_epi32(246))));
    if (!_mm256_testz_si256(bad, bad)) return false;
    // T[m] − (7 << 7) is the low half of 32-bit lane m, 16-bit lane 2m: into every lane i with i % 8 = m
    const __m256i v = _mm256_sub_epi32(r, _mm256_set1_epi32(7 << 7));
    const __m512i idx = _mm512_set_epi16(14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0,
                                         14, 12, 10, 8, 6, 4, 2, 0);
    out.t = _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(v));
    return true;
  }
  // the 32 bytes at p (one weight row's K tile) as 32 bf16, in order
  __m512i row(const uint8_t* p) const {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
    const __m512i mant = _mm512_permutexvar_epi16(x, t);
    const __m512i expo = _mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x0780));  // e << 7
    const __m512i v = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x7F)), mant, expo);
    return _mm512_xor_si512(v, _mm512_and_si512(_mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000)));
  }
};

// FP8 weight rows expanded to bf16 row-major (value × block scale, rounded: fp8_row_bf16's bits, by Fp8Bf16Lut where it
// holds), for AMX's A operand (gemm_direct, the grouped MoE): no transpose, each 32-byte K tile of a row one table
// lookup. 32 rows from r0 into dst (rows ld bytes apart, each kbytes long: zero past K, and rows past N zero), row by
// row: a block's rows follow each other in memory, one stream, prefetched pf bytes ahead (0: none). The tables of a
// scale row are made once and kept while the rows converted next share it (the scales' address: another weight's
// may sit at the same row index).
struct Fp8RowsBf16 {
  std::vector<Fp8Bf16Lut> lut;  // per scale group of the row: its table, and whether the table holds (ok)
  std::vector<char> ok;
  const float* srow = nullptr;
  void rows(const WeightView& W, int64_t r0, int64_t kbytes, int64_t ld, int64_t pf, uint8_t* dst) {
    const bool tables = W.K % 32 == 0 && W.group > 0 && W.group % 32 == 0;
    const int64_t ng = tables ? (W.K + W.group - 1) / W.group : 0;
    for (int64_t n = 0; n < 32; ++n) {
      uint8_t* d = dst + n * ld;
      const int64_t r = r0 + n;
      if (r >= W.N || !tables) {
        if (r < W.N) fp8_row_bf16(W, r, reinterpret_cast<uint16_t*>(d));
        const int64_t done = r < W.N ? 2 * W.K : 0;
        std::memset(d + done, 0, kbytes - done);
        continue;
      }
      const float* sc = W.scale + (r / W.block_n) * W.scale_ld;
      if (sc != srow || (int64_t)lut.size() != ng) {
        srow = sc;
        lut.resize(ng);
        ok.resize(ng);
        for (int64_t g = 0; g < ng; ++g) ok[g] = Fp8Bf16Lut::make(sc[g], lut[g]);
      }
      const uint8_t* src = W.w + r * W.row_bytes;
      for (int64_t g = 0; g < ng; ++g) {  // group g: K tiles [k0, k1) of 32 values
        const int64_t k0 = g * W.group, k1 = std::min<int64_t>(W.K, k0 + W.group);
        if (ok[g]) {
          const Fp8Bf16Lut& t = lut[g];
          for (int64_t k = k0; k < k1; k += 32) {
            if (pf > 0) _mm_prefetch((const char*)(src + k + pf), _MM_HINT_T0);
            _mm512_storeu_si512((void*)(d + 2 * k), t.row(src + k));
          }
        } else {
          for (int64_t k = k0; k < k1; k += 32) _mm512_storeu_si512((void*)(d + 2 * k), fp8_row32_bf16(W, src + k, sc[g]));
        }
      }
      std::memset(d + 2 * W.K, 0, kbytes - 2 * W.K);
    }
  }
};

// The register packings' prefetch (pack_fp8_b, pack_int4_b): byte `ahead` of each of 16 rows (row_bytes apart, `len`
// bytes of data each) into L1, or past a row's data the same place in the next 16-row half's rows.
inline void prefetch_rows16(const uint8_t* const* src, int64_t ahead, int64_t len, int64_t row_bytes) {
  for (int64_t n = 0; n < 16; ++n)
    _mm_prefetch((const char*)(ahead < len ? src[n] + ahead : src[n] + 16 * row_bytes + ahead - len), _MM_HINT_T0);
}

// Columns [n0, n0 + 32) of an FP8 weight packed as BF16 for the tile and dot engines (cpu_fp8_gemm=amx /
// avx512bf16): each row's values times their block scales, rounded to bf16 (as DeepSeek's FP8 → BF16 cast and the
// onednn variant), laid out as pack_b lays out a BF16 weight. The scales are folded into B, so the sums are the
// result. Where the block is whole (32 rows inside N, K a multiple of 32, scale blocks of whole 16-row halves and
// 32-wide K tiles: DeepSeek's 128 × 128), each half's K tile goes from the FP8 bytes to bf16 in registers
// (Fp8Bf16Lut) and is transposed there into its B tile; otherwise the rows are expanded into the scratch `rows`
// ([32][kbytes], zero past K and past N) and packed by pack_b. Both give the same bits.
void pack_fp8_b(const WeightView& W, int64_t n0, int64_t kbytes, uint8_t* rows, uint8_t* b) {
  if (n0 + 32 <= W.N && W.K % 32 == 0 && kbytes == 2 * W.K && W.block_n % 16 == 0 && W.group > 0 &&
      W.group % 32 == 0) {
    constexpr int64_t kAhead = 512;  // bytes of each row prefetched ahead of its conversion, as pack_b does
    const int64_t ktiles = W.K / 32;
    for (int64_t h = 0; h < 2; ++h) {
      const uint8_t* src[16];
      for (int64_t n = 0; n < 16; ++n) src[n] = W.w + (n0 + 16 * h + n) * W.row_bytes;
      const float* srow = W.scale + ((n0 + 16 * h) / W.block_n) * W.scale_ld;
      Fp8Bf16Lut lut;
      bool table = false;
      int64_t block = -1, next = 0;  // K tile kt's scale block, and the element where the next one starts
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        if (32 * kt == next) {  // (no division per K tile)
          ++block;
          next += W.group;
          table = Fp8Bf16Lut::make(srow[block], lut);
        }
        if (kt % 2 == 0) prefetch_rows16(src, 32 * kt + kAhead, W.K, W.row_bytes);
        __m512i r[16];
        for (int64_t n = 0; n < 16; ++n)
          r[n] = table ? lut.row(src[n] + 32 * kt) : fp8_row32_bf16(W, src[n] + 32 * kt, srow[block]);
        transpose16_u32_regs(r, b + (kt * 2 + h) * 1024);
      }
    }
    return;
  }
  for (int64_t n = 0; n < 32; ++n) {
    uint8_t* d = rows + n * kbytes;
    int64_t done = 0;
    if (n0 + n < W.N) {
      fp8_row_bf16(W, n0 + n, reinterpret_cast<uint16_t*>(d));
      done = 2 * W.K;
    }
    std::memset(d + done, 0, kbytes - done);
  }
  pack_scratch_b(rows, kbytes, kBF16, b);
}

// 16 float32 lanes (mk: those inside the row) rounded to bfloat16 at dst, as torch's conversion rounds: to nearest
// even, NaN → 0x7FC0 (c10::BFloat16's). The tile GEMMs' bf16 activations (gemm_tiles_run, the grouped MoE's rows).
inline void store_bf16x16(__m512 v, __mmask16 mk, uint8_t* dst) {
  const __m512i u = _mm512_castps_si512(v);
  __m512i h = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))),
      16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm512_mask_cvtepi32_storeu_epi16(dst, mk, h);
}

// Rows [m0, m0 + rows) × columns [n0, n0 + 32) of the result, from c (element (i, h, j) — row i,
// column n0 + 16h + j — at c[i·c_row + h·c_half + j]; INT8: int32 sums, BF16: float32 bits) into out
// [M, N], 16 lanes at a time, masked at M and N. comp: nullptr, or INT8 on unsigned A (A + 128): the
// per-column Σ_k W[n, k], 128 of which come off each sum (int32 wrap-around, exact when the true sum fits).
template <bool Int8>
inline void write_back(const int32_t* c, int64_t c_row, int64_t c_half, int64_t rows, int64_t m0, int64_t n0,
                       int64_t M, int64_t N, const int32_t* comp, float* out) {
  for (int64_t i = 0; i < rows && m0 + i < M; ++i)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t n = n0 + 16 * h;
      if (n >= N) break;
      const __mmask16 mk = tail_mask16(N - n);
      const __m512i v = _mm512_loadu_si512((const void*)(c + i * c_row + h * c_half));
      float* dst = out + (m0 + i) * N + n;
      if constexpr (Int8) {
        const __m512i w = comp ? _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mk, comp + n), 7) : _mm512_setzero_si512();
        _mm512_mask_storeu_ps(dst, mk, _mm512_cvtepi32_ps(_mm512_sub_epi32(v, w)));
      } else {
        _mm512_mask_storeu_ps(dst, mk, _mm512_castsi512_ps(v));
      }
    }
}

// Rows [m0, m0 + rows) × columns [n0, n0 + 32) of INT8 int32 sums c ([rows][32]) into out [M, N] as the
// real products float(sum − 128·comp[n]) · xs[m] · ws[n] (comp: nullptr on signed A, else A + 128 as
// write_back), the order of the unpack path's out.mul_(xs).mul_(ws); stored as float32, or (Bf16Out)
// rounded to bfloat16 as torch's conversion rounds finite values (nearest even). Masked at M and N.
template <bool Bf16Out>
inline void write_back_scaled(const int32_t* c, int64_t rows, int64_t m0, int64_t n0, int64_t M, int64_t N,
                              const int32_t* comp, const float* xs, const float* ws, void* out) {
  for (int64_t i = 0; i < rows && m0 + i < M; ++i) {
    const __m256 x = _mm256_set1_ps(xs[m0 + i]);
    for (int64_t q = 0; q < 4 && n0 + 8 * q < N; ++q) {
      const int64_t n = n0 + 8 * q, left = std::min<int64_t>(8, N - n);
      const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i s = _mm256_load_si256((const __m256i*)(c + i * 32 + 8 * q));
      if (comp) s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_maskload_epi32(comp + n, mk), 7));
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), x), _mm256_maskload_ps(ws + n, mk));
      if constexpr (Bf16Out) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                                 _mm256_set1_epi32(0x7FFF))), 16);
        // 8 × 16 bits: packus within each 128-bit lane, then the two lanes' low halves together
        const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
        uint16_t* dst = static_cast<uint16_t*>(out) + (m0 + i) * N + n;
        if (left == 8) _mm_storeu_si128((__m128i*)dst, h);
        else {
          alignas(16) uint16_t t[8];
          _mm_store_si128((__m128i*)t, h);
          std::memcpy(dst, t, 2 * left);
        }
      } else {
        _mm256_maskstore_ps(static_cast<float*>(out) + (m0 + i) * N + n, mk, v);
      }
    }
  }
}

// Where a tile GEMM's int32 sums go: the raw path (sums as float32, comp applied: write_back), or the
// real INT8 products scaled per row and column (xs set: write_back_scaled), in float32 or bfloat16.
// BF16 weights: the float32 sums (c as float bits), stored as float32 or rounded to bfloat16 (bf16).
struct SumsOut {
  void* out;
  const int32_t* comp = nullptr;
  const float* xs = nullptr;
  const float* ws = nullptr;
  bool bf16 = false;
  void put(const int32_t* c, int64_t rows, int64_t m0, int64_t n0, int64_t M, int64_t N) const {
    if (!xs) write_back<true>(c, 32, 16, rows, m0, n0, M, N, comp, static_cast<float*>(out));
    else if (bf16) write_back_scaled<true>(c, rows, m0, n0, M, N, comp, xs, ws, out);
    else write_back_scaled<false>(c, rows, m0, n0, M, N, comp, xs, ws, out);
  }
  void put_f32(const int32_t* c, int64_t rows, int64_t m0, int64_t n0, int64_t M, int64_t N) const {
    if (!bf16) return write_back<false>(c, 32, 16, rows, m0, n0, M, N, nullptr, static_cast<float*>(out));
    for (int64_t i = 0; i < rows && m0 + i < M; ++i)
      for (int64_t n = n0; n < std::min(N, n0 + 32); n += 16)
        to_bf16(reinterpret_cast<const float*>(c + i * 32 + (n - n0)), std::min<int64_t>(16, N - n),
                static_cast<uint16_t*>(out) + (m0 + i) * N + n);
  }
};

// One K step: A tiles 4 / 5 from a0 / a1 (rows lda bytes apart), B tiles 6 (and 7 if `two`) from b0 / b1
// (64-byte rows), then the products.
template <class T, bool Int8>
MOETUNE_AMX inline void tile_step(const uint8_t* a0, const uint8_t* a1, int64_t lda, const uint8_t* b0, const uint8_t* b1,
                                  bool two) {
  T::template load<4>(a0, lda);
  T::template load<5>(a1, lda);
  T::template load<6>(b0, 64);
  if (two) {
    T::template load<7>(b1, 64);
    tile_products<T, Int8, 2, 2>();
  } else {
    tile_products<T, Int8, 2, 1>();
  }
}

// The four sum tiles to memory (rows `stride` bytes apart): tile q at c + (q % 2)·h + (q / 2)·r int32s.
template <class T>
MOETUNE_AMX inline void store_sums(int32_t* c, int64_t stride, int64_t h, int64_t r) {
  T::template store<0>(c, stride);
  T::template store<1>(c + h, stride);
  T::template store<2>(c + r, stride);
  T::template store<3>(c + r + h, stride);
}

// The 2 × 2 sum tiles of a 32 × 32 block at the start of K tiles from k0: zero (k0 = 0), or the sums a
// previous pass left in c (row i at c + 32i).
template <class T>
MOETUNE_AMX void start_sums(int64_t k0, const int32_t* c) {
  if (k0 == 0) {
    T::template zero<0>();
    T::template zero<1>();
    T::template zero<2>();
    T::template zero<3>();
  } else {
    T::template load<0>(c, 128);
    T::template load<1>(c + 16, 128);
    T::template load<2>(c + 512, 128);
    T::template load<3>(c + 528, 128);
  }
}

// One 32 × 32 block of C over K tiles [k0, k1) on the 2 × 2 tiles: A tiles at a0 / a1 + kt·1 KiB (rows
// 0-15 / 16-31), B tiles at b + kt·2 KiB (columns 0-15, then 16-31); the sums start at zero (k0 = 0) or
// from c, and end in c (row i at c + 32i). A function of its own with AMX's target, so that the tile
// instructions inline into the loop (on the model, T's plain C++ does; no AMX instruction is emitted).
template <class T, bool Int8>
MOETUNE_AMX void tile_block(const uint8_t* a0, const uint8_t* a1, const uint8_t* b, int64_t k0, int64_t k1, int32_t* c) {
  start_sums<T>(k0, c);
  for (int64_t kt = k0; kt < k1; ++kt)
    tile_step<T, Int8>(a0 + kt * 1024, a1 + kt * 1024, 64, b + (kt * 2) * 1024, b + (kt * 2 + 1) * 1024, true);
  store_sums<T>(c, 128, 16, 512);  // tile (r, h): rows 16r .., columns 16h .. of the block
}

// A (rows of kbytes, M padded to 32) in tile order: the tile of rows 16r .. 16r + 15 and K tile kt, 16
// rows of 64 bytes, at a + (r·ktiles + kt)·1024, so each tile load reads 1 KiB in one piece and a row
// block's tiles follow each other (rows kbytes apart put a tile's 16 lines in a few cache sets).
at::Tensor a_tile_order(const uint8_t* a_rows, int64_t kbytes, int64_t M) {
  const int64_t ktiles = kbytes / 64, mblocks = (M + 31) / 32;
  at::Tensor tiled = at::empty({mblocks * 2 * ktiles * 1024}, at::kByte);
  uint8_t* a = tiled.data_ptr<uint8_t>();
  at::parallel_for(0, mblocks * 2, 1, [&](int64_t s, int64_t e) {
    for (int64_t r = s; r < e; ++r)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t kt = 0; kt < ktiles; ++kt)
          std::memcpy(a + (r * ktiles + kt) * 1024 + i * 64, a_rows + (16 * r + i) * kbytes + 64 * kt, 64);
  });
  return tiled;
}

// One 32 × 32 block of C over K tiles [k0, k1) from weights in the r16 layout (kBF16R16 / kInt8R16), read
// where they lie: a 16-row block's K tile kt (16 units of 4 bytes × the block's 16 rows, unit u of row r at
// uint32 offset u·16 + r) is exactly a B tile, 1 KiB in one piece at b0 / b1 + kt·1 KiB (columns 0-15, then
// 16-31; `two`: the second block exists). K tiles from `full` on are the staged tail (tail / tail + 1 KiB,
// zero past the weight's K). A tiles and sums as tile_block's; a1 null: rows 0-15 only (both B blocks, no
// staged tail: the grouped MoE's last token tile of an expert). Each block's stream prefetched pf bytes ahead
// (0: none).
template <class T, bool Int8>
MOETUNE_AMX void r16_block(const uint8_t* a0, const uint8_t* a1, const uint8_t* b0, const uint8_t* b1, bool two,
                           const uint8_t* tail, int64_t full, int64_t k0, int64_t k1, int64_t pf, int32_t* c) {
  start_sums<T>(k0, c);
  for (int64_t kt = k0; kt < k1; ++kt) {
    const bool staged = kt >= full;
    if (pf > 0 && kt * 1024 + pf < full * 1024)
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch((const char*)(b0 + kt * 1024 + pf + 64 * l), _MM_HINT_T0);
        if (two) _mm_prefetch((const char*)(b1 + kt * 1024 + pf + 64 * l), _MM_HINT_T0);
      }
    if (a1 == nullptr) {  // one A tile (rows 0-15; sums 2 and 3 stay as they started) against both B tiles
      T::template load<4>(a0 + kt * 1024, 64);
      T::template load<6>(b0 + kt * 1024, 64);
      T::template load<7>(b1 + kt * 1024, 64);
      tile_products<T, Int8, 1, 2>();
      continue;
    }
    tile_step<T, Int8>(a0 + kt * 1024, a1 + kt * 1024, 64, staged ? tail : b0 + kt * 1024,
                       staged ? tail + 1024 : b1 + kt * 1024, two);
  }
  store_sums<T>(c, 128, 16, 512);
}

// Where the blocked nest (gemm_nest) takes a column block's B tiles from. PackedB: row-major weights (or FP8,
// expanded to bf16 as they are packed: pack_fp8_b), each group's column blocks packed once per task by
// pack_b into a thread's buffer (nb's K tile kt at b + (g·ktiles + kt)·2 KiB). R16B: r16 weights read where
// they lie (the layout is AMX's B tile layout: no packing), 16-row blocks in one contiguous stream each; the
// K tail (K·esz not a multiple of 64) is copied per column block into a zeroed staging pair of tiles: the
// weight's next block follows it in memory, and garbage × 0 would be NaN for bf16. N ends in whole 16-row
// blocks (r16); an odd last block runs one B tile.
struct PackedB {
  const WeightView& W;
  int64_t data_bytes, kbytes, ktiles;
  std::vector<uint8_t> buf, rows;
  uint8_t* b;
  int64_t pf = 0;  // unused: a packed block is read from the thread's buffer
  PackedB(const WeightView& W_, int64_t data_bytes_, int64_t kbytes_, int64_t group)
      : W(W_), data_bytes(data_bytes_), kbytes(kbytes_), ktiles(kbytes_ / 64), buf(group * ktiles * 2048 + 64),
        rows(W_.fmt == kFp8 ? 32 * kbytes_ : 0) {
    b = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64);
  }
  static void check(const WeightView&, int64_t) {}
  void group(int64_t nb0, int64_t count) {
    for (int64_t g = 0; g < count; ++g) {
      uint8_t* dst = b + g * ktiles * 2048;
      if (W.fmt == kFp8) pack_fp8_b(W, (nb0 + g) * 32, kbytes, rows.data(), dst);
      else pack_b(W, (nb0 + g) * 32, data_bytes, kbytes, dst);
    }
  }
  template <class T, bool Int8>
  void block(int64_t g, const uint8_t* a0, const uint8_t* a1, int64_t k0, int64_t k1, int32_t* c) {
    tile_block<T, Int8>(a0, a1, b + g * ktiles * 2048, k0, k1, c);
  }
};

struct R16B {
  const WeightView& W;
  int64_t full, tail_bytes, ktiles, block_bytes, nb0 = 0, pf = 0;
  std::vector<uint8_t> buf;
  uint8_t* tails;
  R16B(const WeightView& W_, int64_t data_bytes, int64_t kbytes, int64_t group)
      : W(W_), full(data_bytes / 64), tail_bytes((data_bytes - 64 * (data_bytes / 64)) * 16), ktiles(kbytes / 64),
        block_bytes(16 * W_.row_bytes), buf(full < ktiles ? group * 2048 + 64 : 64) {
    tails = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64);
  }
  // before the parallel region (an exception must not leave an OpenMP thread)
  static void check(const WeightView& W, int64_t data_bytes) {
    TORCH_CHECK(W.N % 16 == 0 && data_bytes % 4 == 0 && W.row_bytes == data_bytes, "AMX r16 GEMM: whole 16-row blocks");
  }
  bool two(int64_t nb) const { return nb * 32 + 16 < W.N; }
  const uint8_t* b0(int64_t nb) const { return W.w + 2 * nb * block_bytes; }
  void group(int64_t nb0_, int64_t count) {
    nb0 = nb0_;
    if (full >= ktiles) return;
    for (int64_t g = 0; g < count; ++g) {
      uint8_t* tail = tails + g * 2048;
      std::memset(tail, 0, 2048);
      std::memcpy(tail, b0(nb0 + g) + full * 1024, tail_bytes);
      if (two(nb0 + g)) std::memcpy(tail + 1024, b0(nb0 + g) + block_bytes + full * 1024, tail_bytes);
    }
  }
  template <class T, bool Int8>
  void block(int64_t g, const uint8_t* a0, const uint8_t* a1, int64_t k0, int64_t k1, int32_t* c) {
    const int64_t nb = nb0 + g;
    const uint8_t* p = b0(nb);
    r16_block<T, Int8>(a0, a1, p, two(nb) ? p + block_bytes : p, two(nb), tails + g * 2048, full, k0, k1, pf, c);
  }
};

// The AMX GEMM's loop nest over A in tile order (a_tile_order) and B from Src (PackedB / R16B). Per parallel
// task a group of cpu_amx_n_group 32-column blocks (fewer where the groups would leave a thread without
// one), then the rows in chunks of cpu_amx_m_block (0: all), K in passes of cpu_amx_k_block bytes (0: all
// of K in one pass, the sums kept in tiles), and within a pass each column block of the group against every
// 32-row block of the chunk on the 2 × 2 tiles (AMX, or its model). A column block's K range for the pass
// (2 KiB per 64 bytes) stays in L1 while the chunk's row blocks stream past it, and a row block's A range
// serves the group's column blocks from L2; the partial sums wait in a thread's buffer between passes (four
// tile stores and loads per block and pass). With group 1, one chunk and one pass, this is a column block
// packed once and every row block over all of K. c holds a 32 × 32 block as the write-backs read it (row i at
// c + 32i, int32 or float bits).
template <class T, bool Int8, class Src>
void gemm_nest(const uint8_t* a_rows, int64_t kbytes, const WeightView& W, int64_t data_bytes, const SumsOut& so,
               int64_t M, const AmxOpts& ao) {
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kbytes / 64, mblocks = (M + 31) / 32;
  // One row block (M ≤ 32) has no other row block to share a column block's K range with, and its own A range
  // (≤ 128 KiB per 2 KiB of K) sits in L2 whatever the order: K passes and column groups only cut each column
  // block's stream into pieces, so it runs one pass, one column block per task (r16 [11264, 2048] BF16 from
  // DRAM at 16 / 32 tokens on an AMX VM: x1.36 / x1.55 the grouped passes)
  const bool one_row_block = mblocks == 1;
  const int64_t kstep = ao.k_block > 0 && !one_row_block ? std::max<int64_t>(1, ao.k_block / 64) : ktiles;
  const int64_t mstep = ao.m_block > 0 ? std::min(mblocks, std::max<int64_t>(1, ao.m_block / 32)) : mblocks;
  const int64_t group = one_row_block ? 1
                                      : std::max<int64_t>(1, std::min<int64_t>(ao.n_group, nblocks / std::max(1, omp_get_max_threads())));
  const int64_t groups = (nblocks + group - 1) / group;
  const bool passes = kstep < ktiles;
  Src::check(W, data_bytes);
  const at::Tensor tiled = a_tile_order(a_rows, kbytes, M);
  const uint8_t* a = tiled.data_ptr<uint8_t>();
#pragma omp parallel
  {
    Src src(W, data_bytes, kbytes, group);
    src.pf = one_row_block ? ao.prefetch : 0;
    std::vector<int32_t> cbuf((passes ? group * mstep : 1) * 1024 + 16);
    int32_t* cb = cbuf.data() + ((64 - reinterpret_cast<uintptr_t>(cbuf.data()) % 64) % 64) / 4;
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t nb0 = gi * group, count = std::min(group, nblocks - nb0);
      src.group(nb0, count);
      for (int64_t m0 = 0; m0 < mblocks; m0 += mstep) {
        const int64_t m1 = std::min(mblocks, m0 + mstep);
        for (int64_t k0 = 0; k0 < ktiles; k0 += kstep) {
          const int64_t k1 = std::min(ktiles, k0 + kstep);
          for (int64_t g = 0; g < count; ++g)
            for (int64_t mb = m0; mb < m1; ++mb) {
              int32_t* c = cb + (passes ? (g * mstep + (mb - m0)) * 1024 : 0);
              const uint8_t* a0 = a + 2 * mb * ktiles * 1024;
              src.template block<T, Int8>(g, a0, a0 + ktiles * 1024, k0, k1, c);
              if (k1 < ktiles) continue;
              if constexpr (Int8) so.put(c, 32, mb * 32, (nb0 + g) * 32, M, N);
              else so.put_f32(c, 32, mb * 32, (nb0 + g) * 32, M, N);
            }
        }
      }
    }
    T::release();
  }
}

// The AMX GEMM with the weights as the A operand, read where they lie (no packing): a tile is 16 weight rows
// × 64 bytes of K at the row stride, and the activations are the B operand, packed once per call (per 16
// tokens and K tile, a 16 × 16 transpose of 32-bit units: TDPBSSD's / TDPBF16PS's pairing of B). The sums
// come out transposed (weight rows × tokens) and are transposed back as they are written. For few rows
// (an expert's tokens, a short prefill) the weight is read once from memory, as a decode kernel reads it,
// instead of being packed for rows it will barely serve. Needs whole 64-byte K tiles in the rows.
// FP8 takes this path's loop with any K, each 32-row block expanded to bf16 rows first (Fp8RowsBf16: no transpose,
// where the packed nest's pack_fp8_b transposes every 16 × 16 block of bf16 pairs into a B tile).
inline bool amx_direct_ok(const WeightView& W, int64_t data_bytes) {
  return W.fmt == kFp8 || (W.row_bytes == data_bytes && data_bytes % 64 == 0);
}

// One block of 32 weight rows (A tiles 4 / 5: rows 0-15 / 16-31 at w, stride ld) × up to 32 tokens (B tiles
// 6 / 7 at bt and bt + ktiles KiB; `two`: the second token tile is used) over all of K, each weight row
// prefetched pf bytes ahead (0: none); the 4 sum tiles stored in s (tile q at s + 256q, 16 × 16).
template <class T, bool Int8>
MOETUNE_AMX void direct_block(const uint8_t* w, int64_t ld, const uint8_t* bt, int64_t ktiles, bool two, int64_t pf,
                              int32_t* s) {
  T::template zero<0>();
  T::template zero<1>();
  T::template zero<2>();
  T::template zero<3>();
  const uint8_t* bt1 = bt + ktiles * 1024;
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    if (pf > 0 && 64 * kt + pf < ld)
      for (int r = 0; r < 32; ++r) _mm_prefetch((const char*)(w + r * ld + 64 * kt + pf), _MM_HINT_T0);
    tile_step<T, Int8>(w + 64 * kt, w + 16 * ld + 64 * kt, ld, bt + kt * 1024, bt1 + kt * 1024, two);
  }
  store_sums<T>(s, 64, 256, 512);
}

// direct_block's sums for 32 weight rows × up to 32 tokens, transposed into c[token][32 weight rows] (st, tr: scratch).
template <class T, bool Int8>
inline void direct_sums(const uint8_t* w, int64_t ld, const uint8_t* bt, int64_t ktiles, bool two, int64_t pf, int32_t* st,
                        int32_t* tr, int32_t* c) {
  direct_block<T, Int8>(w, ld, bt, ktiles, two, pf, st);
  // tile (i, j) = weight rows 16i.., tokens 16j..: transposed into c[token][32 weight rows]
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < (two ? 2 : 1); ++j) {
      const int32_t* q = st + 256 * (2 * i + j);
      const uint8_t* src[16];
      for (int r = 0; r < 16; ++r) src[r] = reinterpret_cast<const uint8_t*>(q + 16 * r);
      transpose16_u32(src, 0, reinterpret_cast<uint8_t*>(tr));
      for (int t = 0; t < 16; ++t) std::memcpy(c + (16 * j + t) * 32 + 16 * i, tr + 16 * t, 64);
    }
}

template <class T, bool Int8>
void gemm_direct(const uint8_t* a_rows, int64_t kbytes, const WeightView& W, const SumsOut& so, int64_t M, int64_t pf) {
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kbytes / 64, ttiles = (M + 15) / 16;
  // B: per token tile tt and K tile kt, at b + (tt·ktiles + kt)·1024 (a_rows has M padded to 32 zero rows)
  at::Tensor bbuf = at::empty({ttiles * ktiles * 1024 + 64}, at::kByte);
  uint8_t* b = bbuf.data_ptr<uint8_t>() + ((64 - reinterpret_cast<uintptr_t>(bbuf.data_ptr()) % 64) % 64);
  at::parallel_for(0, ttiles * ktiles, 16, [&](int64_t s0, int64_t e0) {
    for (int64_t i = s0; i < e0; ++i) {
      const int64_t tt = i / ktiles, kt = i % ktiles;
      const uint8_t* rows[16];
      for (int r = 0; r < 16; ++r) rows[r] = a_rows + (16 * tt + r) * kbytes;
      transpose16_u32(rows, 64 * kt, b + i * 1024);
    }
  });
  // FP8: each block's 32 rows expanded to bf16 rows in a thread's buffer (Fp8RowsBf16), rows a line more than
  // kbytes apart (a 4 KiB multiple would put a tile's 16 rows in one L1 set); a task takes the blocks of one scale
  // row together (DeepSeek's 128 rows: 4 blocks), whose tables are made once
  const bool fp8 = W.fmt == kFp8;
  if (fp8) note_used(kUsedFp8Rows);
  const int64_t ld = fp8 ? kbytes + 64 : W.row_bytes;
  const int chunk = fp8 ? (int)std::max<int64_t>(1, W.block_n / 32) : 1;
#pragma omp parallel
  {
    alignas(64) int32_t st[4 * 256], tr[256], c[32 * 32];
    std::vector<uint8_t> tail;  // the last block's rows past N: zeros (the weight's own rows stop at N)
    std::vector<uint8_t> wbuf(fp8 ? 32 * ld + 64 : 0);
    uint8_t* wb = fp8 ? wbuf.data() + ((64 - reinterpret_cast<uintptr_t>(wbuf.data()) % 64) % 64) : nullptr;
    Fp8RowsBf16 conv;
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      const uint8_t* w = fp8 ? wb : W.w + nb * 32 * ld;
      if (fp8) {
        conv.rows(W, nb * 32, kbytes, ld, pf, wb);
      } else if (nb * 32 + 32 > N) {
        tail.assign(32 * ld, 0);
        std::memcpy(tail.data(), w, (N - nb * 32) * ld);
        w = tail.data();
      }
      for (int64_t tt = 0; tt < ttiles; tt += 2) {
        const bool two = tt + 1 < ttiles;
        direct_sums<T, Int8>(w, ld, b + tt * ktiles * 1024, ktiles, two, fp8 ? 0 : pf, st, tr, c);
        const int64_t rows = std::min<int64_t>(two ? 32 : 16, M - 16 * tt);
        if constexpr (Int8) so.put(c, rows, 16 * tt, nb * 32, M, N);
        else so.put_f32(c, rows, 16 * tt, nb * 32, M, N);
      }
    }
    T::release();
  }
}

// The AMX GEMM: r16 weights where they lie (gemm_nest on R16B); row-major ones in place up to ao.direct_max
// rows (where the rows hold whole K tiles; FP8 up to ao.fp8_direct_max, expanded to bf16 rows), else packed weight
// blocks (gemm_nest on PackedB).
template <class T, bool Int8>
void gemm_amx(const uint8_t* a_rows, int64_t kbytes, const WeightView& W, int64_t data_bytes, const SumsOut& so,
              int64_t M, const AmxOpts& ao) {
  if (is_r16(W.fmt)) {
    note_used(kUsedR16);  // the layout, beside the engine
    gemm_nest<T, Int8, R16B>(a_rows, kbytes, W, data_bytes, so, M, ao);
  } else if (M <= ao.direct_rows(W) && amx_direct_ok(W, data_bytes)) gemm_direct<T, Int8>(a_rows, kbytes, W, so, M, ao.prefetch);
  else gemm_nest<T, Int8, PackedB>(a_rows, kbytes, W, data_bytes, so, M, ao);
}

// The dot-product engine (dot_block_*): 8 rows at a time; the models run under MXCSR.DAZ|FTZ.
template <bool Int8>
void gemm_dot(bool model, const uint8_t* a, int64_t kbytes, const WeightView& W, int64_t data_bytes, const SumsOut& so,
              int64_t M) {
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kbytes / 64;
  void (*block)(const uint8_t*, int64_t, const uint8_t*, void*) =
      Int8 ? (model ? dot_block_int8_model : dot_block_int8_hw) : (model ? dot_block_bf16_model : dot_block_bf16_hw);
#pragma omp parallel
  {
    const unsigned csr = _mm_getcsr();
    if (model) _mm_setcsr(csr | 0x8040u);
    std::vector<uint8_t> bbuf(ktiles * 2 * 1024 + 64);
    uint8_t* b = bbuf.data() + ((64 - reinterpret_cast<uintptr_t>(bbuf.data()) % 64) % 64);
    alignas(64) int32_t c[8 * 32];
    const bool fp8 = W.fmt == kFp8;  // expanded to BF16 per block (pack_fp8_b)
    std::vector<uint8_t> rows(fp8 ? 32 * kbytes : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      if (fp8) pack_fp8_b(W, nb * 32, kbytes, rows.data(), b);
      else pack_b(W, nb * 32, data_bytes, kbytes, b);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        block(a + m0 * kbytes, kbytes, b, c);
        if constexpr (Int8) so.put(c, 8, m0, nb * 32, M, N);
        else so.put_f32(c, 8, m0, nb * 32, M, N);
      }
    }
    if (model) _mm_setcsr(csr);
  }
}

// The INT8 GEMM on vpmaddubsw (maddubs_block): per parallel task one 32-column block packed once,
// then every pair of A rows (A padded to whole pairs with zero rows), the sums written as `so` says.
void gemm_maddubs(const uint8_t* a, int64_t kbytes, const WeightView& W, int64_t data_bytes, const SumsOut& so,
                  int64_t M) {
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kbytes / 64;
#pragma omp parallel
  {
    std::vector<uint8_t> bbuf(ktiles * 2 * 1024 + 64);
    uint8_t* b = bbuf.data() + ((64 - reinterpret_cast<uintptr_t>(bbuf.data()) % 64) % 64);
    alignas(64) int32_t c[kMaddubsMBlock * 32];
    const int64_t units = kbytes / 4;
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      pack_b(W, nb * 32, data_bytes, kbytes, b);
      for (int64_t m0 = 0; m0 < M; m0 += kMaddubsMBlock) {
        std::memset(c, 0, sizeof(c));
        const int64_t rows = std::min<int64_t>(kMaddubsMBlock, ((M - m0 + kMaddubsRows - 1) / kMaddubsRows) * kMaddubsRows);
        // the whole K per row pair (K chunks reusing B from L1 across pairs measured no better here)
        for (int64_t i = 0; i < rows; i += kMaddubsRows)
          maddubs_block(a + (m0 + i) * kbytes, kbytes, 0, units, b, c + i * 32);
        so.put(c, rows, m0, nb * 32, M, N);
      }
    }
  }
}

// ------------------------------------------------------------------ INT4 GEMM on vpdpbusd
//
// INT4 group weights (unsigned nibbles q, per (row, group) scale s and zero point z: w = s·(q − z))
// against activations quantized to int8 per (token, group) with the int8 INT4 microkernel method's
// scale (prepare_act's xb: xs = amax/127 of the group) and the reference's rounding (x_q = round(x / xs)
// half to even, ∈ [−127, 127]; prepare_act multiplies by 1/xs, which can differ by one in a tie):
//   y[m, n] = Σ_g s[n, g] · xs[m, g] · (Σ_{k∈g} q[n, k]·x_q[m, k] − z[n, g] · Σ_{k∈g} x_q[m, k]).
// The nibbles are the unsigned operand of vpdpbusd and x_q the signed one, so no +128 term. Per
// 32-column block of W, packed once per call: the nibbles expanded to bytes in a scratch [32][kbytes]
// and laid out by pack_b (the INT8 kernel's layout), plus per group the 32 columns' s and z as four
// vectors. The kernel runs R rows of A × the 32 columns: R × 2 int32 sums of the current group in
// registers (with the two B vectors and A's broadcast), R × 2 float32 accumulators touched once per
// group (at R = 8 the compiler keeps them in L1, a C tile); at each group's end the sums (exact
// integers, < 2^24 for groups up to 8192) minus z·Σx_q (exact for integer zero points, as both quantizers make them) are
// scaled by s·xs into the accumulators. R = 8 measured fastest (small.ffn_gate_up, 512 tokens, 2
// threads: R 4 / 6 / 8 / 10 / 12 → 30.5 / 28.1 / 26.6 / 27.1 / 26.8 ms median; INT8's VNNI GEMM
// 26.2 ms in the same runs). Per (token, group) activation scales rather than one per token: the int8
// INT4 decode method's numerics (one rounding rule for decode and prefill) and a finer step where
// activations have outlier channels, for one multiply (s·xs) per group and column vector.
constexpr int kInt4GemmRows = 8;

// One scale group into 16 float32 accumulators: acc + (part − z·Σx_q) · (s·xs), the operations and order every INT4
// GEMM engine shares (int4_block's registers, the AMX engine's stored tile sums), so their results are bitwise equal.
inline __m512 int4_scaled(__m512 acc, __m512i part, __m512 s, __m512 z, __m512 x, __m512 q) {
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(z, q, _mm512_cvtepi32_ps(part)), _mm512_mul_ps(s, x), acc);
}

#define MOETUNE_INT4_BLOCK(NAME, ATTR, DP)                                                            \
  template <int R>                                                                                   \
  ATTR void NAME(const int8_t* a, int64_t kbytes, const float* xs, const float* xsum, int64_t G,       \
                 int64_t gunits, const uint8_t* b, const float* sz, float* c) {                       \
    __m512 acc[R][2];                                                                                \
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();                         \
    for (int64_t g = 0; g < G; ++g) {                                                                \
      __m512i part[R][2];                                                                            \
      for (int i = 0; i < R; ++i) part[i][0] = part[i][1] = _mm512_setzero_si512();                  \
      for (uint64_t u = g * gunits; u < (uint64_t)((g + 1) * gunits); ++u) {                         \
        const uint8_t* bu = b + (u / 16) * 2048 + (u % 16) * 64;                                     \
        const __m512i b0 = _mm512_load_si512((const void*)bu), b1 = _mm512_load_si512((const void*)(bu + 1024)); \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {                                       \
          const __m512i av = _mm512_set1_epi32(load_u32((const uint8_t*)a + i * kbytes + 4 * u));     \
          part[i][0] = DP(part[i][0], b0, av);                                                       \
          part[i][1] = DP(part[i][1], b1, av);                                                       \
        }                                                                                            \
      }                                                                                              \
      const float* s = sz + g * 64;                                                                  \
      const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);                               \
      const __m512 z0 = _mm512_load_ps(s + 32), z1 = _mm512_load_ps(s + 48);                          \
      _Pragma("GCC unroll 8") for (int i = 0; i < R; ++i) {                                         \
        const __m512 x = _mm512_set1_ps(xs[i * G + g]), q = _mm512_set1_ps(xsum[i * G + g]);          \
        acc[i][0] = int4_scaled(acc[i][0], part[i][0], s0, z0, x, q);                                 \
        acc[i][1] = int4_scaled(acc[i][1], part[i][1], s1, z1, x, q);                                 \
      }                                                                                              \
    }                                                                                                \
    for (int i = 0; i < R; ++i) {                                                                    \
      _mm512_store_ps(c + i * 32, acc[i][0]);                                                        \
      _mm512_store_ps(c + i * 32 + 16, acc[i][1]);                                                   \
    }                                                                                                \
  }
MOETUNE_INT4_BLOCK(int4_block_hw, MOETUNE_TARGET_VNNI, VnniHw::dpbusd)
MOETUNE_INT4_BLOCK(int4_block_model, , VnniModel::dpbusd)
#undef MOETUNE_INT4_BLOCK

// The same GEMM on vpmaddubsw (cpu_int4_gemm=maddubs, any CPU): the nibbles (≤ 15) are its unsigned
// side and x_q (|x_q| ≤ 127) its signed side, so no sign trick is needed, and a pair sum is at most
// 2·15·127 = 3810: eight units add up in int16 (≤ 30480) before vpmaddwd widens them to int32, about
// two instructions per 32 products. Two rows × 16 columns per sweep (4 int16 and 4 int32 sums in
// registers), the 32-column block in two halves, the float32 accumulators in c. The integer sums are
// vpdpbusd's, and the group step the same instructions in the same order: bitwise equal to int4_block.
void int4_block_maddubs(const int8_t* a, int64_t kbytes, const float* xs, const float* xsum, int64_t G,
                        int64_t gunits, const uint8_t* b, const float* sz, float* c) {
  constexpr int R = kInt4GemmRows;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R * 32; i += 8) _mm256_store_ps(c + i, _mm256_setzero_ps());
  // group-major, so that a group's B (gunits · 128 bytes) serves every row pair from L1
  for (int64_t g = 0; g < G; ++g)
    for (int i0 = 0; i0 < R; i0 += 2)
      for (int h = 0; h < 2; ++h) {
        __m256i p32[2][2];
        for (int i = 0; i < 2; ++i) p32[i][0] = p32[i][1] = _mm256_setzero_si256();
        for (uint64_t u8 = g * gunits; u8 < (uint64_t)((g + 1) * gunits); u8 += 8) {
          // eight units lie in one K tile (u8 is a multiple of 8): constant offsets from its base
          const uint8_t* bu = b + (u8 / 16) * 2048 + (u8 % 16) * 64 + 1024 * h;
          const uint8_t* ap = (const uint8_t*)a + i0 * kbytes + 4 * u8;
          __m256i p16[2][2];
          for (int i = 0; i < 2; ++i) p16[i][0] = p16[i][1] = _mm256_setzero_si256();
          _Pragma("GCC unroll 8") for (int uu = 0; uu < 8; ++uu) {
            const __m256i b0 = _mm256_load_si256((const __m256i*)(bu + 64 * uu));
            const __m256i b1 = _mm256_load_si256((const __m256i*)(bu + 64 * uu + 32));
            for (int i = 0; i < 2; ++i) {
              const __m256i av = _mm256_set1_epi32(load_u32(ap + i * kbytes + 4 * uu));
              p16[i][0] = _mm256_add_epi16(p16[i][0], _mm256_maddubs_epi16(b0, av));
              p16[i][1] = _mm256_add_epi16(p16[i][1], _mm256_maddubs_epi16(b1, av));
            }
          }
          for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 2; ++j) p32[i][j] = _mm256_add_epi32(p32[i][j], _mm256_madd_epi16(p16[i][j], ones));
        }
        const float* s = sz + g * 64 + 16 * h;
        for (int i = 0; i < 2; ++i) {
          const __m256 x = _mm256_set1_ps(xs[(i0 + i) * G + g]), q = _mm256_set1_ps(xsum[(i0 + i) * G + g]);
          for (int j = 0; j < 2; ++j) {
            float* cp = c + (i0 + i) * 32 + 16 * h + 8 * j;
            const __m256 sv = _mm256_load_ps(s + 8 * j), zv = _mm256_load_ps(s + 32 + 8 * j);
            _mm256_store_ps(cp, _mm256_fmadd_ps(_mm256_fnmadd_ps(zv, q, _mm256_cvtepi32_ps(p32[i][j])),
                                                _mm256_mul_ps(sv, x), _mm256_load_ps(cp)));
          }
        }
      }
}

// Columns [n0, n0 + 32) of an INT4 weight packed for int4_block: the nibbles as bytes in pack_b's layout at b
// (through the scratch `rows`, [32][kbytes], zero past the row's data and past N, unless the block is whole), and
// per group g the columns' scales at sz[64g .. 64g + 32) and zero points at sz[64g + 32 .. 64g + 64)
// (zero past N).
void pack_int4_b(const WeightView& W, int64_t n0, int64_t G, int64_t kbytes, uint8_t* rows, uint8_t* b, float* sz) {
  const int64_t chunks = W.row_bytes / 16;  // 32 elements per 16 bytes
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < 32; ++j) {
      const int64_t n = n0 + j;
      sz[64 * g + j] = n < W.N ? W.scale[n * W.scale_ld + g] : 0.f;
      sz[64 * g + 32 + j] = n < W.N ? int4_zero(W.zero, n * W.scale_ld + g) : 0.f;
    }
  if (n0 + 32 <= W.N && 2 * W.row_bytes == kbytes) {
    // a whole block (32 rows inside N, whole 64-byte K tiles): each half's K tile goes from its rows' 32 packed bytes
    // to the 64 bytes in registers (per 16-byte chunk its low nibbles, then its high ones) and is transposed there
    // into its B tile, as pack_fp8_b's register path does; the same bytes as through the scratch and pack_b
    constexpr int64_t kAhead = 512;  // bytes of each row prefetched ahead of its expansion
    const int64_t ktiles = kbytes / 64;
    for (int64_t h = 0; h < 2; ++h) {
      const uint8_t* src[16];
      for (int64_t n = 0; n < 16; ++n) src[n] = W.w + (n0 + 16 * h + n) * W.row_bytes;
      for (int64_t kt = 0; kt < ktiles; ++kt) {
        if (kt % 2 == 0) prefetch_rows16(src, 32 * kt + kAhead, W.row_bytes, W.row_bytes);
        __m512i r[16];
        for (int64_t n = 0; n < 16; ++n) {
          const __m128i c0 = _mm_loadu_si128((const __m128i*)(src[n] + 32 * kt));
          const __m128i c1 = _mm_loadu_si128((const __m128i*)(src[n] + 32 * kt + 16));
          const __m256i y0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c0, 4), nib), _mm_and_si128(c0, nib));
          const __m256i y1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c1, 4), nib), _mm_and_si128(c1, nib));
          r[n] = _mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1);
        }
        transpose16_u32_regs(r, b + (kt * 2 + h) * 1024);
      }
    }
    return;
  }
  for (int64_t n = 0; n < 32; ++n) {
    uint8_t* d = rows + n * kbytes;
    int64_t done = 0;
    if (n0 + n < W.N) {
      const uint8_t* src = W.w + (n0 + n) * W.row_bytes;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m128i v = _mm_loadu_si128((const __m128i*)(src + 16 * c));
        _mm_storeu_si128((__m128i*)(d + 32 * c), _mm_and_si128(v, nib));
        _mm_storeu_si128((__m128i*)(d + 32 * c + 16), _mm_and_si128(_mm_srli_epi16(v, 4), nib));
      }
      done = 32 * chunks;
    }
    std::memset(d + done, 0, kbytes - done);
  }
  pack_scratch_b(rows, kbytes, kInt8, b);
}

// A thread's buffer for pack_int4_b: the packed B block (32 × kbytes), the G groups' scales and zero points, and the
// nibble-expansion scratch (32 × kbytes), 64-byte aligned.
struct Int4Pack {
  std::vector<uint8_t> buf;
  uint8_t *b, *rows;
  float* sz;
  Int4Pack(int64_t kbytes, int64_t G) : buf(2 * 32 * kbytes + 64 * G * sizeof(float) + 64) {
    b = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64);
    sz = reinterpret_cast<float*>(b + 32 * kbytes);
    rows = b + 32 * kbytes + 64 * G * sizeof(float);
  }
  void pack(const WeightView& W, int64_t n0, int64_t G, int64_t kbytes) { pack_int4_b(W, n0, G, kbytes, rows, b, sz); }
};

// INT4 on AMX (cpu_int4_gemm=amx): gemm_int4's packing and numerics on TDPBSSD. The nibbles expanded to bytes
// (0-15: valid signed bytes) are pack_b's B tiles, the int8 activations A's tiles (a_tile_order). Per 32 × 32
// block of C and scale group (groups of a multiple of 64: whole K tiles), the group's int32 sums in the 2 × 2
// tiles (int4_group_sums), stored to c, then scaled into the block's float32 accumulators with int4_block's
// operations in int4_block's order (int4_scale_group): bitwise the VNNI GEMM's result.
template <class T>
MOETUNE_AMX void int4_group_sums(const uint8_t* a0, const uint8_t* a1, const uint8_t* b, int64_t kt0, int64_t kt1,
                                 int32_t* c) {
  start_sums<T>(0, c);
  for (int64_t kt = kt0; kt < kt1; ++kt)
    tile_step<T, true>(a0 + kt * 1024, a1 + kt * 1024, 64, b + kt * 2048, b + kt * 2048 + 1024, true);
  store_sums<T>(c, 128, 16, 512);
}

// acc [32][32] += (c − z·Σx_q) · (s·xs) for group g: c the group's sums [32][32], xs / xsum the block's rows'
// [32][G], sz pack_int4_b's scales and zero points of the block's columns.
inline void int4_scale_group(const int32_t* c, int64_t G, int64_t g, const float* xs, const float* xsum,
                             const float* sz, float* acc) {
  const float* s = sz + g * 64;
  const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);
  const __m512 z0 = _mm512_load_ps(s + 32), z1 = _mm512_load_ps(s + 48);
  for (int i = 0; i < 32; ++i) {
    const __m512 x = _mm512_set1_ps(xs[i * G + g]), q = _mm512_set1_ps(xsum[i * G + g]);
    float* ai = acc + 32 * i;
    const int32_t* ci = c + 32 * i;
    _mm512_store_ps(ai, int4_scaled(_mm512_load_ps(ai), _mm512_load_si512((const void*)ci), s0, z0, x, q));
    _mm512_store_ps(ai + 16, int4_scaled(_mm512_load_ps(ai + 16), _mm512_load_si512((const void*)(ci + 16)), s1, z1, x, q));
  }
}

// gemm_int4's AMX engine (T: AmxHw or AmxEmu) on its quantized rows a ([mpad][kbytes], mpad a multiple of 32) and
// per-(row, group) xs / xsum: per parallel task one 32-column block packed once, then every 32-row block over the
// groups; out [M, N] float32.
template <class T>
void gemm_int4_amx(const int8_t* a, int64_t kbytes, const float* xs, const float* xsum, int64_t G, int64_t gsz,
                   const WeightView& W, int64_t M, const SumsOut& so) {
  const at::Tensor tiled = a_tile_order(reinterpret_cast<const uint8_t*>(a), kbytes, M);
  const uint8_t* ta = tiled.data_ptr<uint8_t>();
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kbytes / 64, gtiles = gsz / 64, mblocks = (M + 31) / 32;
#pragma omp parallel
  {
    Int4Pack p(kbytes, G);
    alignas(64) int32_t c[32 * 32];
    alignas(64) float acc[32 * 32];
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      p.pack(W, nb * 32, G, kbytes);
      for (int64_t mb = 0; mb < mblocks; ++mb) {
        const uint8_t* a0 = ta + 2 * mb * ktiles * 1024;
        for (int i = 0; i < 32 * 32; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
        for (int64_t g = 0; g < G; ++g) {
          int4_group_sums<T>(a0, a0 + ktiles * 1024, p.b, g * gtiles, (g + 1) * gtiles, c);
          int4_scale_group(c, G, g, xs + mb * 32 * G, xsum + mb * 32 * G, p.sz, acc);
        }
        so.put_f32(reinterpret_cast<const int32_t*>(acc), 32, mb * 32, nb * 32, M, N);
      }
    }
    T::release();
  }
}

// INT4 r16 weights on AMX (kInt4R16, groups of 128; cpu_int4_gemm=amx): no transpose. Line j of a group's
// 16-row block (16 rows × 4 packed bytes) masked to its low nibbles is row j of the group's first B tile (K 4j .. 4j + 3
// of the r16 activation order), its high nibbles row j of the second; the int8 activations are the r16 microkernels'
// (prepare_act: xb in that order, xbs the per-(row, group) scales, gsb scale × Σq), in tile order as A. Per 32 × 32
// block and group, the group's exact int32 sums (int4_group_sums), then r16_int4_tile's float operations in its order:
// acc = fmadd(float(sums), s · xs, acc), then acc = fnmadd(s·z, gs, acc). So the result is bitwise the r16
// microkernels'. Per task (32 columns) the groups in turn, each unpacked into 4 KiB just before every row block's
// products with it (an expert's few rows would otherwise read a whole unpacked block back from L2). Only by name
// (cpu_int4_gemm=amx): on an AMX VM, fused MoE `small` at 128 tokens x0.80 the microkernels, x1.24 at 512
// (docs/cpu_kernels.md "Session 41").
template <class T>
void gemm_int4_r16_amx(const uint8_t* a_rows, int64_t kp, const float* xs, const float* gs, int64_t G,
                       const WeightView& W, int64_t M, const SumsOut& so) {
  const at::Tensor tiled = a_tile_order(a_rows, kp, M);
  const uint8_t* ta = tiled.data_ptr<uint8_t>();
  const int64_t N = W.N, nblocks = (N + 31) / 32, ktiles = kp / 64, mblocks = (M + 31) / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
#pragma omp parallel
  {
    // one group's two B tile pairs (4 KiB, in L1), unpacked just before its products; every row block's
    // accumulators (4 KiB each) meanwhile
    alignas(64) uint8_t b[4096];
    std::vector<float> abuf(mblocks * 1024 + 16);
    float* accs = abuf.data() + ((64 - reinterpret_cast<uintptr_t>(abuf.data()) % 64) % 64) / 4;
    alignas(64) int32_t c[32 * 32];
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      const int64_t n0 = nb * 32;
      const bool two = n0 + 16 < N;  // N is whole 16-row blocks: the second may be missing (its B tiles zero)
      // the two blocks' scales and scale·zero products (the second only where it exists)
      const Int4R16Groups gv[2] = {Int4R16Groups(W, n0), two ? Int4R16Groups(W, n0 + 16) : Int4R16Groups()};
      if (!two) {
        std::memset(b + 1024, 0, 1024);
        std::memset(b + 3072, 0, 1024);
      }
      for (int64_t i = 0; i < mblocks * 1024; i += 16) _mm512_store_ps(accs + i, _mm512_setzero_ps());
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
          const uint8_t* blk = W.w + (n0 + 16 * h) * W.row_bytes + 64 * 16 * g;
          for (int64_t j = 0; j < 16; ++j) {
            const __m512i v = _mm512_loadu_si512((const void*)(blk + 64 * j));
            _mm512_store_si512((void*)(b + h * 1024 + 64 * j), _mm512_and_si512(v, nib));
            _mm512_store_si512((void*)(b + 2048 + h * 1024 + 64 * j), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
          }
        }
        for (int64_t mb = 0; mb < mblocks; ++mb) {
          const uint8_t* a0 = ta + 2 * mb * ktiles * 1024;
          const int64_t rows = std::min<int64_t>(32, M - 32 * mb);
          // b holds the group's K tiles 2g, 2g + 1 at 0 and 2 KiB: A from the group's first K tile
          const uint8_t* ag = a0 + 2 * g * 1024;
          int4_group_sums<T>(ag, ag + ktiles * 1024, b, 0, 2, c);
          float* acc = accs + mb * 1024;
          for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
            const __m512 s = gv[h].scales(g);
            const __m512 z = gv[h].scale_zero(g, s);
            for (int64_t i = 0; i < rows; ++i) {
              const int64_t m = 32 * mb + i;
              float* ai = acc + 32 * i + 16 * h;
              const __m512 a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)(c + 32 * i + 16 * h))),
                                                _mm512_mul_ps(s, _mm512_set1_ps(xs[m * G + g])), _mm512_load_ps(ai));
              _mm512_store_ps(ai, _mm512_fnmadd_ps(z, _mm512_set1_ps(gs[m * G + g]), a1));
            }
          }
        }
      }
      for (int64_t mb = 0; mb < mblocks; ++mb)
        so.put_f32(reinterpret_cast<const int32_t*>(accs + mb * 1024), std::min<int64_t>(32, M - 32 * mb), mb * 32, n0, M, N);
    }
    T::release();
  }
}

}  // namespace

const std::string& amx_unavailable() {
  static const std::string reason = [] {
#ifdef MOETUNE_AVX2_BUILD
    return std::string("the AVX2 build of the kernels runs no AMX (its tile model only)");
#endif
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return std::string("cpuid leaf 7 is absent");
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22), int8 = d & (1u << 25);
    if (!(tile && bf16 && int8))
      return std::string("this CPU reports no AMX (cpuid leaf 7 EDX: AMX-TILE/AMX-BF16/AMX-INT8 clear)");
    // Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0)
      return std::string("the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
    return std::string();
  }();
  return reason;
}

// Before a GEMM on the hardware engine (kTilesAmx; its model kTilesAmxModel runs anywhere): AMX must run here.
static void check_amx_engine(int engine) {
  if (engine == kTilesAmx)
    TORCH_CHECK(usable_features() & kFeatAmx, "AMX GEMM: ", amx_unavailable().empty() ? "AMX is masked off" : amx_unavailable());
}

// x_act [M, K] float32 (INT8: the quantized integers, exact in float32; BF16: rounded to bf16 here) or
// bfloat16 (BF16 weights: the rows as they are) · Wᵀ → [M, N] float32 (INT8: the integer sums, the caller
// applies the scales), or bfloat16 (bf16_out, BF16 weights), on one tile engine: the AMX tiles or their
// emulation (k_block: gemm_nest's K pass), or the AVX-512 dot-product engine (gemm_dot, on the instructions
// or their models; INT8 needs W.wsum).
at::Tensor gemm_tiles_run(const at::Tensor& x_act, const WeightView& W, int engine, const AmxOpts& ao, bool bf16_out) {
  const bool int8 = W.fmt == kInt8 || W.fmt == kInt8R16, dot = engine == kTilesDot || engine == kTilesDotModel;
  TORCH_CHECK(W.fmt == kBF16 || W.fmt == kInt8 || (W.fmt == kFp8 && engine != kTilesMaddubs) ||
                  ((W.fmt == kBF16R16 || W.fmt == kInt8R16) && (engine == kTilesAmx || engine == kTilesAmxModel)),
              "tile GEMM: BF16, INT8 or FP8 weights (FP8: not on the vpmaddubsw engine; BF16 and INT8 r16: AMX only)");
  TORCH_CHECK(engine != kTilesMaddubs || int8, "tile GEMM: the vpmaddubsw engine takes INT8 weights only");
  TORCH_CHECK(x_act.scalar_type() == at::kFloat || (x_act.scalar_type() == at::kBFloat16 && !int8),
              "tile GEMM: float32 activations (bfloat16 for BF16 and FP8 weights)");
  TORCH_CHECK(!bf16_out || !int8, "tile GEMM: a bfloat16 output for BF16 and FP8 weights only");
  if (engine == kTilesAmx) {
    TORCH_CHECK(amx_unavailable().empty(), "AMX GEMM: ", amx_unavailable());
    TORCH_CHECK(usable_features() & kFeatAmx, "AMX GEMM: AMX is masked off (set_feature_mask)");
  }
  if (engine == kTilesDot)
    TORCH_CHECK(usable_features() & (int8 ? kFeatVnni : kFeatBf16), "tile GEMM: this CPU has no ",
                int8 ? "AVX512-VNNI" : "AVX512-BF16", " (or it is masked off)");
  TORCH_CHECK(!(dot && int8) || W.wsum, "tile GEMM: INT8 on vpdpbusd needs the weight's row sums");
  const int64_t M = x_act.size(0), K = W.K, esz = int8 ? 1 : 2;
  const int64_t kbytes = ((K * esz + 63) / 64) * 64, mpad = ((M + 31) / 32) * 32;
  at::Tensor x = x_act.contiguous();
  std::atomic<bool> has_m128{false};  // the vpmaddubsw engine's sign trick cannot negate −128
  // A: rows of kbytes bytes, zero-padded (bf16: round to nearest even, as torch's conversion;
  // INT8 on vpdpbusd: + 128, unsigned)
  at::Tensor abuf = at::zeros({mpad * kbytes}, at::kByte);
  uint8_t* a = abuf.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {  // bf16 rows as they are
    const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.data_ptr());
    at::parallel_for(0, M, 16, [&](int64_t s, int64_t e) {
      for (int64_t m = s; m < e; ++m) std::memcpy(a + m * kbytes, xb + m * 2 * K, 2 * K);
    });
  }
  const float* xs = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  if (xs) at::parallel_for(0, M, 16, [&](int64_t s, int64_t e) {
    const __m512i off = _mm512_set1_epi32(int8 && dot ? 128 : 0);
    for (int64_t m = s; m < e; ++m)
      for (int64_t k = 0; k < K; k += 16) {  // 16 lanes, masked at K
        const __mmask16 mk = tail_mask16(K - k);
        const __m512 v = _mm512_maskz_loadu_ps(mk, xs + m * K + k);
        if (int8) {  // the quantized integers (exact in float32), + 128 for vpdpbusd's unsigned side
          const __m512i q = _mm512_cvtps_epi32(v);
          if (engine == kTilesMaddubs && (mk & _mm512_cmp_ps_mask(v, _mm512_set1_ps(-128.f), _CMP_LE_OQ))) has_m128 = true;
          _mm512_mask_cvtepi32_storeu_epi8(a + m * kbytes + k, mk, _mm512_add_epi32(q, off));
        } else {  // bfloat16, round to nearest even; NaN → 0x7FC0 (c10::BFloat16's conversion)
          store_bf16x16(v, mk, a + m * kbytes + 2 * k);
        }
      }
  });
  TORCH_CHECK(!has_m128, "tile GEMM: the vpmaddubsw engine takes INT8 activations in [-127, 127] (symmetric "
              "quantization); a row holds -128");
  at::Tensor out = at::empty({M, W.N}, bf16_out ? at::kBFloat16 : at::kFloat);
  const int64_t data_bytes = K * esz;
  const SumsOut so{out.data_ptr(), dot && int8 ? W.wsum : nullptr, nullptr, nullptr, bf16_out};
  switch (engine) {
    case kTilesAmx:
      int8 ? gemm_amx<AmxHw, true>(a, kbytes, W, data_bytes, so, M, ao)
           : gemm_amx<AmxHw, false>(a, kbytes, W, data_bytes, so, M, ao);
      break;
    case kTilesAmxModel:
      int8 ? gemm_amx<AmxEmu, true>(a, kbytes, W, data_bytes, so, M, ao)
           : gemm_amx<AmxEmu, false>(a, kbytes, W, data_bytes, so, M, ao);
      break;
    case kTilesDot:
    case kTilesDotModel:
      int8 ? gemm_dot<true>(engine == kTilesDotModel, a, kbytes, W, data_bytes, so, M)
           : gemm_dot<false>(engine == kTilesDotModel, a, kbytes, W, data_bytes, so, M);
      break;
    case kTilesMaddubs:
      gemm_maddubs(a, kbytes, W, data_bytes, so, M);
      break;
    default: TORCH_CHECK(false, "tile GEMM: unknown engine ", engine);
  }
  return out;
}

// INT8 weights × activation rows already quantized (prepare_act's int16 integers, |q| ≤ 127, row stride
// ld; rows: nullptr for rows 0..M, else the rows to gather) on the vpdpbusd engine (A + 128, unsigned;
// on the instruction or its model) or the vpmaddubsw one (signed A), the scales applied in the
// write-back (xs[rows[m]] · W.scale[n]): no float32 copy of the activations, no pass over the output.
// → [M, N] float32, or bfloat16 (bf16_out: the float32 result rounded, as .to(kBFloat16) would).
// ------------------------------------------------------------------ fused MoE: the GEMM-path experts grouped
//
// cpu_moe_gemm_experts=grouped: the fused MoE's INT8 and BF16 experts that take AMX's in-place path (gemm_direct: from
// cpu_amx_min_tokens up to cpu_amx_direct_max_tokens tokens) run in one parallel region per phase instead of one
// GEMM call per expert, each with its own packing region, output tensor, SiLU pass and index_add_. Every expert's
// activation rows are packed as gemm_direct packs them, all experts in one region (pack_grouped_b). Phase 1's tasks
// are (expert, 32 intermediate rows): the gate rows' and the up rows' sums (INT8: scaled as write_back_scaled scales them),
// SiLU(gate)·up as silu_mul_f32 computes it, into h. Phase 2's tasks are 32 output columns over every grouped
// expert in turn, out[token] += (sums scaled) × the routing weight: what y.mul(wts) and index_add_ add, in the
// experts' order. So h and the output are bitwise the per-expert path's.
namespace {

struct GroupedB {
  at::Tensor buf;
  std::vector<int64_t> off;  // expert i's tiles at b + off[i]: token tile tt and K tile kt at + (tt·ktiles + kt)·1 KiB
  uint8_t* b = nullptr;
  int64_t ktiles = 0;
  // r16 weights: the tokens are the A operand (16 rows of 64 bytes per tile, as a_tile_order lays them); else
  // the B operand (a 16 × 16 transpose of 32-bit units per tile, as gemm_direct packs them)
  bool a_tiles = false;
};

// One activation row into kbytes bytes (zero past K): INT8, the prepared integers as bytes (gemm_int8_prepared's,
// AMX: no +128); BF16, float32 rounded to bfloat16 as gemm_tiles_run rounds (nearest even, NaN → 0x7FC0).
inline void grouped_row(const void* src, bool int8, int64_t K, int64_t kbytes, uint8_t* dst) {
  if (int8) {
    const int16_t* s = static_cast<const int16_t*>(src);
    for (int64_t k = 0; k < K; ++k) dst[k] = (uint8_t)s[k];
    std::memset(dst + K, 0, kbytes - K);
    return;
  }
  const float* s = static_cast<const float*>(src);
  std::memset(dst, 0, kbytes);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail_mask16(K - k);
    store_bf16x16(_mm512_maskz_loadu_ps(mk, s + k), mk, dst + 2 * k);
  }
}

// x: INT8 weights, the int16 integers; BF16, float32 rows (ld elements apart). a_tiles: for r16 weights (GroupedB).
GroupedB pack_grouped_b(const std::vector<MoeExpert>& ex, const void* x, int64_t ld, int64_t K, bool int8, bool a_tiles) {
  GroupedB g;
  const int64_t esz = int8 ? 1 : 2, kbytes = ((K * esz + 63) / 64) * 64;
  g.ktiles = kbytes / 64;
  g.a_tiles = a_tiles;
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, token tile)
  int64_t total = 0;
  for (size_t i = 0; i < ex.size(); ++i) {
    g.off.push_back(total);
    const int64_t tiles = (ex[i].n + 15) / 16;
    for (int64_t tt = 0; tt < tiles; ++tt) items.emplace_back((int64_t)i, tt);
    total += tiles * g.ktiles * 1024;
  }
  g.buf = at::empty({total + 64}, at::kByte);
  g.b = g.buf.data_ptr<uint8_t>() + ((64 - reinterpret_cast<uintptr_t>(g.buf.data_ptr()) % 64) % 64);
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t s, int64_t e) {
    std::vector<uint8_t> rows(16 * kbytes);
    for (int64_t it = s; it < e; ++it) {
      const MoeExpert& xe = ex[items[it].first];
      const int64_t tt = items[it].second;
      const uint8_t* ptr[16];
      for (int64_t r = 0; r < 16; ++r) {
        uint8_t* dst = rows.data() + r * kbytes;
        ptr[r] = dst;
        const int64_t j = 16 * tt + r;
        if (j >= xe.n) {
          std::memset(dst, 0, kbytes);
          continue;
        }
        grouped_row(static_cast<const uint8_t*>(x) + xe.rows[j] * ld * (int8 ? 2 : 4), int8, K, kbytes, dst);
      }
      uint8_t* b = g.b + g.off[items[it].first] + tt * g.ktiles * 1024;
      if (a_tiles)
        for (int64_t kt = 0; kt < g.ktiles; ++kt)
          for (int r = 0; r < 16; ++r) std::memcpy(b + kt * 1024 + 64 * r, ptr[r] + 64 * kt, 64);
      else
        for (int64_t kt = 0; kt < g.ktiles; ++kt) transpose16_u32(ptr, 64 * kt, b + kt * 1024);
    }
  });
  return g;
}

// float(sum) · xs · ws for 16 lanes: write_back_scaled's product, in its order
inline __m512 int8_scaled16(const int32_t* c, float x, const float* ws) {
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)c)), _mm512_set1_ps(x)),
                       _mm512_loadu_ps(ws));
}

// An output's 16 lanes: INT8, float(sum) · xs · ws (int8_scaled16); BF16, the float32 sums as they are.
template <bool Int8>
inline __m512 grouped_value16(const int32_t* c, const float* xs, int64_t row, const float* ws) {
  if constexpr (Int8) return int8_scaled16(c, xs[row], ws);
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(c));
}

// The sums of 32 weight rows from r0 (a multiple of 16) × the 32 tokens of token tiles tt, tt + 1 of an expert, into
// c[token][32 weight rows]: direct_sums on row-major weights (the rows as A tiles in place); on r16 weights, the
// rows' two 16-row blocks as B tiles in place (r16_block, one pass over K, each block's stream prefetched pf ahead)
// against the tokens' A tiles, whose sums come out in c's order (no transpose).
// FP8 weights: rows r0 .. r0 + 31 expanded to bf16 rows beforehand (GroupedFp8::rows), read from there.
struct GroupedFp8 {
  std::vector<uint8_t> buf;
  uint8_t* p[2] = {nullptr, nullptr};  // two blocks of 32 rows (gate and up)
  int64_t kbytes = 0, ld = 0;
  Fp8RowsBf16 conv[2];  // one per block, each keeping its scale row's tables
  explicit GroupedFp8(int64_t ktiles) : buf(2 * 32 * (64 * ktiles + 64) + 64), kbytes(64 * ktiles), ld(64 * ktiles + 64) {
    p[0] = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64);
    p[1] = p[0] + 32 * ld;
  }
  // FP8 rows r0 .. r0 + 31 of w expanded into block i
  const uint8_t* rows(const WeightView& w, int64_t r0, int i, int64_t pf) {
    conv[i].rows(w, r0, kbytes, ld, pf, p[i]);
    return p[i];
  }
};

template <class T, bool Int8>
inline void grouped_sums(const WeightView& w, int64_t r0, const GroupedB& B, int64_t e, int64_t tt, int64_t ttiles,
                         int64_t pf, int32_t* st, int32_t* tr, int32_t* c, const uint8_t* rows = nullptr,
                         int64_t rows_ld = 0) {
  const int64_t ld = w.row_bytes, ktiles = B.ktiles;
  const uint8_t* bt = B.b + B.off[e] + tt * ktiles * 1024;
  if (rows) {  // FP8 rows expanded to bf16 (GroupedFp8)
    direct_sums<T, Int8>(rows, rows_ld, bt, ktiles, tt + 1 < ttiles, 0, st, tr, c);
  } else if (B.a_tiles) {
    const uint8_t* b0 = w.w + r0 * ld;  // 16-row block r0 / 16: 16 · ld bytes, K tile kt at + kt KiB
    const uint8_t* a1 = tt + 1 < ttiles ? bt + ktiles * 1024 : nullptr;  // a lone last token tile: one A tile
    r16_block<T, Int8>(bt, a1, b0, b0 + 16 * ld, true, nullptr, ktiles, 0, ktiles, pf, c);
  } else {
    direct_sums<T, Int8>(w.w + r0 * ld, ld, bt, ktiles, tt + 1 < ttiles, pf, st, tr, c);
  }
}

template <class T, bool Int8>
void gate_up_grouped(const std::vector<MoeExpert>& ex, const GroupedB& B, const float* xs, int64_t I, int64_t pf) {
  const int64_t blocks = I / 32, tasks = (int64_t)ex.size() * blocks;
#pragma omp parallel
  {
    alignas(64) int32_t st[4 * 256], tr[256], cg[32 * 32], cu[32 * 32];
    GroupedFp8 f8(ex[0].w.fmt == kFp8 ? B.ktiles : 0);
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t e = t / blocks;
      const MoeExpert& x = ex[e];
      const int64_t i0 = (t % blocks) * 32, ttiles = (x.n + 15) / 16;
      const bool fp8 = x.w.fmt == kFp8;
      const uint8_t* rg = fp8 ? f8.rows(x.w, i0, 0, pf) : nullptr;
      const uint8_t* ru = fp8 ? f8.rows(x.w, I + i0, 1, pf) : nullptr;
      for (int64_t tt = 0; tt < ttiles; tt += 2) {
        const bool two = tt + 1 < ttiles;
        grouped_sums<T, Int8>(x.w, i0, B, e, tt, ttiles, pf, st, tr, cg, rg, f8.ld);
        grouped_sums<T, Int8>(x.w, I + i0, B, e, tt, ttiles, pf, st, tr, cu, ru, f8.ld);
        const int64_t rows = std::min<int64_t>(two ? 32 : 16, x.n - 16 * tt);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t j = 16 * tt + i;
          for (int q = 0; q < 2; ++q) {
            const __m512 g = grouped_value16<Int8>(cg + i * 32 + 16 * q, xs, x.rows[j], x.w.scale + i0 + 16 * q);
            const __m512 u = grouped_value16<Int8>(cu + i * 32 + 16 * q, xs, x.rows[j], x.w.scale + I + i0 + 16 * q);
            _mm512_storeu_ps(x.h + j * I + i0 + 16 * q, _mm512_mul_ps(silu512(g), u));  // silu_mul_f32's
          }
        }
      }
    }
    T::release();
  }
}

template <class T, bool Int8>
void down_grouped(const std::vector<MoeExpert>& ex, const GroupedB& B, const float* xs, int64_t D, float* out, int64_t pf) {
  const int64_t blocks = D / 32;
#pragma omp parallel
  {
    alignas(64) int32_t st[4 * 256], tr[256], c[32 * 32];
    GroupedFp8 f8(ex[0].w.fmt == kFp8 ? B.ktiles : 0);
    const TileConfig cfg = full_tiles();
    T::config(&cfg);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const int64_t d0 = nb * 32;
      for (size_t e = 0; e < ex.size(); ++e) {
        const MoeExpert& x = ex[e];
        const int64_t ttiles = (x.n + 15) / 16;
        const uint8_t* rd = x.w.fmt == kFp8 ? f8.rows(x.w, d0, 0, pf) : nullptr;
        for (int64_t tt = 0; tt < ttiles; tt += 2) {
          const bool two = tt + 1 < ttiles;
          grouped_sums<T, Int8>(x.w, d0, B, (int64_t)e, tt, ttiles, pf, st, tr, c, rd, f8.ld);
          const int64_t rows = std::min<int64_t>(two ? 32 : 16, x.n - 16 * tt);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t j = 16 * tt + i;
            const __m512 w = _mm512_set1_ps(x.wts[j]);
            float* o = out + x.toks[j] * D + d0;
            for (int q = 0; q < 2; ++q) {
              const __m512 y = grouped_value16<Int8>(c + i * 32 + 16 * q, xs, x.rows[j], x.w.scale + d0 + 16 * q);
              _mm512_storeu_ps(o + 16 * q, _mm512_add_ps(_mm512_loadu_ps(o + 16 * q), _mm512_mul_ps(y, w)));
            }
          }
        }
      }
    }
    T::release();
  }
}

}  // namespace

bool moe_grouped_ok(const WeightView& W, int64_t n, int engine, const AmxOpts& ao) {
  const int f = rows_format(W.fmt);  // INT8 / BF16, row-major or r16; FP8 row-major
  // whole 64-byte K tiles in every row (row-major) or 16-row block's stream (r16: no staged tail); FP8 any K
  return (engine == kTilesAmx || engine == kTilesAmxModel) && ((f == kInt8 && W.scale) || f == kBF16 || f == kFp8) &&
         n <= ao.direct_rows(W) && amx_direct_ok(W, W.K * (f == kInt8 ? 1 : 2)) && W.N % 32 == 0;
}

void moe_gate_up_grouped(const std::vector<MoeExpert>& ex, const void* x, int64_t ld, const float* xs, int64_t I,
                         int engine, const AmxOpts& ao) {
  if (ex.empty()) return;
  TORCH_CHECK(I % 32 == 0 && ex[0].w.N == 2 * I, "grouped MoE gate/up: whole 32-row blocks of gate and up");
  check_amx_engine(engine);
  const bool int8 = rows_format(ex[0].w.fmt) == kInt8;
  const GroupedB B = pack_grouped_b(ex, x, ld, ex[0].w.K, int8, is_r16(ex[0].w.fmt));
  if (ex[0].w.fmt == kFp8) note_used(kUsedFp8Rows);
  if (engine == kTilesAmx) (int8 ? gate_up_grouped<AmxHw, true> : gate_up_grouped<AmxHw, false>)(ex, B, xs, I, ao.prefetch);
  else (int8 ? gate_up_grouped<AmxEmu, true> : gate_up_grouped<AmxEmu, false>)(ex, B, xs, I, ao.prefetch);
}

void moe_down_grouped(const std::vector<MoeExpert>& ex, const void* x, int64_t ld, const float* xs, int64_t D,
                      float* out, int engine, const AmxOpts& ao) {
  if (ex.empty()) return;
  TORCH_CHECK(D % 32 == 0 && ex[0].w.N == D, "grouped MoE down: whole 32-row blocks of the output");
  check_amx_engine(engine);
  const bool int8 = rows_format(ex[0].w.fmt) == kInt8;
  const GroupedB B = pack_grouped_b(ex, x, ld, ex[0].w.K, int8, is_r16(ex[0].w.fmt));
  if (ex[0].w.fmt == kFp8) note_used(kUsedFp8Rows);
  if (engine == kTilesAmx) (int8 ? down_grouped<AmxHw, true> : down_grouped<AmxHw, false>)(ex, B, xs, D, out, ao.prefetch);
  else (int8 ? down_grouped<AmxEmu, true> : down_grouped<AmxEmu, false>)(ex, B, xs, D, out, ao.prefetch);
}

at::Tensor gemm_int8_prepared(const int16_t* xq, int64_t ld, const float* xs, const int64_t* rows, int64_t M,
                              const WeightView& W, int engine, const AmxOpts& ao, bool bf16_out) {
  const bool dot = engine == kTilesDot || engine == kTilesDotModel, amx = engine == kTilesAmx || engine == kTilesAmxModel;
  TORCH_CHECK((W.fmt == kInt8 || (W.fmt == kInt8R16 && amx)) && W.scale,
              "INT8 GEMM from integers: INT8 weights with scales (r16: on AMX only)");
  TORCH_CHECK(dot || amx || engine == kTilesMaddubs, "INT8 GEMM from integers: an AMX, vpdpbusd or vpmaddubsw engine");
  TORCH_CHECK(!dot || W.wsum, "INT8 GEMM from integers: vpdpbusd needs the weight's row sums");
  if (engine == kTilesDot)
    TORCH_CHECK(usable_features() & kFeatVnni, "tile GEMM: this CPU has no AVX512-VNNI (or it is masked off)");
  check_amx_engine(engine);
  // A in blocks of 8 rows (gemm_dot's dot block, kMaddubsMBlock), or 32 (AMX's 2 × 2 tiles)
  const int64_t K = W.K, kbytes = ((K + 63) / 64) * 64, mb = amx ? 32 : 8, mpad = ((M + mb - 1) / mb) * mb;
  at::Tensor abuf = at::empty({mpad * kbytes}, at::kByte), sbuf = at::empty({M}, at::kFloat);
  uint8_t* a = abuf.data_ptr<uint8_t>();
  float* s = sbuf.data_ptr<float>();
  const int off = dot ? 128 : 0;
  std::atomic<bool> bad{false};
  at::parallel_for(0, mpad, 16, [&](int64_t b, int64_t e) {
    int16_t lo = 0;
    for (int64_t m = b; m < e; ++m) {
      uint8_t* dst = a + m * kbytes;
      if (m >= M) {  // padding rows: zero integers
        std::memset(dst, off, kbytes);
        continue;
      }
      const int64_t r = rows ? rows[m] : m;
      const int16_t* src = xq + r * ld;
      for (int64_t k = 0; k < K; ++k) {
        dst[k] = (uint8_t)(src[k] + off);
        lo = std::min(lo, src[k]);
      }
      std::memset(dst + K, off, kbytes - K);
      s[m] = xs[r];
    }
    if (lo < -127) bad = true;
  });
  TORCH_CHECK(!bad || engine != kTilesMaddubs,
              "INT8 GEMM from integers: vpmaddubsw takes activations in [-127, 127] (symmetric quantization)");
  at::Tensor out = at::empty({M, W.N}, bf16_out ? at::kBFloat16 : at::kFloat);
  const SumsOut so{out.data_ptr(), dot ? W.wsum : nullptr, s, W.scale, bf16_out};
  if (engine == kTilesAmx) gemm_amx<AmxHw, true>(a, kbytes, W, K, so, M, ao);
  else if (engine == kTilesAmxModel) gemm_amx<AmxEmu, true>(a, kbytes, W, K, so, M, ao);
  else if (dot) gemm_dot<true>(engine == kTilesDotModel, a, kbytes, W, K, so, M);
  else gemm_maddubs(a, kbytes, W, K, so, M);
  return out;
}

std::string amx_status() { return amx_unavailable(); }

// Peak of the tile dot products (the probe): `iters` rounds of the 2 × 2 block's four products per
// thread on resident tiles. INT8: 16·16·64 multiply-adds per TDPBSSD; BF16: 16·16·32 per TDPBF16PS.
// GOP/s (2 ops per multiply-add).
double amx_peak_gops(int64_t iters, bool int8) {
  TORCH_CHECK(usable_features() & kFeatAmx, "AMX peak: ", amx_unavailable().empty() ? "AMX is masked off" : amx_unavailable());
  const auto t0 = std::chrono::steady_clock::now();
  int threads = 1;
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
    alignas(64) static thread_local uint8_t buf[2][1024];
    const TileConfig cfg = full_tiles();
    AmxHw::config(&cfg);
    AmxHw::zero<0>(); AmxHw::zero<1>(); AmxHw::zero<2>(); AmxHw::zero<3>();
    AmxHw::load<4>(buf[0], 64); AmxHw::load<5>(buf[1], 64); AmxHw::load<6>(buf[0], 64); AmxHw::load<7>(buf[1], 64);
    for (int64_t i = 0; i < iters; ++i) {
      if (int8) {
        AmxHw::dp_int8<0, 4, 6>(); AmxHw::dp_int8<1, 4, 7>(); AmxHw::dp_int8<2, 5, 6>(); AmxHw::dp_int8<3, 5, 7>();
      } else {
        AmxHw::dp_bf16<0, 4, 6>(); AmxHw::dp_bf16<1, 4, 7>(); AmxHw::dp_bf16<2, 5, 6>(); AmxHw::dp_bf16<3, 5, 7>();
      }
    }
    AmxHw::store<0>(buf[0], 64);
    AmxHw::release();
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 4 * 16 * 16 * (int8 ? 64 : 32) * (double)iters * threads / dt / 1e9;
}

// x_act [M, K] float32 · w [N, K]ᵀ (BF16 or INT8, contiguous) on any tile engine (TileEngine; k_block:
// AMX's K pass, 0 = whole K; direct: AMX reads the weight rows in place); INT8 row sums computed here for
// the dot-product engine.
at::Tensor tile_linear_raw(const at::Tensor& x_act, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                           int64_t engine, int64_t k_block, bool direct, int64_t n_group, int64_t m_block) {
  TORCH_CHECK(x_act.dim() == 2 && x_act.size(1) == K && x_act.scalar_type() == at::kFloat, "x_act: float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == N && w.size(1) == K, "w: contiguous [N, K]");
  WeightView W;
  W.fmt = (int)fmt;
  W.w = (const uint8_t*)w.data_ptr();
  W.N = N;
  W.K = K;
  W.row_bytes = K * (fmt == kInt8 ? 1 : 2);
  std::vector<int32_t> sums;
  if (fmt == kInt8 && (engine == kTilesDot || engine == kTilesDotModel)) {
    sums.assign(N, 0);
    const int8_t* p = (const int8_t*)W.w;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) sums[n] += p[n * K + k];
    W.wsum = sums.data();
  }
  return gemm_tiles_run(x_act, W, (int)engine, AmxOpts{k_block, direct ? INT64_MAX : 0, 0, n_group, m_block});
}

// the same on AMX or its emulation (tests/test_amx.py)
at::Tensor amx_linear_raw(const at::Tensor& x_act, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                          bool emulate, int64_t k_block, bool direct, int64_t n_group, int64_t m_block) {
  return tile_linear_raw(x_act, fmt, w, N, K, emulate ? kTilesAmxModel : kTilesAmx, k_block, direct, n_group, m_block);
}

// x_act [M, K] float32 (rows at any stride) · Wᵀ for an INT4 weight → [M, N] float32 real values, on
// the INT4 GEMM (int4_block: vpdpbusd or its C++ model, vpmaddubsw; gemm_int4_amx: AMX or its tile model).
// Activations quantized here per (token, group).
at::Tensor gemm_int4(const at::Tensor& x_act, const WeightView& W, int engine, bool bf16_out) {
  const bool amx = engine == kTilesAmx || engine == kTilesAmxModel;
  TORCH_CHECK(engine == kTilesDot || engine == kTilesDotModel || engine == kTilesMaddubs || amx, "INT4 GEMM: unknown engine ", engine);
  const bool model = engine == kTilesDotModel;
  TORCH_CHECK(!amx || W.group % 64 == 0, "INT4 GEMM on AMX: groups of a multiple of 64 (whole K tiles)");
  check_amx_engine(engine);
  TORCH_CHECK(W.fmt == kInt4 && W.scale && W.group % 32 == 0, "INT4 GEMM: INT4 weights in groups of a multiple of 32");
  TORCH_CHECK(engine != kTilesDot || (usable_features() & kFeatVnni), "INT4 GEMM: this CPU has no AVX512-VNNI (or it is masked off)");
  TORCH_CHECK(x_act.dim() == 2 && x_act.size(1) == W.K && x_act.scalar_type() == at::kFloat, "INT4 GEMM: x float32 [M, K]");
  const int64_t R = amx ? 32 : kInt4GemmRows;  // A's row block: AMX's 2 × 2 tiles, or int4_block's rows
  const at::Tensor x = x_act.stride(1) == 1 ? x_act : x_act.contiguous();
  const int64_t M = x.size(0), K = W.K, ld = x.stride(0), gsz = W.group, G = (K + gsz - 1) / gsz;
  TORCH_CHECK(W.row_bytes * 2 == G * gsz, "INT4 GEMM: rows must hold whole groups");
  const int64_t kbytes = ((G * gsz + 63) / 64) * 64, mpad = ((M + R - 1) / R) * R;
  // A: int8 rows of kbytes (zero past K); per (row, group) the scale and the sum of the integers
  at::Tensor abuf = at::zeros({mpad * kbytes}, at::kChar), sbuf = at::zeros({2, mpad * G}, at::kFloat);
  int8_t* a = abuf.data_ptr<int8_t>();
  float *xs = sbuf.data_ptr<float>(), *xsum = xs + mpad * G;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M * G, 16, [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t) {
      const int64_t m = t / G, g = t % G, k0 = g * gsz, n = std::min(gsz, K - k0);
      const float* xr = xp + m * ld + k0;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < n; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask16(n - k), xr + k)));
      const float am = _mm512_reduce_max_ps(amax), sc = am > 0.f ? am / 127.f : 1.f;
      // round(x / scale) to nearest even, clamped to ±127: the reference's and prepare_act's rounding
      const __m512 vs = _mm512_set1_ps(sc), lim = _mm512_set1_ps(127.f);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 mk = tail_mask16(n - k);
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(mk, xr + k), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
        const __m512i q = _mm512_cvtps_epi32(v);
        sum = _mm512_add_epi32(sum, q);
        _mm512_mask_cvtepi32_storeu_epi8(a + m * kbytes + k0 + k, mk, q);
      }
      xs[m * G + g] = sc;
      xsum[m * G + g] = (float)_mm512_reduce_add_epi32(sum);
    }
  });
  // bf16_out: each 32-column block rounded to bfloat16 as it is written (SumsOut::put_f32), no float32 [M, N] pass
  at::Tensor out = at::empty({M, W.N}, bf16_out ? at::kBFloat16 : at::kFloat);
  SumsOut so{out.data_ptr()};
  so.bf16 = bf16_out;
  if (amx) {
    engine == kTilesAmx ? gemm_int4_amx<AmxHw>(a, kbytes, xs, xsum, G, gsz, W, M, so)
                        : gemm_int4_amx<AmxEmu>(a, kbytes, xs, xsum, G, gsz, W, M, so);
    return out;
  }
  constexpr int RB = kInt4GemmRows;
  const int64_t N = W.N, nblocks = (N + 31) / 32, gunits = gsz / 4;
  auto block = engine == kTilesMaddubs ? int4_block_maddubs : model ? int4_block_model<RB> : int4_block_hw<RB>;
#pragma omp parallel
  {
    Int4Pack p(kbytes, G);
    alignas(64) float c[RB * 32];
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < nblocks; ++nb) {
      p.pack(W, nb * 32, G, kbytes);
      for (int64_t m0 = 0; m0 < M; m0 += RB) {
        block(a + m0 * kbytes, kbytes, xs + m0 * G, xsum + m0 * G, G, gunits, p.b, p.sz, c);
        so.put_f32(reinterpret_cast<const int32_t*>(c), RB, m0, nb * 32, M, N);
      }
    }
  }
  return out;
}


// INT4 r16 weights on AMX (gemm_int4_r16_amx) from the r16 microkernels' prepared activations p (xb, xbs, gsb: prepare_act
// with the weight's int4_i8 form), rows `rows` of them (null: 0 .. M − 1) → [M, N] float32, or bfloat16 (bf16_out).
at::Tensor gemm_int4_r16(const PreparedAct& p, const int64_t* rows, int64_t M, const WeightView& W, int engine, bool bf16_out) {
  TORCH_CHECK(engine == kTilesAmx || engine == kTilesAmxModel, "INT4 r16 GEMM: AMX or its tile model only");
  check_amx_engine(engine);
  TORCH_CHECK(W.fmt == kInt4R16 && W.group == 128 && W.N % 16 == 0 && (W.scale || W.scale_h), "INT4 r16 GEMM: kInt4R16 weights");
  TORCH_CHECK(p.xb.defined() && p.xbs.defined() && p.gsb.defined(), "INT4 r16 GEMM: the int8 activations of the r16 form");
  const int64_t kp = p.xb.size(1), G = p.xbs.size(1), mpad = ((M + 31) / 32) * 32;
  TORCH_CHECK(kp == 2 * W.row_bytes && kp == G * 128, "INT4 r16 GEMM: activations of whole groups");
  // A: the rows (gathered) into mpad zero-padded rows; their scales and group sums
  at::Tensor abuf = at::zeros({mpad * kp}, at::kByte), sbuf = at::empty({2, M * G}, at::kFloat);
  uint8_t* a = abuf.data_ptr<uint8_t>();
  float *xs = sbuf.data_ptr<float>(), *gs = xs + M * G;
  const int8_t* xb = p.xb.data_ptr<int8_t>();
  const float *pxs = p.xbs.data_ptr<float>(), *pgs = p.gsb.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t s0, int64_t e0) {
    for (int64_t m = s0; m < e0; ++m) {
      const int64_t r = rows ? rows[m] : m;
      std::memcpy(a + m * kp, xb + r * kp, kp);
      std::memcpy(xs + m * G, pxs + r * G, G * sizeof(float));
      std::memcpy(gs + m * G, pgs + r * G, G * sizeof(float));
    }
  });
  note_used(amx_used(engine) | kUsedR16);
  at::Tensor out = at::empty({M, W.N}, bf16_out ? at::kBFloat16 : at::kFloat);
  SumsOut so{out.data_ptr()};
  so.bf16 = bf16_out;
  if (engine == kTilesAmx) gemm_int4_r16_amx<AmxHw>(a, kp, xs, gs, G, W, M, so);
  else gemm_int4_r16_amx<AmxEmu>(a, kp, xs, gs, G, W, M, so);
  return out;
}

}  // namespace moetune
