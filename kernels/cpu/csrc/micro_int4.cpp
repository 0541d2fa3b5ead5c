// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"
#include "dot.h"

namespace moetune {
MicroFn get_micro_int4(int rows, int tokens) { return pick_rows<kInt4>(rows, tokens); }
MicroFn get_micro_int4i(int rows, int tokens) { return pick_rows<kInt4i>(rows, tokens); }
}  // namespace moetune

// The INT4-int8 dot-product variants: micro_dot.inc on the instruction (dot_hw) and on its C++ model (dot_model).
namespace moetune {
namespace {
#include "micro_dot_both.inc"
}  // namespace
// the int8 INT4 method without VNNI: the dot-product kernel on vpmaddubsw (no extra ISA: the model namespace)
MicroFn get_micro_int4b(int rows, int tokens) { MOETUNE_DOT_PICK(dot_model, micro_int4b_dp, MaddubsNibbles, rows, tokens) }
MicroFn get_micro_int4_dot(int fmt, int rows, int tokens) {
  if (fmt == kInt4bDp) { MOETUNE_DOT_PICK(dot_hw, micro_int4b_dp, VnniHw, rows, tokens) }
  MOETUNE_DOT_PICK(dot_model, micro_int4b_dp, VnniModel, rows, tokens)
}
}  // namespace moetune
