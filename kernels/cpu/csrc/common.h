// Shared pieces of the AVX-512 kernels: weight views, in-register weight conversion, reductions.
//
// Every weight is row-major [N, K] (N output rows, K inputs), the layout the checkpoint stores, so
// "repacking" at load is only making tensors contiguous and precomputing scales; the one exception is a
// BF16 or INT8 weight taking the r16 layout (kBF16R16 / kInt8R16 below, micro_r16.cpp). A kernel reads 32
// consecutive K elements of a row at a time and turns them into two float32 vectors (or one int16
// vector for INT8), the conversion happening in registers.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace moetune {

// This source compiled as the AVX2 build (kernels/cpu_build.py: AVX-512 on avx512_model.h's register pairs),
// for the choices that differ between the builds (auto knob values, register-bound loop shapes).
#ifdef MOETUNE_AVX2_BUILD
constexpr bool kAvx2Build = true;
#else
constexpr bool kAvx2Build = false;
#endif

// kInt4i: INT4 by integer products; kFp8w: FP8 widened through 16-bit lanes (the "widen" method)
// kInt4b: INT4 by byte products against int8 activations (the "int8" INT4 method)
// From kInt8Dp on: the dot-product variants (micro_dot.inc), each on the instruction (native) and
// on its C++ model: INT8 and INT4-int8 through vpdpbusd (AVX512-VNNI), BF16 and FP8 through
// vdpbf16ps (AVX512-BF16). kInt8Mb: micro_int8_dp on vpmaddubsw (the sign trick; no VNNI needed).
enum Format : int {
  kF32 = 0, kBF16 = 1, kInt8 = 2, kFp8 = 3, kInt4 = 4, kInt4i = 5, kFp8w = 6, kInt4b = 7,
  kInt8Dp = 8, kInt8DpModel = 9, kInt4bDp = 10, kInt4bDpModel = 11, kBF16Dp = 12, kBF16DpModel = 13,
  kFp8Dp = 14, kFp8DpModel = 15, kBF16s = 16, kInt8Mb = 17, kBF16y = 18,
  // kBF16R16: a BF16 expert stack or linear repacked at load (knobs cpu_bf16_expert_layout / _linear_layout =
  // r16): every block of 16 rows
  // keeps the bytes those rows held, as [K/2][16] 32-bit bf16 pairs (pair p of the block's row r at
  // uint32 offset p·16 + r). N % 16 == 0, K even. Read by the r16 sweep (micro_r16.cpp), by AMX's GEMM, whose
  // B tiles the blocks' K tiles are (gemm_nest's R16B), and by oneDNN on rows restored block by block (gemm_r16_onednn).
  kBF16R16 = 19,
  // kInt8R16: an INT8 expert stack or linear in the same block form (knobs cpu_int8_expert_layout /
  // _linear_layout = r16): every block of 16 rows as [K/4][16] 32-bit units of 4 int8 weights (unit u of the
  // block's row r at uint32 offset u·16 + r), the per-row scales and Σw as for kInt8. N % 16 == 0, K % 4 == 0.
  // Read by the r16 sweep, on vpdpbusd, its C++ model, or vpmaddubsw with the sign trick, and by AMX's GEMM
  // (gemm_nest's R16B, TDPBSSD on the blocks as B tiles).
  kInt8R16 = 20,
  // kInt4R16: an INT4 weight of groups of 128 in the same block form (knobs cpu_int4_expert_layout / _linear_layout
  // = r16): a row's packed bytes (kInt4's nibble order) interleaved by 4-byte unit as kInt8R16's, so each group is
  // 16 units; its scales and scale·zero products per block as [G][16] (group g of the block's row r at g·16 + r).
  // Read by the r16 sweep only, with int8 activations per (token, group) (the INT4 "int8" method's).
  kInt4R16 = 21,
  // kFp8R16: an FP8 E4M3 weight (scale blocks of whole 16-row blocks) in the same block form, 4-byte units of 4
  // fp8 (knobs cpu_fp8_expert_layout / _linear_layout = r16); its block scales as kFp8's. Read by the r16 sweep
  // only: vdpbf16ps on the bytes turned into bf16 in registers, its model, or float32 FMAs.
  kFp8R16 = 22,
};
// The r16 formats (the r16 sweep's), and each one's row-major format
inline bool is_r16(int fmt) { return fmt == kBF16R16 || fmt == kInt8R16 || fmt == kInt4R16 || fmt == kFp8R16; }
inline int rows_format(int fmt) {
  return fmt == kBF16R16 ? kBF16 : fmt == kInt8R16 ? kInt8 : fmt == kInt4R16 ? kInt4 : fmt == kFp8R16 ? kFp8 : fmt;
}
enum Int4Method : int { kInt4Float = 0, kInt4Int16 = 1, kInt4Int8 = 2 };
enum Fp8Method : int { kFp8Vector = 0, kFp8Lut = 1, kFp8Widen = 2 };
// cpu_bf16_method: BF16 weights on float FMAs (no BF16 dot): each bf16 widened to a float32 lane (widen), or
// the two bf16 of each 32-bit lane split by a shift and a mask against de-interleaved activations (split), the
// same on 256-bit registers with tiles for AVX2's 16 (split256, micro_bf16y); auto: split256 in the AVX2 build,
// split in the AVX-512 one.
enum Bf16Method : int { kBf16Widen = 0, kBf16Split = 1, kBf16Split256 = 2, kBf16MethodAuto = 3 };
// cpu_tile_rows: which rows of a sweep a register tile of R rows reads: R adjacent rows (adjacent: R streams
// of one row each per tile), or rows a sweep's rows / R apart (spread: R streams that each run through
// rows / R consecutive rows, one long sequential read per stream, as the probe's fastest reader).
enum TileRows : int { kTileAdjacent = 0, kTileSpread = 1 };
// cpu_moe_gemm_experts: the fused MoE's GEMM-path INT8 experts on AMX's in-place path in one region per phase, or one call each
enum MoeGemmExperts : int { kMoeGrouped = 0, kMoeEach = 1 };
// cpu_micro_order: a sweep of more tokens than one register tile takes (micro_sweep), in groups of
// micro_tokens: every group runs over all the sweep's rows before the next (groups: the rows are read
// from memory once, then from L2 for each later group), or every row tile runs all the groups while its
// rows are in L1 (tiles: the memory stream of the next rows overlaps the later groups' arithmetic).
enum MicroOrder : int { kOrderGroups = 0, kOrderTiles = 1, kOrderTilesNext = 2 };
// cpu_prefetch_hint: the cache level the microkernels' software prefetch of weight rows fills (prefetcht0: L1,
// prefetcht1: L2, prefetcht2: L3 on Intel / L2 on AMD), or none (the hardware prefetchers alone).
enum PrefetchHint : int { kPrefetchT0 = 0, kPrefetchT1 = 1, kPrefetchT2 = 2, kPrefetchNone = 3 };
// cpu_prefill_prefetch_hint: the same for a sweep of more than one token group (prefill on the microkernels:
// each tile's rows are read again by the later groups, from L1), as PrefetchHint's values, or kPrefillSame:
// cpu_prefetch_hint and cpu_prefetch_ahead as for one group.
enum PrefillPrefetch : int { kPrefillT0 = 0, kPrefillT1 = 1, kPrefillT2 = 2, kPrefillNone = 3, kPrefillSame = 4 };
// cpu_attn_isa: the attention products' instruction (attention.cpp's attn_dot): float32 FMAs (avx512),
// vdpbf16ps on bf16 pairs (avx512bf16), AMX tiles (amx: TDPBF16PS), auto: amx, else avx512bf16, where the
// CPU has it and the queries are bf16.
enum AttnIsa : int { kAttnIsaAuto = 0, kAttnIsaAvx512 = 1, kAttnIsaDot = 2, kAttnIsaAmx = 3 };
// cpu_attn_f32_form: the float32-FMA register form's layout (rows below cpu_attn_blas_rows): transpose (each key
// block converted and transposed, 16 keys in the lanes, the rows' queries broadcast) or lanes (16 rows in the
// lanes, each key's float32 row broadcast: no transposes of keys or probabilities, the softmax down the keys);
// packed (decode, a KV head of at most 8 query rows): lanes holding the rows of 2 or 4 KV heads at once, interleaved
// (lane p + P·r: row r of the task's head p), each key element of the P heads broadcast together (elsewhere: auto's
// rule); auto: packed where it applies, else lanes for a task of at least 16 rows (a full register group), else
// transpose.
enum AttnF32Form : int { kAttnFormAuto = 0, kAttnTranspose = 1, kAttnLanes = 2, kAttnPacked = 3 };
// cpu_attn_prefetch: the cache level of the next cache block's prefetch in attention decode's register forms, as
// PrefetchHint's values, or auto: t1 where K and V are rows of their own (GQA/MHA), none where V is the leading
// columns of the K rows (MLA's latent: its products dominate, and the prefetch measured x0.98-1.01 there).
enum AttnPrefetch : int { kAttnPrefetchT0 = 0, kAttnPrefetchT1 = 1, kAttnPrefetchT2 = 2, kAttnPrefetchNone = 3,
                          kAttnPrefetchAuto = 4 };
