// Attention over a paged cache, one core for every form (SEEDS.md A; kernels/reference.py is the oracle):
//
// - decode (MLA absorbed, MHA/GQA): one query row per sequence; the query heads that share a KV head
//   are folded into the rows of one task (head_fold at a time), and the sequence's keys are cut into
//   kv_splits pieces computed in parallel (flash decoding), merged at the end by log-sum-exp;
// - extend (prefill, chunked prefill): query tiles of q_block rows of one head; keys below every
//   row's causal limit are a plain rectangle, only the diagonal block is masked, blocks above skipped.
//
// Per task the keys come in cache blocks of kv_block tokens, read through the block table. A block's
// keys are converted to float32 and transposed once ([dim][keys], 16×16 in-register transposes) so
// QK is a register-tiled GEMM (rows × 16 keys, query values broadcast); the same rows (still in L2)
// then feed the PV product (rows × 16 value columns, probabilities broadcast). For MLA, K and V are
// the same cache row (V = its first R columns): each block comes from DRAM once. Scores, the online
// softmax (running max m, sum l, output rescaled by exp(m_old − m_new)) and outputs are float32.
// From blas_rows rows per task on, QK and PV go instead through sgemm (ATen → MKL, single-threaded
// inside the task) on the block converted to float32 rows — the better choice for many heads (V3's 128)
// or long query tiles, where the products dominate and a tuned GEMM beats the register kernels.
// The cache may be float32 or bfloat16. Every size is a run-time argument (kernels/cpu_knobs.py).
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include "dot.h"
#include "ops.h"
#include "vmath.h"
#include "amx_tiles.h"

namespace moetune {

namespace {

#define MOETUNE_ATTN_NS attn_hw
#define MOETUNE_BF16_ATTR MOETUNE_TARGET_BF16
#include "attn_dot.inc"
#undef MOETUNE_ATTN_NS
#undef MOETUNE_BF16_ATTR
#define MOETUNE_ATTN_NS attn_model
#define MOETUNE_BF16_ATTR
#include "attn_dot.inc"
#undef MOETUNE_ATTN_NS
#undef MOETUNE_BF16_ATTR

// the QK / PV instruction of a call: float32 FMAs, vdpbf16ps (or its model), AMX tiles (or their model)
enum AttnDot : int { kNoDot = 0, kDotHw = 1, kDotModel = 2, kDotAmx = 3, kDotAmxModel = 4 };

constexpr int kGroup = 16;  // rows per register group
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float exp_scalar(float x) { return x == kNegInf ? 0.f : std::exp(x); }

// 16 elements [i, i + 16) of a cache row (masked) as float32.
template <int DT>
inline __m512 load16(const uint8_t* row, int64_t i, __mmask16 m) {
  if constexpr (DT == kBF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(row) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + i);
  }
}

// In-register transpose of a 16×16 float32 tile: out[c] = column c of rows r[0..16).
inline void transpose16(const __m512 r[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 c = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD), d = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_f32x4(a, b, 0x88);
    out[8 + k] = _mm512_shuffle_f32x4(a, b, 0xDD);
    out[4 + k] = _mm512_shuffle_f32x4(c, d, 0x88);
    out[12 + k] = _mm512_shuffle_f32x4(c, d, 0xDD);
  }
}

// The rows of the next cache block that a kernel prefetches while it works on this block's (cpu_attn_prefetch):
// rows[j] for j < n, into the level `hint` says (kPrefetchNone: none).
struct Ahead {
  const uint8_t* const* rows = nullptr;
  int n = 0;
  int hint = kPrefetchNone;
};

// Kt[d * ldk + j] = K[j][d] as float32 for d < Dk, j < nbp (keys j ≥ nb are zero); next: the next block's key
// rows, each line prefetched beside the reads of the same line of this block's.
template <int DT>
void transpose_keys(const uint8_t* const* krow, int nb, int64_t Dk, float* Kt, int64_t ldk, const Ahead& next = Ahead{}) {
  constexpr int64_t esz = DT == kBF16 ? 2 : 4;
  const int pn = next.hint != kPrefetchNone ? next.n : 0;
  __m512 r[16], o[16];
  for (int j0 = 0; j0 < ldk; j0 += 16) {
    for (int64_t d0 = 0; d0 < Dk; d0 += 16) {
      const __mmask16 m = tail_mask16(Dk - d0);
      if ((d0 * esz) % 64 == 0)
        for (int j = j0; j < std::min(j0 + 16, pn); ++j) prefetch_line(next.rows[j] + d0 * esz, next.hint);
      for (int j = 0; j < 16; ++j) r[j] = j0 + j < nb ? load16<DT>(krow[j0 + j], d0, m) : _mm512_setzero_ps();
      transpose16(r, o);
      const int64_t dn = std::min<int64_t>(16, Dk - d0);
      for (int64_t d = 0; d < dn; ++d) _mm512_storeu_ps(Kt + (d0 + d) * ldk + j0, o[d]);
    }
  }
}

// S[g * lds + j] = Σ_d Qt[d * 16 + g] · Kt[d * ldk + j] for G rows, j < ldk (a multiple of 16). The
// query block is stored transposed ([dim][16 rows]) so every broadcast comes off one pointer.
template <int G>
void qk_tile(const float* Qt, const float* Kt, int64_t ldk, int64_t Dk, float* S, int64_t lds) {
  for (int64_t j = 0; j < ldk; j += 32) {
    if (j + 32 <= ldk && G <= 14) {  // two key vectors per pass: half the broadcasts per FMA
      __m512 a[G], b[G];
      for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
      const float* kt = Kt + j;
      for (int64_t d = 0; d < Dk; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * ldk), k1 = _mm512_loadu_ps(kt + d * ldk + 16);
        const float* q = Qt + d * kGroup;
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
          const __m512 qg = _mm512_set1_ps(q[g]);
          a[g] = _mm512_fmadd_ps(qg, k0, a[g]);
          b[g] = _mm512_fmadd_ps(qg, k1, b[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(S + g * lds + j, a[g]);
        _mm512_storeu_ps(S + g * lds + j + 16, b[g]);
      }
      continue;
    }
    for (int64_t jj = j; jj < std::min<int64_t>(j + 32, ldk); jj += 16) {
      __m512 a[G];
      for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
      const float* kt = Kt + jj;
      for (int64_t d = 0; d < Dk; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * ldk);
        const float* q = Qt + d * kGroup;
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g]), k0, a[g]);
      }
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(S + g * lds + jj, a[g]);
    }
  }
}

// A[g][c] = A[g][c] · alpha[g · LS] + Σ_j Pt[j * 16 + g · LS] · V[j][c] for G rows, c < Dv (probabilities
// transposed, [keys][16 lanes], for the same reason as the queries; LS > 1: the packed form's rows of one KV head,
// every LS-th lane).
// next: the rows of the next cache block (cpu_attn_prefetch), each line prefetched in the pass over the columns
// that starts on it, one row per key of this block.
template <int G, int DT, int LS = 1>
void pv_tile(const float* Pt, const uint8_t* const* vrow, int nb, int64_t Dv, float* A, int64_t lda,
             const float* alpha, const Ahead& next = Ahead{}) {
  constexpr int64_t esz = DT == kBF16 ? 2 : 4;
  for (int64_t c = 0; c < Dv; c += 16) {
    const __mmask16 m = tail_mask16(Dv - c);
    __m512 acc[G];
    for (int g = 0; g < G; ++g)
      acc[g] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, A + g * lda + c), _mm512_set1_ps(alpha[g * LS]));
    const int pn = next.hint != kPrefetchNone && (c * esz) % 64 == 0 ? next.n : 0;
    for (int j = 0; j < nb; ++j) {
      if (j < pn) prefetch_line(next.rows[j] + c * esz, next.hint);
      const __m512 v = load16<DT>(vrow[j], c, m);
      const float* p = Pt + j * kGroup;
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * LS]), v, acc[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(A + g * lda + c, m, acc[g]);
  }
}

// Pt[j * 16 + g] = S[g * lds + j] for g < G (rows past G read as zero), j < ldk.
inline void transpose_probs(const float* S, int64_t lds, int G, int64_t ldk, float* Pt) {
  __m512 r[16], o[16];
  for (int64_t j0 = 0; j0 < ldk; j0 += 16) {
    for (int g = 0; g < 16; ++g) r[g] = g < G ? _mm512_loadu_ps(S + g * lds + j0) : _mm512_setzero_ps();
    transpose16(r, o);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(Pt + (j0 + i) * kGroup, o[i]);
  }
}

inline __m512 select_ps(__m512 a, __mmask16 k, __m512 b) {  // lanes of b where k, else of a
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_castps_si512(a), k, _mm512_castps_si512(b)));
}

// The lanes form (cpu_attn_f32_form=lanes) reads a block's keys as float32 in chunks of kChunk dims:
// Kc[(c * nbp + j) * kChunk + i] = K[j][c * kChunk + i] (zero past Dk, and for the pad keys nb <= j < nbp), so
// that every key of a chunk sits a constant distance from the first (one base register for 16 broadcasts), and
// one chunk of the queries and of the block's keys stays in L1 while it is used.
constexpr int kChunk = 64;

// Whether a task of `rows` rows on the register form takes the lanes form (cpu_attn_f32_form; auto: from a full
// register group, as fewer rows leave lanes idle).
inline bool lanes_form(const Knobs& kn, int64_t rows) {
  return kn.attn_f32_form == kAttnLanes ||
         ((kn.attn_f32_form == kAttnFormAuto || kn.attn_f32_form == kAttnPacked) && rows >= kGroup);
}

