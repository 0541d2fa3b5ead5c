// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"

namespace moetune {
MicroFn get_micro_fp8(int rows, int tokens) { return pick_rows<kFp8>(rows, tokens); }
MicroFn get_micro_fp8w(int rows, int tokens) { return pick_rows<kFp8w>(rows, tokens); }
}  // namespace moetune