// cpu_int8_isa / cpu_bf16_isa: the dot-product instruction a microkernel is asked to use ("auto":
// the best this CPU has, under the feature mask; BF16 dot only for bf16 activations, see isa.cpp).
// maddubs: INT8 on vpmaddubsw + vpmaddwd with the sign trick (AVX-512BW, or AVX2 in that build).
enum Int8Isa : int { kInt8IsaAuto = 0, kInt8IsaAvx512 = 1, kInt8IsaVnni = 2, kInt8IsaMaddubs = 3 };
enum Bf16Isa : int { kBf16IsaAuto = 0, kBf16IsaAvx512 = 1, kBf16IsaDot = 2 };
// cpu_bf16_gemm: BF16 weights on the GEMM path (many tokens): our unpack + BLAS, or torch's bf16 linear
// (oneDNN), or our tile GEMM on vdpbf16ps (avx512bf16: amx.cpp's gemm_dot) or on AMX tiles (amx);
// auto: see isa.cpp (bf16_gemm_choice).
enum Bf16Gemm : int { kBf16GemmAuto = 0, kBf16GemmUnpack = 1, kBf16GemmOnednn = 2, kBf16GemmDot = 3, kBf16GemmAmx = 4 };
enum Fp8Gemm : int { kFp8GemmAuto = 0, kFp8GemmUnpack = 1, kFp8GemmOnednn = 2, kFp8GemmDot = 3, kFp8GemmAmx = 4 };
// cpu_int8_gemm: INT8 weights on the GEMM path: unpack + float32 BLAS, or our tile GEMM on vpdpbusd, on
// AVX2's vpmaddubsw (any CPU the kernels run on), or on AMX tiles (TDPBSSD).
enum Int8Gemm : int { kInt8GemmAuto = 0, kInt8GemmUnpack = 1, kInt8GemmVnni = 2, kInt8GemmMaddubs = 3, kInt8GemmAmx = 4 };
// cpu_int4_gemm: INT4 weights on the GEMM path: unpack + float32 BLAS, or our INT4 GEMM on vpdpbusd, vpmaddubsw
// or AMX's TDPBSSD (activations quantized to int8 per (token, group); amx.cpp gemm_int4).
// cpu_unpack_gemm: the GEMM after unpacking to float32: torch's BLAS, or our FMA register tiles (gemm_fma);
// auto: fma in the AVX2 build, blas in the AVX-512 one.
enum UnpackGemm : int { kUnpackGemmAuto = 0, kUnpackGemmBlas = 1, kUnpackGemmFma = 2 };
enum Int4Gemm : int { kInt4GemmAuto = 0, kInt4GemmUnpack = 1, kInt4GemmVnni = 2, kInt4GemmMaddubs = 3, kInt4GemmAmx = 4 };

