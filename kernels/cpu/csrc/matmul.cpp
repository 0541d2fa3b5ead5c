// Linear layers: activation preparation, the direct (microkernel) path and the unpack + BLAS path.
#include <omp.h>
#include <cmath>
#include <vector>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include "ops.h"

namespace moetune {

// ------------------------------------------------------------------ FP8 LUT

float g_fp8_lut[256];

// The LUT holds exactly what the vector path computes for each byte.
static const bool kLutReady = [] {
  for (int b = 0; b < 256; ++b) {
    alignas(64) float v[16];
    _mm512_store_ps(v, fp8x16_to_f32(_mm_set1_epi8((char)b)));
    g_fp8_lut[b] = v[0];
  }
  return true;
}();

// ------------------------------------------------------------------ microkernel table

MicroFn get_micro(int fmt, int rows, int tokens) {
  switch (fmt) {
    case kF32: return get_micro_f32(rows, tokens);
    case kBF16: return get_micro_bf16(rows, tokens);
    case kInt8: return get_micro_int8(rows, tokens);
    case kFp8: return get_micro_fp8(rows, tokens);
    case kInt4: return get_micro_int4(rows, tokens);
    case kInt4i: return get_micro_int4i(rows, tokens);
    case kFp8w: return get_micro_fp8w(rows, tokens);
    case kBF16s: return get_micro_bf16s(rows, tokens);
    case kBF16y: return get_micro_bf16y(rows, tokens);
    case kInt4b: return get_micro_int4b(rows, tokens);
    case kInt8Dp: case kInt8DpModel: case kInt8Mb: return get_micro_int8_dot(fmt, rows, tokens);
    case kInt4bDp: case kInt4bDpModel: return get_micro_int4_dot(fmt, rows, tokens);
    case kBF16Dp: case kBF16DpModel: return get_micro_bf16_dot(fmt, rows, tokens);
    case kFp8Dp: case kFp8DpModel: return get_micro_fp8_dot(fmt, rows, tokens);
  }
  return nullptr;
}

// ------------------------------------------------------------------ weights and knobs

static int64_t elem_bytes(int fmt) { return fmt == kF32 ? 4 : fmt == kBF16 || fmt == kBF16R16 ? 2 : 1; }  // int8 r16: 1

// Bytes ahead a microkernel's weight prefetch reads (knobs cpu_prefetch_ahead, cpu_prefill_prefetch_ahead) in the
// stream it reads: at most a row (row-major weights: more than a row or 0, the same offset one row on, the next
// tile's), or a 16-row block (r16, whose block is one contiguous stream: more than that, the next block at the same
// offset; 0, one row's bytes).
static int64_t prefetch_distance(int64_t ahead, const WeightView& W) {
  const int64_t stream = is_r16(W.fmt) ? 16 * W.row_bytes : W.row_bytes;
  return ahead == 0 ? W.row_bytes : std::min(ahead, stream);
}

StackedWeight make_weight(int64_t fmt, const at::Tensor& w, int64_t N, int64_t K, const at::Tensor& scale,
                          const at::Tensor& zero, int64_t group, int64_t block_n, const Knobs& kn, bool act_bf16) {
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  StackedWeight s;
  WeightView& v = s.base;
  v.fmt = (int)fmt;
  v.w = (const uint8_t*)w.data_ptr();
  v.N = N;
  v.K = K;
  v.row_bytes = w.size(-1) * elem_bytes((int)fmt);
  v.group = (int)group;
  v.block_n = (int)block_n;
  v.fp8_method = kn.fp8_method;
  // INT4: int8 activations need groups of whole 128-element chunks; otherwise int16 (groups of 64)
  // kInt4R16: always the int8 method (the layout's only one; groups of 128)
  v.int4_i8 = (fmt == kInt4 && kn.int4_method == kInt4Int8 && group % 128 == 0) || fmt == kInt4R16;
  v.int4_int = fmt == kInt4 && !v.int4_i8 && kn.int4_method != kInt4Float && group % 64 == 0;
  v.fp8_widen = fmt == kFp8 && kn.fp8_method == kFp8Widen && group % 64 == 0;
  // INT4 r16: its own distance where cpu_r16_int4_prefetch_ahead sets one
  v.prefetch_dist = prefetch_distance(fmt == kInt4R16 && kn.r16_int4_prefetch_ahead > 0 ? kn.r16_int4_prefetch_ahead
                                                                                       : kn.prefetch_ahead, v);
  v.prefetch_hint = kn.prefetch_hint;
  if (scale.defined() && scale.numel()) {
    // INT4 r16's block scales may be bfloat16 (prepare stores them so where every one is exact in it)
    const bool h = fmt == kInt4R16 && scale.scalar_type() == at::kBFloat16;
    TORCH_CHECK(scale.is_contiguous() && (h || scale.scalar_type() == at::kFloat),
                "scale must be contiguous float32 (INT4 r16: or bfloat16)");
    if (h) v.scale_h = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
    else v.scale = scale.data_ptr<float>();
    v.scale_ld = scale.size(-1);
    s.scale_expert_stride = w.dim() == 3 ? scale.stride(0) : 0;
  }
  // INT8: the zero slot carries the per-row weight sums (int32), the VNNI kernels' +128 compensation
  if (zero.defined() && zero.numel()) {
    if (fmt == kInt8 || fmt == kInt8R16) {
      TORCH_CHECK(zero.scalar_type() == at::kInt && zero.is_contiguous() && zero.numel() == scale.numel(),
                  "int8: the row sums must be contiguous int32 shaped like the scales");
      v.wsum = zero.data_ptr<int32_t>();
    } else {
      v.zero = zero.data_ptr<float>();
    }
  }
  v.act_bf16 = act_bf16;
  // r16: the dot product as for the row-major weight (cpu_bf16_isa, cpu_int8_isa); without one, BF16 on float32
  // FMAs (no split forms) and INT8 on vpmaddubsw (no int16 form)
  v.dot = resolve_dot(rows_format((int)fmt), v.int4_i8, v.wsum != nullptr, group, kn, act_bf16);
  if ((fmt == kInt8R16 || fmt == kInt4R16) && v.dot == kDotNone) v.dot = kDotMaddubs;
  v.bf16_split = fmt == kBF16 && v.dot == kDotNone && kn.bf16_method != kBf16Widen;
  v.bf16_ymm = v.bf16_split && (kn.bf16_method == kBf16Split256 || (kn.bf16_method == kBf16MethodAuto && kAvx2Build));
  v.k_block = kn.k_block;
  s.expert_bytes = w.dim() == 3 ? w.stride(0) * elem_bytes((int)fmt) : 0;
  // INT4 without zero points: symmetric weights, every zero point 8 (prepare keeps no zero stream for them)
  TORCH_CHECK(fmt != kInt4 || (v.scale && group % 32 == 0), "int4 needs scale and group % 32 == 0");
  TORCH_CHECK(fmt != kInt4R16 || ((v.scale || v.scale_h) && group == 128 && N % 16 == 0 && v.row_bytes % 64 == 0),
              "int4 r16 needs groups of 128, rows in whole blocks of 16 and its block scales");
  TORCH_CHECK(fmt != kFp8 || (v.scale && group % 32 == 0), "fp8 needs scale and a block K multiple of 32");
  TORCH_CHECK(fmt != kFp8R16 || (v.scale && group % 4 == 0 && block_n % 16 == 0 && N % 16 == 0 && K % 4 == 0 &&
                                 w.size(-1) == K),
              "fp8 r16 needs scale blocks of whole 16-row blocks and 4-byte units of K, rows in whole blocks of 16");
  TORCH_CHECK((fmt != kInt8 && fmt != kInt8R16) || v.scale, "int8 needs scale");
  TORCH_CHECK(fmt != kInt8R16 || (N % 16 == 0 && K % 4 == 0 && w.size(-1) == K && v.wsum),
              "int8 r16 needs rows in whole blocks of 16, K a multiple of 4 and the row sums");
  TORCH_CHECK(fmt != kBF16R16 || (N % 16 == 0 && K % 2 == 0 && w.size(-1) == K),
              "bf16 r16 needs rows in whole blocks of 16 and an even K");
  return s;
}

void Knobs::check() const {
  TORCH_CHECK(get_micro(kBF16, (int)micro_rows, (int)micro_tokens), "micro_rows must be 4 or 8 and micro_tokens 1, 2 or 4");
  TORCH_CHECK(micro_wide == 0 || get_micro_bf16_dot_wide(kBF16DpModel, (int)micro_wide), "micro_wide must be 0, 6, 8 or 12");
  TORCH_CHECK(linear_block_n >= 1 && moe_block_n >= 1 && moe_int4_tasks >= 0 && gemm_min_tokens >= 1 && gemm_block_n >= 1 && task_chunk >= 1 &&
                  amx_min_tokens >= 1 && amx_k_block >= 0 && amx_k_block % 64 == 0 && amx_direct_max_tokens >= 0 && amx_fp8_direct_max_tokens >= 0 && int4_r16_amx_min_tokens >= 1 && amx_n_group >= 1 && amx_m_block >= 0 && amx_m_block % 32 == 0 && dot_gemm_min_tokens >= 1 && bf16_gemm_min_tokens >= 1 && r16_onednn_min_tokens >= 1 && prefetch_ahead >= 0 &&
                  prefetch_ahead % 64 == 0 && r16_int4_prefetch_ahead >= 0 && r16_int4_prefetch_ahead % 64 == 0 && k_block >= 32 && k_block % 32 == 0,
              "moe_int4_tasks ≥ 0, int4_r16_amx_min_tokens, linear_block_n, moe_block_n, gemm_min_tokens, gemm_block_n, task_chunk, amx_min_tokens, "
              "amx_k_block (a multiple of 64, 0: all of K), amx_direct_max_tokens and amx_fp8_direct_max_tokens ≥ 0, amx_n_group ≥ 1, amx_m_block (a multiple of 32, 0: all rows), "
              "dot_gemm_min_tokens, bf16_gemm_min_tokens, r16_onednn_min_tokens must be ≥ 1, prefetch_ahead and r16_int4_prefetch_ahead multiples of 64 ≥ 0, "
              "k_block a multiple of 32 ≥ 32");
  TORCH_CHECK(fp8_method >= kFp8Vector && fp8_method <= kFp8Widen && bf16_method >= kBf16Widen &&
                  bf16_method <= kBf16MethodAuto && tile_rows >= kTileAdjacent && tile_rows <= kTileSpread &&
                  micro_order >= kOrderGroups && micro_order <= kOrderTilesNext && prefetch_hint >= kPrefetchT0 &&
                  prefetch_hint <= kPrefetchNone &&
                  int4_method >= kInt4Float &&
                  int4_method <= kInt4Int8 && int8_isa >= kInt8IsaAuto && int8_isa <= kInt8IsaMaddubs &&
                  bf16_isa >= kBf16IsaAuto && bf16_isa <= kBf16IsaDot && bf16_gemm >= kBf16GemmAuto &&
                  bf16_gemm <= kBf16GemmAmx && int8_gemm >= kInt8GemmAuto && int8_gemm <= kInt8GemmAmx &&
                  int4_gemm >= kInt4GemmAuto && int4_gemm <= kInt4GemmAmx && fp8_gemm >= kFp8GemmAuto &&
                  fp8_gemm <= kFp8GemmAmx,
              "fp8_method, bf16_method, tile_rows, micro_order, prefetch_hint, int4_method, int8_isa, bf16_isa, "
              "bf16_gemm, int8_gemm, int4_gemm and fp8_gemm must be set");
  TORCH_CHECK(attn_head_fold >= 1 && attn_kv_splits >= 1 && attn_decode_kv_block >= 1 && attn_extend_q_block >= 1 &&
                  attn_extend_kv_block >= 1 && attn_blas_rows >= 1 && attn_blas_kv_block >= 1,
              "attention knobs must be ≥ 1");
  TORCH_CHECK(attn_isa >= kAttnIsaAuto && attn_isa <= kAttnIsaAmx, "attn_isa must be set");
  TORCH_CHECK(attn_f32_form >= kAttnFormAuto && attn_f32_form <= kAttnPacked, "attn_f32_form must be set");
  TORCH_CHECK(attn_prefetch >= kAttnPrefetchT0 && attn_prefetch <= kAttnPrefetchAuto, "attn_prefetch must be set");
  TORCH_CHECK(unpack_gemm >= kUnpackGemmAuto && unpack_gemm <= kUnpackGemmFma, "unpack_gemm must be set");
  TORCH_CHECK(prefill_prefetch_hint >= kPrefillT0 && prefill_prefetch_hint <= kPrefillSame && prefill_prefetch_ahead >= 0 &&
                  prefill_prefetch_ahead % 64 == 0,
              "prefill_prefetch_hint must be set and prefill_prefetch_ahead a multiple of 64 ≥ 0");
  const auto tile_rows = [](int64_t v) { return v == 16 || v == 32 || v == 64; };
  const auto tokens = [](int64_t v, int64_t low) { return v >= low && v <= kR16MaxTokens; };
  TORCH_CHECK(tile_rows(r16_rows) && tile_rows(r16_int8_rows) && tile_rows(r16_int4_rows) && tile_rows(r16_fp8_rows) &&
                  tile_rows(r16_prefill_rows) && tokens(r16_tokens, 1) && tokens(r16_bf16_tokens, 1) &&
                  tokens(r16_bf16_one_group, 0) && (r16_tile_blocks == kTileAdjacent || r16_tile_blocks == kTileSpread) &&
                  r16_next_prefetch >= kPrefetchT0 && r16_next_prefetch <= kPrefetchNone &&
                  (moe_gemm_experts == kMoeGrouped || moe_gemm_experts == kMoeEach),
              "r16_rows, r16_int8_rows, r16_int4_rows, r16_fp8_rows and r16_prefill_rows must be 16, 32 or 64, r16_tokens and r16_bf16_tokens 1..12, r16_bf16_one_group 0..12, r16_next_prefetch and moe_gemm_experts set");
}

// ------------------------------------------------------------------ activations

static int64_t padded_k(const WeightView& W) {
  const int64_t g = W.group > 0 ? W.group : 32;
  const int64_t k = ((W.K + g - 1) / g) * g;
  return ((k + 127) / 128) * 128;
}

// Per-token symmetric int8 exactly as the reference: scale = amax / 127 (1 if amax = 0),
// q = round-half-even(x / scale) clamped to ±127, stored as int16.
static void quantize_row(const float* x, int64_t K, int16_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float a = _mm512_reduce_max_ps(amax);
  for (; k < K; ++k) a = std::max(a, std::fabs(x[k]));
  const float s = a > 0.f ? a / 127.f : 1.f;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.f);
  for (k = 0; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    _mm256_storeu_si256((__m256i*)(q + k), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
  }
  for (; k < K; ++k) q[k] = (int16_t)std::max(-127.f, std::min(127.f, std::nearbyint(x[k] / s)));
}

Act PreparedAct::view() const {  // INT4 integer path: both forms, the same padded width
  Act a;
  if (xq.defined()) {
    a.xq = xq.data_ptr<int16_t>();
    a.xs = xs.data_ptr<float>();
    a.ld = xq.size(1);
  }
  if (xf.defined()) {
    a.xf = xf.data_ptr<float>();
    a.ld = xf.size(1);
  }
  if (gsum.defined()) {
    a.gsum = gsum.data_ptr<float>();
    a.gld = gsum.size(1);
  }
  if (gsumq.defined()) a.gsumq = gsumq.data_ptr<float>();
  if (xp.defined()) a.xp = xp.data_ptr<float>();
  if (xd.defined()) a.xd = xd.data_ptr<float>();
  if (xu.defined()) a.xu = xu.data_ptr<uint8_t>();
  if (xh.defined()) a.xh = reinterpret_cast<const uint16_t*>(xh.data_ptr<at::BFloat16>());
  if (xb.defined()) {
    a.xb = xb.data_ptr<int8_t>();
    a.xbs = xbs.data_ptr<float>();
    a.gsb = gsb.data_ptr<float>();
    a.ld = xb.size(1);
    a.gld = xbs.size(1);
  }
  return a;
}

// How a buffer starts: uninitialized (every element written), zeroed when allocated (every call
// writes the same elements, the rest stays zero: the padding past K), or zeroed on every call.
enum Init { kUninit, kZeroOnce, kZeroEach };

// Buffer `idx` of a prepared activation: fresh without a pool, else the pool's when its shape, dtype
// and K match (K: the padding past it must be the zeros it was allocated with).
static at::Tensor act_buf(ActPool* pool, int idx, int64_t K, at::IntArrayRef sizes, at::ScalarType dt, Init init) {
  auto fresh = [&] { return init == kUninit ? at::empty(sizes, dt) : at::zeros(sizes, dt); };
  if (pool == nullptr) return fresh();
  at::Tensor& t = pool->t[idx];
  if (!t.defined() || t.scalar_type() != dt || t.sizes() != sizes || pool->k[idx] != K) {
    t = fresh();
    pool->k[idx] = K;
  } else if (init == kZeroEach) {
    std::memset(t.data_ptr(), 0, t.nbytes());
  }
  return t;
}

PreparedAct prepare_act_f32rows(const float* src, int64_t M, int64_t K, int64_t ld, const WeightView& W,
                                ActPool* pool) {
  PreparedAct p;
  const int64_t kp = padded_k(W);
  if (W.fmt == kInt8 || W.fmt == kInt8R16) {
    p.xq = act_buf(pool, 0, K, {M, kp}, at::kShort, kZeroOnce);
    p.xs = act_buf(pool, 1, K, {M}, at::kFloat, kUninit);
    int16_t* q = p.xq.data_ptr<int16_t>();
    float* s = p.xs.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) quantize_row(src + m * ld, K, q + m * kp, s + m);
    });
    // the dot-product kernels' bytes: q + 128 (VNNI, unsigned) or q itself (vpmaddubsw with the sign trick)
    if (W.dot == kDotVnni || W.dot == kDotVnniModel || W.dot == kDotMaddubs) {
      const int bias = W.dot == kDotMaddubs ? 0 : 128;
      p.xu = act_buf(pool, 2, K, {M, kp}, at::kByte, kZeroOnce);
      uint8_t* u = p.xu.data_ptr<uint8_t>();
      at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m)
          for (int64_t k = 0; k < K; ++k) u[m * kp + k] = (uint8_t)(q[m * kp + k] + bias);
      });
    }
    return p;
  }
  p.xf = act_buf(pool, 3, K, {M, kp}, at::kFloat, kZeroOnce);
  float* d = p.xf.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) std::memcpy(d + m * kp, src + m * ld, K * sizeof(float));
  });
  if (W.fmt == kBF16 && W.bf16_split) {  // the split microkernel's order: per 32, the 16 even, then the 16 odd
    p.xd = act_buf(pool, 11, K, {M, kp}, at::kFloat, kUninit);
    float* o = p.xd.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        for (int64_t k0 = 0; k0 < kp; k0 += 32)
          for (int64_t i = 0; i < 16; ++i) {
            o[m * kp + k0 + i] = d[m * kp + k0 + 2 * i];
            o[m * kp + k0 + 16 + i] = d[m * kp + k0 + 2 * i + 1];
          }
    });
  }
  if (W.fmt == kFp8 && W.fp8_widen) {  // the widen microkernel's order, × 2^60
    p.xp = act_buf(pool, 4, K, {M, kp}, at::kFloat, kUninit);
    float* o = p.xp.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        for (int64_t k0 = 0; k0 < kp; k0 += 64)
          for (int v = 0; v < 4; ++v)
            for (int q = 0; q < 16; ++q)
              o[m * kp + k0 + 16 * v + q] = d[m * kp + k0 + fp8_widen_order(v, q)] * kFp8WidenActScale;
    });
  }
  if (W.dot == kDotBf16 || W.dot == kDotBf16Model) {  // bf16 rows (round to nearest even); FP8: × 2^60, permuted
    p.xh = act_buf(pool, 5, K, {M, kp}, at::kBFloat16, kZeroOnce);
    uint16_t* h = reinterpret_cast<uint16_t*>(p.xh.data_ptr<at::BFloat16>());
    const bool fp8 = W.fmt == kFp8;
    const float xscale = W.fmt == kFp8R16 ? kFp8WidenActScale : 1.f;  // FP8 r16: × 2^60 in order
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        const float* xr = d + m * kp;
        uint16_t* hr = h + m * kp;
        if (!fp8) {
          for (int64_t k = 0; k < K; ++k) hr[k] = c10::BFloat16(xr[k] * xscale).x;
          continue;
        }
        // per 64: the 32 elements the unpacklo half meets, then the 32 the unpackhi half meets
        for (int64_t k0 = 0; k0 < kp; k0 += 64)
          for (int64_t i = 0; i < 32; ++i) {
            const int64_t src = k0 + 16 * (i / 8) + i % 8;
            hr[k0 + i] = c10::BFloat16(xr[src] * kFp8WidenActScale).x;
            hr[k0 + 32 + i] = c10::BFloat16(xr[src + 8] * kFp8WidenActScale).x;
          }
      }
    });
  }
  if ((W.fmt == kInt4 || W.fmt == kInt4R16) && W.int4_i8) {  // int8 per (token, group), micro_int4b's order, group sums
    const int64_t G = kp / W.group;
    p.xb = act_buf(pool, 6, K, {M, kp}, at::kChar, kZeroOnce);
    p.xbs = act_buf(pool, 7, K, {M, G}, at::kFloat, kUninit);
    p.gsb = act_buf(pool, 8, K, {M, G}, at::kFloat, kUninit);
    int8_t* q = p.xb.data_ptr<int8_t>();
    float *sc = p.xbs.data_ptr<float>(), *gs = p.gsb.data_ptr<float>();
    at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m)
        for (int64_t g = 0; g < G; ++g) {
          const float* xr = d + m * kp + g * W.group;  // zero-padded past K
          float a = 0.f;
          for (int64_t i = 0; i < W.group; ++i) a = std::max(a, std::fabs(xr[i]));
          const float s = a > 0.f ? a / 127.f : 1.f, inv = 1.f / s;
          int64_t sum = 0;
          for (int64_t i = 0; i < W.group; ++i) {
            const int8_t v = (int8_t)std::max(-127.f, std::min(127.f, std::nearbyint(xr[i] * inv)));
            const int64_t c = i / 128, e2 = i % 128, j = e2 % 32;  // chunk, element in it, in its 32
            q[m * kp + g * W.group + c * 128 + (j < 16 ? 0 : 64) + 16 * (e2 / 32) + j % 16] = v;
            sum += v;
          }
          sc[m * G + g] = s;
          gs[m * G + g] = s * (float)sum;
        }
    });
  }
  if (W.fmt == kInt4 && W.int4_int) {  // int16 activations (±32767) in the kernel's order, int group sums
    p.xq = act_buf(pool, 0, K, {M, kp}, at::kShort, kZeroOnce);
    p.xs = act_buf(pool, 1, K, {M}, at::kFloat, kUninit);
    p.gsumq = act_buf(pool, 9, K, {M, kp / W.group}, at::kFloat, kZeroEach);
    int16_t* q = p.xq.data_ptr<int16_t>();
    float *s = p.xs.data_ptr<float>(), *gq = p.gsumq.data_ptr<float>();
    const int64_t G = kp / W.group;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = d + m * kp;
      float a = 0.f;
      for (int64_t k = 0; k < K; ++k) a = std::max(a, std::fabs(xr[k]));
      s[m] = a > 0.f ? a / 32767.f : 1.f;
      const float inv = 1.f / s[m];
      for (int64_t k0 = 0; k0 < kp; k0 += 64)
        for (int64_t i = 0; i < 64; ++i) {
          const int64_t src = k0 + i, dst = k0 + (i < 16 ? i : i < 32 ? i + 16 : i < 48 ? i - 16 : i);
          const int16_t v = (int16_t)std::max(-32767.f, std::min(32767.f, std::nearbyint(xr[src] * inv)));
          q[m * kp + dst] = v;
          gq[m * G + src / W.group] += (float)v;
        }
    }
  }
  if (W.fmt == kInt4) {
    const int64_t G = kp / W.group;
    p.gsum = act_buf(pool, 10, K, {M, G}, at::kFloat, kUninit);
    float* gs = p.gsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = g * W.group; k < (g + 1) * W.group; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(d + m * kp + k));
        gs[m * G + g] = hsum(acc);
      }
  }
  return p;
}

