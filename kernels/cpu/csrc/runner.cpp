// The decode-layer runner (engine knob graph_mode=cpp): one call per decode step runs every decoder
// layer — the attention (DeepSeek-V2/V3's absorbed MLA over the latent cache, or the GQA families'
// q/k/v projections with their biases or per-head q/k norms, RoPE and paged decode over the per-head
// K/V cache) and the MoE (routing, fused experts, shared experts with Qwen2-MoE's sigmoid gate) or
// dense FFN — calling the kernels of this extension directly, so a layer costs no Python, no pybind
// crossing and no torch glue per op.
//
// Numerics follow the eager path (engine/models/deepseek_v3.py, gqa.py over kernels/cpu) op by op: the
// activations live in float32 buffers throughout, and every value the eager path rounds to the
// model dtype (bfloat16) is rounded to it here at the same point, so the two paths differ only in
// summation order where an op is computed differently (head_linear: one bmm; routing; SiLU's exp).
// The weights are handed over once, at load (add_layer); the per-call knob structs once per token
// bucket (set_knobs); a step passes only its activations and cache metadata.
//
// Small ops run on the calling thread: an op reading fewer than serial_below bytes of weights (attention:
// the layer's KV cache bytes × the query heads that read each KV row, attn_work) runs with one OpenMP
// thread, skipping the fork/join of a parallel region whose work is below its cost (knob
// cpu_serial_below_bytes; 0: every op parallel as the eager path).
#include <torch/csrc/utils/pybind.h>
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>
#include <c10/util/BFloat16.h>
#include "ops.h"
#include "vmath.h"

namespace moetune {

at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, const at::Tensor& cache, const at::Tensor& rows,
                       const at::Tensor& slots, const Knobs& knobs);

namespace {

namespace py = pybind11;

// Knob slots of a layer: the call sites whose knob struct the runner takes per layer and bucket.
// MLA: q_a, q_b (or q_proj), kv_a; GQA: q, k, v. Both: o, the decode attention, the FFN's.
enum Slot : int { kQA = 0, kQB = 1, kKVA = 2, kO = 3, kAttn = 4, kFfn1 = 5, kShGU = 6, kShDown = 7, kDown = 8,
                  kRouter = 9, kQ = 10, kK = 11, kV = 12, kShGate = 13, kSlots = 14 };
// Parts of a step, as suites/breakdown.py names them (timed when timing is on).
enum Part : int { pLinAttn = 0, pHead, pAttn, pNorms, pRope, pRouting, pRouter, pMoe, pShared, pDense, pAct,
                  pLmHead, kParts };
const char* kPartNames[kParts] = {"linear.attn", "head_linear", "attention", "norms", "rope", "routing",
                                  "linear.router", "fused_moe", "linear.shared", "linear.dense", "activation",
                                  "lm_head"};

// A weight as kernels.cpu.Packed.args: (format, w, N, K, scale, zero, group, block_n).
struct Lin {
  int64_t fmt = -1, N = 0, K = 0, group = 0, block_n = 1;
  at::Tensor w, scale, zero;
  int64_t bytes() const { return w.defined() ? (int64_t)w.nbytes() : 0; }
};

Lin to_lin(const py::object& o) {
  Lin l;
  if (o.is_none()) return l;
  const py::tuple t = o.cast<py::tuple>();
  TORCH_CHECK(t.size() == 8, "runner: a weight's kernel arguments are 8 values");
  l.fmt = t[0].cast<int64_t>();
  l.w = t[1].cast<at::Tensor>();
  l.N = t[2].cast<int64_t>();
  l.K = t[3].cast<int64_t>();
  l.scale = t[4].cast<at::Tensor>();
  l.zero = t[5].cast<at::Tensor>();
  l.group = t[6].cast<int64_t>();
  l.block_n = t[7].cast<int64_t>();
  return l;
}

struct Layer {
  Lin q_a, q_b, kv_a, o, w13, w2, sh_gu, sh_down, gu, down, router;  // q_b: q_b_proj, or q_proj without q_lora
  Lin q, k, v, sh_gate;                                              // GQA projections; Qwen2-MoE's shared gate
  at::Tensor attn_norm, q_a_norm, kv_a_norm, ffn_norm, next_norm;    // float32, values of the model dtype
  at::Tensor q_norm, k_norm, q_bias, k_bias, v_bias;                 // GQA: per-head norms [d], biases (or undefined)
  at::Tensor w_uk, w_uv;  // MLA: W_UKᵀ [H, N, R], W_UVᵀ [H, R, V], model dtype, blocked by head_block (load_head_weight)
  at::Tensor bias;                                                   // router correction bias float32, or undefined
  bool moe = false;
};

inline float rnd(float v, bool bf) { return bf ? (float)c10::BFloat16(v) : v; }

// 16 lanes rounded to bfloat16 exactly as c10::BFloat16(float): round to nearest even on the bits,
// a NaN becomes the quiet NaN 0x7FC0.
inline __m512 rnd16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, bias), _mm512_set1_epi32((int)0xFFFF0000u));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000)));
}

// out[k] = rnd(f(a[k], b[k])) over n elements, 16 at a time (masked tail); f on vectors.
template <class F>
inline void map2(const float* a, const float* b, float* out, int64_t n, bool bf, F f) {
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = tail_mask16(n - k);
    __m512 v = f(_mm512_maskz_loadu_ps(m, a + k), b ? _mm512_maskz_loadu_ps(m, b + k) : _mm512_setzero_ps());
    _mm512_mask_storeu_ps(out + k, m, bf ? rnd16(v) : v);
  }
}

// As small_ops.cpp's rms_norm on one row: out = w · (x / rms(x)), rounded like the reference.
void norm_row(const float* x, const float* w, float* out, int64_t D, float eps, bool bf) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= D; k += 16) { __m512 v = _mm512_loadu_ps(x + k); acc = _mm512_fmadd_ps(v, v, acc); }
  float ss = hsum(acc);
  for (; k < D; ++k) ss += x[k] * x[k];
  const float inv = 1.f / std::sqrt(ss / (float)D + eps);
  const __m512 vi = _mm512_set1_ps(inv);
  map2(x, w, out, D, bf, [&](__m512 xv, __m512 wv) {
    const __m512 n = _mm512_mul_ps(xv, vi);
    return _mm512_mul_ps(wv, bf ? rnd16(n) : n);
  });
}