// The dot-product variant a weight view runs (resolved per call by isa.cpp from the knobs, the CPU
// features under the mask, and the emulated features).
enum Dot : int { kDotNone = 0, kDotVnni = 1, kDotVnniModel = 2, kDotBf16 = 3, kDotBf16Model = 4, kDotMaddubs = 5 };

// One weight matrix [N, K] (one expert of a stack, or a plain linear).
struct WeightView {
  int fmt = kF32;
  const uint8_t* w = nullptr;  // row r starts at w + r * row_bytes
  int64_t row_bytes = 0;
  int64_t N = 0, K = 0;
  const float* scale = nullptr;  // int8: [N]; fp8: [ceil(N/bn), G]; int4: [N, G]
  const float* zero = nullptr;   // int4: [N, G] zero point in quantized units; int4 r16: scale·zero per block, or
                                 // none where every zero point is 8 (symmetric weights: the tiles take 8·scale)
  const int32_t* wsum = nullptr; // int8 (either layout): [N] Σ_k w[n, k] (the VNNI kernels' +128 compensation)
  const uint16_t* scale_h = nullptr;  // int4 r16: the block scales as bfloat16 (every one exact in it), scale null
  int64_t scale_ld = 0;          // row stride of scale/zero
  int group = 0;                 // K elements per scale group (fp8 block K, int4 group); 0: whole row
  int block_n = 1;               // fp8: rows per scale block
  int fp8_method = kFp8Vector;
  bool int4_int = false;         // int4: integer products with int16 activations (group % 64 == 0)
  bool int4_i8 = false;          // int4: byte products with per-group int8 activations (group % 128 == 0)
  bool fp8_widen = false;        // fp8: the widen microkernel on permuted activations (group % 64 == 0)
  bool bf16_split = false;       // bf16 on float FMAs: the split microkernel on de-interleaved activations
  bool bf16_ymm = false;         // ... in its 256-bit form (micro_bf16y)
  int64_t k_block = 0;           // micro_bf16y: K elements per turn of a tile's row groups (knob cpu_k_block)
  // microkernels: bytes ahead in a row that their prefetch reads, in (0, row_bytes]; row_bytes = the next
  // tile's line at the offset read (knob cpu_prefetch_ahead 0, or a row no longer than it). Set by make_weight
  int64_t prefetch_dist = 0;
  int prefetch_hint = 0;         // PrefetchHint (knob cpu_prefetch_hint). Set by make_weight
  int64_t r16_stride = 1;        // r16 tiles: blocks of a tile this many blocks apart (r16_sweep, cpu_r16_tile_blocks)
  int64_t tile_stride = 1;       // rows between a register tile's rows (micro_sweep: 1, or rows / R when spread)
  int dot = kDotNone;            // the dot-product variant of the microkernels (int8, int4 int8, bf16, fp8)
  bool act_bf16 = false;         // the call's activations are bf16 (the "auto" variants that round to bf16)
  // The GEMM path (AMX / unpack + BLAS) multiplies float activations: no microkernel-only forms.
  // (INT4 r16 keeps its int8 form: its AMX GEMM, gemm_int4_r16, reads those activations)
  void no_micro_forms() {
    int4_int = fp8_widen = bf16_split = bf16_ymm = false;
    int4_i8 = int4_i8 && fmt == kInt4R16;
    dot = kDotNone;
  }
};