// next: the next block's key rows, each row's lines prefetched beside the conversion of this block's row j.
template <int DT>
void keys_chunked(const uint8_t* const* krow, int nb, int nbp, int64_t Dk, float* Kc, const Ahead& next = Ahead{}) {
  constexpr int64_t esz = DT == kBF16 ? 2 : 4;
  const int64_t nch = (Dk + kChunk - 1) / kChunk, full = Dk / kChunk, cs = (int64_t)nbp * kChunk;
  const int pn = next.hint != kPrefetchNone ? next.n : 0;
  for (int j = 0; j < nb; ++j) {  // each key row read in order, its chunks nbp rows apart
    if (j < pn)
      for (int64_t b = 0; b < Dk * esz; b += 64) prefetch_line(next.rows[j] + b, next.hint);
    float* dst = Kc + (int64_t)j * kChunk;
    for (int64_t c = 0; c < full; ++c)
#pragma GCC unroll 4
      for (int i = 0; i < kChunk; i += 16) _mm512_storeu_ps(dst + c * cs + i, load16<DT>(krow[j], c * kChunk + i, 0xFFFF));
    for (int i = 0; full < nch && i < kChunk; i += 16) {
      const int64_t d = full * kChunk + i;
      _mm512_storeu_ps(dst + full * cs + i, d < Dk ? load16<DT>(krow[j], d, tail_mask16(Dk - d)) : _mm512_setzero_ps());
    }
  }
  for (int64_t c = 0; c < nch && nb < nbp; ++c)
    std::fill(Kc + c * cs + (int64_t)nb * kChunk, Kc + (c + 1) * cs, 0.f);
}

// One register group's QK in the lanes form: St[j * 16 + g] = Σ_d Qt[d * 16 + g] · K[j][d] for j < nbp (a
// multiple of 16): the group's rows in the lanes, each key's elements broadcast, 16 keys at a time; chunk by
// chunk of the dims, the sums kept in St between chunks. Nothing is transposed, and the scores come out in
// the [keys][16 rows] layout that the softmax (down the keys) and PV read.
inline void qk_lanes(const float* Qt, const float* Kc, int nbp, int64_t Dk, float* St) {
  const int64_t nch = (Dk + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t dn = std::min<int64_t>(kChunk, Dk - c * kChunk);
    const float* q = Qt + c * kChunk * kGroup;
    for (int j0 = 0; j0 < nbp; j0 += 16) {
      const float* kb = Kc + (c * nbp + j0) * kChunk;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = c ? _mm512_loadu_ps(St + (j0 + i) * kGroup) : _mm512_setzero_ps();
      for (int64_t d = 0; d < dn; ++d) {
        const __m512 qd = _mm512_loadu_ps(q + d * kGroup);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[i * kChunk + d]), acc[i]);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(St + (j0 + i) * kGroup, acc[i]);
    }
  }
}

// The online softmax of one register group's block in the lanes form, as the row form's: St[j * 16 + g] the
// scores of key n0 + j (j < nb) for row g < G, overwritten by its probability (0 where the row may not see
// it: n0 + j >= lim[g]); m, l, alpha [G]. A row that sees no key of the block keeps m and l, alpha 1; one that
// saw none before gets alpha 0 (its output is still zero).
inline void softmax_lanes(float* St, int nb, int G, const int64_t* lim, int64_t n0, float* m, float* l, float* alpha) {
  alignas(64) float visf[16];  // keys row g sees in this block, as float (exact: ≤ a block's keys)
  int maxvis = 0;
  for (int g = 0; g < kGroup; ++g) {
    const int v = g < G ? (int)std::clamp<int64_t>(lim[g] - n0, 0, nb) : 0;
    visf[g] = (float)v, maxvis = std::max(maxvis, v);
  }
  const __mmask16 gm = tail_mask16(G);
  const __m512 visv = _mm512_load_ps(visf);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  const __m512 mo = _mm512_mask_loadu_ps(ninf, gm, m);
  __m512 bm = ninf;
  for (int j = 0; j < maxvis; ++j)
    bm = _mm512_max_ps(bm, select_ps(ninf, _mm512_cmp_ps_mask(_mm512_set1_ps((float)j), visv, _CMP_LT_OQ),
                                     _mm512_loadu_ps(St + 16 * j)));
  const __m512 mn = _mm512_max_ps(mo, bm);
  const __mmask16 seen = _mm512_cmp_ps_mask(visv, _mm512_setzero_ps(), _CMP_GT_OQ);  // a key of this block
  const __mmask16 had = _mm512_cmp_ps_mask(mo, ninf, _CMP_GT_OQ);                    // a key before it
  const __m512 al = select_ps(_mm512_set1_ps(1.f), seen, _mm512_maskz_mov_ps(had, exp512(_mm512_sub_ps(mo, mn))));
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < nb; ++j) {
    const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps((float)j), visv, _CMP_LT_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(St + 16 * j), mn)));
    _mm512_storeu_ps(St + 16 * j, p);
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_mask_storeu_ps(l, gm, _mm512_fmadd_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), gm, l), al, sum));
  _mm512_mask_storeu_ps(m, gm & seen, mn);
  _mm512_mask_storeu_ps(alpha, gm, al);
}

// ------------------------------------------------------------------ the packed form (decode, cpu_attn_f32_form)
// A KV head with at most 8 query rows fills half a register group or less; the packed form gives one task the rows
// of P = 2 or 4 KV heads, interleaved in the lanes (lane p + P·r: row r of the task's head p, R rows per head). A
// block's keys of the P heads are converted once into chunks of kChunk dims with the heads interleaved,
// Kc[((c · nbp + j) · kChunk + i) · P + p] = K_p[j][c · kChunk + i], so one broadcast of P floats (vpbroadcastq,
// vbroadcastf32x4: a load, no shuffle) gives every lane its own head's key element: QK is the lanes form's 16 keys
// × 1 query vector per dim with every lane busy. The online softmax runs down the keys as the lanes form's, and PV
// runs per head on pv_tile over that head's lanes (every P-th).

// How many KV heads a decode task packs into its lanes: P ∈ {4, 2} with P · Hg ≤ 16 that divides Hkv, on the
// register form (float32 FMAs, fewer rows than cpu_attn_blas_rows), where cpu_attn_f32_form is packed or auto; else 1.
inline int packed_heads(const Knobs& kn, int64_t Hg, int64_t Hkv, bool dot) {
  if (dot || Hg > kGroup / 2 || Hg >= kn.attn_blas_rows ||
      (kn.attn_f32_form != kAttnPacked && kn.attn_f32_form != kAttnFormAuto))
    return 1;
  for (int P = 4; P >= 2; P /= 2)
    if (P * Hg <= kGroup && Hkv % P == 0) return P;
  return 1;
}

// P broadcast floats: every lane l gets x[l % P].
template <int P>
inline __m512 bcast_heads(const float* x) {
  if constexpr (P == 4) return _mm512_broadcast_f32x4(_mm_loadu_ps(x));
  if constexpr (P == 2) {
    long long bits;
    std::memcpy(&bits, x, sizeof bits);
    return _mm512_castsi512_ps(_mm512_set1_epi64(bits));
  }
  return _mm512_set1_ps(*x);
}

// v[0..P) (16 dims each, one per head) interleaved into dst[i · P + p] = v[p][i], i < 16.
template <int P>
inline void store_interleaved(const __m512* v, float* dst) {
  alignas(64) static const int32_t lo2[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t hi2[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i l2 = _mm512_loadu_si512(lo2), h2 = _mm512_loadu_si512(hi2);
  if constexpr (P == 2) {
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(v[0], l2, v[1]));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(v[0], h2, v[1]));
  } else if constexpr (P == 4) {  // pairs (a, b) and (c, d) interleaved, then the pairs as 64-bit units
    alignas(64) static const int32_t lo4[16] = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
    alignas(64) static const int32_t hi4[16] = {8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31};
    const __m512i l4 = _mm512_loadu_si512(lo4), h4 = _mm512_loadu_si512(hi4);
    const __m512 ab0 = _mm512_permutex2var_ps(v[0], l2, v[1]), ab1 = _mm512_permutex2var_ps(v[0], h2, v[1]);
    const __m512 cd0 = _mm512_permutex2var_ps(v[2], l2, v[3]), cd1 = _mm512_permutex2var_ps(v[2], h2, v[3]);
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(ab0, l4, cd0));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(ab0, h4, cd0));
    _mm512_storeu_ps(dst + 32, _mm512_permutex2var_ps(ab1, l4, cd1));
    _mm512_storeu_ps(dst + 48, _mm512_permutex2var_ps(ab1, h4, cd1));
  } else {
    _mm512_storeu_ps(dst, v[0]);
  }
}