PreparedAct prepare_act(const at::Tensor& x, const WeightView& W) {
  at::Tensor xf = x.to(at::kFloat).contiguous();
  return prepare_act_f32rows(xf.data_ptr<float>(), xf.size(0), xf.size(1), xf.size(1), W);
}

// ------------------------------------------------------------------ direct path

// The r16 form of micro_sweep (kBF16R16, kInt8R16): rows [n0, n1) in whole 16-row blocks, the tokens in groups of
// r16_tokens (the rest in one smaller group), each row tile of r16_rows (one group) or r16_prefill_rows
// (several) running every group over all of K while its rows are in cache (the first group streams them from
// memory, the later ones read them from L2). Prefetch as micro_sweep's: a sweep of several groups as
// cpu_prefill_prefetch_hint / _ahead say; the distance is bytes ahead in each block's stream.
static void r16_sweep(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, int64_t n0, int64_t n1,
                      float* out, int64_t ldo, const Knobs& kn, bool expert) {
  TORCH_CHECK(n0 % 16 == 0 && n1 % 16 == 0, "r16 sweep: rows in whole 16-row blocks");
  // BF16: groups of cpu_r16_bf16_tokens; a fused-MoE expert of at most cpu_r16_bf16_one_group tokens in one group,
  // each tile's rows read once instead of again from cache by a second group (a linear keeps the groups: at 12
  // tokens its rows need the 4-block tiles' streams)
  const int MT = (int)(W.fmt != kBF16R16 ? kn.r16_tokens
                       : expert && M > kn.r16_bf16_tokens && M <= kn.r16_bf16_one_group ? M : kn.r16_bf16_tokens);
  const int64_t ng = (M + MT - 1) / MT;
  // rows per tile as the knob says, fewer where its tokens would need more than kR16MaxAcc accumulators
  const int64_t max_acc = W.fmt == kFp8R16 ? kR16Fp8MaxAcc : kR16MaxAcc;
  // rows per tile for one token group (decode), per format: BF16 cpu_r16_rows, the others their own knob
  const int64_t rows1 = W.fmt == kInt8R16 ? kn.r16_int8_rows : W.fmt == kInt4R16 ? kn.r16_int4_rows
                        : W.fmt == kFp8R16 ? kn.r16_fp8_rows : kn.r16_rows;
  const int RB = (int)std::min<int64_t>((ng > 1 ? kn.r16_prefill_rows : rows1) / 16,
                                        max_acc / std::min<int64_t>(MT, M));
  // INT8 and INT4: the policy is W.dot (make_weight: VNNI, its model or vpmaddubsw)
  const bool ints = W.fmt == kInt8R16 || W.fmt == kInt4R16;
  const int policy = ints || W.dot == kDotBf16 || W.dot == kDotBf16Model ? W.dot : kDotNone;
  R16Fn (*pick)(int, int, int) = W.fmt == kInt8R16 ? get_micro_r16_int8 : W.fmt == kInt4R16 ? get_micro_r16_int4
                                 : W.fmt == kFp8R16 ? get_micro_r16_fp8 : get_micro_r16;
  // INT4's and FP8's tiles add each group's share to out
  if (W.fmt == kInt4R16 || W.fmt == kFp8R16)
    for (int64_t m = 0; m < M; ++m) std::memset(out + m * ldo, 0, (n1 - n0) * sizeof(float));
  WeightView Ws = W;
  if (ng > 1 && kn.prefill_prefetch_hint != kPrefillSame) {
    Ws.prefetch_hint = (int)kn.prefill_prefetch_hint;
    Ws.prefetch_dist = prefetch_distance(kn.prefill_prefetch_ahead, W);
  }
  const unsigned csr = _mm_getcsr();
  if (policy == kDotBf16Model) _mm_setcsr(csr | 0x8040u);  // the instruction's DAZ + FTZ (micro_sweep)
  // the first group prefetches its own lines Ws.prefetch_dist ahead; with cpu_r16_next_prefetch the second
  // (whose rows come from cache) the next tile's instead, into the level it says, so they stream in while it
  // computes, and the later ones none
  const bool ahead = kn.r16_next_prefetch != kPrefetchNone;
  WeightView Wn = Ws, Wq = Ws;
  Wn.prefetch_hint = kn.r16_next_prefetch;
  Wq.prefetch_hint = kPrefetchNone;
  const int64_t blocks = (n1 - n0) / 16;
  // cpu_r16_tile_blocks=spread: tile j takes blocks j, j + S, j + 2S, ... (S = blocks / RB), so each of its RB
  // streams runs on through S consecutive blocks (the sweep's rows in RB long streams instead of a new set of RB
  // every tile); where the blocks split into RB parts of at least 2
  const int64_t S = kn.r16_tile_blocks == kTileSpread && RB > 1 && blocks % RB == 0 && blocks / RB >= 2 ? blocks / RB : 1;
  Ws.r16_stride = Wn.r16_stride = Wq.r16_stride = S;
  const int64_t tiles = S > 1 ? S : (blocks + RB - 1) / RB, tstep = S > 1 ? 1 : RB;
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t b0 = j * tstep;
    const int rb = (int)std::min<int64_t>(RB, blocks - b0);
    const uint8_t* own = W.w + (n0 + 16 * b0) * W.row_bytes;
    const uint8_t* nxt = own + 16 * (S > 1 ? 1 : rb) * W.row_bytes;  // the next tile's first rows
    for (int64_t m0 = 0, q = 0; m0 < M; m0 += MT, ++q) {
      const int mt = (int)std::min<int64_t>(MT, M - m0);
      const WeightView& Wv = q == 0 || !ahead ? Ws : q == 1 ? Wn : Wq;
      pick(policy, rb, mt)(Wv, n0 + 16 * b0, A, tok + m0, out + m0 * ldo + 16 * b0, ldo,
                                    q == 0 || !ahead ? own + Ws.prefetch_dist : nxt);
    }
  }
  if (policy == kDotBf16Model) _mm_setcsr(csr);
}