// Every per-call knob of kernels/cpu_knobs.py, named as in the catalogue without "cpu_" (bound by
// pybind11 in bindings.cpp; kernels/cpu checks at import that the two sets are equal). No defaults
// here: kernels/cpu fills every field from the declarations, and check() refuses an unset one.
struct Knobs {
  int64_t micro_rows = 0;        // weight rows per microkernel pass (4, 8)
  int64_t micro_tokens = 0;      // tokens per microkernel pass (1, 2, 4)
  int64_t micro_wide = -1;       // BF16 / INT8 dot products: tokens per wide tile (0: none; 6, 8, 12)
  int64_t linear_block_n = 0;    // rows per parallel task (linear)
  int64_t moe_block_n = 0;       // rows per parallel task (fused MoE)
  int64_t moe_int4_tasks = 0;    // INT4 r16 experts: about this many tasks per thread and phase, of ≥ moe_block_n rows (0: off)
  int64_t gemm_min_tokens = 0;   // from this many tokens (per expert in MoE) use unpack + BLAS
  int64_t gemm_block_n = 0;      // rows unpacked per BLAS call (the weight-unpack cache block)
  Fp8Method fp8_method = (Fp8Method)-1;
  Bf16Method bf16_method = (Bf16Method)-1;
  TileRows tile_rows = (TileRows)-1;
  MicroOrder micro_order = (MicroOrder)-1;
  Int4Method int4_method = (Int4Method)-1;
  int64_t task_chunk = 0;        // consecutive parallel tasks a thread takes at once
  int64_t amx_min_tokens = 0;    // from this many rows, BF16/INT8 GEMMs run on AMX tiles where present
  int64_t amx_k_block = -1;      // AMX GEMM: bytes of K per pass of every row block over a packed weight block (0: all)
  int64_t amx_n_group = -1;      // AMX GEMM: 32-column weight blocks per parallel task (the K passes' group)
  int64_t amx_m_block = -1;      // AMX GEMM: activation rows per chunk of the nest (0: all)
  int64_t amx_direct_max_tokens = -1;  // AMX GEMM: up to this many rows, weight rows read as tiles in place
  int64_t amx_fp8_direct_max_tokens = -1;
  int64_t int4_r16_amx_min_tokens = 0;  // INT4 r16, cpu_int4_gemm auto: AMX's gemm_int4_r16 from this many rows  // ... FP8 weights: up to this many rows, each 32-row block expanded to bf16 rows as A tiles
  int64_t dot_gemm_min_tokens = 0;  // from this many rows, weights with a dot-product GEMM engine here take it
  int64_t bf16_gemm_min_tokens = 0;  // from this many rows, BF16 weights on the unpack + BLAS GEMM path take it
  int64_t r16_onednn_min_tokens = 0;  // from this many rows, BF16 r16 linears (bf16 activations) run oneDNN on rows restored
  TileRows r16_tile_blocks = (TileRows)-1;  // r16 tiles' blocks adjacent or spread (r16_sweep)
  MoeGemmExperts moe_gemm_experts = (MoeGemmExperts)-1;  // fused MoE: GEMM-path experts grouped or one call each
  int64_t r16_bf16_tokens = 0;   // tokens per BF16 r16 register tile (cpu_r16_tokens: the other r16 formats')
  int64_t r16_bf16_one_group = 0;  // fused MoE, BF16 r16 experts of at most this many tokens: one token group
  int64_t prefetch_ahead = 0;    // microkernels' software prefetch: bytes ahead in the row (0: the next tile's rows)
  int64_t k_block = 0;           // micro_bf16y: K elements per turn of a tile's row groups; gemm_fma: per pass
  PrefetchHint prefetch_hint = (PrefetchHint)-1;
  PrefillPrefetch prefill_prefetch_hint = (PrefillPrefetch)-1;  // sweeps of ≥ 2 token groups (kPrefillSame: as above)
  int64_t prefill_prefetch_ahead = -1;  // ... their bytes ahead in the row, as prefetch_ahead
  int64_t r16_rows = 0;          // r16 experts: rows per register tile, one token group (16, 32, 64)
  int64_t r16_int4_rows = 0;     // ... on INT4 r16 weights (16, 32, 64)
  int64_t r16_int4_prefetch_ahead = -1;  // INT4 r16 weights: prefetch_ahead's bytes ahead instead (0: prefetch_ahead)
  int64_t r16_fp8_rows = 0;      // ... on FP8 r16 weights (16, 32, 64)
  int64_t r16_int8_rows = 0;     // ... on INT8 r16 weights (16, 32, 64)
  int64_t r16_prefill_rows = 0;  // ... several token groups
  int64_t r16_tokens = 0;        // ... tokens per register tile (1..12)
  PrefetchHint r16_next_prefetch = (PrefetchHint)-1;  // ... a tile's second token group prefetching the next tile
  Int8Isa int8_isa = (Int8Isa)-1;
  Bf16Isa bf16_isa = (Bf16Isa)-1;
  Bf16Gemm bf16_gemm = (Bf16Gemm)-1;
  Fp8Gemm fp8_gemm = (Fp8Gemm)-1;
  Int8Gemm int8_gemm = (Int8Gemm)-1;
  Int4Gemm int4_gemm = (Int4Gemm)-1;
  UnpackGemm unpack_gemm = (UnpackGemm)-1;
  int64_t attn_head_fold = 0, attn_kv_splits = 0, attn_decode_kv_block = 0, attn_extend_q_block = 0,
          attn_extend_kv_block = 0, attn_blas_rows = 0, attn_blas_kv_block = 0;
  AttnIsa attn_isa = (AttnIsa)-1;
  AttnF32Form attn_f32_form = (AttnF32Form)-1;
  AttnPrefetch attn_prefetch = (AttnPrefetch)-1;  // attention: the next cache block's rows, while this one's are used
  void check() const;  // every field set and in range (matmul.cpp)
};

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
// Horizontal sum of 8 float32 lanes (a fixed order: the halves, then pairs, then the last two).
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __mmask16 tail_mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// 16 rows of 64 bytes (src[n] + off) as a 16 × 16 matrix of 32-bit units, transposed into 16 rows of
// 64 bytes at dst, dst_ld bytes apart (row kk = unit kk of every source row; amx.cpp's B tiles, matmul.cpp's
// rows restored from r16): unpack 32-bit, unpack 64-bit, then two
// rounds of 128-bit lane shuffles. transpose16_u32_regs: the same of 16 rows already in registers (r, overwritten).
inline void transpose16_u32_regs(__m512i* r, uint8_t* dst, int64_t dst_ld = 64) {
  __m512i t[16];
  for (int n = 0; n < 16; n += 2) {
    t[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
    t[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
  }
  // u[4g + c], per 128-bit lane L: unit 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512i* q = t + 4 * g;
    r[4 * g + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
  }
  for (int c = 0; c < 4; ++c) {  // output row 4L + c = lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i s0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), s1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), s3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(dst + (0 + c) * dst_ld, _mm512_shuffle_i32x4(s0, s2, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * dst_ld, _mm512_shuffle_i32x4(s0, s2, 0xDD));
    _mm512_storeu_si512(dst + (8 + c) * dst_ld, _mm512_shuffle_i32x4(s1, s3, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * dst_ld, _mm512_shuffle_i32x4(s1, s3, 0xDD));
  }
}
inline void transpose16_u32(const uint8_t* const* src, int64_t off, uint8_t* dst, int64_t dst_ld = 64) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(src[n] + off);
  transpose16_u32_regs(r, dst, dst_ld);
}

// One line into the cache level `hint` says (PrefetchHint; kPrefetchNone: nothing): the r16 tiles' and the decode
// runner's head projections' software prefetch. Inline assembly, the address in a register, as prefetch_row's
// (micro.h: GCC dropped _mm_prefetch of a chosen address); a hint the same on every step is a predicted branch.
inline void prefetch_line(const void* line, int hint) {
  if (hint == kPrefetchT0) asm volatile("prefetcht0 (%0)" : : "r"(line));
  else if (hint == kPrefetchT1) asm volatile("prefetcht1 (%0)" : : "r"(line));
  else if (hint == kPrefetchT2) asm volatile("prefetcht2 (%0)" : : "r"(line));
}

// INT4 rows: a row's zero point of one group: the stored one at zero[off], or, for a symmetric weight, which keeps
// no zero points (zero null), 8
inline float int4_zero(const float* zero, int64_t off) { return zero ? zero[off] : 8.f; }

// INT4 r16: one 16-row block's per-group values (the block of row r of W), 16 rows at once per group g: its block
// scales (float32, or bfloat16 where prepare stored them so, every one exact: the same values widened) and its
// scale·zero products (none for a symmetric weight: 8·scale, the same float32 product)
struct Int4R16Groups {
  const float* sc = nullptr;
  const uint16_t* sch = nullptr;
  const float* sz = nullptr;
  Int4R16Groups() = default;
  Int4R16Groups(const WeightView& W, int64_t r) {
    const int64_t off = r * W.scale_ld;
    if (W.scale) sc = W.scale + off;
    if (W.scale_h) sch = W.scale_h + off;
    if (W.zero) sz = W.zero + off;
  }
  __m512 scales(int64_t g) const {
    return sch ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sch + 16 * g))), 16))
               : _mm512_loadu_ps(sc + 16 * g);
  }
  __m512 scale_zero(int64_t g, __m512 s) const {
    return sz ? _mm512_loadu_ps(sz + 16 * g) : _mm512_mul_ps(s, _mm512_set1_ps(8.f));
  }
};