// The block's keys of P heads (krow[p · ldk + j]: key j of head p) as Kc above (zero past Dk and for the pad keys
// nb <= j < nbp); next: the next block's key rows in the same layout (next.rows[p · ldk + j], j < next.n), each
// line prefetched beside the conversion of the same line of this block.
template <int DT, int P>
void keys_packed(const uint8_t* const* krow, int64_t ldk, int nb, int nbp, int64_t Dk, float* Kc, const Ahead& next) {
  constexpr int64_t esz = DT == kBF16 ? 2 : 4;
  const int64_t nch = (Dk + kChunk - 1) / kChunk, cs = (int64_t)nbp * kChunk * P;
  const int pn = next.hint != kPrefetchNone ? next.n : 0;
  __m512 v[P];
  for (int j = 0; j < nb; ++j) {
    float* dst = Kc + (int64_t)j * kChunk * P;
    for (int64_t c = 0; c < nch; ++c)
      for (int i = 0; i < kChunk; i += 16) {
        const int64_t d = c * kChunk + i;
        const __mmask16 m = d < Dk ? tail_mask16(Dk - d) : (__mmask16)0;
        if (j < pn && d < Dk && (d * esz) % 64 == 0)
          for (int p = 0; p < P; ++p) prefetch_line(next.rows[p * ldk + j] + d * esz, next.hint);
        for (int p = 0; p < P; ++p) v[p] = load16<DT>(krow[p * ldk + j], d, m);
        store_interleaved<P>(v, dst + c * cs + i * P);
      }
  }
  for (int64_t c = 0; c < nch && nb < nbp; ++c)
    std::fill(Kc + c * cs + (int64_t)nb * kChunk * P, Kc + (c + 1) * cs, 0.f);
}

// QK of the packed register group: St[j * 16 + l] = Σ_d Qt[d * 16 + l] · K_{l % P}[j][d], j < nbp (a multiple of
// 16), as qk_lanes with the P heads' elements broadcast together.
template <int P>
void qk_packed(const float* Qt, const float* Kc, int nbp, int64_t Dk, float* St) {
  const int64_t nch = (Dk + kChunk - 1) / kChunk;
  for (int64_t c = 0; c < nch; ++c) {
    const int64_t dn = std::min<int64_t>(kChunk, Dk - c * kChunk);
    const float* q = Qt + c * kChunk * kGroup;
    for (int j0 = 0; j0 < nbp; j0 += 16) {
      const float* kb = Kc + (c * nbp + j0) * kChunk * P;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = c ? _mm512_loadu_ps(St + (j0 + i) * kGroup) : _mm512_setzero_ps();
      for (int64_t d = 0; d < dn; ++d) {
        const __m512 qd = _mm512_loadu_ps(q + d * kGroup);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qd, bcast_heads<P>(kb + (i * kChunk + d) * P), acc[i]);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(St + (j0 + i) * kGroup, acc[i]);
    }
  }
}

// Qt[d * 16 + l] = q[(p · R + r) · Dk + d] · scale for lane l = p + P · r (r < R; other lanes zero): the task's
// P · R query rows (head p's R rows consecutive in q) in the packed lanes.
inline void pack_queries_packed(const float* q, int P, int R, int64_t Dk, float scale, float* Qt) {
  for (int l = 0; l < kGroup; ++l) {
    const int p = l % P, r = l / P;
    const float* row = r < R ? q + (p * R + r) * Dk : nullptr;
    for (int64_t d = 0; d < Dk; ++d) Qt[d * kGroup + l] = row ? row[d] * scale : 0.f;
  }
}

template <int G>
struct Tiles {
  static void qk(int g, const float* Qt, const float* Kt, int64_t ldk, int64_t Dk, float* S, int64_t lds) {
    if (g == G) return qk_tile<G>(Qt, Kt, ldk, Dk, S, lds);
    if constexpr (G > 1) Tiles<G - 1>::qk(g, Qt, Kt, ldk, Dk, S, lds);
  }
  template <int DT, int LS = 1>
  static void pv(int g, const float* Pt, const uint8_t* const* vrow, int nb, int64_t Dv, float* A, int64_t lda,
                 const float* alpha, const Ahead& next = Ahead{}) {
    if (g == G) return pv_tile<G, DT, LS>(Pt, vrow, nb, Dv, A, lda, alpha, next);
    if constexpr (G > 1) Tiles<G - 1>::template pv<DT, LS>(g, Pt, vrow, nb, Dv, A, lda, alpha, next);
  }
};

// One K/V source: [blocks, block_size, heads, dim] with element strides, read through a block table.
struct KVSource {
  const uint8_t* base = nullptr;
  int64_t esz = 4, sblock = 0, stok = 0, shead = 0, block_size = 1, dim = 0, heads = 0, nblocks = 0;
  const uint8_t* row(const int32_t* table, int64_t n, int64_t h) const {
    return base + ((int64_t)table[n / block_size] * sblock + (n % block_size) * stok + h * shead) * esz;
  }
};

KVSource kv_source(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, what, ": [blocks, block_size, heads, dim] with a unit last stride");
  KVSource s;
  s.base = static_cast<const uint8_t*>(t.data_ptr());
  s.esz = t.element_size();
  s.sblock = t.stride(0), s.stok = t.stride(1), s.shead = t.stride(2);
  s.block_size = t.size(1), s.heads = t.size(2), s.dim = t.size(3), s.nblocks = t.size(0);
  return s;
}

// Per-task working memory: the transposed key block, scores/probabilities, row state.
// Kept per thread across calls and only ever grown: a call neither zeroes nor page-faults fresh memory.
struct Scratch {
  std::vector<float> kt, s, pt, alpha, kf, vf, q;  // kf, vf, q: the BLAS form (row-major float32)
  std::vector<uint32_t> kp, pb;                     // the dot form: key pairs, probability pairs
  std::vector<const uint8_t*> krow, vrow, nkrow, nvrow;  // nkrow, nvrow: the next block's (the packed form)
  // the AMX form: staged key tiles, V's key pairs interleaved, bf16 probability rows, the output rows
  std::vector<uint16_t> kst, pbf;
  std::vector<uint32_t> vp;
  std::vector<float> o;
  std::vector<const uint8_t*> ka;  // per 16-key tile: its A operand (in the cache, or staged)
  std::vector<int64_t> kld;        // and the bytes between its rows
  // pack: the packed form's KV heads per task (their key and value rows, their interleaved chunked keys)
  void fit(int64_t rows, int64_t kv_block, int64_t Dk, int64_t Dv, bool blas, int dot, bool lanes = false, int pack = 1) {
    const int64_t ldk = (kv_block + 15) / 16 * 16, rp = (rows + kGroup - 1) / kGroup * kGroup;
    grow(kt, Dk * ldk), grow(s, rp * ldk), grow(pt, ldk * kGroup), grow(alpha, rp);
    grow(krow, ldk * pack), grow(vrow, ldk * pack), grow(nkrow, ldk * pack), grow(nvrow, ldk * pack);
    if (lanes) grow(kf, ldk * ((Dk + kChunk - 1) / kChunk) * kChunk * pack);  // the chunked keys (keys_chunked, _packed)
    if (blas) grow(kf, kv_block * Dk), grow(vf, kv_block * Dv), grow(q, rows * Dk);
    if (dot) grow(kp, (Dk + 1) / 2 * ldk), grow(pb, kGroup * ldk / 2);
    if (dot >= kDotAmx) {
      const int64_t ldk32 = (kv_block + 31) / 32 * 32;
      grow(kst, ldk * Dk), grow(pbf, rp * ldk32), grow(vp, ldk32 / 2 * Dv), grow(o, rp * Dv);
      grow(ka, ldk / 16), grow(kld, ldk / 16);
    }
  }
  template <class T>
  static void grow(std::vector<T>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  }
};

Scratch& thread_scratch(int64_t rows, int64_t kv_block, int64_t Dk, int64_t Dv, bool blas, int dot, bool lanes,
                        int pack = 1) {
  static thread_local Scratch sc;
  sc.fit(rows, kv_block, Dk, Dv, blas, dot, lanes, pack);
  return sc;
}

// attend's packed form (float32 FMAs): one register group of P KV heads (kvh0 ..) with R rows each, in the packed
// lanes (pack_queries_packed's Qt); lim, m, l: per lane [16]; A: the rows in head order (head p's row r at
// A + (p · R + r) · lda).
template <int DT, int P>
void attend_packed(const float* Qt, int R, const int64_t* lim, const KVSource& K, const KVSource& V,
                   const int32_t* table, int64_t kvh0, int64_t k0, int64_t k1, int64_t kv_block, Scratch& sc, float* m,
                   float* l, float* A, int64_t lda, int hint) {
  const int64_t Dk = K.dim, Dv = V.dim, ldk = (kv_block + 15) / 16 * 16;
  if (hint == kAttnPrefetchAuto) hint = kPrefetchT1;  // (K and V rows of their own: GQA/MHA)
  // the block's rows (krow, vrow) and the next block's (nkrow, nvrow: prefetched while these are used)
  auto rows_of = [&](int64_t n0, int nb, const uint8_t** kr, const uint8_t** vr) {
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < nb; ++j) {
        kr[p * ldk + j] = K.row(table, n0 + j, kvh0 + p);
        vr[p * ldk + j] = V.row(table, n0 + j, kvh0 + p);
      }
  };
  const int nb0 = (int)std::min<int64_t>(kv_block, k1 - k0);
  rows_of(k0, nb0, sc.nkrow.data(), sc.nvrow.data());
  for (int64_t n0 = k0; n0 < k1; n0 += kv_block) {
    const int nb = (int)std::min<int64_t>(kv_block, k1 - n0), nbp = (nb + 15) / 16 * 16;
    std::swap(sc.krow, sc.nkrow), std::swap(sc.vrow, sc.nvrow);  // the rows found one block ago
    const int nn = (int)std::clamp<int64_t>(k1 - n0 - kv_block, 0, kv_block);
    if (nn > 0) rows_of(n0 + kv_block, nn, sc.nkrow.data(), sc.nvrow.data());
    const int h = nn > 0 ? hint : (int)kPrefetchNone;
    float* St = sc.s.data();
    keys_packed<DT, P>(sc.krow.data(), ldk, nb, nbp, Dk, sc.kf.data(), Ahead{sc.nkrow.data(), nn, h});
    qk_packed<P>(Qt, sc.kf.data(), nbp, Dk, St);
    softmax_lanes(St, nb, P * R, lim, n0, m, l, sc.alpha.data());
    for (int p = 0; p < P; ++p)
      Tiles<kGroup>::pv<DT, P>(R, St + p, sc.vrow.data() + p * ldk, nb, Dv, A + p * R * lda, lda, sc.alpha.data() + p,
                               Ahead{sc.nvrow.data() + p * ldk, nn, h});
  }
}