void micro_sweep(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, int64_t n0, int64_t n1,
                 float* out, int64_t ldo, const Knobs& kn, const uint8_t* next, bool expert) {
  if (is_r16(W.fmt)) return r16_sweep(W, A, tok, M, n0, n1, out, ldo, kn, expert);
  const int R = (int)kn.micro_rows, MT = (int)kn.micro_tokens;
  const bool vnni = W.dot == kDotVnni || W.dot == kDotVnniModel, bf16dot = W.dot == kDotBf16 || W.dot == kDotBf16Model;
  const bool model = W.dot == kDotVnniModel || W.dot == kDotBf16Model;
  const int fmt = W.fmt == kInt8 && vnni                      ? (model ? kInt8DpModel : kInt8Dp)
                  : W.fmt == kInt8 && W.dot == kDotMaddubs    ? kInt8Mb
                  : W.fmt == kInt4 && W.int4_i8 && vnni       ? (model ? kInt4bDpModel : kInt4bDp)
                  : W.fmt == kInt4 && W.int4_i8               ? kInt4b
                  : W.fmt == kInt4 && W.int4_int              ? kInt4i
                  : W.fmt == kBF16 && bf16dot                 ? (model ? kBF16DpModel : kBF16Dp)
                  : W.fmt == kFp8 && bf16dot                  ? (model ? kFp8DpModel : kFp8Dp)
                  : W.fmt == kFp8 && W.fp8_widen              ? kFp8w
                  : W.fmt == kBF16 && W.bf16_ymm              ? kBF16y
                  : W.fmt == kBF16 && W.bf16_split            ? kBF16s
                                                              : W.fmt;
  // MT tokens per tile while that many are left, then pairs, then single tokens
  MicroFn fn = get_micro(fmt, R, MT), fn2 = MT > 2 ? get_micro(fmt, R, 2) : nullptr;
  MicroFn fn1 = get_micro(fmt, R, 1);
  const unsigned csr = _mm_getcsr();
  // DAZ for the sweep: micro_fp8w's denormals read as zero; the vdpbf16ps model: DAZ + FTZ, as the instruction
  const unsigned csr_bits = fmt == kFp8w ? 0x0040u : (fmt == kBF16DpModel || fmt == kFp8DpModel) ? 0x8040u : 0u;
  if (csr_bits) _mm_setcsr(csr | csr_bits);
  float buf[8 * 4];  // a tile's outputs: R × MT ≤ 32, a wide tile's wide_rows × micro_wide ≤ 24
  int64_t t[12];
  const uint8_t* first = W.w + n0 * W.row_bytes;  // the sweep's first tile: next for a later token group
  if (!next) next = W.w + n1 * W.row_bytes;      // default: the rows after the sweep
  // cpu_tile_rows=spread: tile i reads rows n0 + i + r·S (S = the sweep's rows / R), so each of the R
  // streams runs through S consecutive rows; only where the rows split into R equal parts of ≥ 2 rows
  const int64_t rows = n1 - n0;
  const int64_t S = kn.tile_rows == kTileSpread && rows % R == 0 && rows / R >= 2 ? rows / R : 1;
  WeightView Ws = W;
  Ws.tile_stride = S;
  const int64_t tiles = S > 1 ? S : (rows + R - 1) / R, tstep = S > 1 ? 1 : R, cstep = S > 1 ? S : 1;
  // The token groups: micro_tokens tokens while that many are left in a group, then pairs, then single
  // tokens (at most M groups; the vector only past 256 tokens, beyond the microkernels' token range)
  // cpu_micro_wide: first, groups of micro_wide tokens on the wide tiles (wide_rows rows each, so R / wide_rows
  // of them cover a tile's rows), where the format has them (BF16 / INT8 dot products) and R is a multiple
  struct Group { int64_t m, n; MicroFn f; int rows; };
  Group one[256];
  std::vector<Group> many;
  Group* groups = M <= 256 ? one : (many.resize(M), many.data());
  int64_t ng = 0, mw = 0;
  if (const int WT = (int)kn.micro_wide; WT > 0 && M >= WT && R % wide_rows(WT) == 0) {
    MicroFn fw = (fmt == kBF16Dp || fmt == kBF16DpModel) ? get_micro_bf16_dot_wide(fmt, WT)
                 : (fmt == kInt8Dp || fmt == kInt8DpModel) ? get_micro_int8_dot_wide(fmt, WT)
                                                           : nullptr;
    if (fw)
      for (; mw + WT <= M; mw += WT) groups[ng++] = {mw, WT, fw, wide_rows(WT)};
  }
  for (int64_t m0 = mw; m0 < M; m0 += MT)
    for (int64_t mm = m0, end = std::min<int64_t>(m0 + MT, M); mm < end;) {
      const int64_t left = end - mm, step = left == MT ? MT : (left >= 2 && fn2) ? 2 : 1;
      groups[ng++] = {mm, step, step == MT ? fn : step == 2 ? fn2 : fn1, R};
      mm += step;
    }
  // cpu_prefill_prefetch_hint / _ahead: a sweep of several token groups (each tile's rows read again by the
  // later groups) prefetches its weight rows as they say instead of cpu_prefetch_hint / _ahead (same: as those)
  if (ng > 1 && kn.prefill_prefetch_hint != kPrefillSame) {
    Ws.prefetch_hint = (int)kn.prefill_prefetch_hint;
    Ws.prefetch_dist = prefetch_distance(kn.prefill_prefetch_ahead, W);
  }
  // cpu_micro_order=tiles_next: a tile's second token group prefetches the next tile's rows at the offset
  // it reads (a whole tile ahead), so the next rows stream in while the later groups compute from L1; the
  // other groups prefetch as tiles does (their own rows ahead: already cached after the first group)
  WeightView Wn = Ws;
  Wn.prefetch_dist = W.row_bytes;
  // a group over tile i: one call, or a wide group's R / g.rows calls on its row parts (part p: the tile's
  // rows p·g.rows ..., prefetching the next part's rows, the last part the next tile's)
  auto run = [&](const Group& g, int64_t i, const uint8_t* nx, const WeightView& Wv) {
    const int64_t r0 = n0 + i * tstep;
    for (int64_t j = 0; j < g.n; ++j) t[j] = tok[g.m + j];
    const int64_t nr = S > 1 ? R : std::min<int64_t>(R, n1 - r0);
    for (int64_t p0 = 0; p0 < nr; p0 += g.rows) {
      const uint8_t* np = p0 + g.rows < R ? W.w + (r0 + (p0 + g.rows) * Ws.tile_stride) * W.row_bytes : nx;
      g.f(Wv, r0 + p0 * Ws.tile_stride, A, t, buf, np);
      for (int64_t j = 0; j < g.n; ++j)
        for (int64_t r = 0; r < g.rows && p0 + r < nr; ++r)
          out[(g.m + j) * ldo + (r0 - n0) + (p0 + r) * cstep] = buf[j * g.rows + r];
    }
  };
  // the rows a tile prefetches while it is read: the next tile's; after the last tile, the next group's
  // first tile (groups order) or the rows after the sweep
  auto next_of = [&](int64_t i, bool last) { return i + 1 < tiles ? W.w + (n0 + (i + 1) * tstep) * W.row_bytes : last ? next : first; };
  if (kn.micro_order == kOrderGroups) {
    for (int64_t q = 0; q < ng; ++q)
      for (int64_t i = 0; i < tiles; ++i) run(groups[q], i, next_of(i, q + 1 == ng), Ws);
  } else {
    const bool ahead = kn.micro_order == kOrderTilesNext;
    for (int64_t i = 0; i < tiles; ++i)
      for (int64_t q = 0; q < ng; ++q) run(groups[q], i, next_of(i, true), ahead && q == 1 ? Wn : Ws);
  }
  if (csr_bits) _mm_setcsr(csr);
}

