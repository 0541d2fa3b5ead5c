// Run-time ISA dispatch: which dot-product instructions this CPU has (cpuid; AMX also the kernel's
// permission, amx.cpp), a mask that lowers them (tests, and a user who wants a portable run), the
// features run on their C++ models instead (tests), the variant each weight view runs, and a
// per-thread note of the variants a call used (kernels/cpu's call record).
#include <cpuid.h>
#include <atomic>
#include "ops.h"

namespace moetune {

namespace {
std::atomic<unsigned> g_mask{~0u};
std::atomic<unsigned> g_emulated{0};
thread_local unsigned t_used = 0;
const char* const kUsedNames[] = {"avx512", "vnni", "vnni-model", "avx512bf16", "avx512bf16-model", "amx", "blas", "onednn", "fma", "maddubs", "amx-model", "avx2", "r16", "grouped", "fp8rows"};
}  // namespace

unsigned detected_features() {
  static const unsigned f = [] {
    unsigned a = 0, b = 0, c = 0, d = 0, out = 0;
#ifdef MOETUNE_AVX2_BUILD
    return out;  // the AVX2 build runs no AVX-512 form: VNNI, BF16 and AMX only on their C++ models
#endif
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
      const unsigned subleaves = a;
      if (c & (1u << 11)) out |= kFeatVnni;  // leaf 7 ECX bit 11: AVX512_VNNI
      if (subleaves >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)))
        out |= kFeatBf16;  // leaf 7 subleaf 1 EAX bit 5: AVX512_BF16
    }
    if (amx_unavailable().empty()) out |= kFeatAmx;
    return out;
  }();
  return f;
}

unsigned usable_features() { return detected_features() & g_mask.load(std::memory_order_relaxed); }
unsigned emulated_features() { return g_emulated.load(std::memory_order_relaxed); }
void set_feature_mask(int64_t mask) { g_mask.store((unsigned)mask); }
int64_t feature_mask() { return g_mask.load(); }
void set_emulated_features(int64_t mask) {
  TORCH_CHECK((mask & ~(int64_t)(kFeatVnni | kFeatBf16 | kFeatAmx)) == 0, "only VNNI, AVX512-BF16 and AMX have C++ models here");
  g_emulated.store((unsigned)mask);
}

int resolve_dot(int fmt, bool int4_i8, bool has_wsum, int64_t group, const Knobs& kn, bool act_bf16) {
  const unsigned have = usable_features(), emu = emulated_features();
  auto pick = [&](unsigned feat, int native, int model) { return (emu & feat) ? model : (have & feat) ? native : kDotNone; };
  // INT4: micro_int4b_dp takes one group of 128 per step (the int8 method's only group in INT4_GROUPS; a
  // longer one keeps the int16 path)
  if (fmt == kInt8 || (fmt == kInt4 && int4_i8 && group == 128)) {
    if (kn.int8_isa == kInt8IsaAvx512) return kDotNone;
    // maddubs: INT8 on vpmaddubsw with the sign trick; INT4 on vpmaddubsw too (micro_int4b_dp with
    // MaddubsNibbles, as under avx512), not VNNI
    if (kn.int8_isa == kInt8IsaMaddubs) return fmt == kInt8 ? kDotMaddubs : kDotNone;
    const int vnni = fmt == kInt4 || has_wsum ? pick(kFeatVnni, kDotVnni, kDotVnniModel) : kDotNone;
    if (vnni != kDotNone || kn.int8_isa == kInt8IsaVnni) return vnni;
    // auto without VNNI: INT8 on vpmaddubsw in the AVX2 build (docs/cpu_kernels.md, session 16); the int16
    // vpmaddwd kernel in the AVX-512 one (unmeasured there against maddubs: equal instruction counts)
    return fmt == kInt8 && kAvx2Build ? kDotMaddubs : kDotNone;
  }
  if (fmt == kBF16 || (fmt == kFp8 && group % 64 == 0)) {
    if (kn.bf16_isa == kBf16IsaAvx512 || (kn.bf16_isa == kBf16IsaAuto && !act_bf16)) return kDotNone;
    return pick(kFeatBf16, kDotBf16, kDotBf16Model);
  }
  return kDotNone;
}