// 16 float32 lanes rounded to bfloat16 (nearest even; finite values: attention's queries and
// probabilities, FP8 weights dequantized for cpu_fp8_gemm: fp8_row_bf16).
inline __m256i bf16x16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                                         _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
// dst[i] = x[i] rounded so, n values.
inline void to_bf16(const float* x, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    _mm256_mask_storeu_epi16(dst + i, m, bf16x16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}
inline __mmask32 tail_mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << n) - 1); }

// FP8 E4M3 → float32 in registers, without NaN or denormal handling: sign to bit 31, exponent and
// mantissa shifted into place (<< 20) and the exponent rebased by +120 (127 − 7) unless the value
// is ±0. E4M3 denormals (exponent 0, mantissa ≠ 0) come out as 2^-7·(1 + m/8) instead of 2^-9·m,
// an error below 2^-6 of one quantization unit (never hit by the block quantizer's amax scaling
// except for near-zero weights); NaN (0x7F/0xFF) reads as 480.
inline __m512 fp8x16_to_f32(__m128i b) {
  const __m512i t = _mm512_slli_epi32(_mm512_cvtepi8_epi32(b), 20);
  const __m512i bits = _mm512_and_si512(t, _mm512_set1_epi32((int)0x87F00000u));
  const __mmask16 nonzero = _mm512_test_epi32_mask(t, _mm512_set1_epi32(0x07F00000));
  return _mm512_castsi512_ps(_mm512_mask_add_epi32(bits, nonzero, bits, _mm512_set1_epi32(120 << 23)));
}