// A linear's parallel tasks: cpu_linear_block_n rows each, rounded up to whole microkernel tiles (r16: 16-row blocks)
static int64_t task_rows(const WeightView& W, const Knobs& kn) {
  const int64_t unit = is_r16(W.fmt) ? 16 : kn.micro_rows;
  return ((kn.linear_block_n + unit - 1) / unit) * unit;
}

void gemv_rows(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, float* out, int64_t ldo,
               const Knobs& kn, bool parallel) {
  const int64_t bn = task_rows(W, kn), tiles = (W.N + bn - 1) / bn;
#pragma omp parallel for schedule(dynamic, kn.task_chunk) if (parallel && tiles > 1)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * bn, n1 = std::min(W.N, n0 + bn);
    micro_sweep(W, A, tok, M, n0, n1, out + n0, ldo, kn, nullptr);  // next: the following task's rows
  }
}

// gemv_rows with a bf16 output (the caller's rows are bf16: linear): each task sweeps its rows into a float32
// scratch of [M, its rows] (dense, in cache: no [M, N] float32 array in memory, no second pass over one) and
// rounds it into out, nearest even as at::Tensor::to does (to_bf16).
static void gemv_rows_bf16(const WeightView& W, const Act& A, const int64_t* tok, int64_t M, uint16_t* out,
                           int64_t ldo, const Knobs& kn) {
  const int64_t bn = task_rows(W, kn), tiles = (W.N + bn - 1) / bn;
#pragma omp parallel if (tiles > 1)
  {
    std::vector<float> scratch((size_t)(M * std::min(bn, W.N)));
#pragma omp for schedule(dynamic, kn.task_chunk)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * bn, n1 = std::min(W.N, n0 + bn), w = n1 - n0;
      micro_sweep(W, A, tok, M, n0, n1, scratch.data(), w, kn, nullptr);
      for (int64_t m = 0; m < M; ++m) to_bf16(scratch.data() + m * w, w, out + m * ldo + n0);
    }
  }
}