// auto, for bf16 activations: oneDNN where the CPU has AVX512-BF16 or AMX, where AMX itself does not run
// (the callers ask amx_engine first: below amx_min_tokens rows, or AMX masked off)
bool bf16_gemm_onednn(const Knobs& kn, bool act_bf16) {
  if (kn.bf16_gemm != kBf16GemmAuto) return kn.bf16_gemm == kBf16GemmOnednn;
  return act_bf16 && (usable_features() & (kFeatBf16 | kFeatAmx));
}

// FP8 auto, for activations that are bf16 already: our AMX GEMM where the CPU has AMX (amx_engine, from
// amx_min_tokens rows; the weight expanded to bf16 as it is packed: 1.5-1.9x oneDNN on the dequantized weight
// at 128-512 tokens on an AMX VM, docs/cpu_kernels.md "Session 38"), else our BF16 tile GEMM where it has
// AVX512-BF16 (gemm_dot_engine; 1.1-1.3x oneDNN on a Zen 4 VM). oneDNN by name only.
bool fp8_gemm_onednn(const Knobs& kn) { return kn.fp8_gemm == kFp8GemmOnednn; }

// INT8 auto: AMX where the CPU has it (from amx_min_tokens rows), VNNI's tile GEMM below that or without
// AMX (gemm_dot_engine); BF16 and FP8 auto: AMX for bf16 activations (float32 ones are not rounded by auto; FP8's
// blocks are expanded to bf16 per call: rows as A tiles up to cpu_amx_fp8_direct_max_tokens rows, else B tiles as
// they are packed). BF16 and INT8 r16 weights as their row-major formats (gemm_nest's R16B reads their
// blocks as B tiles in place); INT4 r16 ones (gemm_int4_r16, its lines' nibbles as B tile rows) under amx from
// amx_min_tokens rows, under auto from int4_r16_amx_min_tokens (fewer rows: the r16 microkernels win, fused MoE
// `small` at 24 tokens per expert, docs/cpu_kernels.md "Session 42").
// the rows from which AMX takes W where it runs for it
static int64_t amx_rows(const WeightView& W, const Knobs& kn) {
  return W.fmt == kInt4R16 && kn.int4_gemm == kInt4GemmAuto ? std::max(kn.amx_min_tokens, kn.int4_r16_amx_min_tokens)
                                                            : kn.amx_min_tokens;
}

int amx_engine(const WeightView& W, const Knobs& kn, int64_t M) {
  const int fmt = W.fmt == kBF16R16 || W.fmt == kInt8R16 ? rows_format(W.fmt) : W.fmt;
  const bool want = (fmt == kInt8 && (kn.int8_gemm == kInt8GemmAmx || kn.int8_gemm == kInt8GemmAuto)) ||
                    (fmt == kBF16 && (kn.bf16_gemm == kBf16GemmAmx || (kn.bf16_gemm == kBf16GemmAuto && W.act_bf16))) ||
                    (W.fmt == kFp8 && (kn.fp8_gemm == kFp8GemmAmx || (kn.fp8_gemm == kFp8GemmAuto && W.act_bf16))) ||
                    (W.fmt == kInt4 && W.group % 64 == 0 && (kn.int4_gemm == kInt4GemmAmx || kn.int4_gemm == kInt4GemmAuto)) ||
                    (W.fmt == kInt4R16 && (kn.int4_gemm == kInt4GemmAmx || kn.int4_gemm == kInt4GemmAuto));
  if (!want || M < amx_rows(W, kn)) return -1;
  return (emulated_features() & kFeatAmx) ? kTilesAmxModel : (usable_features() & kFeatAmx) ? kTilesAmx : -1;
}