extern float g_fp8_lut[256];  // E4M3 byte → the value fp8x16_to_f32 gives (the table method)

inline __m512 fp8x16_lut(__m128i b) {
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), g_fp8_lut, 4);
}

// 32 consecutive elements of a float row → two float32 vectors; n < 32 only at a row's end.
template <int F>
struct Loader;

template <>
struct Loader<kF32> {
  static inline void load(const WeightView& W, const uint8_t* row, int64_t k, int64_t n, __m512& a, __m512& b) {
    const float* p = reinterpret_cast<const float*>(row) + k;
    if (n >= 32) { a = _mm512_loadu_ps(p); b = _mm512_loadu_ps(p + 16); return; }
    a = _mm512_maskz_loadu_ps(tail_mask16(n), p);
    b = n > 16 ? _mm512_maskz_loadu_ps(tail_mask16(n - 16), p + 16) : _mm512_setzero_ps();
  }
};

template <>
struct Loader<kBF16> {
  static inline __m512 cvt(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static inline void load(const WeightView& W, const uint8_t* row, int64_t k, int64_t n, __m512& a, __m512& b) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(row) + k;
    if (n >= 32) {
      a = cvt(_mm256_loadu_si256((const __m256i*)p));
      b = cvt(_mm256_loadu_si256((const __m256i*)(p + 16)));
      return;
    }
    a = cvt(_mm256_maskz_loadu_epi16(tail_mask16(n), p));
    b = n > 16 ? cvt(_mm256_maskz_loadu_epi16(tail_mask16(n - 16), p + 16)) : _mm512_setzero_ps();
  }
};