// ------------------------------------------------------------------ unpack + BLAS path

void unpack_rows_f32(const WeightView& W, int64_t r0, int64_t r1, float* dst) {
  TORCH_CHECK(!is_r16(W.fmt), "r16 weights have no unpack GEMM path");
  const int64_t K = W.K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.w + r * W.row_bytes;
    float* d = dst + (r - r0) * K;
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t n = std::min<int64_t>(32, K - k);
      __m512 a, b;
      switch (W.fmt) {
        case kF32: Loader<kF32>::load(W, row, k, n, a, b); break;
        case kBF16: Loader<kBF16>::load(W, row, k, n, a, b); break;
        case kFp8: Loader<kFp8>::load(W, row, k, n, a, b); break;
        case kInt4: Loader<kInt4>::load(W, row, k, n, a, b); break;
        default: {  // int8: raw integers
          __m256i v = n >= 32 ? _mm256_loadu_si256((const __m256i*)(row + k)) : _mm256_maskz_loadu_epi8(tail_mask32(n), row + k);
          a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
          b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        }
      }
      if (W.fmt == kFp8) {
        const __m512 s = _mm512_set1_ps(W.scale[(r / W.block_n) * W.scale_ld + k / W.group]);
        a = _mm512_mul_ps(a, s);
        b = _mm512_mul_ps(b, s);
      } else if (W.fmt == kInt4) {
        const int64_t g = k / W.group;
        const __m512 s = _mm512_set1_ps(W.scale[r * W.scale_ld + g]), z = _mm512_set1_ps(int4_zero(W.zero, r * W.scale_ld + g));
        a = _mm512_mul_ps(_mm512_sub_ps(a, z), s);
        b = _mm512_mul_ps(_mm512_sub_ps(b, z), s);
      }
      _mm512_mask_storeu_ps(d + k, tail_mask16(n), a);
      if (n > 16) _mm512_mask_storeu_ps(d + k + 16, tail_mask16(n - 16), b);
    }
  }
}