int64_t amx_from(const WeightView& W, const Knobs& kn) {
  return amx_engine(W, kn, INT64_MAX) >= 0 ? amx_rows(W, kn) : INT64_MAX;
}

int gemm_dot_engine(const WeightView& W, const Knobs& kn) {
  const unsigned have = usable_features(), emu = emulated_features();
  unsigned feat = 0;
  // auto: the VNNI tile GEMM where the CPU has VNNI (measured 1.9-3.0x unpack + BLAS at 512 tokens on an
  // Emerald Rapids VM, docs/cpu_kernels.md); on an AMX CPU below amx_min_tokens rows (amx_engine first)
  const bool vnni = kn.int8_gemm == kInt8GemmVnni || kn.int8_gemm == kInt8GemmAuto;
  if (W.fmt == kInt8 && kn.int8_gemm == kInt8GemmMaddubs) return kTilesMaddubs;
  if (W.fmt == kInt8 && W.wsum && vnni) feat = kFeatVnni;
  if (W.fmt == kBF16 && kn.bf16_gemm == kBf16GemmDot) feat = kFeatBf16;
  // FP8 auto: here below amx_min_tokens rows on an AMX CPU (amx_engine first), or without AMX
  if (W.fmt == kFp8 && (kn.fp8_gemm == kFp8GemmDot || (kn.fp8_gemm == kFp8GemmAuto && W.act_bf16)))
    feat = kFeatBf16;
  // INT4 (amx.cpp gemm_int4): VNNI below amx_min_tokens rows on an AMX CPU (amx_engine first, groups of a multiple
  // of 64), for other groups, or without AMX; amx falls back to it likewise
  if (W.fmt == kInt4 && kn.int4_gemm == kInt4GemmMaddubs) return kTilesMaddubs;
  if (W.fmt == kInt4 && kn.int4_gemm != kInt4GemmUnpack) feat = kFeatVnni;
  if (!feat) return -1;
  const int engine = (emu & feat) ? kTilesDotModel : (have & feat) ? kTilesDot : -1;
  // auto in the AVX2 build (no VNNI, no AMX form): INT8 and INT4 on vpmaddubsw (linear [5632, 2048] on an
  // AMD Zen 3 VM: INT8 x1.3-1.7, INT4 x1.5-2.2 the float32 unpack + FMA tiles at 128-512 tokens;
  // docs/cpu_kernels.md "Session 12")
  if (kAvx2Build && engine < 0 &&
      ((W.fmt == kInt8 && kn.int8_gemm == kInt8GemmAuto) || (W.fmt == kInt4 && kn.int4_gemm == kInt4GemmAuto)))
    return kTilesMaddubs;
  return engine;
}

void reset_used() { t_used = 0; }
void note_used(unsigned bits) { t_used |= bits; }
void note_micro(const WeightView& W) {
  // micro_sweep: INT4 with the int8 method and no dot form runs micro_int4b_dp on vpmaddubsw (MaddubsNibbles)
  const int dot = rows_format(W.fmt) == kInt4 && W.int4_i8 && W.dot == kDotNone ? kDotMaddubs : W.dot;
  // BF16 on split256: 256-bit instructions only (micro_bf16y), named avx2
  t_used |= dot == kDotVnni ? kUsedVnni : dot == kDotVnniModel ? kUsedVnniModel : dot == kDotBf16 ? kUsedBf16
            : dot == kDotBf16Model ? kUsedBf16Model : dot == kDotMaddubs ? kUsedMaddubs
            : W.bf16_ymm ? kUsedAvx2 : kUsedAvx512;
  if (is_r16(W.fmt)) t_used |= kUsedR16;  // the layout, beside the instruction
}

std::string used_variants() {
  std::string s;
  for (unsigned i = 0; i < sizeof(kUsedNames) / sizeof(kUsedNames[0]); ++i)
    if (t_used & (1u << i)) s += (s.empty() ? "" : "+") + std::string(kUsedNames[i]);
  return s;
}

}  // namespace moetune
