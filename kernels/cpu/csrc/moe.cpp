// Fused MoE: tokens grouped by expert; phase 1 computes SiLU(gate)·up per (expert, intermediate
// tile) task, phase 2 the down projection per output (D) tile over every expert, accumulating the
// routing-weighted sum in place (a tile is owned by one task, so no atomics). One barrier between
// the phases, none per expert. Experts with many tokens (≥ gemm_min_tokens; ≥ dot_gemm_min_tokens where
// the format's GEMM is a dot-product engine here; ≥ amx_min_tokens where AMX runs) take the GEMM path
// instead (dot-product or AMX tiles, or unpack + BLAS), one expert at a time with all threads.
#include <omp.h>
#include <cmath>
#include "ops.h"
#include "vmath.h"

namespace moetune {

namespace {

struct Routing {
  std::vector<int64_t> count, offset;  // per expert
  std::vector<int64_t> slot_tok;       // [P] token of each slot, slots grouped by expert
  std::vector<float> slot_w;           // [P] routing weight of each slot
  std::vector<int64_t> slot_idx;       // [P] 0..P-1 (activation rows of phase 2)
};

Routing group_by_expert(const at::Tensor& topk_w, const at::Tensor& topk_ids, int64_t E) {
  const int64_t T = topk_ids.size(0), Kt = topk_ids.size(1), P = T * Kt;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* w = topk_w.data_ptr<float>();
  Routing r;
  r.count.assign(E, 0);
  r.offset.assign(E + 1, 0);
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "fused_moe: expert id ", ids[i], " outside [0, ", E, ")");
    ++r.count[ids[i]];
  }
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] = r.offset[e] + r.count[e];
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  r.slot_tok.resize(P);
  r.slot_w.resize(P);
  r.slot_idx.resize(P);
  for (int64_t i = 0; i < P; ++i) {
    const int64_t p = fill[ids[i]]++;
    r.slot_tok[p] = i / Kt;
    r.slot_w[p] = w[i];
  }
  for (int64_t p = 0; p < P; ++p) r.slot_idx[p] = p;
  return r;
}

// Rows `rows` of a GEMM-path input (float32 or the INT8 integers as float32).
at::Tensor gather_rows(const PreparedAct& p, const int64_t* rows, int64_t n, int64_t K) {
  at::Tensor idx = at::from_blob(const_cast<int64_t*>(rows), {n}, at::kLong);
  if (p.xq.defined() && !p.xf.defined()) return p.xq.narrow(1, 0, K).index_select(0, idx).to(at::kFloat);
  return p.xf.narrow(1, 0, K).index_select(0, idx);
}

at::Tensor gathered_scales(const PreparedAct& p, const int64_t* rows, int64_t n) {
  at::Tensor idx = at::from_blob(const_cast<int64_t*>(rows), {n}, at::kLong);
  return p.xs.index_select(0, idx);
}

// Phase 1 for one (expert, intermediate tile [i0, i1)): h[slot, i] = SiLU(gate) · up. `next`: the
// first gate row of the task this thread likely takes next (prefetched at the end of the up rows).
void gate_up_tile(const WeightView& W, const Act& A, const int64_t* tok, int64_t n, int64_t I, int64_t i0,
                  int64_t i1, float* h, const Knobs& kn, const uint8_t* next) {
  const int64_t w = i1 - i0;
  std::vector<float> gate(n * w), up(n * w);
  micro_sweep(W, A, tok, n, i0, i1, gate.data(), w, kn, W.w + (I + i0) * W.row_bytes, true);
  micro_sweep(W, A, tok, n, I + i0, I + i1, up.data(), w, kn, next, true);
  for (int64_t m = 0; m < n; ++m) silu_mul_f32(gate.data() + m * w, up.data() + m * w, w, h + m * I + i0);
}