// A BF16 weight's rows as a torch tensor [N, K] over our storage (no copy), for torch's own linear.
inline at::Tensor bf16_weight(const WeightView& W) {
  return at::from_blob(const_cast<uint8_t*>(W.w), {W.N, W.K}, {W.row_bytes / 2, 1}, at::kBFloat16);
}

// cpu_fp8_gemm=onednn: x (bf16) × an FP8 weight through torch's bf16 linear (oneDNN), cpu_gemm_block_n
// weight rows at a time: each block dequantized into one reused bf16 buffer (every value times its
// block scale, rounded to bf16 as DeepSeek's own FP8 → BF16 cast of the checkpoint does; the block
// stays cache-resident for its GEMM, and no weight-sized buffer is allocated and faulted in per call).
at::Tensor gemm_fp8_onednn(const at::Tensor& x, const WeightView& W, const Knobs& kn, at::ScalarType out_dtype) {
  const int64_t M = x.size(0), bn = std::min(kn.gemm_block_n, W.N);
  at::Tensor out = at::empty({M, W.N}, out_dtype);
  at::Tensor wb = at::empty({bn, W.K}, at::kBFloat16);
  uint16_t* const o = reinterpret_cast<uint16_t*>(wb.data_ptr());
  for (int64_t n0 = 0; n0 < W.N; n0 += bn) {
    const int64_t n1 = std::min(W.N, n0 + bn);
    at::parallel_for(n0, n1, 4, [&](int64_t s, int64_t e) {
      for (int64_t r = s; r < e; ++r) fp8_row_bf16(W, r, o + (r - n0) * W.K);
    });
    out.narrow(1, n0, n1 - n0).copy_(at::linear(x, wb.narrow(0, 0, n1 - n0)));
  }
  return out;
}

// Rows [r0, r1) (whole 16-row blocks) of a BF16 r16 weight, row-major into dst [r1 - r0, K]: each block's
// [units][16] 4-byte units (bf16 pairs) transposed back to [16][units], 16 units (1 KiB) at a time.
static void r16_rows_bf16(const WeightView& W, int64_t r0, int64_t r1, uint16_t* dst) {
  const int64_t U = W.K / 2;
  for (int64_t b = r0 / 16; b < r1 / 16; ++b) {
    const uint8_t* src = W.w + b * 16 * W.row_bytes;  // unit u of the block's 16 rows: 64 bytes at src + 64u
    uint32_t* d = reinterpret_cast<uint32_t*>(dst) + (b * 16 - r0) * U;
    const int64_t u16 = U & ~int64_t(15);
    for (int64_t u0 = 0; u0 < u16; u0 += 16) {
      const uint8_t* units[16];
      for (int j = 0; j < 16; ++j) units[j] = src + (u0 + j) * 64;
      transpose16_u32(units, 0, reinterpret_cast<uint8_t*>(d + u0), U * 4);  // row r: its 16 units
    }
    const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
    for (int64_t u = u16; u < U; ++u)
      for (int r = 0; r < 16; ++r) d[r * U + u] = s32[u * 16 + r];
  }
}