// Row j of a block as float32 into dst[j * n ...] (n elements).
template <int DT>
void rows_to_f32(const uint8_t* const* row, int nb, int64_t n, float* dst) {
  for (int j = 0; j < nb; ++j)
    for (int64_t d = 0; d < n; d += 16) {
      const __mmask16 m = tail_mask16(n - d);
      _mm512_mask_storeu_ps(dst + j * n + d, m, load16<DT>(row[j], d, m));
    }
}

inline at::Tensor view2d(float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(p, {rows, cols}, {ld, 1}, at::kFloat);
}

// Rows [0, rows) of float32 values (row r at x[r], n even) as bf16 pairs in register groups of 16 rows,
// each group transposed: dst[(r / 16) * (n / 2) * 16 + i * 16 + r % 16] = (x[r][2i], x[r][2i + 1]); the
// last group's lanes past `rows` zero. The dot and AMX forms' queries (unscaled) and probabilities.
inline void pack_pairs_t(const float* const* x, int rows, int64_t n, uint32_t* dst) {
  static thread_local std::vector<uint32_t> row;
  const int64_t units = n / 2;
  Scratch::grow(row, units);
  for (int r = 0; r < rows; ++r) {
    to_bf16(x[r], n, reinterpret_cast<uint16_t*>(row.data()));
    uint32_t* d = dst + (r / kGroup) * units * kGroup + r % kGroup;
    for (int64_t i = 0; i < units; ++i) d[i * kGroup] = row[i];
  }
  for (int r = rows; r % kGroup != 0; ++r) {
    uint32_t* d = dst + (r / kGroup) * units * kGroup + r % kGroup;
    for (int64_t i = 0; i < units; ++i) d[i * kGroup] = 0;
  }
}

// Kp[p * ldk + j] = unit p (dims 2p, 2p + 1) of bf16 key row j, for p < pairs, j < ldk (keys past nb:
// zero): 16 keys × 16 units at a time through the in-register transpose.
inline void transpose_pairs(const uint8_t* const* krow, int nb, int64_t pairs, uint32_t* Kp, int64_t ldk) {
  __m512 r[16], o[16];
  for (int j0 = 0; j0 < ldk; j0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 m = tail_mask16(pairs - p0);
      for (int j = 0; j < 16; ++j)
        r[j] = j0 + j < nb ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, krow[j0 + j] + 4 * p0)) : _mm512_setzero_ps();
      transpose16(r, o);
      const int64_t pn = std::min<int64_t>(16, pairs - p0);
      for (int64_t p = 0; p < pn; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(Kp + (p0 + p) * ldk + j0), o[p]);
    }
  }
}

// MXCSR.DAZ|FTZ on this thread for the scope when `on` (the vdpbf16ps model's denormal rule).
struct DenormalScope {
  unsigned prev = 0;
  bool on;
  explicit DenormalScope(bool o) : on(o) {
    if (on) prev = _mm_getcsr(), _mm_setcsr(prev | 0x8040u);
  }
  ~DenormalScope() { if (on) _mm_setcsr(prev); }
};

// ------------------------------------------------------------------ the AMX form (cpu_attn_isa=amx)
// QK and PV on TDPBF16PS tiles (or their C++ model, amx_tiles.h) for a bf16 cache with Dk % 32 == 0 and
// Dv % 16 == 0, the rows in register groups of 16 (the last one zero-padded):
// - QK as Sᵀ = K · Qᵀ: the A tiles are 16 keys × 32 dims of the cache rows, read where they lie when the
//   16 rows are evenly spaced (else copied to a staging tile, zero past the block), the B tiles the queries
//   as bf16 pairs [dim pair][16 rows] (pack_pairs_t's groups). A sum tile holds 16 keys × 16 rows, so the
//   online softmax runs down the keys with the rows in the lanes, and nothing transposes the keys.
// - The running max moves only when a block's max passes it by more than kLazyMax (the probabilities
//   stay below e^8 ≈ 3000, far inside float32's and bf16's range; the result is the same up to rounding):
//   the output rows are rescaled when it moves, not after every block.
// - PV as O += P · V: the A tiles the probabilities as bf16 rows [16 rows][32 keys] (each group's Sᵀ
//   transposed 16 × 16 at a time, rounded as the dot form rounds them), the B tiles V with each pair of key
//   rows interleaved ([key pair][Dv] units (V[2i][c], V[2i + 1][c]), built once per block for every row
//   group), the sum tiles 16 rows × 16 columns of O (the task's float32 rows in the scratch), loaded and
//   stored around each block's keys.
constexpr float kLazyMax = 8.f;

// C(i, j) += Σ_k A_i(k) · B_j(k) over `steps` K tiles, for NA ≤ 2 A tiles (tmm4 / 5; A_i(k) at a[i] + k·astep
// bytes, rows lda[i] bytes apart) and NB ≤ 2 B tiles (tmm6 / 7; B_j(k) at b[j] + k·bstep, rows ldb apart);
// C(i, j) is tile 2i + j, at c[2i + j] with rows ldc bytes apart, zeroed first or loaded from there (load_c),
// stored there at the end.
template <class T, int NA, int NB>
MOETUNE_AMX void amx_block(const uint8_t* const* a, const int64_t* lda, int64_t astep, const uint8_t* const* b,
                           int64_t ldb, int64_t bstep, int64_t steps, float* const* c, int64_t ldc, bool load_c) {
  if (load_c) {
    T::template load<0>(c[0], ldc);
    if constexpr (NB > 1) T::template load<1>(c[1], ldc);
    if constexpr (NA > 1) T::template load<2>(c[2], ldc);
    if constexpr (NA > 1 && NB > 1) T::template load<3>(c[3], ldc);
  } else {
    T::template zero<0>();
    if constexpr (NB > 1) T::template zero<1>();
    if constexpr (NA > 1) T::template zero<2>();
    if constexpr (NA > 1 && NB > 1) T::template zero<3>();
  }
  for (int64_t k = 0; k < steps; ++k) {
    T::template load<4>(a[0] + k * astep, lda[0]);
    if constexpr (NA > 1) T::template load<5>(a[1] + k * astep, lda[1]);
    T::template load<6>(b[0] + k * bstep, ldb);
    if constexpr (NB > 1) T::template load<7>(b[1] + k * bstep, ldb);
    tile_products<T, false, NA, NB>();
  }
  T::template store<0>(c[0], ldc);
  if constexpr (NB > 1) T::template store<1>(c[1], ldc);
  if constexpr (NA > 1) T::template store<2>(c[2], ldc);
  if constexpr (NA > 1 && NB > 1) T::template store<3>(c[3], ldc);
}

template <class T>
void amx_products(int na, int nb, const uint8_t* const* a, const int64_t* lda, int64_t astep, const uint8_t* const* b,
                  int64_t ldb, int64_t bstep, int64_t steps, float* const* c, int64_t ldc, bool load_c) {
  if (na == 2 && nb == 2) amx_block<T, 2, 2>(a, lda, astep, b, ldb, bstep, steps, c, ldc, load_c);
  else if (na == 2) amx_block<T, 2, 1>(a, lda, astep, b, ldb, bstep, steps, c, ldc, load_c);
  else if (nb == 2) amx_block<T, 1, 2>(a, lda, astep, b, ldb, bstep, steps, c, ldc, load_c);
  else amx_block<T, 1, 1>(a, lda, astep, b, ldb, bstep, steps, c, ldc, load_c);
}


