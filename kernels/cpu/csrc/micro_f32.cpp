// Microkernel instantiations for one weight format (kept apart so they compile in parallel).
#include "micro.h"

namespace moetune {
MicroFn get_micro_f32(int rows, int tokens) { return pick_rows<kF32>(rows, tokens); }
}  // namespace moetune