// As small_ops.cpp's rope on one head row: x [P] (pairs interleaved or halves) → out [P] de-interleaved.
void rope_row(const float* x, const float* c, const float* s, int64_t P, bool interleave, float* o, bool bf) {
  const int64_t half = P / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleave ? x[2 * i] : x[i], x2 = interleave ? x[2 * i + 1] : x[i + half];
    const float a = x1 * c[i], b2 = x2 * s[i], d = x2 * c[i], f = x1 * s[i];
    o[i] = rnd(a - b2, bf);
    o[half + i] = rnd(d + f, bf);
  }
}

// One OpenMP thread for the scope when `serial` (restored after).
struct SerialScope {
  int prev = 0;
  bool on;
  explicit SerialScope(bool serial) : on(serial) {
    if (on) { prev = omp_get_max_threads(); omp_set_num_threads(1); }
  }
  ~SerialScope() { if (on) omp_set_num_threads(prev); }
};

using Clock = std::chrono::steady_clock;

class DecodeRunner {
 public:
  DecodeRunner(int64_t H, int64_t Nn, int64_t P, int64_t R, int64_t V, int64_t D, double eps, double scale,
               bool interleave, int64_t topk, int64_t n_group, int64_t topk_group, bool sigmoid, bool renorm,
               double scaling, bool bf16, int64_t serial_below)
      : H_(H), Nn_(Nn), P_(P), R_(R), V_(V), D_(D), eps_((float)eps), scale_(scale), interleave_(interleave),
        topk_(topk), n_group_(n_group), topk_group_(topk_group), sigmoid_(sigmoid), renorm_(renorm),
        scaling_((float)scaling), bf_(bf16), serial_below_(serial_below) {}

  // The token embedding [vocab, D] (model dtype) and the rotary angles (engine/rope.py): inv_freq [P/2],
  // cos/sin scaled by `factor`.
  void set_embedding(const at::Tensor& embed, const at::Tensor& inv_freq, double factor) {
    embed_ = embed.contiguous();
    inv_freq_ = inv_freq.to(at::kFloat).contiguous();
    rope_factor_ = (float)factor;
  }

  // GQA mode (before add_layer): kv_heads KV heads of head_dim (the constructor's qk_rope = v_head = head_dim)
  void set_gqa(int64_t kv_heads, int64_t head_dim) {
    TORCH_CHECK(layers_.empty(), "runner: set_gqa before add_layer");
    TORCH_CHECK(kv_heads >= 1 && H_ % kv_heads == 0 && head_dim == P_ && head_dim == V_ && head_dim % 2 == 0,
                "runner: GQA needs heads a multiple of kv_heads and qk_rope = v_head = head_dim (even)");
    gqa_ = true, Hkv_ = kv_heads, Dh_ = head_dim;
  }

  void add_layer(const py::dict& lin, const py::dict& ten, bool moe) {
    Layer L;
    auto get = [&](const char* k) { return lin.contains(k) ? to_lin(lin[k]) : Lin(); };
    auto values = [&](const char* k) -> at::Tensor {  // float32 holding values of the model dtype
      if (!ten.contains(k) || ten[k].is_none()) return at::Tensor();
      at::Tensor t = ten[k].cast<at::Tensor>();
      return t.to(bf_ ? at::kBFloat16 : at::kFloat).to(at::kFloat).contiguous();
    };
    L.q_a = get("q_a"), L.q_b = get("q_b"), L.kv_a = get("kv_a"), L.o = get("o");
    L.q = get("q"), L.k = get("k"), L.v = get("v"), L.sh_gate = get("sh_gate");
    L.w13 = get("w13"), L.w2 = get("w2"), L.sh_gu = get("sh_gu"), L.sh_down = get("sh_down");
    L.gu = get("gu"), L.down = get("down"), L.router = get("router");
    L.attn_norm = values("attn_norm"), L.q_a_norm = values("q_a_norm"), L.kv_a_norm = values("kv_a_norm");
    L.ffn_norm = values("ffn_norm"), L.next_norm = values("next_norm");
    L.q_norm = values("q_norm"), L.k_norm = values("k_norm");
    L.q_bias = values("q_bias"), L.k_bias = values("k_bias"), L.v_bias = values("v_bias");
    if (!gqa_) {
      L.w_uk = load_head_weight(ten["w_uk"].cast<at::Tensor>());
      L.w_uv = load_head_weight(ten["w_uv"].cast<at::Tensor>());
    }
    if (ten.contains("bias") && !ten["bias"].is_none()) L.bias = ten["bias"].cast<at::Tensor>().to(at::kFloat).contiguous();
    L.moe = moe;
    if (gqa_) {
      TORCH_CHECK(L.q.fmt >= 0 && L.k.fmt >= 0 && L.v.fmt >= 0 && L.o.fmt >= 0, "runner: attention weights missing");
      TORCH_CHECK(L.q.N == H_ * Dh_ && L.k.N == Hkv_ * Dh_ && L.v.N == Hkv_ * Dh_ && L.o.K == H_ * Dh_,
                  "runner: q/k/v/o shapes do not match the heads");
      auto fits = [](const at::Tensor& t, int64_t n) { return !t.defined() || t.numel() == n; };
      TORCH_CHECK(fits(L.q_bias, H_ * Dh_) && fits(L.k_bias, Hkv_ * Dh_) && fits(L.v_bias, Hkv_ * Dh_) &&
                      fits(L.q_norm, Dh_) && fits(L.k_norm, Dh_),
                  "runner: a GQA bias or norm weight of the wrong size");
    } else {
      TORCH_CHECK(L.q_b.fmt >= 0 && L.kv_a.fmt >= 0 && L.o.fmt >= 0, "runner: attention weights missing");
    }
    TORCH_CHECK(moe ? (L.w13.fmt >= 0 && L.w2.fmt >= 0 && L.router.fmt >= 0) : (L.gu.fmt >= 0 && L.down.fmt >= 0),
                "runner: feed-forward weights missing");
    layers_.push_back(std::move(L));
  }

  // The output projection (lm_head), run by forward_logits after the final norm.
  void set_lm_head(const py::object& lin) { lm_head_ = to_lin(lin); }