at::Tensor gemm_r16_onednn(const at::Tensor& x, const WeightView& W, const Knobs& kn, at::ScalarType out_dtype) {
  TORCH_CHECK(W.fmt == kBF16R16 && x.scalar_type() == at::kBFloat16, "gemm_r16_onednn: a BF16 r16 weight, bf16 rows");
  const int64_t M = x.size(0), bn = std::max<int64_t>(16, std::min(kn.gemm_block_n, W.N) / 16 * 16);
  at::Tensor out = at::empty({M, W.N}, out_dtype);
  at::Tensor wb = at::empty({bn, W.K}, at::kBFloat16);
  uint16_t* const o = reinterpret_cast<uint16_t*>(wb.data_ptr());
  for (int64_t n0 = 0; n0 < W.N; n0 += bn) {
    const int64_t n1 = std::min(W.N, n0 + bn);
    at::parallel_for(n0 / 16, n1 / 16, 1, [&](int64_t s, int64_t e) {
      r16_rows_bf16(W, s * 16, e * 16, o + (s * 16 - n0) * W.K);
    });
    out.narrow(1, n0, n1 - n0).copy_(at::linear(x, wb.narrow(0, 0, n1 - n0)));
  }
  return out;
}

// ------------------------------------------------------------------ FMA register tiles (cpu_unpack_gemm=fma)
//
// C[6, 16] = A[6, K] · P[K, 16] for one panel P of 16 weight rows unpacked to float32 and laid out
// K-major (P[k][j] = row j's element k: two 256-bit vectors per k), against one tile of 6 rows of x
// packed K-major as well (A[k][i]: 6 consecutive floats per k; rows past M are zero). The 6 × 2
// accumulators stay in registers over the whole K (12 + the panel's two vectors + one broadcast = 15
// of AVX2's 16 ymm registers: the classic 6 × 16 AVX2 FMA tile), so each k costs 6 broadcasts and two
// panel loads, all sequential, for 12 FMAs. Written on 256-bit intrinsics in both builds (native there:
// the AVX-512 model is not involved); float32 FMAs in K order, so the result differs from BLAS's by
// summation order only. gemm_fma runs K in passes (cpu_k_block): `add` sums this pass into C.
__attribute__((target("avx2,fma"))) void fma_tile(const float* a, const float* p, int64_t K, float* c, int64_t ldc,
                                                  int64_t rows, int64_t ncols, bool add) {
  __m256 acc[6][2];
  for (int i = 0; i < 6; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(p + 16 * k), b1 = _mm256_load_ps(p + 16 * k + 8);
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + 6 * k + i);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  // all 6 rows through a buffer at constant indices (a run-time row index made GCC keep the accumulators
  // in memory, stored on every k), then the rows and columns that exist
  alignas(32) float t[6][16];
#pragma GCC unroll 6
  for (int i = 0; i < 6; ++i) {
    _mm256_store_ps(t[i], acc[i][0]);
    _mm256_store_ps(t[i] + 8, acc[i][1]);
  }
  for (int64_t i = 0; i < rows; ++i)
    if (add)
      for (int64_t j = 0; j < ncols; ++j) c[i * ldc + j] += t[i][j];
    else
      std::memcpy(c + i * ldc, t[i], ncols * sizeof(float));
}

