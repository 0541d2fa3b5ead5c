// BF16 and INT8 weights in the r16 layout (kBF16R16, kInt8R16, common.h; knobs cpu_bf16_expert_layout,
// cpu_int8_expert_layout, ...): the register tiles of micro_r16.inc on AVX512-BF16 / AVX512-VNNI (dot_hw), on
// their C++ models, on float32 FMAs and on vpmaddubsw (dot_model). The layout is
// ik_llama.cpp's BF16_R16 idea (its -rtr repack): 16 rows interleaved by bf16 pair, so a step reads one
// contiguous line per 16 rows and each token's pair is broadcast, with no horizontal sums; measured
// against our dot form in suites/experiments/bf16_r16_layout.cpp (docs/cpu_kernels.md, session 22).
#include <cstring>
#include <type_traits>
#include "micro.h"
#include "dot.h"

namespace moetune {
namespace {

struct F32Fma {};  // no dot instruction: float32 FMAs on each pair's two halves against float activations

// A tile as R16Fn: its body with the prefetch code where W's hint asks for a prefetch, else without
#define MOETUNE_R16_TILE(NAME, ATTR)                                                                   \
  template <class P, int RB, int MT>                                                                   \
  ATTR void NAME(const WeightView& W, int64_t r0, const Act& A, const int64_t* tok, float* out, int64_t ldo, \
                 const uint8_t* pf) {                                                                   \
    if (W.prefetch_hint == kPrefetchNone) NAME##_body<P, RB, MT, false>(W, r0, A, tok, out, ldo, pf);  \
    else NAME##_body<P, RB, MT, true>(W, r0, A, tok, out, ldo, pf);                                   \
  }

#define MOETUNE_DOT_NS dot_hw
#define MOETUNE_R16_ATTR MOETUNE_TARGET_BF16
#define MOETUNE_R16_VNNI_ATTR MOETUNE_TARGET_VNNI
#include "micro_r16.inc"
#undef MOETUNE_DOT_NS
#undef MOETUNE_R16_ATTR
#undef MOETUNE_R16_VNNI_ATTR
#define MOETUNE_DOT_NS dot_model
#define MOETUNE_R16_ATTR
#define MOETUNE_R16_VNNI_ATTR
#include "micro_r16.inc"
#undef MOETUNE_DOT_NS
#undef MOETUNE_R16_ATTR
#undef MOETUNE_R16_VNNI_ATTR

}  // namespace

// every (blocks, tokens) with blocks · tokens ≤ kR16MaxAcc accumulators, blocks 1..4, tokens 1..kR16MaxTokens
#define MOETUNE_R16_PICK(NS, P) MOETUNE_R16_PICK_TILE(NS, r16_tile, P)
#define MOETUNE_R16_PICK_TILE(NS, T, P)                                                  \
  {                                                                                      \
    using namespace NS;                                                                  \
    static const R16Fn t[4][kR16MaxTokens] = {                                           \
        {T<P, 1, 1>, T<P, 1, 2>, T<P, 1, 3>, T<P, 1, 4>, T<P, 1, 5>, T<P, 1, 6>,         \
         T<P, 1, 7>, T<P, 1, 8>, T<P, 1, 9>, T<P, 1, 10>, T<P, 1, 11>, T<P, 1, 12>},     \
        {T<P, 2, 1>, T<P, 2, 2>, T<P, 2, 3>, T<P, 2, 4>, T<P, 2, 5>, T<P, 2, 6>,         \
         T<P, 2, 7>, T<P, 2, 8>, T<P, 2, 9>, T<P, 2, 10>, T<P, 2, 11>, T<P, 2, 12>},     \
        {T<P, 3, 1>, T<P, 3, 2>, T<P, 3, 3>, T<P, 3, 4>, T<P, 3, 5>, T<P, 3, 6>,         \
         T<P, 3, 7>, T<P, 3, 8>},                                                        \
        {T<P, 4, 1>, T<P, 4, 2>, T<P, 4, 3>, T<P, 4, 4>, T<P, 4, 5>, T<P, 4, 6>}};       \
    return t[blocks - 1][tokens - 1];                                                    \
  }

R16Fn get_micro_r16(int policy, int blocks, int tokens) {
  static_assert(kR16MaxTokens == 12 && kR16MaxAcc == 24, "MOETUNE_R16_PICK's table");
  if (blocks < 1 || blocks > 4 || tokens < 1 || tokens > kR16MaxTokens || blocks * tokens > kR16MaxAcc) return nullptr;
  if (policy == kDotBf16) MOETUNE_R16_PICK(dot_hw, Bf16Hw)
  if (policy == kDotBf16Model) MOETUNE_R16_PICK(dot_model, Bf16Model)
  MOETUNE_R16_PICK(dot_model, F32Fma)
}

// blocks · tokens ≤ 12 (two sums per output in a group)
#define MOETUNE_R16_PICK_FP8(NS, P)                                                      \
  {                                                                                      \
    using namespace NS;                                                                  \
    static const R16Fn t[4][kR16MaxTokens] = {                                           \
        {r16_fp8_tile<P, 1, 1>, r16_fp8_tile<P, 1, 2>, r16_fp8_tile<P, 1, 3>, r16_fp8_tile<P, 1, 4>, \
         r16_fp8_tile<P, 1, 5>, r16_fp8_tile<P, 1, 6>, r16_fp8_tile<P, 1, 7>, r16_fp8_tile<P, 1, 8>, \
         r16_fp8_tile<P, 1, 9>, r16_fp8_tile<P, 1, 10>, r16_fp8_tile<P, 1, 11>, r16_fp8_tile<P, 1, 12>}, \
        {r16_fp8_tile<P, 2, 1>, r16_fp8_tile<P, 2, 2>, r16_fp8_tile<P, 2, 3>, r16_fp8_tile<P, 2, 4>, \
         r16_fp8_tile<P, 2, 5>, r16_fp8_tile<P, 2, 6>},                                  \
        {r16_fp8_tile<P, 3, 1>, r16_fp8_tile<P, 3, 2>, r16_fp8_tile<P, 3, 3>, r16_fp8_tile<P, 3, 4>}, \
        {r16_fp8_tile<P, 4, 1>, r16_fp8_tile<P, 4, 2>, r16_fp8_tile<P, 4, 3>}};          \
    return t[blocks - 1][tokens - 1];                                                    \
  }

R16Fn get_micro_r16_fp8(int policy, int blocks, int tokens) {
  static_assert(kR16Fp8MaxAcc == 12, "MOETUNE_R16_PICK_FP8's table");
  if (blocks < 1 || blocks > 4 || tokens < 1 || tokens > kR16MaxTokens || blocks * tokens > kR16Fp8MaxAcc) return nullptr;
  if (policy == kDotBf16) MOETUNE_R16_PICK_FP8(dot_hw, Bf16Hw)
  if (policy == kDotBf16Model) MOETUNE_R16_PICK_FP8(dot_model, Bf16Model)
  MOETUNE_R16_PICK_FP8(dot_model, F32Fma)
}

R16Fn get_micro_r16_int4(int policy, int blocks, int tokens) {
  if (blocks < 1 || blocks > 4 || tokens < 1 || tokens > kR16MaxTokens || blocks * tokens > kR16MaxAcc) return nullptr;
  if (policy == kDotVnni) MOETUNE_R16_PICK_TILE(dot_hw, r16_int4_tile, VnniHw)
  if (policy == kDotVnniModel) MOETUNE_R16_PICK_TILE(dot_model, r16_int4_tile, VnniModel)
  if (policy == kDotMaddubs) MOETUNE_R16_PICK_TILE(dot_model, r16_int4_tile, MaddubsNibbles)
  return nullptr;
}

R16Fn get_micro_r16_int8(int policy, int blocks, int tokens) {
  if (blocks < 1 || blocks > 4 || tokens < 1 || tokens > kR16MaxTokens || blocks * tokens > kR16MaxAcc) return nullptr;
  if (policy == kDotVnni) MOETUNE_R16_PICK_TILE(dot_hw, r16_int8_tile, VnniHw)
  if (policy == kDotVnniModel) MOETUNE_R16_PICK_TILE(dot_model, r16_int8_tile, VnniModel)
  if (policy == kDotMaddubs) MOETUNE_R16_PICK_TILE(dot_model, r16_int8_tile, MaddubsSigned)
  return nullptr;
}

}  // namespace moetune