  // The knob structs of one token bucket: per layer, one per slot (Slot order), then one more row
  // whose first struct is the lm_head's.
  void set_knobs(int64_t key, const std::vector<std::vector<Knobs>>& per_layer) {
    TORCH_CHECK((int64_t)per_layer.size() == (int64_t)layers_.size() + 1, "runner: one knob list per layer, then lm_head's");
    for (const auto& l : per_layer) {
      TORCH_CHECK((int64_t)l.size() == kSlots, "runner: ", kSlots, " knob structs per layer");
      for (const auto& k : l) k.check();
    }
    knobs_[key] = per_layer;
  }
  bool has_knobs(int64_t key) const { return knobs_.count(key) > 0; }

  // ids [T] int64 (one new token per sequence); positions [T] int64; caches: MLA [the latent cache
  // [L, NB, BS, R + P]], GQA [k [L, NB, BS, Hkv, d], v (same)]; tables [T, MB] int32; lens [T] int32;
  // slots [T] int64. Returns the final-norm hidden [T, D] (model dtype).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& cache,
                     const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots, int64_t key) {
    const auto t_start = tic();
    run_layers(ids, positions, cache, tables, lens, slots, key);
    const int64_t T = ids.numel();
    at::Tensor out = at::empty({T, D_}, at::kFloat);
    std::memcpy(out.data_ptr<float>(), h_.data(), T * D_ * sizeof(float));
    if (timing) total_s_ = std::chrono::duration<double>(Clock::now() - t_start).count();
    return bf_ ? out.to(at::kBFloat16) : out;
  }

  // As forward, then lm_head: the float32 logits [T, vocab] (rounded to the model dtype first, as the
  // eager path's lm_head output is).
  at::Tensor forward_logits(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& cache,
                            const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots, int64_t key) {
    const auto t_start = tic();
    TORCH_CHECK(lm_head_.fmt >= 0, "runner: no lm_head (set_lm_head)");
    run_layers(ids, positions, cache, tables, lens, slots, key);
    const int64_t T = ids.numel(), L = (int64_t)layers_.size();
    at::Tensor out = at::empty({T, lm_head_.N}, at::kFloat);
    linear(lm_head_, h_.data(), T, out.data_ptr<float>(), knobs_.at(key)[L][0], bf_, pLmHead, L, 0, &head_pool_);
    round_all(out.data_ptr<float>(), T * lm_head_.N);
    if (timing) total_s_ = std::chrono::duration<double>(Clock::now() - t_start).count();
    return out;
  }

  // forward_logits from plain lists (the engine's decode fast path: no tensors built in Python):
  // ids, positions [T]; tables: each sequence's block table (its blocks in order); the slots and the
  // keys each token sees (position + 1) follow from them and the cache's block size. Every block id
  // and position is checked against the cache, since the kernels write the new latent row there.
  at::Tensor step_logits(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                         const std::vector<std::vector<int64_t>>& tables, const std::vector<at::Tensor>& cache,
                         int64_t key) {
    const int64_t T = (int64_t)ids.size();
    TORCH_CHECK(T > 0 && (int64_t)positions.size() == T && (int64_t)tables.size() == T, "runner: bad step lists");
    check_caches(cache);
    const int64_t nb = cache[0].size(1), bs = cache[0].size(2);
    int64_t width = 1;
    for (const auto& t : tables) width = std::max<int64_t>(width, (int64_t)t.size());
    ids_in_.assign(ids.begin(), ids.end());
    pos_in_.assign(positions.begin(), positions.end());
    tab_in_.assign(T * width, 0);
    lens_in_.resize(T);
    slots_in_.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      const auto& row = tables[t];
      for (size_t j = 0; j < row.size(); ++j) {
        TORCH_CHECK(row[j] >= 0 && row[j] < nb, "runner: block id ", row[j], " outside the cache's ", nb);
        tab_in_[t * width + j] = (int32_t)row[j];
      }
      const int64_t p = positions[t];
      TORCH_CHECK(p >= 0 && p / bs < (int64_t)row.size(), "runner: position ", p, " past its block table");
      lens_in_[t] = (int32_t)(p + 1);
      slots_in_[t] = row[p / bs] * bs + p % bs;
    }
    return forward_logits(at::from_blob(ids_in_.data(), {T}, at::kLong), at::from_blob(pos_in_.data(), {T}, at::kLong),
                          cache, at::from_blob(tab_in_.data(), {T, width}, at::kInt),
                          at::from_blob(lens_in_.data(), {T}, at::kInt), at::from_blob(slots_in_.data(), {T}, at::kLong),
                          key);
  }

  // MLA: one latent cache [L, NB, BS, W]; GQA: k and v [L, NB, BS, Hkv, d], contiguous, of the model dtype
  void check_caches(const std::vector<at::Tensor>& c) const {
    const int64_t L = (int64_t)layers_.size();
    const auto dt = bf_ ? at::kBFloat16 : at::kFloat;
    if (gqa_) {
      TORCH_CHECK(c.size() == 2 && c[0].dim() == 5 && c[0].sizes() == c[1].sizes() && c[0].size(0) == L &&
                      c[0].size(3) == Hkv_ && c[0].size(4) == Dh_,
                  "runner: GQA caches k, v [layers, blocks, block size, kv heads, head dim]");
    } else {
      TORCH_CHECK(c.size() == 1 && c[0].dim() == 4 && c[0].size(0) == L && c[0].size(3) == R_ + P_,
                  "runner: MLA cache [layers, blocks, block size, rank + rope]");
    }
    for (const auto& t : c) TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dt, "runner: caches contiguous, of the model dtype");
  }

  void run_layers(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& cache,
                  const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots, int64_t key) {
    auto it = knobs_.find(key);
    TORCH_CHECK(it != knobs_.end(), "runner: no knobs registered for bucket ", key);
    TORCH_CHECK(embed_.defined(), "runner: no embedding (set_embedding)");
    const auto& kn = it->second;
    const int64_t T = ids.numel(), D = D_, L = (int64_t)layers_.size();
    check_caches(cache);
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && positions.numel() == T &&
                    tables.size(0) == T && lens.numel() == T && slots.numel() == T,
                "runner: bad step shapes");
    if (cache[0].data_ptr() != cache_ptr_ || cache[0].sizes() != cache_sizes_) {  // per-layer views, once per cache
      cache_ptr_ = cache[0].data_ptr();
      cache_sizes_ = cache[0].sizes().vec();
      kviews_.clear(), vviews_.clear(), cviews_.clear();
      for (int64_t i = 0; i < L; ++i) {
        if (gqa_) {  // [NB, BS, Hkv, d] each
          kviews_.push_back(cache[0].select(0, i));
          vviews_.push_back(cache[1].select(0, i));
          continue;
        }
        at::Tensor c = cache[0].select(0, i);
        cviews_.push_back(c);
        kviews_.push_back(c.unsqueeze(2));
        vviews_.push_back(c.narrow(-1, 0, R_).unsqueeze(2));
      }
    }
    calls_.clear();
    std::fill(part_s_, part_s_ + kParts, 0.0);
    std::fill(part_n_, part_n_ + kParts, 0);
    experts_used_.assign(L, 0);
    // the embedding rows and the rotary angles: as F.embedding and RotaryAngles (engine/rope.py)
    residual_.resize(T * D);
    const int64_t half = P_ / 2, vocab = embed_.size(0);
    cos_.resize(T * half), sin_.resize(T * half);
    const int64_t* idp = ids.contiguous().data_ptr<int64_t>();
    const int64_t* pp = positions.contiguous().data_ptr<int64_t>();
    const float* inv = inv_freq_.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(idp[t] >= 0 && idp[t] < vocab, "runner: token id ", idp[t], " outside the vocabulary");
      if (bf_) {
        const c10::BFloat16* e = embed_.data_ptr<c10::BFloat16>() + idp[t] * D;
        for (int64_t k = 0; k < D; ++k) residual_[t * D + k] = (float)e[k];
      } else {
        std::memcpy(residual_.data() + t * D, embed_.data_ptr<float>() + idp[t] * D, D * sizeof(float));
      }
      for (int64_t i = 0; i < half; ++i) {
        const float ang = (float)pp[t] * inv[i];
        cos_[t * half + i] = std::cos(ang) * rope_factor_;
        sin_[t * half + i] = std::sin(ang) * rope_factor_;
      }
    }
    const at::Tensor lens_c = lens.to(at::kInt).contiguous(), tables_c = tables.to(at::kInt).contiguous();
    const at::Tensor slots_c = slots.to(at::kLong).contiguous();
    int64_t kv_tokens = 0;
    for (int64_t t = 0; t < T; ++t) kv_tokens += lens_c.data_ptr<int32_t>()[t];
    int64_t row_bytes = 0;  // one token's cache row(s) in one layer
    for (const auto& c : cache) row_bytes += c[0][0][0].numel() * c.element_size();
    kv_bytes_ = kv_tokens * row_bytes;
    h_.resize(T * D);
    {
      const auto t0 = tic();
      for (int64_t t = 0; t < T; ++t)
        norm_row(residual_.data() + t * D, layers_[0].attn_norm.data_ptr<float>(), h_.data() + t * D, D, eps_, bf_);
      toc(pNorms, t0);
    }
    for (int64_t i = 0; i < L; ++i) {
      if (gqa_) attention_gqa(i, T, tables_c, lens_c, slots_c, kn[i]);
      else attention(i, T, tables_c, lens_c, slots_c, kn[i]);
      add_norm(T, a_.data(), layers_[i].ffn_norm);
      if (layers_[i].moe) moe(i, T, kn[i]); else dense(i, T, kn[i]);
      add_norm(T, m_.data(), layers_[i].next_norm);
    }
  }

  bool timing = false, recording = false;
  // Recorded calls: (op, format id or -1 for the cache dtype, tokens, layer, slot, variants).
  std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, std::string>> calls_;
  double part_s_[kParts] = {};
  int64_t part_n_[kParts] = {};
  std::vector<int64_t> experts_used_;
  int64_t kv_bytes_ = 0;  // one layer's KV cache bytes that this step's attention reads
  double total_s_ = 0;  // the last step's whole call (timing on)
  int64_t serial_below_;

  py::dict parts() const {
    py::dict d;
    for (int p = 0; p < kParts; ++p) d[kPartNames[p]] = py::make_tuple(part_s_[p], part_n_[p]);
    return d;
  }

 private:
  int64_t H_, Nn_, P_, R_, V_, D_;
  bool gqa_ = false;
  int64_t Hkv_ = 0, Dh_ = 0;
  float eps_;
  double scale_;
  bool interleave_;
  int64_t topk_, n_group_, topk_group_;
  bool sigmoid_, renorm_;
  float scaling_;
  bool bf_;
  std::vector<Layer> layers_;
  Lin lm_head_;
  std::unordered_map<int64_t, std::vector<std::vector<Knobs>>> knobs_;
  void* cache_ptr_ = nullptr;
  std::vector<int64_t> cache_sizes_;
  std::vector<at::Tensor> kviews_, vviews_, cviews_;
  // step buffers, reused across steps
  at::Tensor embed_, inv_freq_;
  float rope_factor_ = 1.f;
  std::vector<float> cos_, sin_, residual_, h_, a_, m_, qa_, q_, kv_, rows_, qcat_, oin_, logits_, sh_, act_, g_;
  std::vector<float> k_, v_, gate_;
  std::vector<int64_t> tok_;
  ActPool pools_[kSlots], head_pool_;  // the activation buffers of each knob slot's linears, and lm_head's
  const at::Tensor none_ = at::empty({0}, at::kFloat), no_slots_ = at::empty({0}, at::kLong);
  std::vector<int64_t> ids_;
  std::vector<int64_t> ids_in_, pos_in_, slots_in_;  // step_logits' inputs as the tensor path takes them
  std::vector<int32_t> tab_in_, lens_in_;
  std::vector<float> tw_;

  Clock::time_point tic() const { return timing ? Clock::now() : Clock::time_point(); }
  void toc(int part, Clock::time_point t0) {
    if (!timing) return;
    part_s_[part] += std::chrono::duration<double>(Clock::now() - t0).count();
    part_n_[part] += 1;
  }
  void note(const char* op, int64_t fmt, int64_t tokens, int64_t layer, int64_t slot) {
    if (recording) calls_.emplace_back(op, fmt, tokens, layer, slot, used_variants());
  }
  bool serial(int64_t bytes) const { return bytes < serial_below_; }
  // Attention's size for serial(): the layer's KV bytes (kv_bytes_ is one layer's) × the query heads per KV
  // head, as its arithmetic grows with both (MLA: every head reads the one latent row of a key).
  int64_t attn_work() const { return kv_bytes_ * (gqa_ ? H_ / std::max<int64_t>(1, Hkv_) : H_); }

  // out [M, N] float32 = x [M, K] · Wᵀ, as moetune::linear (the same paths and knobs) on float rows.
  // The activations go through the slot's buffers (pool: lm_head's own), allocated once.
  void linear(const Lin& L, const float* x, int64_t M, float* out, const Knobs& kn, bool act_bf16, int part,
              int64_t layer, int64_t slot, ActPool* pool = nullptr) {
    const auto t0 = tic();
    SerialScope one(serial(L.bytes()));
    reset_used();
    WeightView W = make_weight(L.fmt, L.w, L.N, L.K, L.scale, L.zero, L.group, L.block_n, kn, act_bf16).base;
    const bool gemm = M >= gemm_from(W, kn);
    if (gemm) W.no_micro_forms();
    PreparedAct p = prepare_act_f32rows(x, M, L.K, L.K, W, pool ? pool : &pools_[slot]);
    const int int8_engine = gemm ? int8_integer_engine(W, kn, M) : -1;
    if (int8_engine >= 0) {
      at::Tensor o = gemm_int8_prepared(p.xq.data_ptr<int16_t>(), p.xq.size(1), p.xs.data_ptr<float>(), nullptr, M, W,
                                        int8_engine, amx_opts(kn));
      std::memcpy(out, o.data_ptr<float>(), M * L.N * sizeof(float));
    } else if (gemm && W.fmt == kInt4R16) {
      at::Tensor o = gemm_int4_r16(p, nullptr, M, W, amx_engine(W, kn, M));
      std::memcpy(out, o.data_ptr<float>(), M * L.N * sizeof(float));
    } else if (gemm) {
      at::Tensor in = (p.xq.defined() && !p.xf.defined()) ? p.xq.narrow(1, 0, L.K).to(at::kFloat) : p.xf.narrow(1, 0, L.K);
      at::Tensor o = gemm_unpacked(in, W, kn);
      if (W.fmt == kInt8) o.mul_(p.xs.unsqueeze(1)).mul_(L.scale.unsqueeze(0));
      o = o.contiguous();
      std::memcpy(out, o.data_ptr<float>(), M * L.N * sizeof(float));
    } else {
      note_micro(W);
      tok_.resize(M);
      for (int64_t m = 0; m < M; ++m) tok_[m] = m;
      gemv_rows(W, p.view(), tok_.data(), M, out, L.N, kn, true);
    }
    note("linear", L.fmt, M, layer, slot);
    toc(part, t0);
  }

  void round_all(float* p, int64_t n) const {
    if (bf_) map2(p, nullptr, p, n, true, [](__m512 v, __m512) { return v; });
  }

  // residual += x (in the model dtype), h = norm(residual) · w
  void add_norm(int64_t T, const float* x, const at::Tensor& w) {
    const auto t0 = tic();
    const float* wp = w.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* r = residual_.data() + t * D_;
      map2(r, x + t * D_, r, D_, bf_, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
      norm_row(r, wp, h_.data() + t * D_, D_, eps_, bf_);
    }
    toc(pNorms, t0);
  }

  // A per-head weight [H, B, A] (W_UK or W_UV, outputs × inputs) as head_linear reads it, in the model
  // dtype: transposed (the outputs in the lanes) and cut into blocks of kHeadBlock outputs, each block
  // [A, kHeadBlock] contiguous: [H, nb, A, bw] with bw = min(B, kHeadBlock) rounded up to 16 (zero
  // columns past B). A block is one memory stream, and a thread's blocks follow each other.
  static constexpr int kHeadStreams = 4;  // head_linear's tasks at a time (one memory stream each)
  static constexpr int64_t kHeadBlock = 256 / kHeadStreams;  // 16 accumulators of 16 lanes over the streams
  at::Tensor load_head_weight(const at::Tensor& w) const {
    const int64_t H = w.size(0), B = w.size(1), A = w.size(2);
    const int64_t bw = std::min<int64_t>(kHeadBlock, (B + 15) / 16 * 16), nb = (B + bw - 1) / bw;
    at::Tensor t = at::zeros({H, A, nb * bw}, bf_ ? at::kBFloat16 : at::kFloat);
    t.narrow(2, 0, B).copy_(w.transpose(1, 2));
    return t.view({H, A, nb, bw}).permute({0, 2, 1, 3}).contiguous();
  }

  // out [T, H, B] = per head w[h] · x[t, h] (kernels/reference.head_linear): x rows of A floats per head at
  // stride hs; wt [H, nb, A, bw] from load_head_weight (converted in registers); float32 sums, rounded to
  // the model dtype, written at out + (t * H + h) * ldo. Per input a, the bw outputs of a block take one
  // broadcast of x[a]: no horizontal sums, each output summed over a in order (one bmm's order). A task
  // is one (head, block): one contiguous stream, which the microkernels' prefetch knobs (kn: the attention
  // site's) prefetch: cpu_prefetch_ahead bytes ahead in it into the level cpu_prefetch_hint says, running on
  // into the next block (the task this thread takes next under the static schedule); 0: the same row of the
  // next block.
  void head_linear(const float* x, int64_t T, int64_t A, int64_t hs, const at::Tensor& wt, int64_t B, float* out,
                   int64_t ldo, const Knobs& kn) {
    const auto t0 = tic();
    const int64_t H = wt.size(0), nb = wt.size(1), bw = wt.size(3);
    TORCH_CHECK(H == H_ && wt.size(2) == A && nb * bw >= B && bw <= kHeadBlock, "runner: head weight shape");
    const bool wbf = wt.scalar_type() == at::kBFloat16;
    const int64_t esz = wbf ? 2 : 4, row = bw * esz, blk = A * row;
    const uint8_t* wp = static_cast<const uint8_t*>(wt.data_ptr());
    const bool par = !serial((int64_t)wt.nbytes()) && omp_get_max_threads() > 1;
    const int64_t ahead = kn.prefetch_ahead == 0 ? blk : std::min<int64_t>(kn.prefetch_ahead, blk);
    const int hint = kn.prefetch_hint;
    // kHeadStreams tasks at a time (adjacent blocks: as many memory streams per thread; each output still summed over a
    // in order)
    constexpr int kV = (int)(kHeadBlock / 16), S = kHeadStreams;
    const int64_t tasks = H * nb, sets = (tasks + S - 1) / S;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t p = 0; p < sets; ++p) {
      int64_t tk[S];
      for (int s = 0; s < S; ++s) tk[s] = std::min(S * p + s, tasks - 1);
      const int live = (int)std::min<int64_t>(S, tasks - S * p);  // the last set's may be fewer
      int64_t hh[S], b0[S], nout[S];
      int nv[S];
      const uint8_t* wb[S];
      const float* xr[S];
      for (int s = 0; s < S; ++s) {
        hh[s] = tk[s] / nb, b0[s] = (tk[s] % nb) * bw, nout[s] = std::min(bw, B - b0[s]);
        nv[s] = (int)((nout[s] + 15) / 16), wb[s] = wp + tk[s] * blk;
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int s = 0; s < S; ++s) xr[s] = x + (t * H + hh[s]) * hs;
        __m512 acc[S][kV];
        for (int s = 0; s < S; ++s)
          for (int i = 0; i < kV; ++i) acc[s][i] = _mm512_setzero_ps();
        for (int64_t a = 0; a < A; ++a) {
#pragma GCC unroll 4
          for (int s = 0; s < S; ++s) {
            if (s >= live) break;
            const __m512 xa = _mm512_set1_ps(xr[s][a]);
            const uint8_t* r = wb[s] + a * row;
            for (int64_t l = 0; l < row; l += 64) prefetch_line(r + ahead + l, hint);
#pragma GCC unroll 16
            for (int i = 0; i < kV; ++i) {
              if (i >= nv[s]) break;
              const __m512 wv = wbf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r + 32 * i))), 16))
                                    : _mm512_loadu_ps((const float*)r + 16 * i);
              acc[s][i] = _mm512_fmadd_ps(wv, xa, acc[s][i]);
            }
          }
        }
        for (int s = 0; s < live; ++s) {
          float* o = out + (t * H + hh[s]) * ldo + b0[s];
          for (int i = 0; i < nv[s]; ++i)
            _mm512_mask_storeu_ps(o + 16 * i, tail_mask16(nout[s] - 16 * i), bf_ ? rnd16(acc[s][i]) : acc[s][i]);
        }
      }
    }
    toc(pHead, t0);
  }

  void attention(int64_t i, int64_t T, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots,
                 const std::vector<Knobs>& kn) {
    const Layer& L = layers_[i];
    const int64_t Dq = Nn_ + P_, W = R_ + P_, half = P_ / 2;
    const float *cp = cos_.data(), *sp = sin_.data();
    // q [T, H, N + P]
    q_.resize(T * H_ * Dq);
    if (L.q_a.fmt >= 0) {
      qa_.resize(T * L.q_a.N);
      linear(L.q_a, h_.data(), T, qa_.data(), kn[kQA], bf_, pLinAttn, i, kQA);
      round_all(qa_.data(), T * L.q_a.N);
      const auto t0 = tic();
      for (int64_t t = 0; t < T; ++t)
        norm_row(qa_.data() + t * L.q_a.N, L.q_a_norm.data_ptr<float>(), qa_.data() + t * L.q_a.N, L.q_a.N, eps_, bf_);
      toc(pNorms, t0);
      linear(L.q_b, qa_.data(), T, q_.data(), kn[kQB], bf_, pLinAttn, i, kQB);
    } else {
      linear(L.q_b, h_.data(), T, q_.data(), kn[kQB], bf_, pLinAttn, i, kQB);
    }
    round_all(q_.data(), T * H_ * Dq);
    // latent and k_pe: [T, R + P]
    kv_.resize(T * W);
    rows_.resize(T * W);
    linear(L.kv_a, h_.data(), T, kv_.data(), kn[kKVA], bf_, pLinAttn, i, kKVA);
    round_all(kv_.data(), T * W);
    qcat_.resize(T * H_ * W);  // the attention query: [q_lat | roped q_pe] per head, float32
    {
      const auto t0 = tic();
      for (int64_t t = 0; t < T; ++t) {
        norm_row(kv_.data() + t * W, L.kv_a_norm.data_ptr<float>(), rows_.data() + t * W, R_, eps_, bf_);
        rope_row(kv_.data() + t * W + R_, cp + t * half, sp + t * half, P_, interleave_, rows_.data() + t * W + R_, bf_);
        for (int64_t h = 0; h < H_; ++h)
          rope_row(q_.data() + (t * H_ + h) * Dq + Nn_, cp + t * half, sp + t * half, P_, interleave_,
                   qcat_.data() + (t * H_ + h) * W + R_, bf_);
      }
      toc(pRope, t0);
    }
    head_linear(q_.data(), T, Nn_, Dq, L.w_uk, R_, qcat_.data(), W, kn[kAttn]);  // q_lat = W_UKᵀ q_nope
    const auto t0 = tic();
    at::Tensor out_lat;
    {
      SerialScope one(serial(attn_work()));
      reset_used();
      at::Tensor q = at::from_blob(qcat_.data(), {T, H_, W}, at::kFloat);
      at::Tensor rows = at::from_blob(rows_.data(), {T, W}, at::kFloat);
      out_lat = attn_decode(q, kviews_[i], vviews_[i], tables, lens, scale_, cviews_[i], rows, slots, kn[kAttn]);
    }
    note("mla_decode", -1, T, i, kAttn);
    toc(pAttn, t0);
    float* ol = out_lat.data_ptr<float>();  // [T, H, R]
    round_all(ol, T * H_ * R_);
    oin_.resize(T * H_ * V_);
    head_linear(ol, T, R_, R_, L.w_uv, V_, oin_.data(), V_, kn[kAttn]);  // [T, H, V]
    a_.resize(T * D_);
    linear(L.o, oin_.data(), T, a_.data(), kn[kO], bf_, pLinAttn, i, kO);
    round_all(a_.data(), T * D_);
  }

  // x [T, n] += bias [n] (values of the model dtype), rounded: the eager path's `q + q_bias`
  void add_bias(float* x, int64_t T, const at::Tensor& b) const {
    if (!b.defined()) return;
    const float* bp = b.data_ptr<float>();
    const int64_t n = b.numel();
    for (int64_t t = 0; t < T; ++t)
      map2(x + t * n, bp, x + t * n, n, bf_, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
  }

  // GQA (engine/models/gqa.py): q/k/v projections (+ biases, + per-head RMSNorm), RoPE on q and k, the
  // new K/V rows into the cache at the slots, paged decode over every sequence, o_proj.
  void attention_gqa(int64_t i, int64_t T, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots,
                     const std::vector<Knobs>& kn) {
    const Layer& L = layers_[i];
    const int64_t d = Dh_, G = Hkv_, half = d / 2;
    q_.resize(T * H_ * d), k_.resize(T * G * d), v_.resize(T * G * d);
    linear(L.q, h_.data(), T, q_.data(), kn[kQ], bf_, pLinAttn, i, kQ);
    round_all(q_.data(), T * H_ * d);
    linear(L.k, h_.data(), T, k_.data(), kn[kK], bf_, pLinAttn, i, kK);
    round_all(k_.data(), T * G * d);
    linear(L.v, h_.data(), T, v_.data(), kn[kV], bf_, pLinAttn, i, kV);
    round_all(v_.data(), T * G * d);
    add_bias(q_.data(), T, L.q_bias), add_bias(k_.data(), T, L.k_bias), add_bias(v_.data(), T, L.v_bias);
    qcat_.resize(T * H_ * d), rows_.resize(T * G * d);  // roped q, roped k
    {
      const auto t0 = tic();
      if (L.q_norm.defined()) {
        for (int64_t r = 0; r < T * H_; ++r) norm_row(q_.data() + r * d, L.q_norm.data_ptr<float>(), q_.data() + r * d, d, eps_, bf_);
        for (int64_t r = 0; r < T * G; ++r) norm_row(k_.data() + r * d, L.k_norm.data_ptr<float>(), k_.data() + r * d, d, eps_, bf_);
      }
      toc(pNorms, t0);
    }
    {
      const auto t0 = tic();
      const float *cp = cos_.data(), *sp = sin_.data();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H_; ++h)
          rope_row(q_.data() + (t * H_ + h) * d, cp + t * half, sp + t * half, d, interleave_,
                   qcat_.data() + (t * H_ + h) * d, bf_);
        for (int64_t h = 0; h < G; ++h)
          rope_row(k_.data() + (t * G + h) * d, cp + t * half, sp + t * half, d, interleave_,
                   rows_.data() + (t * G + h) * d, bf_);
      }
      toc(pRope, t0);
    }
    const auto t0 = tic();
    {  // the new rows into the cache (checked: the slots come from the step's block tables)
      const int64_t capacity = kviews_[i].size(0) * kviews_[i].size(1), n = G * d;
      const int64_t* sl = slots.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) {
        TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "runner: slot ", sl[t], " outside the cache");
        if (bf_) {
          c10::BFloat16* kd = static_cast<c10::BFloat16*>(kviews_[i].data_ptr()) + sl[t] * n;
          c10::BFloat16* vd = static_cast<c10::BFloat16*>(vviews_[i].data_ptr()) + sl[t] * n;
          for (int64_t j = 0; j < n; ++j) kd[j] = c10::BFloat16(rows_[t * n + j]), vd[j] = c10::BFloat16(v_[t * n + j]);
        } else {
          std::memcpy(static_cast<float*>(kviews_[i].data_ptr()) + sl[t] * n, rows_.data() + t * n, n * sizeof(float));
          std::memcpy(static_cast<float*>(vviews_[i].data_ptr()) + sl[t] * n, v_.data() + t * n, n * sizeof(float));
        }
      }
    }
    at::Tensor out;
    {
      SerialScope one(serial(attn_work()));
      reset_used();
      const at::Tensor q = at::from_blob(qcat_.data(), {T, H_, d}, at::kFloat);
      out = attn_decode(q, kviews_[i], vviews_[i], tables, lens, scale_, none_, none_, no_slots_, kn[kAttn]);
    }
    note("paged_decode", -1, T, i, kAttn);
    toc(pAttn, t0);
    float* o = out.data_ptr<float>();  // [T, H, d]
    round_all(o, T * H_ * d);
    a_.resize(T * D_);
    linear(L.o, o, T, a_.data(), kn[kO], bf_, pLinAttn, i, kO);
    round_all(a_.data(), T * D_);
  }

  // gate_up [T, 2I] → act [T, I] = SiLU(gate) · up in the model dtype
  void silu_mul(const float* gu, int64_t T, int64_t I, float* act) {
    const auto t0 = tic();
    for (int64_t t = 0; t < T; ++t) silu_mul_f32(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
    round_all(act, T * I);
    toc(pAct, t0);
  }

  // x [T, D] → out [T, D] through gate_up and down (dense MLP or shared experts), model dtype
  void mlp(const Lin& gu, const Lin& down, int64_t T, const Knobs& k1, const Knobs& k2, int part, int64_t layer,
           int64_t s1, int64_t s2, float* out) {
    const int64_t I = gu.N / 2;
    g_.resize(T * gu.N);
    act_.resize(T * I);
    linear(gu, h_.data(), T, g_.data(), k1, bf_, part, layer, s1);
    round_all(g_.data(), T * gu.N);
    silu_mul(g_.data(), T, I, act_.data());
    linear(down, act_.data(), T, out, k2, bf_, part, layer, s2);
    round_all(out, T * D_);
  }

  void dense(int64_t i, int64_t T, const std::vector<Knobs>& kn) {
    const Layer& L = layers_[i];
    m_.resize(T * D_);
    mlp(L.gu, L.down, T, kn[kFfn1], kn[kDown], pDense, i, kFfn1, kDown, m_.data());
  }

  // DeepSeek routing exactly as kernels/reference.grouped_topk, one token at a time.
  void route(const float* lg, const float* bias, int64_t E, float* w, int64_t* ids) {
    std::vector<float> score(E), choice(E);
    if (sigmoid_) {
      for (int64_t e = 0; e < E; ++e) score[e] = 1.f / (1.f + std::exp(-lg[e]));
    } else {
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lg[e]);
      for (int64_t e = 0; e < E; ++e) sum += (score[e] = std::exp(lg[e] - mx));
      for (int64_t e = 0; e < E; ++e) score[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = bias ? score[e] + bias[e] : score[e];
    const float ninf = -std::numeric_limits<float>::infinity();
    if (n_group_ > 1) {
      const int64_t per = E / n_group_;
      std::vector<float> gs(n_group_);
      for (int64_t g = 0; g < n_group_; ++g) {
        float a = ninf, b = ninf;  // the best two of the group
        for (int64_t j = 0; j < per; ++j) {
          const float v = choice[g * per + j];
          if (v > a) b = a, a = v; else if (v > b) b = v;
        }
        gs[g] = bias ? a + b : a;
      }
      std::vector<char> keep(n_group_, 0);
      for (int64_t k = 0; k < topk_group_; ++k) {
        int64_t best = -1;
        for (int64_t g = 0; g < n_group_; ++g)
          if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
        keep[best] = 1;
      }
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = ninf;
    }
    std::vector<char> taken(E, 0);
    float sum = 0.f;
    for (int64_t k = 0; k < topk_; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      taken[best] = 1;
      ids[k] = best;
      w[k] = score[best];
      sum += w[k];
    }
    for (int64_t k = 0; k < topk_; ++k) w[k] = (renorm_ ? w[k] / (sum + 1e-20f) : w[k]) * scaling_;
  }

  void moe(int64_t i, int64_t T, const std::vector<Knobs>& kn) {
    const Layer& L = layers_[i];
    const int64_t E = L.router.N;
    logits_.resize(T * E);
    linear(L.router, h_.data(), T, logits_.data(), kn[kRouter], false, pRouter, i, kRouter);
    ids_.resize(T * topk_);
    tw_.resize(T * topk_);
    {
      const auto t0 = tic();
      const float* bias = L.bias.defined() ? L.bias.data_ptr<float>() : nullptr;
      for (int64_t t = 0; t < T; ++t) route(logits_.data() + t * E, bias, E, tw_.data() + t * topk_, ids_.data() + t * topk_);
      toc(pRouting, t0);
    }
    std::vector<char> used(E, 0);
    int64_t n_used = 0;
    for (int64_t id : ids_) n_used += !used[id], used[id] = 1;
    experts_used_[i] = n_used;
    m_.resize(T * D_);
    {
      const auto t0 = tic();
      SerialScope one(serial((L.w13.bytes() + L.w2.bytes()) / E * n_used));
      const at::Tensor hf = at::from_blob(h_.data(), {T, D_}, at::kFloat);
      const at::Tensor x = bf_ ? hf.to(at::kBFloat16) : hf;
      const at::Tensor w = at::from_blob(tw_.data(), {T, topk_}, at::kFloat);
      const at::Tensor id = at::from_blob(ids_.data(), {T, topk_}, at::kLong);
      const at::Tensor y = fused_moe(x, L.w13.fmt, L.w13.w, L.w13.scale, L.w13.zero, L.w2.fmt, L.w2.w, L.w2.scale, L.w2.zero,
                                     L.w13.N / 2, L.w13.group, L.w13.block_n, w, id, kn[kFfn1]);
      std::memcpy(m_.data(), y.data_ptr<float>(), T * D_ * sizeof(float));
      note("fused_moe", L.w13.fmt, T, i, kFfn1);
      toc(pMoe, t0);
    }
    round_all(m_.data(), T * D_);
    if (L.sh_gu.fmt >= 0) {
      sh_.resize(T * D_);
      mlp(L.sh_gu, L.sh_down, T, kn[kShGU], kn[kShDown], pShared, i, kShGU, kShDown, sh_.data());
      if (L.sh_gate.fmt >= 0) {  // Qwen2-MoE: shared output × sigmoid(shared_gate · x), float32 then rounded
        gate_.resize(T);
        linear(L.sh_gate, h_.data(), T, gate_.data(), kn[kShGate], false, pShared, i, kShGate);
        for (int64_t t = 0; t < T; ++t) {
          const float g = 1.f / (1.f + std::exp(-gate_[t]));
          const __m512 gv = _mm512_set1_ps(g);
          map2(sh_.data() + t * D_, nullptr, sh_.data() + t * D_, D_, bf_, [&](__m512 a, __m512) { return _mm512_mul_ps(a, gv); });
        }
      }
      map2(m_.data(), sh_.data(), m_.data(), T * D_, bf_, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
    }
  }
};

}  // namespace

void bind_runner(py::module_& m) {
  py::class_<DecodeRunner>(m, "DecodeRunner", "every decoder layer of a decode step in one call (graph_mode=cpp)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, int64_t, int64_t,
                    int64_t, bool, bool, double, bool, int64_t>(),
           py::arg("heads"), py::arg("qk_nope"), py::arg("qk_rope"), py::arg("kv_lora_rank"), py::arg("v_head"),
           py::arg("hidden"), py::arg("eps"), py::arg("scale"), py::arg("interleave"), py::arg("topk"),
           py::arg("n_group"), py::arg("topk_group"), py::arg("sigmoid"), py::arg("renormalize"),
           py::arg("scaling"), py::arg("bf16"), py::arg("serial_below"))
      .def("set_gqa", &DecodeRunner::set_gqa, py::arg("kv_heads"), py::arg("head_dim"),
           "GQA attention (before add_layer): kv heads and head dim")
      .def("add_layer", &DecodeRunner::add_layer, "one layer's weights (kernel argument tuples) and tensors")
      .def("set_knobs", &DecodeRunner::set_knobs, "the knob structs of one bucket: per layer, one per slot")
      .def("has_knobs", &DecodeRunner::has_knobs)
      .def("set_embedding", &DecodeRunner::set_embedding, "the token embedding and the rotary angles' inv_freq, factor")
      .def_readonly("total_seconds", &DecodeRunner::total_s_)
      .def("forward", &DecodeRunner::forward, py::call_guard<py::gil_scoped_release>())
      .def("step_logits", &DecodeRunner::step_logits, py::arg("ids"), py::arg("positions"), py::arg("tables"),
           py::arg("cache"), py::arg("key"), py::call_guard<py::gil_scoped_release>(),
           "forward_logits from lists: token ids, positions, block tables (slots and lens derived)")
      .def("set_lm_head", &DecodeRunner::set_lm_head, "the output projection's kernel arguments")
      .def_readwrite("timing", &DecodeRunner::timing)
      .def_readwrite("recording", &DecodeRunner::recording)
      .def_readwrite("serial_below", &DecodeRunner::serial_below_)
      .def_readonly("calls", &DecodeRunner::calls_)
      .def_readonly("experts_used", &DecodeRunner::experts_used_)
      .def_readonly("kv_bytes", &DecodeRunner::kv_bytes_)
      .def("parts", &DecodeRunner::parts, "per breakdown part: (seconds, calls) of the last step (timing on)");
  m.attr("RUNNER_SLOTS") = py::make_tuple("q_a", "q_b", "kv_a", "o", "attn", "ffn1", "shared_gate_up",
                                          "shared_down", "down", "router", "q", "k", "v", "shared_gate");
}

}  // namespace moetune