// attend's AMX form (same contract; Qb: the unscaled query rows as bf16 pairs in zero-padded register groups,
// pack_pairs_t; qscale applied to the scores). T: AmxHw or AmxEmu.
template <class T>
void attend_amx(const uint32_t* Qb, float qscale, int rows, const int64_t* lim, const KVSource& K, const KVSource& V,
                const int32_t* table, int64_t kvh, int64_t k0, int64_t k1, int64_t kv_block, Scratch& sc, float* m,
                float* l, float* A, int64_t lda) {
  const int64_t Dk = K.dim, Dv = V.dim, pairs = Dk / 2, groups = (rows + kGroup - 1) / kGroup, rp = groups * kGroup;
  const int64_t ksteps = Dk / 32, rs = K.stok * K.esz, ctiles = Dv / 16;
  float* O = sc.o.data();
  for (int64_t r = 0; r < rp; ++r) {
    if (r < rows) std::memcpy(O + r * Dv, A + r * lda, Dv * sizeof(float));
    else std::fill(O + r * Dv, O + r * Dv + Dv, 0.f);
  }
  const __m512i pair_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512 ninf = _mm512_set1_ps(kNegInf), sv = _mm512_set1_ps(qscale);
  const TileConfig cfg = full_tiles();
  T::config(&cfg);
  for (int64_t n0 = k0; n0 < k1; n0 += kv_block) {
    const int nb = (int)std::min<int64_t>(kv_block, k1 - n0);
    const int64_t ldk = (nb + 15) / 16 * 16, ldk32 = (nb + 31) / 32 * 32, ktiles = ldk / 16;
    for (int j = 0; j < nb; ++j) {
      sc.krow[j] = K.row(table, n0 + j, kvh);
      sc.vrow[j] = V.row(table, n0 + j, kvh);
    }
    for (int64_t t = 0; t < ktiles; ++t) {  // QK's A tiles: 16 keys each, in place where evenly spaced
      const int64_t j0 = 16 * t;
      bool even = j0 + 16 <= nb;
      for (int i = 1; even && i < 16; ++i) even = sc.krow[j0 + i] == sc.krow[j0] + i * rs;
      if (even) {
        sc.ka[t] = sc.krow[j0], sc.kld[t] = rs;
        continue;
      }
      uint16_t* st = sc.kst.data() + t * 16 * Dk;
      for (int64_t i = 0; i < 16; ++i) {
        if (j0 + i < nb) std::memcpy(st + i * Dk, sc.krow[j0 + i], Dk * 2);
        else std::fill(st + i * Dk, st + (i + 1) * Dk, (uint16_t)0);
      }
      sc.ka[t] = reinterpret_cast<const uint8_t*>(st), sc.kld[t] = Dk * 2;
    }
    float* St = sc.s.data();  // group g: [ldk keys][16 rows] at St + g·ldk·16
    for (int64_t t = 0; t < ktiles; t += 2) {
      const int na = (int)std::min<int64_t>(2, ktiles - t);
      for (int64_t g = 0; g < groups; g += 2) {
        const int nq = (int)std::min<int64_t>(2, groups - g);
        const uint8_t* a[2] = {sc.ka[t], na > 1 ? sc.ka[t + 1] : nullptr};
        const int64_t la[2] = {sc.kld[t], na > 1 ? sc.kld[t + 1] : 0};
        const uint8_t* b[2] = {reinterpret_cast<const uint8_t*>(Qb + g * pairs * kGroup),
                               reinterpret_cast<const uint8_t*>(Qb + (g + nq - 1) * pairs * kGroup)};
        float* c[4] = {St + g * ldk * 16 + t * 256, St + (g + nq - 1) * ldk * 16 + t * 256,
                       St + g * ldk * 16 + (t + na - 1) * 256, St + (g + nq - 1) * ldk * 16 + (t + na - 1) * 256};
        amx_products<T>(na, nq, a, la, 64, b, 64, 1024, ksteps, c, 64, false);
      }
    }
    // online softmax per row group, down the keys (rows in the lanes); the probabilities over the scores
    for (int64_t g = 0; g < groups; ++g) {
      float* sg = St + g * ldk * 16;
      alignas(64) float visf[16], mof[16], lof[16], alf[16];
      int maxvis = 0;
      for (int i = 0; i < 16; ++i) {
        const int64_t r = g * 16 + i;
        const int v = r < rows ? (int)std::clamp<int64_t>(lim[r] - n0, 0, nb) : 0;
        visf[i] = (float)v, maxvis = std::max(maxvis, v);
        mof[i] = r < rows ? m[r] : kNegInf, lof[i] = r < rows ? l[r] : 0.f;
      }
      const __m512 visv = _mm512_load_ps(visf), mo = _mm512_load_ps(mof);
      __m512 bm = ninf;
      for (int j = 0; j < maxvis; ++j) {
        const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps((float)j), visv, _CMP_LT_OQ);
        const __m512 s = select_ps(ninf, live, _mm512_mul_ps(_mm512_loadu_ps(sg + 16 * j), sv));
        _mm512_storeu_ps(sg + 16 * j, s);
        bm = _mm512_max_ps(bm, s);
      }
      // raise the max where this block passes it by more than kLazyMax (from −inf: any visible key)
      const __mmask16 up = _mm512_cmp_ps_mask(bm, _mm512_add_ps(mo, _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
      const __mmask16 had = _mm512_cmp_ps_mask(mo, ninf, _CMP_GT_OQ);
      const __m512 mn = select_ps(mo, up, bm);
      const __m512 alpha = select_ps(_mm512_set1_ps(1.f), up, _mm512_maskz_mov_ps(had, exp512(_mm512_sub_ps(mo, mn))));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < maxvis; ++j) {
        const __m512 s = _mm512_loadu_ps(sg + 16 * j);
        const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf, _CMP_GT_OQ), exp512(_mm512_sub_ps(s, mn)));
        _mm512_storeu_ps(sg + 16 * j, p);
        sum = _mm512_add_ps(sum, p);
      }
      for (int64_t j = maxvis; j < ldk; ++j) _mm512_storeu_ps(sg + 16 * j, _mm512_setzero_ps());
      _mm512_store_ps(lof, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(lof), alpha), sum));
      _mm512_store_ps(mof, mn);
      _mm512_store_ps(alf, alpha);
      for (int i = 0; i < 16 && g * 16 + i < rows; ++i) {
        const int64_t r = g * 16 + i;
        m[r] = mof[i], l[r] = lof[i];
        if (alf[i] != 1.f) {  // the max moved: this row's output so far to the new max
          const __m512 av = _mm512_set1_ps(alf[i]);
          for (int64_t c = 0; c < Dv; c += 16) _mm512_storeu_ps(O + r * Dv + c, _mm512_mul_ps(_mm512_loadu_ps(O + r * Dv + c), av));
        }
      }
      // PV's A tiles: the group's probabilities as bf16 rows [16 rows][ldk32 keys] (zero past ldk)
      uint16_t* pg = sc.pbf.data() + g * 16 * ldk32;
      __m512 in[16], o[16];
      for (int64_t j0 = 0; j0 < ldk32; j0 += 16) {
        if (j0 >= ldk) {
          for (int r = 0; r < 16; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + r * ldk32 + j0), _mm256_setzero_si256());
          continue;
        }
        for (int i = 0; i < 16; ++i) in[i] = _mm512_loadu_ps(sg + (j0 + i) * 16);
        transpose16(in, o);  // o[r]: row r's probabilities of keys j0 .. j0 + 15
        for (int r = 0; r < 16; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + r * ldk32 + j0), bf16x16(o[r]));
      }
    }
    // PV's B tiles: V's key pairs interleaved, [ldk32 / 2][Dv] units (zero past the block)
    uint32_t* Vp = sc.vp.data();
    for (int64_t i = 0; i < ldk32 / 2; ++i) {
      const int64_t j = 2 * i;
      const uint16_t* v0 = j < nb ? reinterpret_cast<const uint16_t*>(sc.vrow[j]) : nullptr;
      const uint16_t* v1 = j + 1 < nb ? reinterpret_cast<const uint16_t*>(sc.vrow[j + 1]) : nullptr;
      for (int64_t c = 0; c < Dv; c += 16) {
        const __m256i x0 = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c)) : _mm256_setzero_si256();
        const __m256i x1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c)) : _mm256_setzero_si256();
        _mm512_storeu_si512(reinterpret_cast<void*>(Vp + i * Dv + c),
                            _mm512_permutex2var_epi16(_mm512_castsi256_si512(x0), pair_idx, _mm512_castsi256_si512(x1)));
      }
    }
    const int64_t lp = ldk32 * 2;
    for (int64_t g = 0; g < groups; g += 2) {
      const int na = (int)std::min<int64_t>(2, groups - g);
      const uint8_t* a[2] = {reinterpret_cast<const uint8_t*>(sc.pbf.data() + g * 16 * ldk32),
                             reinterpret_cast<const uint8_t*>(sc.pbf.data() + (g + na - 1) * 16 * ldk32)};
      const int64_t la[2] = {lp, lp};
      for (int64_t ct = 0; ct < ctiles; ct += 2) {
        const int nc = (int)std::min<int64_t>(2, ctiles - ct);
        const uint8_t* b[2] = {reinterpret_cast<const uint8_t*>(Vp + ct * 16),
                               reinterpret_cast<const uint8_t*>(Vp + (ct + nc - 1) * 16)};
        float* c[4] = {O + g * 16 * Dv + ct * 16, O + g * 16 * Dv + (ct + nc - 1) * 16,
                       O + (g + na - 1) * 16 * Dv + ct * 16, O + (g + na - 1) * 16 * Dv + (ct + nc - 1) * 16};
        amx_products<T>(na, nc, a, la, 64, b, Dv * 4, 16 * Dv * 4, ldk32 / 32, c, Dv * 4, true);
      }
    }
  }
  T::release();
  for (int r = 0; r < rows; ++r) std::memcpy(A + r * lda, O + r * Dv, Dv * sizeof(float));
}

// The QK / PV instruction of a call (cpu_attn_isa, as isa.cpp's rule for the weights), for a bf16 cache
// whose key rows have an even length: AMX tiles (key dims a multiple of 32, value dims of 16), else
// vdpbf16ps, each on its C++ model under emulation; asked for (amx: AMX where it runs, else as avx512bf16;
// avx512bf16), or with auto where the queries hold bf16 values already (nothing is rounded that the model
// did not round: only the probabilities are, before the PV product). Else float32 FMAs.
int attn_dot(const Knobs& kn, bool bf16_cache, int64_t Dk, int64_t Dv, const float* q, int64_t n) {
  if (!bf16_cache || Dk % 2 != 0 || kn.attn_isa == kAttnIsaAvx512) return kNoDot;
  const unsigned have = usable_features(), emu = emulated_features();
  const int x = (Dk % 32 != 0 || Dv % 16 != 0) ? kNoDot : (emu & kFeatAmx) ? kDotAmxModel : (have & kFeatAmx) ? kDotAmx : kNoDot;
  const int b = (emu & kFeatBf16) ? kDotModel : (have & kFeatBf16) ? kDotHw : kNoDot;
  const int d = kn.attn_isa == kAttnIsaDot ? b : x != kNoDot ? x : b;
  if (d == kNoDot || kn.attn_isa != kAttnIsaAuto) return d;
  __m512i low = _mm512_setzero_si512();  // auto: any query bits below a bf16's?
  for (int64_t i = 0; i < n; i += 16)
    low = _mm512_or_si512(low, _mm512_maskz_loadu_epi32(tail_mask16(n - i), q + i));
  return _mm512_test_epi32_mask(low, _mm512_set1_epi32(0xFFFF)) ? kNoDot : d;
}

