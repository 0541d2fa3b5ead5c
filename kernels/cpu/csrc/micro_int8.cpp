// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"

namespace moetune {
MicroFn get_micro_int8(int rows, int tokens) { return pick_rows<kInt8>(rows, tokens); }
}  // namespace moetune