// Phase 2 for one output tile [d0, d1) over every small expert: out[tok, d] += w · down(h)[d].
// Each expert's rows prefetch the next expert's; the last, the next tile's first expert.
void down_tile(const StackedWeight& W2, const Act& H, const Routing& r, const std::vector<int64_t>& experts,
               int64_t d0, int64_t d1, float* out, int64_t D, const Knobs& kn) {
  const int64_t w = d1 - d0;
  std::vector<float> y;
  for (size_t j = 0; j < experts.size(); ++j) {
    const int64_t e = experts[j], n = r.count[e], off = r.offset[e];
    const uint8_t* next = j + 1 < experts.size() ? W2.expert(experts[j + 1]).w + d0 * W2.base.row_bytes
                                                 : W2.expert(experts[0]).w + d1 * W2.base.row_bytes;
    y.resize(n * w);
    micro_sweep(W2.expert(e), H, r.slot_idx.data() + off, n, d0, d1, y.data(), w, kn, next, true);
    for (int64_t m = 0; m < n; ++m) {
      float* o = out + r.slot_tok[off + m] * D + d0;
      const float s = r.slot_w[off + m];
      for (int64_t i = 0; i < w; ++i) o[i] += s * y[m * w + i];
    }
  }
}

// The GEMM path for one expert's gate/up: rows of h for its slots.
void gate_up_gemm(const WeightView& W, const PreparedAct& xa, const int64_t* tok, int64_t n, int64_t D, int64_t I,
                  float* h, const Knobs& kn) {
  at::Tensor g;
  if (const int engine = int8_integer_engine(W, kn, n); engine >= 0) {
    g = gemm_int8_prepared(xa.xq.data_ptr<int16_t>(), xa.xq.size(1), xa.xs.data_ptr<float>(), tok, n, W, engine,
                           amx_opts(kn));
  } else if (W.fmt == kInt4R16) {
    g = gemm_int4_r16(xa, tok, n, W, amx_engine(W, kn, n));
  } else {
    g = gemm_unpacked(gather_rows(xa, tok, n, D), W, kn);  // [n, 2I]
    if (W.fmt == kInt8)
      g.mul_(gathered_scales(xa, tok, n).unsqueeze(1)).mul_(at::from_blob((void*)W.scale, {2 * I}, at::kFloat).unsqueeze(0));
  }
  const at::Tensor gf = g.to(at::kFloat).contiguous();
  const float* gp = gf.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) silu_mul_f32(gp + m * 2 * I, gp + m * 2 * I + I, I, h + m * I);
  });
}

void down_gemm(const WeightView& W, const PreparedAct& ha, const Routing& r, int64_t e, int64_t I, at::Tensor& out,
               const Knobs& kn) {
  const int64_t n = r.count[e], off = r.offset[e];
  at::Tensor y;
  if (const int engine = int8_integer_engine(W, kn, n); engine >= 0) {
    y = gemm_int8_prepared(ha.xq.data_ptr<int16_t>(), ha.xq.size(1), ha.xs.data_ptr<float>(), r.slot_idx.data() + off, n,
                           W, engine, amx_opts(kn));
  } else if (W.fmt == kInt4R16) {
    y = gemm_int4_r16(ha, r.slot_idx.data() + off, n, W, amx_engine(W, kn, n));
  } else {
    y = gemm_unpacked(gather_rows(ha, r.slot_idx.data() + off, n, I), W, kn);  // [n, D]
    if (W.fmt == kInt8)
      y.mul_(gathered_scales(ha, r.slot_idx.data() + off, n).unsqueeze(1))
          .mul_(at::from_blob((void*)W.scale, {W.N}, at::kFloat).unsqueeze(0));
  }
  at::Tensor wts = at::from_blob((void*)(r.slot_w.data() + off), {n, 1}, at::kFloat);
  at::Tensor toks = at::from_blob((void*)(r.slot_tok.data() + off), {n}, at::kLong);
  out.index_add_(0, toks, y.mul(wts));
}