inline unsigned attn_used(int dot) {
  return dot == kDotHw ? kUsedBf16 : dot == kDotModel ? kUsedBf16Model : dot == kDotAmx ? kUsedAmx
         : dot == kDotAmxModel ? kUsedAmxModel : kUsedAvx512;
}

// The rows' online-softmax state over keys [k0, k1) of one sequence. Qt: the pre-scaled queries in
// register groups, [rows / 16][Dk][16] (see pack_queries); lim[r]: row r sees keys n < lim[r];
// m, l [rows]; A [rows][lda] unnormalized output.
// The dot form (dot ≠ kNoDot, a bf16 cache): Qb the unscaled query rows as bf16 pairs in transposed
// register groups (pack_pairs_t), qscale applied to the scores; the block's keys transposed by pairs
// (transpose_pairs), the probabilities rounded to bf16 pairs, QK and PV on vdpbf16ps (attn_dot.inc).
template <int DT>
void attend(const float* Qt, const uint32_t* Qb, float qscale, int dot, int rows, const int64_t* lim,
            const KVSource& K, const KVSource& V, const int32_t* table, int64_t kvh, int64_t k0, int64_t k1,
            int64_t kv_block, bool blas, bool lanes, Scratch& sc, float* m, float* l, float* A, int64_t lda,
            int hint = kPrefetchNone) {
  if constexpr (DT == kBF16) {  // (attn_dot takes the AMX form for a bf16 cache only)
    if (dot == kDotAmx) return attend_amx<AmxHw>(Qb, qscale, rows, lim, K, V, table, kvh, k0, k1, kv_block, sc, m, l, A, lda);
    if (dot == kDotAmxModel)
      return attend_amx<AmxEmu>(Qb, qscale, rows, lim, K, V, table, kvh, k0, k1, kv_block, sc, m, l, A, lda);
  }
  const int64_t Dk = K.dim, Dv = V.dim, pairs = Dk / 2;
  if (dot) blas = false;
  // V the leading columns of the K rows (MLA's latent): one conversion serves both products.
  // (the head stride matters only with more than one KV head: MLA's views [.., 1, R + P] and [.., 1, R] of one
  // cache differ in it, and were taken for two sources until session 36)
  const bool v_in_k = V.base == K.base && V.sblock == K.sblock && V.stok == K.stok &&
                      (V.shead == K.shead || K.heads == 1) && Dv <= Dk;
  at::Tensor Qm;
  if (blas) {  // the BLAS form: row-major queries, blocks converted to float32 rows, QK and PV by sgemm
    __m512 t[16], o[16];  // Qt's [dim][16 rows] groups back to rows, 16 × 16 at a time
    for (int g0 = 0; g0 < rows; g0 += kGroup) {
      const float* qg = Qt + (g0 / kGroup) * Dk * kGroup;
      const int gr = std::min(kGroup, rows - g0);
      for (int64_t d0 = 0; d0 < Dk; d0 += 16) {
        const int64_t dn = std::min<int64_t>(16, Dk - d0);
        for (int d = 0; d < 16; ++d) t[d] = d < dn ? _mm512_loadu_ps(qg + (d0 + d) * kGroup) : _mm512_setzero_ps();
        transpose16(t, o);
        for (int r = 0; r < gr; ++r) _mm512_mask_storeu_ps(sc.q.data() + (g0 + r) * Dk + d0, tail_mask16(dn), o[r]);
      }
    }
    Qm = view2d(sc.q.data(), rows, Dk, Dk);
  }
  // cpu_attn_prefetch (the register forms): the next block's rows (nkrow, nvrow), prefetched while this block's
  // are read (auto: where V has rows of its own)
  if (hint == kAttnPrefetchAuto) hint = v_in_k ? kPrefetchNone : kPrefetchT1;
  if (blas || dot) hint = kPrefetchNone;
  auto rows_of = [&](int64_t n0, int nb, const uint8_t** kr, const uint8_t** vr) {
    for (int j = 0; j < nb; ++j) {
      kr[j] = K.row(table, n0 + j, kvh);
      vr[j] = V.row(table, n0 + j, kvh);
    }
  };
  if (k0 < k1) rows_of(k0, (int)std::min<int64_t>(kv_block, k1 - k0), sc.nkrow.data(), sc.nvrow.data());
  for (int64_t n0 = k0; n0 < k1; n0 += kv_block) {
    const int nb = (int)std::min<int64_t>(kv_block, k1 - n0);
    const int64_t ldk = (nb + 15) / 16 * 16;
    std::swap(sc.krow, sc.nkrow), std::swap(sc.vrow, sc.nvrow);  // the rows found one block ago
    const int nn = (int)std::clamp<int64_t>(k1 - n0 - kv_block, 0, kv_block);
    if (nn > 0) rows_of(n0 + kv_block, nn, sc.nkrow.data(), sc.nvrow.data());
    const Ahead knext{sc.nkrow.data(), nn, nn > 0 ? hint : (int)kPrefetchNone};
    const Ahead vnext{sc.nvrow.data(), nn, v_in_k || nn == 0 ? (int)kPrefetchNone : hint};
    float* S = sc.s.data();
    at::Tensor Vm;
    if (blas) {
      rows_to_f32<DT>(sc.krow.data(), nb, Dk, sc.kf.data());
      if (!v_in_k) rows_to_f32<DT>(sc.vrow.data(), nb, Dv, sc.vf.data());
      Vm = v_in_k ? view2d(sc.kf.data(), nb, Dv, Dk) : view2d(sc.vf.data(), nb, Dv, Dv);
      at::Tensor St = view2d(S, rows, nb, ldk);
      at::mm_out(St, Qm, view2d(sc.kf.data(), nb, Dk, Dk).t());
    } else if (dot) {
      transpose_pairs(sc.krow.data(), nb, pairs, sc.kp.data(), ldk);
      for (int g0 = 0; g0 < rows; g0 += kGroup) {
        const int G = std::min(kGroup, rows - g0);
        const uint32_t* Qg = Qb + g0 * pairs;  // group g0 / 16: pairs × 16 units
        if (dot == kDotHw) attn_hw::qk_dot<Bf16Hw>(G, Qg, sc.kp.data(), ldk, pairs, qscale, S + g0 * ldk, ldk);
        else attn_model::qk_dot<Bf16Model>(G, Qg, sc.kp.data(), ldk, pairs, qscale, S + g0 * ldk, ldk);
      }
    } else if (lanes) {  // QK, softmax and PV per register group, its rows in the lanes
      const int nbp = (int)ldk;
      keys_chunked<DT>(sc.krow.data(), nb, nbp, Dk, sc.kf.data(), knext);
      for (int g0 = 0; g0 < rows; g0 += kGroup) {
        const int G = std::min(kGroup, rows - g0);
        float* St = S + g0 * ldk;
        qk_lanes(Qt + g0 * Dk, sc.kf.data(), nbp, Dk, St);
        softmax_lanes(St, nb, G, lim + g0, n0, m + g0, l + g0, sc.alpha.data() + g0);
        if (!v_in_k) {  // (V's next rows: prefetched in the first register group's PV)
          Tiles<kGroup>::pv<DT>(G, St, sc.vrow.data(), nb, Dv, A + g0 * lda, lda, sc.alpha.data() + g0,
                                g0 == 0 ? vnext : Ahead{});
          continue;
        }
        // V the leading columns of the K rows: PV reads the same float32 chunks (no second conversion), the
        // value columns of one chunk at a time, its keys' rows kChunk floats apart
        for (int64_t c0 = 0; c0 < Dv; c0 += kChunk) {
          const float* kc = sc.kf.data() + (c0 / kChunk) * nbp * kChunk;
          for (int j = 0; j < nb; ++j) sc.vrow[j] = reinterpret_cast<const uint8_t*>(kc + j * kChunk);
          Tiles<kGroup>::pv<kF32>(G, St, sc.vrow.data(), nb, std::min<int64_t>(kChunk, Dv - c0), A + g0 * lda + c0, lda,
                                  sc.alpha.data() + g0);
        }
      }
      continue;
    } else {
      transpose_keys<DT>(sc.krow.data(), nb, Dk, sc.kt.data(), ldk, knext);
      for (int g0 = 0; g0 < rows; g0 += kGroup)
        Tiles<kGroup>::qk(std::min(kGroup, rows - g0), Qt + g0 * Dk, sc.kt.data(), ldk, Dk, S + g0 * ldk, ldk);
    }
    for (int r = 0; r < rows; ++r) {  // online softmax of this block, probabilities written over the scores
      float* sr = S + r * ldk;
      const int vis = (int)std::clamp<int64_t>(lim[r] - n0, 0, nb);
      if (vis == 0) {
        sc.alpha[r] = 1.f;
        std::fill(sr, sr + ldk, 0.f);
        continue;
      }
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int j = 0; j < vis; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask16(vis - j), sr + j));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      sc.alpha[r] = exp_scalar(m[r] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < ldk; j += 16) {
        const __mmask16 live = j < vis ? tail_mask16(vis - j) : (__mmask16)0;
        const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
        _mm512_storeu_ps(sr + j, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[r] = l[r] * sc.alpha[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
    }
    if (blas) {
      for (int r = 0; r < rows; ++r)
        if (sc.alpha[r] != 1.f) {
          const __m512 a = _mm512_set1_ps(sc.alpha[r]);
          for (int64_t c = 0; c < Dv; c += 16) {
            const __mmask16 mk = tail_mask16(Dv - c);
            _mm512_mask_storeu_ps(A + r * lda + c, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, A + r * lda + c), a));
          }
        }
      view2d(A, rows, Dv, lda).addmm_(view2d(S, rows, nb, ldk), Vm);
      continue;
    }
    if (dot) {
      uint32_t* Pb = sc.pb.data();
      for (int g0 = 0; g0 < rows; g0 += kGroup) {
        const int G = std::min(kGroup, rows - g0);
        const float* prow[kGroup];
        for (int g = 0; g < G; ++g) prow[g] = S + (g0 + g) * ldk;
        pack_pairs_t(prow, G, ldk, Pb);
        if (dot == kDotHw) attn_hw::pv_dot<Bf16Hw>(G, Pb, sc.vrow.data(), nb, Dv, A + g0 * lda, lda, sc.alpha.data() + g0);
        else attn_model::pv_dot<Bf16Model>(G, Pb, sc.vrow.data(), nb, Dv, A + g0 * lda, lda, sc.alpha.data() + g0);
      }
      continue;
    }
    for (int g0 = 0; g0 < rows; g0 += kGroup) {
      const int G = std::min(kGroup, rows - g0);
      transpose_probs(S + g0 * ldk, ldk, G, ldk, sc.pt.data());
      Tiles<kGroup>::pv<DT>(G, sc.pt.data(), sc.vrow.data(), nb, Dv, A + g0 * lda, lda, sc.alpha.data() + g0,
                            g0 == 0 ? vnext : Ahead{});
    }
  }
}