// The K-major panel of 16 unpacked rows: p[16 k + j] = rows[j K + k]; 8 × 8 blocks transposed in registers
// (8 loads, 24 shuffles, 8 stores per 64 floats, where the scalar loop took 64 loads and 64 stores: 19 % of
// gemm_fma's time at [4096, 2048] × 128 tokens on a Zen 3), the last K % 8 columns one by one.
__attribute__((target("avx2,fma"))) void panel_16(const float* rows, int64_t K, float* p) {
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t k0 = 0; k0 < k8; k0 += 8)
    for (int h = 0; h < 16; h += 8) {
      __m256 r[8], t[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + (h + i) * K + k0);
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved: (r0 k0, r1 k0, r0 k1, r1 k1 | ...k4, k5)
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
#pragma GCC unroll 2
      for (int i = 0; i < 8; i += 4) {  // four rows per k: (r0..r3 at k0 | k4), (k1 | k5), (k2 | k6), (k3 | k7)
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {  // rows 0-3 beside rows 4-7: k = i (low halves), k = i + 4 (high halves)
        _mm256_storeu_ps(p + 16 * (k0 + i) + h, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(p + 16 * (k0 + i + 4) + h, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
  for (int64_t k = k8; k < K; ++k)
    for (int j = 0; j < 16; ++j) p[16 * k + j] = rows[j * K + k];
}

// out [M, N] = x [M, K] · Wᵀ: x packed once into K-major tiles of 6 rows; per parallel task one panel
// of 16 weight rows, unpacked (unpack_rows_f32) and transposed into the K-major panel once, then
// every tile of x, K in passes of kb elements (cpu_k_block): each tile's pass reads its A slice
// (6 × kb floats) and the panel's (16 × kb) from L1, where a whole K of both (6 and 16 × K: 48 and
// 128 KiB at K = 2048) streamed from L2 on every k.
at::Tensor gemm_fma(const at::Tensor& x_act, const WeightView& W, int64_t kb) {
  const at::Tensor x = x_act.contiguous();
  const int64_t M = x.size(0), K = W.K, N = W.N, panels = (N + 15) / 16, tiles = (M + 5) / 6;
  at::Tensor out = at::empty({M, N}, at::kFloat);
  at::Tensor apack = at::zeros({tiles * 6 * K}, at::kFloat);
  const float* xa = x.data_ptr<float>();
  float* ap = apack.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t)
      for (int64_t i = 0; i < 6 && 6 * t + i < M; ++i)
        for (int64_t k = 0; k < K; ++k) ap[t * 6 * K + 6 * k + i] = xa[(6 * t + i) * K + k];
  });
  at::parallel_for(0, panels, 1, [&](int64_t s, int64_t e) {
    std::vector<float> rows(16 * K), pbuf(16 * K + 8);
    float* panel = pbuf.data() + ((32 - reinterpret_cast<uintptr_t>(pbuf.data()) % 32) % 32) / sizeof(float);
    for (int64_t pn = s; pn < e; ++pn) {
      const int64_t n0 = pn * 16, nc = std::min<int64_t>(16, N - n0);
      unpack_rows_f32(W, n0, n0 + nc, rows.data());
      if (nc < 16) std::fill(rows.begin() + nc * K, rows.end(), 0.f);
      panel_16(rows.data(), K, panel);
      for (int64_t k0 = 0; k0 < K; k0 += kb)
        for (int64_t t = 0; t < tiles; ++t)
          fma_tile(ap + t * 6 * K + 6 * k0, panel + 16 * k0, std::min(kb, K - k0), o + 6 * t * N + n0, N,
                   std::min<int64_t>(6, M - 6 * t), nc, k0 > 0);
    }
  });
  return out;
}

bool unpack_gemm_fma(const Knobs& kn) {
  if (kn.unpack_gemm != kUnpackGemmAuto) return kn.unpack_gemm == kUnpackGemmFma;
  return kAvx2Build;
}

at::Tensor gemm_unpacked(const at::Tensor& x_act, const WeightView& W, const Knobs& kn, bool int4_bf16_out) {
  if (const int amx = amx_engine(W, kn, x_act.size(0)); amx >= 0) {
    note_used(amx_used(amx));
    return W.fmt == kInt4 ? gemm_int4(x_act, W, amx, int4_bf16_out) : gemm_tiles_run(x_act, W, amx, amx_opts(kn));
  }
  TORCH_CHECK(W.fmt == kBF16R16 || !is_r16(W.fmt), "GEMM: r16 INT8, INT4 and FP8 weights on AMX only (gemm_from)");
  if (W.fmt == kBF16R16) {  // from r16_onednn_min_tokens (gemm_from): oneDNN on the rows restored from r16
    note_used(kUsedOnednn | kUsedR16);
    return gemm_r16_onednn(x_act.to(at::kBFloat16), W, kn, at::kFloat);
  }
  if (W.fmt == kBF16 && bf16_gemm_onednn(kn, W.act_bf16)) {  // torch's bf16 linear (oneDNN), bf16 output
    note_used(kUsedOnednn);
    return at::linear(x_act.to(at::kBFloat16), bf16_weight(W)).to(at::kFloat);
  }
  if (W.fmt == kFp8 && fp8_gemm_onednn(kn)) {  // the same on the weight dequantized to bf16
    note_used(kUsedOnednn);
    return gemm_fp8_onednn(x_act.to(at::kBFloat16), W, kn, at::kFloat);
  }
  const int engine = gemm_dot_engine(W, kn);
  if (engine == kTilesMaddubs) {
    note_used(kUsedMaddubs);
    return W.fmt == kInt4 ? gemm_int4(x_act, W, engine, int4_bf16_out) : gemm_tiles_run(x_act, W, engine);
  }
  if (engine >= 0) {
    const bool model = engine == kTilesDotModel;
    const bool bf16_dot = W.fmt == kBF16 || W.fmt == kFp8;
    note_used(!bf16_dot ? (model ? kUsedVnniModel : kUsedVnni) : (model ? kUsedBf16Model : kUsedBf16));
    return W.fmt == kInt4 ? gemm_int4(x_act, W, engine, int4_bf16_out) : gemm_tiles_run(x_act, W, engine);
  }
  if (unpack_gemm_fma(kn)) {
    note_used(kUsedFma);
    return gemm_fma(x_act.to(at::kFloat), W, kn.k_block);
  }
  note_used(kUsedBlas);
  const int64_t M = x_act.size(0), bn = kn.gemm_block_n;
  at::Tensor out = at::empty({M, W.N}, at::kFloat);
  at::Tensor buf = at::empty({std::min(bn, W.N), W.K}, at::kFloat);
  for (int64_t n0 = 0; n0 < W.N; n0 += bn) {
    const int64_t n1 = std::min(W.N, n0 + bn);
    float* b = buf.data_ptr<float>();
    at::parallel_for(n0, n1, 4, [&](int64_t s, int64_t e) { unpack_rows_f32(W, s, e, b + (s - n0) * W.K); });
    out.narrow(1, n0, n1 - n0).copy_(at::mm(x_act, buf.narrow(0, 0, n1 - n0).t()));
  }
  return out;
}

// x as the GEMM path multiplies it: float32, or for INT8 the quantized integers (exact in float32).
static at::Tensor gemm_input(const PreparedAct& p, int64_t K) {
  if (p.xq.defined() && !p.xf.defined()) return p.xq.narrow(1, 0, K).to(at::kFloat);
  return p.xf.narrow(1, 0, K);
}

int int8_integer_engine(const WeightView& W, const Knobs& kn, int64_t M) {
  if (W.fmt != kInt8 && W.fmt != kInt8R16) return -1;  // r16: AMX only (gemm_nest's R16B)
  const int amx = amx_engine(W, kn, M), engine = amx >= 0 ? amx : W.fmt == kInt8 ? gemm_dot_engine(W, kn) : -1;
  if (engine < 0) return -1;
  note_used(amx >= 0                   ? amx_used(amx)
            : engine == kTilesMaddubs  ? kUsedMaddubs
            : engine == kTilesDot      ? kUsedVnni
                                       : kUsedVnniModel);
  return engine;
}

at::Tensor linear(const at::Tensor& x, int64_t fmt, const at::Tensor& w, int64_t N, int64_t K,
                     const at::Tensor& scale, const at::Tensor& zero, int64_t group, int64_t block_n,
                     const Knobs& kn) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear: x must be [T, ", K, "]");
  kn.check();
  reset_used();
  WeightView W = make_weight(fmt, w, N, K, scale, zero, group, block_n, kn, x.scalar_type() == at::kBFloat16).base;
  const int64_t M = x.size(0);
  const bool gemm = M >= gemm_from(W, kn);
  if (gemm) W.no_micro_forms();
  if (const int amx = gemm && (W.fmt == kBF16 || W.fmt == kBF16R16 || W.fmt == kFp8) && W.act_bf16 ? amx_engine(W, kn, M) : -1;
      amx >= 0) {
    // AMX on the caller's bf16 rows (FP8: the weight expanded to bf16 as it is packed), a bf16 output: no
    // float32 copy either way
    note_used(amx_used(amx));
    return gemm_tiles_run(x.contiguous(), W, amx, amx_opts(kn), true);
  }
  if (gemm && W.fmt == kBF16R16 && W.act_bf16) {  // bf16 rows (gemm_from): oneDNN on the restored rows, a bf16 output
    note_used(kUsedOnednn | kUsedR16);
    return gemm_r16_onednn(x.contiguous(), W, kn, at::kBFloat16);
  }
  if (gemm && W.fmt == kBF16 && W.act_bf16 && bf16_gemm_onednn(kn, true)) {
    // torch's bf16 linear on the caller's bf16 rows, its bf16 output returned as is: no float32 copy
    // of the activations or of the [M, N] result (linear's output is in x's dtype)
    note_used(kUsedOnednn);
    return at::linear(x.contiguous(), bf16_weight(W));
  }
  if (gemm && W.fmt == kFp8 && W.act_bf16 && fp8_gemm_onednn(kn)) {  // likewise, on the dequantized weight
    note_used(kUsedOnednn);
    return gemm_fp8_onednn(x.contiguous(), W, kn, at::kBFloat16);
  }
  PreparedAct p = prepare_act(x, W);
  if (gemm && W.fmt == kInt4R16)  // the r16 microkernels' int8 activations on AMX, in x's dtype
    return gemm_int4_r16(p, nullptr, M, W, amx_engine(W, kn, M), x.scalar_type() == at::kBFloat16);
  const int int8_engine = gemm ? int8_integer_engine(W, kn, M) : -1;
  if (int8_engine >= 0)  // the integers as they are, scaled in the write-back, in x's dtype
    return gemm_int8_prepared(p.xq.data_ptr<int16_t>(), p.xq.size(1), p.xs.data_ptr<float>(), nullptr, M, W,
                              int8_engine, amx_opts(kn), x.scalar_type() == at::kBFloat16);
  if (gemm) {
    // INT4 on bf16 rows: a bf16 output from the GEMM's write-back (the Python side's .to(x.dtype) is then a no-op)
    at::Tensor out = gemm_unpacked(gemm_input(p, K), W, kn, fmt == kInt4 && x.scalar_type() == at::kBFloat16);
    if (fmt == kInt8) out.mul_(p.xs.unsqueeze(1)).mul_(scale.unsqueeze(0));
    return out;
  }
  note_micro(W);
  std::vector<int64_t> tok(M);
  for (int64_t m = 0; m < M; ++m) tok[m] = m;
  if (x.scalar_type() == at::kBFloat16) {  // bf16 rows in, bf16 rows out, rounded per task from cache
    at::Tensor out = at::empty({M, N}, at::kBFloat16);
    gemv_rows_bf16(W, p.view(), tok.data(), M, reinterpret_cast<uint16_t*>(out.data_ptr()), N, kn);
    return out;
  }
  at::Tensor out = at::empty({M, N}, at::kFloat);
  gemv_rows(W, p.view(), tok.data(), M, out.data_ptr<float>(), N, kn, true);
  return out;
}

}  // namespace moetune