template <>
struct Loader<kFp8> {
  static inline void load(const WeightView& W, const uint8_t* row, int64_t k, int64_t n, __m512& a, __m512& b) {
    const uint8_t* p = row + k;
    __m128i x0, x1;
    if (n >= 32) {
      x0 = _mm_loadu_si128((const __m128i*)p);
      x1 = _mm_loadu_si128((const __m128i*)(p + 16));
    } else {
      x0 = _mm_maskz_loadu_epi8(tail_mask16(n), p);
      x1 = n > 16 ? _mm_maskz_loadu_epi8(tail_mask16(n - 16), p + 16) : _mm_setzero_si128();
    }
    if (W.fp8_method == kFp8Lut) { a = fp8x16_lut(x0); b = fp8x16_lut(x1); return; }
    a = fp8x16_to_f32(x0);
    b = fp8x16_to_f32(x1);
  }
};

// 32 FP8 values at p times the block scale s, rounded to bf16 (nearest even), in order: fp8_row_bf16's whole chunks,
// and amx.cpp's packing where its table refuses a scale.
inline __m512i fp8_row32_bf16(const WeightView& W, const uint8_t* p, float s) {
  __m512 a, c;
  Loader<kFp8>::load(W, p, 0, 32, a, c);
  const __m512 sv = _mm512_set1_ps(s);
  return _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(_mm512_mul_ps(a, sv))), bf16x16(_mm512_mul_ps(c, sv)), 1);
}