// Qt[(r / 16) * Dk * 16 + d * 16 + r % 16] = q_r[d] · scale; lanes past `rows` are zero. 16 rows ×
// 16 dims at a time through the in-register transpose.
inline void pack_queries(const float* const* q, int rows, int64_t Dk, float scale, float* Qt) {
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 r[16], o[16];
  for (int g0 = 0; g0 < rows; g0 += kGroup) {
    float* dst = Qt + (g0 / kGroup) * Dk * kGroup;
    for (int64_t d0 = 0; d0 < Dk; d0 += 16) {
      const __mmask16 m = tail_mask16(Dk - d0);
      for (int j = 0; j < 16; ++j)
        r[j] = g0 + j < rows ? _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q[g0 + j] + d0), sv) : _mm512_setzero_ps();
      transpose16(r, o);
      const int64_t dn = std::min<int64_t>(16, Dk - d0);
      for (int64_t d = 0; d < dn; ++d) _mm512_storeu_ps(dst + (d0 + d) * kGroup, o[d]);
    }
  }
}

// The new tokens' rows written into the cache (rows [T, W] any float dtype → the cache's dtype).
void write_rows(const at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots) {
  if (!rows.defined() || rows.numel() == 0) return;
  const int64_t W = cache.size(-1), T = rows.size(0);
  TORCH_CHECK(cache.is_contiguous(), "attention: the cache written must be contiguous");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == W && slots.numel() == T && slots.scalar_type() == at::kLong,
              "attention: new rows [T, ", W, "] and int64 slots [T] expected");
  const int64_t capacity = cache.numel() / W;
  const at::Tensor src = rows.to(cache.scalar_type()).contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t row_bytes = W * cache.element_size();
  uint8_t* dst = static_cast<uint8_t*>(cache.data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "attention: slot ", sl[t], " outside the cache (", capacity, ")");
    std::memcpy(dst + sl[t] * row_bytes, s + t * row_bytes, row_bytes);
  }
}

void check_tables(const int32_t* table, int64_t len, int64_t block_size, int64_t nblocks) {
  for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < nblocks, "attention: block id ", table[i], " outside [0, ", nblocks, ")");
}

template <int DT>
void decode_impl(const float* q, int64_t B, int64_t H, const KVSource& K, const KVSource& V, const int32_t* tables,
                 int64_t MB, const int32_t* lens, float scale, const Knobs& kn, float* out) {
  const int64_t Hkv = K.heads, Hg = H / Hkv, Dk = K.dim, Dv = V.dim;
  const int64_t threads = omp_get_max_threads();
  // Fewer (sequence, KV head, head block) tasks than threads (one sequence of MLA's 128 heads on one
  // latent head): the head blocks are halved first, down to one register group of heads, as a head block
  // needs no partial output and no merge (each block reads every key; attention decode is bound by its
  // products there). cpu_attn_head_fold stays the cap. Zen 4, 2 threads, 128 heads × 512 keys: 64-head
  // blocks ×1.16 one 128-head block cut into 2 key splits.
  int64_t hf = std::min(kn.attn_head_fold, Hg);
  while (hf / 2 >= kGroup && B * Hkv * ((Hg + hf - 1) / hf) < threads) hf /= 2;
  // the dot form (attn_dot): the query rows as bf16 pairs instead, rows × Dk / 2 units per head block
  const int dot = attn_dot(kn, DT == kBF16, Dk, Dv, q, B * H * Dk);
  // The packed form: P KV heads per task, all of their rows (hf = Hg ≤ 8), one register group.
  const int P = packed_heads(kn, hf == Hg ? Hg : kGroup, Hkv, dot != kNoDot);
  const int64_t Hp = Hkv / P;  // a task's KV heads: kvg · P ..
  const int64_t nhb = (Hg + hf - 1) / hf;
  // Splitting a sequence's keys only creates parallelism (and costs a partial output per piece, zeroed
  // and merged): at most attn_kv_splits pieces, and no more than the threads need beside the
  // (sequence, KV head, head block) tasks there already are (a batch of ≥ threads sequences: none).
  const int64_t groups = B * Hp * nhb;
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(kn.attn_kv_splits, (threads + groups - 1) / groups));
  const int64_t tasks = groups * S;
  // Split partials: the output rows are written before they are read (an empty split is never read),
  // so the buffer is reused across calls uninitialized.
  static thread_local std::vector<float> part_buf;  // the calling thread's; workers get the pointer
  Scratch::grow(part_buf, B * H * S * Dv);
  float* const part_acc = part_buf.data();
  std::vector<float> part_m(B * H * S, kNegInf), part_l(B * H * S, 0.f);
  // The packed queries of every (sequence, KV head (group), head block), once: the splits of one share them.
  const int64_t qsize = (hf * P + kGroup - 1) / kGroup * kGroup * Dk, nq = B * Hp * nhb;
  static thread_local std::vector<float> q_buf;
  Scratch::grow(q_buf, nq * qsize);
  float* const qpacked = q_buf.data();
  const int64_t qbsize = (hf + kGroup - 1) / kGroup * kGroup * (Dk / 2);
  static thread_local std::vector<uint32_t> qb_buf;
  if (dot) Scratch::grow(qb_buf, nq * qbsize);
  uint32_t* const qbpacked = qb_buf.data();
  note_used(attn_used(dot));