// The activations the grouped GEMM-path experts read (moe_gate_up_grouped / moe_down_grouped): INT8, the prepared
// integers and their scales (as gemm_int8_prepared); BF16, the float32 rows gather_rows takes. False where p lacks them.
bool grouped_source(const PreparedAct& p, int fmt, const void*& x, int64_t& ld, const float*& xs) {
  if (rows_format(fmt) == kInt8) {
    if (!p.xq.defined() || !p.xs.defined()) return false;
    x = p.xq.data_ptr<int16_t>(), ld = p.xq.size(1), xs = p.xs.data_ptr<float>();
    return true;
  }
  if (p.xq.defined() || !p.xf.defined() || p.xf.scalar_type() != at::kFloat || p.xf.stride(1) != 1) return false;
  x = p.xf.data_ptr<float>(), ld = p.xf.stride(0), xs = nullptr;
  return true;
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& x, int64_t fmt, const at::Tensor& w13, const at::Tensor& s13,
                        const at::Tensor& z13, int64_t fmt2, const at::Tensor& w2, const at::Tensor& s2,
                        const at::Tensor& z2, int64_t I, int64_t group, int64_t block_n,
                        const at::Tensor& topk_w, const at::Tensor& topk_ids, const Knobs& kn) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_w.sizes() == topk_ids.sizes(), "fused_moe: bad shapes");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_w.scalar_type() == at::kFloat, "fused_moe: ids int64, weights float32");
  kn.check();
  reset_used();
  const int64_t T = x.size(0), D = x.size(1), E = w13.size(0);
  // bf16 activations: the down projection's input (SiLU·up) counts as bf16 too (the model's dtype)
  const bool act_bf16 = x.scalar_type() == at::kBFloat16;
  const StackedWeight W13 = make_weight(fmt, w13, 2 * I, D, s13, z13, group, block_n, kn, act_bf16);
  // the two stacks in one format, in either layout each (each stack is repacked by its own shape)
  TORCH_CHECK(rows_format((int)fmt2) == rows_format((int)fmt), "fused_moe: w13 and w2 in different formats");
  const StackedWeight W2 = make_weight(fmt2, w2, D, I, s2, z2, group, block_n, kn, act_bf16);
  TORCH_CHECK(!is_r16((int)fmt) || I % 16 == 0, "fused_moe: r16 gate|up needs an intermediate size in whole 16-row blocks");
  const bool r16 = is_r16((int)fmt) || is_r16((int)fmt2);
  const Routing r = group_by_expert(topk_w.contiguous(), topk_ids.contiguous(), E);
  const int64_t P = T * topk_ids.size(1);

  std::vector<int64_t> small, large;
  // the GEMM path from where both stacks have one: r16 ones on AMX only (gemm_nest's R16B; r16 BF16's oneDNN restore is
  // for linears); an r16 stack without AMX keeps every expert on the r16 sweep
  const auto stack_from = [&](const WeightView& W) {
    return !is_r16(W.fmt) ? gemm_from(W, kn) : amx_from(W, kn);
  };
  const int64_t from = r16 ? std::max(stack_from(W13.base), stack_from(W2.base)) : gemm_from(W13.base, kn);
  for (int64_t e = 0; e < E; ++e)
    if (r.count[e] > 0) (r.count[e] >= from ? large : small).push_back(e);

  // phase 1: h [P, I]
  // the microkernel-only activation forms (INT4 int16 / int8, FP8 widen) only where a microkernel reads them
  WeightView xw = W13.base, hw = W2.base;
  if (small.empty()) xw.no_micro_forms(), hw.no_micro_forms();
  hw.fp8_widen &= !small.empty();
  if (!small.empty()) note_micro(W13.base);
  if (is_r16((int)fmt2)) note_used(kUsedR16);
  PreparedAct xa = prepare_act(x, xw);
  const Act A = xa.view();
  at::Tensor h = at::empty({P, I}, at::kFloat);
  float* hp = h.data_ptr<float>();
  // the GEMM-path experts AMX runs in place, grouped (cpu_moe_gemm_experts=grouped); the rest one call each
  const AmxOpts ao = amx_opts(kn);
  std::vector<MoeExpert> grouped13, grouped2;
  int engine13 = -1, engine2 = -1;
  std::vector<int64_t> each13, each2;
  const void* x13 = nullptr;
  int64_t ld13 = 0;
  const float* xs13 = nullptr;
  const bool group13 = kn.moe_gemm_experts == kMoeGrouped && I % 32 == 0 && grouped_source(xa, W13.base.fmt, x13, ld13, xs13);
  // whether an expert's phase (weight w, n rows) runs grouped; its engine into `engine`
  const auto groups = [&](bool allowed, const WeightView& w, int64_t n, int& engine) {
    const int g = allowed ? amx_engine(w, kn, n) : -1;
    if (g < 0 || !moe_grouped_ok(w, n, g, ao)) return false;
    engine = g;
    return true;
  };
  for (int64_t e : large) {
    const int64_t n = r.count[e], off = r.offset[e];
    MoeExpert m13, m2;  // gate/up: the tokens' rows of xa, into h; down: the slots' rows of ha, into the tokens
    m13.w = W13.expert(e), m13.rows = r.slot_tok.data() + off, m13.n = n, m13.h = hp + off * I;
    m2.w = W2.expert(e), m2.rows = r.slot_idx.data() + off, m2.n = n;
    m2.toks = r.slot_tok.data() + off, m2.wts = r.slot_w.data() + off;
    if (groups(group13, m13.w, n, engine13)) grouped13.push_back(m13);
    else each13.push_back(e);
    if (groups(kn.moe_gemm_experts == kMoeGrouped, m2.w, n, engine2)) grouped2.push_back(m2);
    else each2.push_back(e);
  }
  if (!grouped13.empty()) {
    note_used(amx_used(engine13) | kUsedGrouped);
    moe_gate_up_grouped(grouped13, x13, ld13, xs13, I, engine13, ao);
  }
  for (int64_t e : each13)
    gate_up_gemm(W13.expert(e), xa, r.slot_tok.data() + r.offset[e], r.count[e], D, I, hp + r.offset[e] * I, kn);
  // r16: tasks in whole 16-row blocks (I and D are multiples of 16 there: make_weight)
  const int64_t bn0 = r16 ? (kn.moe_block_n + 15) / 16 * 16 : kn.moe_block_n;
  // INT4 r16 experts with cpu_moe_int4_tasks = k: each phase in about k tasks per thread (at least bn0 rows each,
  // the rows split evenly in whole 16-row blocks): their one-stream decode tiles run a task's rows as one contiguous
  // stream, which slows at each new task (docs/cpu_kernels.md, session 29)
  // (each phase by its own stack's layout: the two may differ)
  const int64_t threads = std::max(1, omp_get_max_threads());
  const auto task_rows = [&](const WeightView& W, int64_t rows, int64_t total) {  // over `rows` (an expert's, or D)
    const int64_t k = W.fmt == kInt4R16 ? kn.moe_int4_tasks : 0;
    if (k == 0 || rows <= bn0) return bn0;
    const int64_t want = std::max(bn0, (total + threads * k - 1) / (threads * k));
    const int64_t parts = (rows + want - 1) / want;
    return ((rows + parts - 1) / parts + 15) / 16 * 16;
  };
  const int64_t bn = task_rows(W13.base, I, (int64_t)small.size() * I), bn2 = task_rows(W2.base, D, D);
  const int64_t itiles = (I + bn - 1) / bn;
  const int64_t tasks1 = (int64_t)small.size() * itiles;
