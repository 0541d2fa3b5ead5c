// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"

namespace moetune {
MicroFn get_micro_int4(int rows, int tokens) { return pick_rows<kInt4>(rows, tokens); }
MicroFn get_micro_int4i(int rows, int tokens) { return pick_rows<kInt4i>(rows, tokens); }
MicroFn get_micro_int4b(int rows, int tokens) { return pick_rows<kInt4b>(rows, tokens); }
}  // namespace moetune
