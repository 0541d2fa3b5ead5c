// BF16 experts in the r16 layout (kBF16R16, common.h; knob cpu_bf16_expert_layout): the register tiles of
// micro_r16.inc on AVX512-BF16 (dot_hw), on its C++ model and on float32 FMAs (dot_model). The layout is
// ik_llama.cpp's BF16_R16 idea (its -rtr repack): 16 rows interleaved by bf16 pair, so a step reads one
// contiguous line per 16 rows and each token's pair is broadcast, with no horizontal sums; measured
// against our dot form in suites/experiments/bf16_r16_layout.cpp (docs/cpu_kernels.md, session 22).
#include <type_traits>
#include "micro.h"
#include "dot.h"

namespace moetune {
namespace {

struct F32Fma {};  // no dot instruction: float32 FMAs on each pair's two halves against float activations

#define MOETUNE_DOT_NS dot_hw
#define MOETUNE_R16_ATTR MOETUNE_TARGET_BF16
#include "micro_r16.inc"
#undef MOETUNE_DOT_NS
#undef MOETUNE_R16_ATTR
#define MOETUNE_DOT_NS dot_model
#define MOETUNE_R16_ATTR
#include "micro_r16.inc"
#undef MOETUNE_DOT_NS
#undef MOETUNE_R16_ATTR

}  // namespace

// every (blocks, tokens) with blocks · tokens ≤ kR16MaxAcc accumulators, blocks 1..4, tokens 1..kR16MaxTokens
#define MOETUNE_R16_PICK(NS, P)                                                          \
  {                                                                                      \
    using namespace NS;                                                                  \
    static const R16Fn t[4][kR16MaxTokens] = {                                           \
        {r16_tile<P, 1, 1>, r16_tile<P, 1, 2>, r16_tile<P, 1, 3>, r16_tile<P, 1, 4>,     \
         r16_tile<P, 1, 5>, r16_tile<P, 1, 6>, r16_tile<P, 1, 7>, r16_tile<P, 1, 8>,     \
         r16_tile<P, 1, 9>, r16_tile<P, 1, 10>, r16_tile<P, 1, 11>, r16_tile<P, 1, 12>}, \
        {r16_tile<P, 2, 1>, r16_tile<P, 2, 2>, r16_tile<P, 2, 3>, r16_tile<P, 2, 4>,     \
         r16_tile<P, 2, 5>, r16_tile<P, 2, 6>, r16_tile<P, 2, 7>, r16_tile<P, 2, 8>,     \
         r16_tile<P, 2, 9>, r16_tile<P, 2, 10>, r16_tile<P, 2, 11>, r16_tile<P, 2, 12>}, \
        {r16_tile<P, 3, 1>, r16_tile<P, 3, 2>, r16_tile<P, 3, 3>, r16_tile<P, 3, 4>,     \
         r16_tile<P, 3, 5>, r16_tile<P, 3, 6>, r16_tile<P, 3, 7>, r16_tile<P, 3, 8>},    \
        {r16_tile<P, 4, 1>, r16_tile<P, 4, 2>, r16_tile<P, 4, 3>, r16_tile<P, 4, 4>,     \
         r16_tile<P, 4, 5>, r16_tile<P, 4, 6>}};                                         \
    return t[blocks - 1][tokens - 1];                                                    \
  }

R16Fn get_micro_r16(int policy, int blocks, int tokens) {
  static_assert(kR16MaxTokens == 12 && kR16MaxAcc == 24, "MOETUNE_R16_PICK's table");
  if (blocks < 1 || blocks > 4 || tokens < 1 || tokens > kR16MaxTokens || blocks * tokens > kR16MaxAcc) return nullptr;
  if (policy == kDotBf16) MOETUNE_R16_PICK(dot_hw, Bf16Hw)
  if (policy == kDotBf16Model) MOETUNE_R16_PICK(dot_model, Bf16Model)
  MOETUNE_R16_PICK(dot_model, F32Fma)
}

}  // namespace moetune
