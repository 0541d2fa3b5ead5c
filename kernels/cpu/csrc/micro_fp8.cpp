// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"
#include "dot.h"

namespace moetune {
MicroFn get_micro_fp8(int rows, int tokens) { return pick_rows<kFp8>(rows, tokens); }
MicroFn get_micro_fp8w(int rows, int tokens) { return pick_rows<kFp8w>(rows, tokens); }
}  // namespace moetune

// The FP8 dot-product variants: micro_dot.inc on the instruction (dot_hw) and on its C++ model (dot_model).
namespace moetune {
namespace {
#include "micro_dot_both.inc"
}  // namespace
MicroFn get_micro_fp8_dot(int fmt, int rows, int tokens) {
  if (fmt == kFp8Dp) { MOETUNE_DOT_PICK(dot_hw, micro_fp8_dp, Bf16Hw, rows, tokens) }
  MOETUNE_DOT_PICK(dot_model, micro_fp8_dp, Bf16Model, rows, tokens)
}
}  // namespace moetune