#pragma omp parallel
  {
    DenormalScope daz(dot == kDotModel);
    const bool blas = !dot && hf >= kn.attn_blas_rows;
    // keys per block, for the path taken (the sgemm and AMX forms convert whole blocks)
    const int64_t kvb = blas || dot >= kDotAmx ? kn.attn_blas_kv_block : kn.attn_decode_kv_block;
    // the register form's layout (rows below blas_rows): packed (P > 1), lanes, or transposed
    const bool lanes = !dot && (P > 1 || lanes_form(kn, hf));
    Scratch& sc = thread_scratch(hf * P, kvb, Dk, Dv, blas, dot, lanes, P);
    std::vector<const float*> qrow(hf);
    const int64_t nlim = std::max<int64_t>(hf, kGroup);  // the packed form's per lane
    std::vector<int64_t> lim(nlim);
    std::vector<float> m(nlim), l(nlim);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t hb = i % nhb, kvh = (i / nhb) % Hp * P, b = i / (nhb * Hp), h0 = kvh * Hg + hb * hf;
      if (P > 1) {
        pack_queries_packed(q + (b * H + h0) * Dk, P, (int)Hg, Dk, scale, qpacked + i * qsize);
        continue;
      }
      const int rows = (int)std::min(hf, kvh * Hg + Hg - h0);
      for (int r = 0; r < rows; ++r) qrow[r] = q + (b * H + h0 + r) * Dk;
      if (dot) pack_pairs_t(qrow.data(), rows, Dk, qbpacked + i * qbsize);
      else pack_queries(qrow.data(), rows, Dk, scale, qpacked + i * qsize);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t s = t % S, hb = (t / S) % nhb, kvh = (t / (S * nhb)) % Hp * P, b = t / (S * nhb * Hp);
      // Cut into at most S pieces, none shorter than one cache block (short contexts: fewer, fuller tasks);
      // the AMX form's blocks are long (cpu_attn_blas_kv_block) and its tiles cheap: pieces of ≥ 32 keys, in
      // whole 16-key tiles (one sequence of 16 heads × 140 keys on 2 threads: both threads work; the runner's
      // decode attention of `small`, 3 layers: 344 → 303 µs per step, session 15)
      const int64_t len = lens[b];
      const int64_t split = dot >= kDotAmx ? std::max<int64_t>(32, ((len + S - 1) / S + 15) / 16 * 16)
                                           : std::max<int64_t>(kvb, (len + S - 1) / S);
      const int64_t k0 = std::min(len, s * split), k1 = std::min(len, k0 + split);
      const int64_t h0 = kvh * Hg + hb * hf;
      // rows: in head order (the packed form: P heads' Hg rows each)
      const int rows = P > 1 ? (int)(P * Hg) : (int)std::min(hf, kvh * Hg + Hg - h0);
      const int64_t base = (b * H + h0) * S + s;  // partial index of (b, h0, s); heads step by S
      if (k1 <= k0) continue;
      std::fill(lim.begin(), lim.end(), len);
      const int64_t qi = (b * Hp + kvh / P) * nhb + hb;
      const float* Qt = qpacked + qi * qsize;
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      float* A = part_acc + base * Dv;
      for (int r = 0; r < rows; ++r) std::fill(A + r * S * Dv, A + r * S * Dv + Dv, 0.f);
      if (P > 1) {
        const int R = (int)Hg;
        if (P == 2) attend_packed<DT, 2>(Qt, R, lim.data(), K, V, tables + b * MB, kvh, k0, k1, kvb, sc, m.data(),
                                         l.data(), A, S * Dv, kn.attn_prefetch);
        else attend_packed<DT, 4>(Qt, R, lim.data(), K, V, tables + b * MB, kvh, k0, k1, kvb, sc, m.data(), l.data(),
                                  A, S * Dv, kn.attn_prefetch);
        for (int g = 0; g < rows; ++g) {  // lane g = p + P · r → row p · R + r
          const int64_t row = (g % P) * R + g / P;
          part_m[base + row * S] = m[g], part_l[base + row * S] = l[g];
        }
        continue;
      }
      attend<DT>(Qt, qbpacked + qi * qbsize, scale, dot, rows, lim.data(), K, V, tables + b * MB, kvh, k0, k1, kvb,
                 blas, lanes, sc, m.data(), l.data(), A, S * Dv, kn.attn_prefetch);
      for (int r = 0; r < rows; ++r) part_m[base + r * S] = m[r], part_l[base + r * S] = l[r];
    }
  }
  // Merge the splits: out = Σ_s e^{m_s − M} A_s / Σ_s e^{m_s − M} l_s.
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    float M = kNegInf;
    for (int64_t s = 0; s < S; ++s) M = std::max(M, part_m[bh * S + s]);
    float* o = out + bh * Dv;
    std::fill(o, o + Dv, 0.f);
    if (M == kNegInf) continue;  // no keys at all
    float denom = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const float w = exp_scalar(part_m[bh * S + s] - M);
      if (w == 0.f) continue;
      denom += w * part_l[bh * S + s];
      const float* a = part_acc + (bh * S + s) * Dv;
      for (int64_t c = 0; c < Dv; ++c) o[c] += w * a[c];
    }
    const float inv = 1.f / denom;
    for (int64_t c = 0; c < Dv; ++c) o[c] *= inv;
  }
}

template <int DT>
void extend_impl(const float* q, int64_t T, int64_t H, const KVSource& K, const KVSource& V, const int32_t* table,
                 int64_t kv_len, float scale, const Knobs& kn, float* out) {
  const int64_t Hkv = K.heads, Hg = H / Hkv, Dk = K.dim, Dv = V.dim, prefix = kv_len - T;
  const int64_t qb = kn.attn_extend_q_block, ntile = (T + qb - 1) / qb, tasks = ntile * H;
  const int dot = attn_dot(kn, DT == kBF16, Dk, Dv, q, T * H * Dk);
  note_used(attn_used(dot));
#pragma omp parallel
  {
    DenormalScope daz(dot == kDotModel);
    const bool blas = !dot && qb >= kn.attn_blas_rows;
    Scratch& sc = thread_scratch(qb, kn.attn_extend_kv_block, Dk, Dv, blas, dot, !dot && lanes_form(kn, qb));
    std::vector<float> Qt((qb + kGroup - 1) / kGroup * kGroup * Dk), A(qb * Dv), m(qb), l(qb);
    std::vector<uint32_t> Qb(dot ? (qb + kGroup - 1) / kGroup * kGroup * (Dk / 2) : 0);
    std::vector<const float*> qrow(qb);
    std::vector<int64_t> lim(qb);
    // The most expensive tiles (the last query rows see the most keys) are handed out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t tile = ntile - 1 - t / H, h = t % H, i0 = tile * qb;
      const int rows = (int)std::min(qb, T - i0);
      for (int r = 0; r < rows; ++r) {
        qrow[r] = q + ((i0 + r) * H + h) * Dk;
        lim[r] = prefix + i0 + r + 1;
        m[r] = kNegInf, l[r] = 0.f;
      }
      if (dot) pack_pairs_t(qrow.data(), rows, Dk, Qb.data());
      else pack_queries(qrow.data(), rows, Dk, scale, Qt.data());
      std::fill(A.begin(), A.begin() + rows * Dv, 0.f);
      attend<DT>(Qt.data(), Qb.data(), scale, dot, rows, lim.data(), K, V, table, h / Hg, 0, lim[rows - 1],
                 kn.attn_extend_kv_block, rows >= kn.attn_blas_rows && blas,
                 !dot && lanes_form(kn, rows), sc, m.data(), l.data(), A.data(), Dv);
      for (int r = 0; r < rows; ++r) {
        float* o = out + ((i0 + r) * H + h) * Dv;
        const float inv = 1.f / l[r];
        for (int64_t c = 0; c < Dv; ++c) o[c] = A[r * Dv + c] * inv;
      }
    }
  }
}

void check_kv(const at::Tensor& k, const at::Tensor& v, const KVSource& K, const KVSource& V, int64_t H) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "attention: K and V must both be float32 or bfloat16");
  TORCH_CHECK(K.heads == V.heads && K.block_size == V.block_size && K.heads >= 1 && H % K.heads == 0,
              "attention: query heads must be a multiple of the KV heads");
}

}  // namespace

// Decode: q [B, H, Dk] float32; k [NB, BS, Hkv, Dk], v [NB, BS, Hkv, Dv] (views, may share storage);
// tables [B, MB] int32; lens [B] int32. Optionally first writes rows [T, W] into `cache` at slots [T]
// (the step's new tokens; cache is the contiguous tensor k/v view). Returns [B, H, Dv] float32.
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                       const at::Tensor& lens, double scale, const at::Tensor& cache, const at::Tensor& rows,
                       const at::Tensor& slots, const Knobs& kn) {
  kn.check();
  reset_used();
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "attn_decode: q [B, H, Dk] float32");
  if (cache.defined() && cache.numel() > 0) write_rows(cache, rows, slots);
  const KVSource K = kv_source(k, "attn_decode k"), V = kv_source(v, "attn_decode v");
  const int64_t B = q.size(0), H = q.size(1);
  check_kv(k, v, K, V, H);
  TORCH_CHECK(q.size(2) == K.dim, "attn_decode: q has ", q.size(2), " dims, keys ", K.dim);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kInt && lens.numel() == B &&
                  lens.scalar_type() == at::kInt,
              "attn_decode: block_tables [B, MB] and seq_lens [B] int32");
  const int32_t *tb = tables.data_ptr<int32_t>(), *ln = lens.data_ptr<int32_t>();
  const int64_t MB = tables.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 0 && ln[b] <= MB * K.block_size, "attn_decode: seq_len ", ln[b], " exceeds its block table");
    check_tables(tb + b * MB, ln[b], K.block_size, K.nblocks);
  }
  at::Tensor out = at::empty({B, H, V.dim}, at::kFloat);
  if (k.scalar_type() == at::kBFloat16)
    decode_impl<kBF16>(q.data_ptr<float>(), B, H, K, V, tb, MB, ln, (float)scale, kn, out.data_ptr<float>());
  else
    decode_impl<kF32>(q.data_ptr<float>(), B, H, K, V, tb, MB, ln, (float)scale, kn, out.data_ptr<float>());
  return out;
}

// Extend: q [T, H, Dk] float32 (the last T of kv_len keys); k/v as attn_decode; table [MB] int32.
// Query i sees keys 0 .. kv_len − T + i. Returns [T, H, Dv] float32.
at::Tensor attn_extend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                       int64_t kv_len, double scale, const Knobs& kn) {
  kn.check();
  reset_used();
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "attn_extend: q [T, H, Dk] float32");
  const KVSource K = kv_source(k, "attn_extend k"), V = kv_source(v, "attn_extend v");
  const int64_t T = q.size(0), H = q.size(1);
  check_kv(k, v, K, V, H);
  TORCH_CHECK(q.size(2) == K.dim, "attn_extend: q has ", q.size(2), " dims, keys ", K.dim);
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous(), "attn_extend: block table int32");
  TORCH_CHECK(kv_len >= T && kv_len <= table.numel() * K.block_size, "attn_extend: kv_len ", kv_len,
              " must be ≥ the new tokens (", T, ") and fit the block table");
  check_tables(table.data_ptr<int32_t>(), kv_len, K.block_size, K.nblocks);
  at::Tensor out = at::empty({T, H, V.dim}, at::kFloat);
  if (T == 0) return out;
  if (k.scalar_type() == at::kBFloat16)
    extend_impl<kBF16>(q.data_ptr<float>(), T, H, K, V, table.data_ptr<int32_t>(), kv_len, (float)scale, kn,
                       out.data_ptr<float>());
  else
    extend_impl<kF32>(q.data_ptr<float>(), T, H, K, V, table.data_ptr<int32_t>(), kv_len, (float)scale, kn,
                      out.data_ptr<float>());
  return out;
}

}  // namespace moetune
