// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"
#include "dot.h"

namespace moetune {
MicroFn get_micro_bf16(int rows, int tokens) { return pick_rows<kBF16>(rows, tokens); }
MicroFn get_micro_bf16s(int rows, int tokens) { return pick_rows<kBF16s>(rows, tokens); }
MicroFn get_micro_bf16y(int rows, int tokens) { return pick_rows<kBF16y>(rows, tokens); }
}  // namespace moetune

// The BF16 dot-product variants: micro_dot.inc on the instruction (dot_hw) and on its C++ model (dot_model).
namespace moetune {
namespace {
#include "micro_dot_both.inc"
}  // namespace
MicroFn get_micro_bf16_dot(int fmt, int rows, int tokens) {
  if (fmt == kBF16Dp) { MOETUNE_DOT_PICK(dot_hw, micro_bf16_dp, Bf16Hw, rows, tokens) }
  MOETUNE_DOT_PICK(dot_model, micro_bf16_dp, Bf16Model, rows, tokens)
}
MicroFn get_micro_bf16_dot_wide(int fmt, int tokens) {
  if (fmt == kBF16Dp) { MOETUNE_DOT_PICK_WIDE(dot_hw, micro_bf16_dp, Bf16Hw, tokens) }
  MOETUNE_DOT_PICK_WIDE(dot_model, micro_bf16_dp, Bf16Model, tokens)
}
}  // namespace moetune