// Row r of an FP8 weight as bf16: each value times its block scale, rounded to nearest even (DeepSeek's
// FP8 → BF16 cast of its checkpoint), K values at dst. The FP8 GEMM variants' weight (cpu_fp8_gemm).
inline void fp8_row_bf16(const WeightView& W, int64_t r, uint16_t* dst) {
  const uint8_t* src = W.w + r * W.row_bytes;
  const float* srow = W.scale + (r / W.block_n) * W.scale_ld;
  // rounded in registers and stored whole (a masked vpmovdw to memory costs several cycles), masked at K's tail
  for (int64_t k = 0; k < W.K; k += 32) {
    const int64_t m = std::min<int64_t>(32, W.K - k);
    if (m == 32) {
      _mm512_storeu_si512((void*)(dst + k), fp8_row32_bf16(W, src + k, srow[k / W.group]));
    } else {
      __m512 a, c;
      Loader<kFp8>::load(W, src, k, m, a, c);
      const __m512 s = _mm512_set1_ps(srow[k / W.group]);
      const __m256i lo = bf16x16(_mm512_mul_ps(a, s)), hi = bf16x16(_mm512_mul_ps(c, s));
      _mm256_mask_storeu_epi16(dst + k, tail_mask16(m), lo);
      if (m > 16) _mm256_mask_storeu_epi16(dst + k + 16, tail_mask16(m - 16), hi);
    }
  }
}

// INT4: per 32 elements 16 bytes, byte i = q[i] | q[i + 16] << 4 (unsigned nibbles); rows are
// padded to a whole number of groups, so no tail handling is needed (the activations are zero there).
template <>
struct Loader<kInt4> {
  static inline void load(const WeightView& W, const uint8_t* row, int64_t k, int64_t n, __m512& a, __m512& b) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + k / 2)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};

// Unpack rows [r0, r1) of a weight to float32 [r1 - r0, K] (real values; INT8: the raw integers,
// its row scale applied after the product). The GEMM path's weight-unpack cache block.
void unpack_rows_f32(const WeightView& W, int64_t r0, int64_t r1, float* dst);

}  // namespace moetune
