// Entry points shared by the translation units (bindings.cpp exposes them to Python).
#pragma once
// Light ATen headers only (no torch/extension.h): each .cpp compiles in seconds, not minutes.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <string>
#include <vector>
#include "micro.h"

namespace moetune {

// A (possibly expert-stacked) weight from its tensors; see kernels/cpu/packed.py for the layout.
// w: [E?, N, K] (int4: [E?, N, Kpad/2] uint8); scale/zero as documented in WeightView.
struct StackedWeight {
  WeightView base;
  int64_t expert_bytes = 0, scale_expert_stride = 0;
  WeightView expert(int64_t e) const {
    WeightView v = base;
    v.w += e * expert_bytes;
    if (v.scale) v.scale += e * scale_expert_stride;
    if (v.scale_h) v.scale_h += e * scale_expert_stride;
    if (v.zero) v.zero += e * scale_expert_stride;
    if (v.wsum) v.wsum += e * scale_expert_stride;
    return v;
  }
};

// act_bf16: the activations are bf16 (cpu_bf16_isa=auto takes the BF16 dot product only then)
StackedWeight make_weight(int64_t fmt, const at::Tensor& w, int64_t N, int64_t K, const at::Tensor& scale,
                          const at::Tensor& zero, int64_t group, int64_t block_n, const Knobs& kn, bool act_bf16);

// Run-time ISA dispatch (isa.cpp). Features: bits of this CPU's dot-product instructions.
enum Feature : unsigned { kFeatVnni = 1, kFeatBf16 = 2, kFeatAmx = 4 };
unsigned detected_features();   // cpuid (AMX: and the kernel's permission)
unsigned usable_features();     // detected & the mask (set_feature_mask)
unsigned emulated_features();   // run on their C++ models instead (set_emulated_features)
void set_feature_mask(int64_t mask);
int64_t feature_mask();
void set_emulated_features(int64_t mask);
// The Dot variant of a weight's microkernels for these knobs on this (masked) CPU.
int resolve_dot(int fmt, bool int4_i8, bool has_wsum, int64_t group, const Knobs& kn, bool act_bf16);
// Whether a BF16 weight's GEMM path calls torch's bf16 linear (oneDNN) for these knobs here.
bool bf16_gemm_onednn(const Knobs& kn, bool act_bf16);
// cpu_fp8_gemm: whether an FP8 weight's GEMM path dequantizes it to bf16 for torch's linear (oneDNN)
bool fp8_gemm_onednn(const Knobs& kn);
// The variants a call used, noted per calling thread (the Python call record reads them).
enum Used : unsigned { kUsedAvx512 = 1, kUsedVnni = 2, kUsedVnniModel = 4, kUsedBf16 = 8, kUsedBf16Model = 16,
                       kUsedAmx = 32, kUsedBlas = 64, kUsedOnednn = 128, kUsedFma = 256,
                       kUsedMaddubs = 512, kUsedAmxModel = 1024, kUsedAvx2 = 2048, kUsedR16 = 4096,
                       kUsedGrouped = 8192,  // grouped: the fused MoE's GEMM-path experts (cpu_moe_gemm_experts)
                       kUsedFp8Rows = 16384 };  // fp8rows: FP8 blocks expanded to bf16 rows as AMX A tiles (cpu_amx_fp8_direct_max_tokens)
void reset_used();
void note_used(unsigned bits);
// the microkernels' variant for weight W: its dot form, or maddubs where the INT4 int8 method runs without VNNI
void note_micro(const WeightView& W);
std::string used_variants();

// Activations prepared once per call for a format: float32 padded rows (+ group sums) or int16
// quantized rows + scales. Owns its buffers.
struct PreparedAct {
  at::Tensor xf, xq, xs, gsum, gsumq, xp, xb, xbs, gsb, xu, xh, xd;
  Act view() const;
};
// A call site's reusable activation buffers (the decode runner keeps one per knob slot): a buffer is
// reallocated only when its shape, dtype or K changes, so a decode step allocates none.
struct ActPool {
  static constexpr int kBufs = 12;
  at::Tensor t[kBufs];
  int64_t k[kBufs] = {};
};
PreparedAct prepare_act(const at::Tensor& x, const WeightView& W);
PreparedAct prepare_act_f32rows(const float* src, int64_t M, int64_t K, int64_t ld, const WeightView& W,
                                ActPool* pool = nullptr);

// out[m, n] for rows [0, N) of W with M activation rows tok[0..M) (direct microkernel path),
// parallel over row tiles of block_n. out: float32 with row stride ldo.
void gemv_rows(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, float* out, int64_t ldo,
               const Knobs& kn, bool parallel);
// One microkernel sweep over rows [n0, n1) for tokens tok[0..M): out[m * ldo + (n - n0)].
// next: the first row the caller reads after the sweep (same row length), prefetched during its
// last tile; nullptr: row n1 of W. expert: one expert's rows in the fused MoE (BF16 r16: at most
// cpu_r16_bf16_one_group tokens run as one token group).
void micro_sweep(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo, const Knobs& kn, const uint8_t* next, bool expert = false);
// x_act [M, K] float32 (INT8: the quantized integers) @ W^T through unpacked blocks and BLAS.
at::Tensor gemm_unpacked(const at::Tensor& x_act, const WeightView& W, const Knobs& kn, bool int4_bf16_out = false);

// AMX (amx.cpp): why the tiles cannot run here ("" when they can).
const std::string& amx_unavailable();
// The tile GEMM on one engine: AMX, its C++ model, AVX-512 dot-product tiles (VNNI / AVX512-BF16)
// or their C++ model, or INT8 on AVX2's vpmaddubsw (every CPU the kernels run on; amx.cpp).
enum TileEngine : int { kTilesAmx = 0, kTilesAmxModel = 1, kTilesDot = 2, kTilesDotModel = 3, kTilesMaddubs = 4 };
// The AMX engine (kTilesAmx, or kTilesAmxModel where AMX is emulated) a weight's GEMM path runs at M rows,
// or -1: INT8 weights under cpu_int8_gemm amx or auto, BF16 / FP8 weights under cpu_bf16_gemm / cpu_fp8_gemm amx
// or auto, from amx_min_tokens rows (BF16 and FP8 auto: bf16 activations), where the CPU has AMX under the feature mask (isa.cpp).
int amx_engine(const WeightView& W, const Knobs& kn, int64_t M);
// From how many rows amx_engine runs for W (INT64_MAX: never here): amx_min_tokens, or for INT4 r16 under auto
// int4_r16_amx_min_tokens if later.
int64_t amx_from(const WeightView& W, const Knobs& kn);
// The call record's note for an AMX engine (the tiles, or their model).
inline unsigned amx_used(int engine) { return engine == kTilesAmx ? kUsedAmx : kUsedAmxModel; }
// How the AMX GEMM runs (from the knobs: amx_opts): groups of n_group 32-column weight blocks per task, rows
// in chunks of m_block (0: all), K in passes of k_block bytes (0: all of K at once); up to direct_max rows,
// the weight rows read as tiles where they lie, no packing, each row prefetched `prefetch` bytes ahead (0: none).
struct AmxOpts {
  int64_t k_block = 0, direct_max = 0, prefetch = 0, n_group = 1, m_block = 0, fp8_direct_max = 0;
  // the in-place path's row limit for W (FP8: its blocks expanded to bf16 rows, fp8_direct_max)
  int64_t direct_rows(const WeightView& W) const { return W.fmt == kFp8 ? fp8_direct_max : direct_max; }
};
inline AmxOpts amx_opts(const Knobs& kn) {
  return {kn.amx_k_block, kn.amx_direct_max_tokens, kn.prefetch_ahead, kn.amx_n_group, kn.amx_m_block,
          kn.amx_fp8_direct_max_tokens};
}
// x_act [M, K] (float32: INT8's quantized integers, or BF16 weights' activations, rounded to bf16;
// bfloat16: BF16 weights only) · Wᵀ on a tile engine → [M, N] float32 (INT8: the integer sums), or
// bfloat16 (bf16_out, BF16 weights).
at::Tensor gemm_tiles_run(const at::Tensor& x_act, const WeightView& W, int engine, const AmxOpts& ao = {},
                          bool bf16_out = false);
// INT8 from prepare_act's int16 integers (row stride ld; rows: nullptr, or the rows to gather) on the
// AMX engines, the vpdpbusd engine (kTilesDot / kTilesDotModel) or vpmaddubsw (kTilesMaddubs), the scales
// applied (xs[row] · W.scale[n]) → [M, N] float32, or bfloat16 with bf16_out (amx.cpp).
// The engine INT8 weights' GEMM path runs from the integers here at M rows (the call record noted), or -1.
int int8_integer_engine(const WeightView& W, const Knobs& kn, int64_t M);
// The fused MoE's INT8 and BF16 experts on AMX's in-place path in one parallel region per phase (cpu_moe_gemm_experts=grouped,
// amx.cpp): an expert's weight, its n activation rows (rows: indices into xq), and per phase its h rows (gate/up,
// [n, I]) or its output tokens and routing weights (down). moe_grouped_ok: whether an expert of n rows takes it.
struct MoeExpert {
  WeightView w;
  const int64_t* rows = nullptr;
  int64_t n = 0;
  float* h = nullptr;
  const int64_t* toks = nullptr;
  const float* wts = nullptr;
};
bool moe_grouped_ok(const WeightView& W, int64_t n, int engine, const AmxOpts& ao);
// x: the activations, INT8 weights' int16 integers (xs: their scales) or BF16 weights' float32 rows (xs unused), ld
// elements apart.
void moe_gate_up_grouped(const std::vector<MoeExpert>& ex, const void* x, int64_t ld, const float* xs, int64_t I,
                         int engine, const AmxOpts& ao);
void moe_down_grouped(const std::vector<MoeExpert>& ex, const void* x, int64_t ld, const float* xs, int64_t D,
                      float* out, int engine, const AmxOpts& ao);
at::Tensor gemm_int8_prepared(const int16_t* xq, int64_t ld, const float* xs, const int64_t* rows, int64_t M,
                              const WeightView& W, int engine, const AmxOpts& ao, bool bf16_out = false);
// The dot-product tile engine a weight's GEMM path runs for these knobs here (-1: none; INT4: the
// engine of gemm_int4; INT8 and INT4 may run kTilesMaddubs, on any CPU).
int gemm_dot_engine(const WeightView& W, const Knobs& kn);
// x_act [M, K] float32 · Wᵀ for an INT4 weight, real values, on vpdpbusd (engine kTilesDot), its C++
// model (kTilesDotModel) or vpmaddubsw (kTilesMaddubs); activations quantized to int8 per (token,
// group) inside (amx.cpp).
at::Tensor gemm_int4(const at::Tensor& x_act, const WeightView& W, int engine, bool bf16_out = false);
// INT4 r16 weights on AMX (or its model) from the r16 microkernels' int8 activations p (rows `rows`, null: 0 .. M − 1).
at::Tensor gemm_int4_r16(const PreparedAct& p, const int64_t* rows, int64_t M, const WeightView& W, int engine,
                         bool bf16_out = false);
// x (bf16) × a BF16 r16 weight through torch's bf16 linear (oneDNN): cpu_gemm_block_n rows at a time restored
// from r16 into one reused row-major buffer (matmul.cpp); out_dtype: float32 or bf16.
at::Tensor gemm_r16_onednn(const at::Tensor& x, const WeightView& W, const Knobs& kn, at::ScalarType out_dtype);
// From how many activation rows a weight takes the GEMM path: dot_gemm_min_tokens where its GEMM runs a
// dot-product engine here (no float32 unpack: it wins from fewer rows; FP8 excepted, whose blocks are
// expanded to bf16 as they are packed); bf16_gemm_min_tokens for a BF16 weight on the unpack + BLAS path
// (the split BF16 microkernel outruns it up to a few hundred rows); else gemm_min_tokens (oneDNN, FP8 on
// any path, and the unpack path of the other formats); AMX, where it runs for the weight, from
// amx_min_tokens at the latest. r16 weights: from amx_min_tokens where AMX runs for them (BF16 and INT8: their
// blocks are B tiles, gemm_nest's R16B), BF16 r16 with bf16 activations from r16_onednn_min_tokens (oneDNN on its rows
// restored block by block: gemm_r16_onednn) if that is sooner, else never.
inline int64_t gemm_from(const WeightView& W, const Knobs& kn) {
  if (is_r16(W.fmt)) {
    const int64_t amx = amx_from(W, kn);
    return std::min(amx, W.fmt == kBF16R16 && W.act_bf16 ? kn.r16_onednn_min_tokens : INT64_MAX);
  }
  const int64_t from = W.fmt != kFp8 && gemm_dot_engine(W, kn) >= 0           ? kn.dot_gemm_min_tokens
                       : W.fmt == kBF16 && !bf16_gemm_onednn(kn, W.act_bf16) ? kn.bf16_gemm_min_tokens
                                                                             : kn.gemm_min_tokens;
  // INT4 enters the GEMM path where it did (its microkernels' activations are not the GEMM's int8 ones), and takes
  // AMX there from amx_min_tokens rows
  return W.fmt != kInt4 ? std::min(from, amx_from(W, kn)) : from;
}

at::Tensor linear(const at::Tensor& x, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                     const at::Tensor& scale, const at::Tensor& zero, int64_t group, int64_t block_n,
                     const Knobs& knobs);
at::Tensor fused_moe(const at::Tensor& x, int64_t fmt, const at::Tensor& w13, const at::Tensor& s13,
                        const at::Tensor& z13, int64_t fmt2, const at::Tensor& w2, const at::Tensor& s2,
                        const at::Tensor& z2, int64_t inter, int64_t group, int64_t block_n,
                        const at::Tensor& topk_w, const at::Tensor& topk_ids, const Knobs& knobs);

}  // namespace moetune