#pragma omp parallel for schedule(dynamic, kn.task_chunk)
  for (int64_t t = 0; t < tasks1; ++t) {
    const int64_t e = small[t / itiles], i0 = (t % itiles) * bn;
    const int64_t tn = std::min(t + 1, tasks1 - 1), en = small[tn / itiles];  // the next task (chunks: this thread's)
    const uint8_t* next = W13.expert(en).w + ((tn % itiles) * bn) * W13.base.row_bytes;
    gate_up_tile(W13.expert(e), A, r.slot_tok.data() + r.offset[e], r.count[e], I, i0, std::min(I, i0 + bn),
                 hp + r.offset[e] * I, kn, next);
  }

  // phase 2: out [T, D]
  PreparedAct ha = prepare_act_f32rows(hp, P, I, I, hw);
  const Act H = ha.view();
  at::Tensor out = at::zeros({T, D}, at::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t dtiles = (D + bn2 - 1) / bn2;
  if (!small.empty()) {
#pragma omp parallel for schedule(dynamic, kn.task_chunk)
    for (int64_t t = 0; t < dtiles; ++t) down_tile(W2, H, r, small, t * bn2, std::min(D, (t + 1) * bn2), op, D, kn);
  }
  const void* x2 = nullptr;
  int64_t ld2 = 0;
  const float* xs2 = nullptr;
  if (!grouped2.empty() && grouped_source(ha, W2.base.fmt, x2, ld2, xs2)) {
    note_used(amx_used(engine2) | kUsedGrouped);
    moe_down_grouped(grouped2, x2, ld2, xs2, D, op, engine2, ao);
  } else {
    each2 = large;  // one call each, in the experts' order
  }
  for (int64_t e : each2) down_gemm(W2.expert(e), ha, r, e, I, out, kn);
  return out;
}

}  // namespace moetune
