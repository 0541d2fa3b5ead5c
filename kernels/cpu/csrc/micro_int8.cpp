// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"
#include "dot.h"

namespace moetune {
MicroFn get_micro_int8(int rows, int tokens) { return pick_rows<kInt8>(rows, tokens); }
}  // namespace moetune

// The int8 dot-product variants: micro_dot.inc on the instruction (dot_hw), on its C++ model (dot_model), and
// on vpmaddubsw with the sign trick (dot_model, MaddubsSigned).
namespace moetune {
namespace {
#include "micro_dot_both.inc"
}  // namespace
MicroFn get_micro_int8_dot(int fmt, int rows, int tokens) {
  if (fmt == kInt8Dp) { MOETUNE_DOT_PICK(dot_hw, micro_int8_dp, VnniHw, rows, tokens) }
  // vpmaddubsw (AVX-512BW / AVX2): no extra ISA, the model namespace
  if (fmt == kInt8Mb) { MOETUNE_DOT_PICK(dot_model, micro_int8_dp, MaddubsSigned, rows, tokens) }
  MOETUNE_DOT_PICK(dot_model, micro_int8_dp, VnniModel, rows, tokens)
}
MicroFn get_micro_int8_dot_wide(int fmt, int tokens) {
  if (fmt == kInt8Dp) { MOETUNE_DOT_PICK_WIDE(dot_hw, micro_int8_dp, VnniHw, tokens) }
  MOETUNE_DOT_PICK_WIDE(dot_model, micro_int8_dp, VnniModel, tokens)
}
}  // namespace moetune
