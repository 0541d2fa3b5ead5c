// Standalone measurement (not part of the engine): the BF16 expert GEMM of a prefill at 12 tokens per
// expert, `small`'s gate/up shape ([2816, 2048] x 64 experts, 740 MB, read from DRAM each repeat), on
// 2 OpenMP threads, in six forms. It asks whether a weight layout repacked at load (issue 14 item 3,
// what ik_llama.cpp's -rtr does for BF16: 16 rows interleaved by bf16 pair, each token's pair broadcast
// into 16-row accumulators) would beat the engine's dot-product microkernel on row-major weights.
//   mode 0: the engine's form: 4 rows x 6 tokens on vdpbf16ps, two token groups per tile, each tile
//           prefetching the next one's rows at the offset read into L1 (cpu_prefill_prefetch_hint=t0);
//   mode 1: row-major weights repacked per call (32 rows x 256 K into an L1 buffer) + broadcast form;
//   mode 2: as if repacked at load, 12 tokens per pass in 256-K blocks, 32-row tasks;
//   mode 3-5: as if repacked at load, 64-row tasks, each 6-token group over both 32-row blocks (the
//           second group from L2), full K, no software prefetch / prefetcht0 1 KiB / 4 KiB ahead;
//   mode 6: decode (1 token per expert) in the engine's form, 4 rows, prefetcht1 2 KiB ahead;
//   mode 9: decode in the engine's form with its default cpu_tile_rows=spread (each of the 4 rows' streams runs
//           through 16 consecutive rows of a 64-row task);
//   mode 7-8: decode on the layout as if repacked at load: 64-row tasks, four 16-row blocks (four streams),
//           no software prefetch / prefetcht1 2 KiB ahead.
// Modes 2-5 read the row-major values as if they were the repacked layout (the same bytes streamed and
// the same arithmetic, other values), so only modes 0 and 1 are compared for their results.
// Build and run (a CPU with AVX512-BF16; nothing else may run meanwhile):
//   g++ -O3 -mavx512f -mavx512bf16 -mavx512bw -mavx512vl -mfma -fopenmp bf16_r16_layout.cpp -o r16 && ./r16
// Figures: docs/cpu_kernels.md "Session 22".
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <chrono>
#include <algorithm>
#include <cmath>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
constexpr int E = 64, N = 2816, K = 2048, T = 12;
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// dot form: 4 rows x 6 tokens, two groups, tiles order, prefetcht0 next tile at offset
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void dot_tile(const uint16_t* w, const uint16_t* const* x, int ntok, float* out, const uint16_t* next) {
  __m512 acc[4][6];
  for (int r = 0; r < 4; ++r) for (int m = 0; m < 6; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __m512i wr[4];
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch((const char*)(next + r * K + k), _MM_HINT_T0);
      wr[r] = _mm512_loadu_si512(w + r * K + k);
    }
    for (int m = 0; m < 6; ++m) {
      __m512i xm = _mm512_loadu_si512(x[m] + k);
      for (int r = 0; r < 4; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)wr[r], (__m512bh)xm);
    }
  }
  for (int r = 0; r < 4; ++r) for (int m = 0; m < 6; ++m) out[m * N + r] = hsum(acc[r][m]);
}

// broadcast form on a repacked block: 32 rows, K block KB; buf[kp][32] uint32 (pairs)
constexpr int KB = 256;
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void repack32(const uint16_t* w, int k0, uint32_t* buf) {
  // buf[kp*32 + r] = pair (k0+2kp, k0+2kp+1) of row r
  for (int half = 0; half < 2; ++half) {
    for (int kp0 = 0; kp0 < KB / 2; kp0 += 16) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(w + (size_t)(half * 16 + r) * K + k0 + 2 * kp0);
      // 16x16 transpose of 32-bit
      __m512i t[16];
      for (int i = 0; i < 8; ++i) { t[2*i] = _mm512_unpacklo_epi32(v[2*i], v[2*i+1]); t[2*i+1] = _mm512_unpackhi_epi32(v[2*i], v[2*i+1]); }
      for (int i = 0; i < 4; ++i) {
        v[4*i+0] = _mm512_unpacklo_epi64(t[4*i+0], t[4*i+2]); v[4*i+1] = _mm512_unpackhi_epi64(t[4*i+0], t[4*i+2]);
        v[4*i+2] = _mm512_unpacklo_epi64(t[4*i+1], t[4*i+3]); v[4*i+3] = _mm512_unpackhi_epi64(t[4*i+1], t[4*i+3]);
      }
      for (int i = 0; i < 2; ++i) for (int j = 0; j < 4; ++j) {
        t[8*i+j] = _mm512_shuffle_i32x4(v[8*i+j], v[8*i+4+j], 0x88); t[8*i+4+j] = _mm512_shuffle_i32x4(v[8*i+j], v[8*i+4+j], 0xDD);
      }
      for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[8+j], 0x88); v[8+j] = _mm512_shuffle_i32x4(t[j], t[8+j], 0xDD);
      }
      // v[i] now holds column kp0 + perm(i) for rows 0..15: store each to buf (perm resolved by the check)
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(buf + (size_t)(kp0 + i) * 32 + half * 16, v[i]);
    }
  }
}
int PERM[16];
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void dot4x1(const uint16_t* w, const uint16_t* x, float* out, const uint16_t* next, int stride = 1) {
  __m512 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    const __m512i xm = _mm512_loadu_si512(x + k);
    for (int r = 0; r < 4; ++r) {
      const uint16_t* row = w + (size_t)r * stride * K;
      _mm_prefetch((const char*)(row + k) + 2048, _MM_HINT_T1);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)xm);
    }
  }
  for (int r = 0; r < 4; ++r) out[r * stride] = hsum(acc[r]);
}
template <int PF>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void r16x64x1(const uint32_t* blk, const uint16_t* x, float* out) {  // 4 blocks of 16 rows, each [K/2][16]
  __m512 a[4];
  for (int b = 0; b < 4; ++b) a[b] = _mm512_setzero_ps();
  for (int kp = 0; kp < K / 2; ++kp) {
    const __m512i bx = _mm512_set1_epi32(*(const int32_t*)(x + 2 * kp));
    for (int b = 0; b < 4; ++b) {
      const uint32_t* p = blk + (size_t)b * 16 * (K / 2) + (size_t)kp * 16;
      if (PF) _mm_prefetch((const char*)p + PF, _MM_HINT_T1);
      a[b] = _mm512_dpbf16_ps(a[b], (__m512bh)_mm512_loadu_si512(p), (__m512bh)bx);
    }
  }
  for (int b = 0; b < 4; ++b) _mm512_storeu_ps(out + 16 * b, a[b]);
}
template <int PF>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void bcast32x6(const uint32_t* blk, const uint16_t* const* x, float* out) {
  __m512 a[6][2];
  for (int t = 0; t < 6; ++t) a[t][0] = a[t][1] = _mm512_setzero_ps();
  for (int kp = 0; kp < K / 2; ++kp) {
    const __m512i w0 = _mm512_loadu_si512(blk + (size_t)kp * 32), w1 = _mm512_loadu_si512(blk + (size_t)kp * 32 + 16);
    if (PF) { _mm_prefetch((const char*)(blk + (size_t)kp * 32) + PF, _MM_HINT_T0); _mm_prefetch((const char*)(blk + (size_t)kp * 32) + PF + 64, _MM_HINT_T0); }
    for (int t = 0; t < 6; ++t) {
      const __m512i b = _mm512_set1_epi32(*(const int32_t*)(x[t] + 2 * kp));
      a[t][0] = _mm512_dpbf16_ps(a[t][0], (__m512bh)w0, (__m512bh)b);
      a[t][1] = _mm512_dpbf16_ps(a[t][1], (__m512bh)w1, (__m512bh)b);
    }
  }
  for (int t = 0; t < 6; ++t) { _mm512_storeu_ps(out + t * N, a[t][0]); _mm512_storeu_ps(out + t * N + 16, a[t][1]); }
}
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void bcast_block(const uint32_t* buf, const uint16_t* const* x, int k0, __m512* acc /*[12][2]*/) {
  __m512 a[T][2];
  for (int t = 0; t < T; ++t) { a[t][0] = acc[2*t]; a[t][1] = acc[2*t+1]; }
  for (int kp0 = 0; kp0 < KB / 2; kp0 += 16)
    for (int i = 0; i < 16; ++i) {
      const int kp = kp0 + PERM[i];
      const __m512i w0 = _mm512_loadu_si512(buf + (size_t)(kp0 + i) * 32), w1 = _mm512_loadu_si512(buf + (size_t)(kp0 + i) * 32 + 16);
      for (int t = 0; t < T; ++t) {
        const __m512i b = _mm512_set1_epi32(*(const int32_t*)(x[t] + k0 + 2 * kp));
        a[t][0] = _mm512_dpbf16_ps(a[t][0], (__m512bh)w0, (__m512bh)b);
        a[t][1] = _mm512_dpbf16_ps(a[t][1], (__m512bh)w1, (__m512bh)b);
      }
    }
  for (int t = 0; t < T; ++t) { acc[2*t] = a[t][0]; acc[2*t+1] = a[t][1]; }
}

int main(int argc, char** argv) {
  const int reps = 8;
  size_t per = (size_t)N * K;
  uint16_t* W = (uint16_t*)aligned_alloc(2 << 20, per * E * 2);
  for (size_t i = 0; i < per * E; ++i) W[i] = 0x3f80 ^ (uint16_t)((i * 2654435761u) >> 20 & 0x80ff);
  std::vector<uint16_t> X((size_t)E * T * K);
  for (size_t i = 0; i < X.size(); ++i) X[i] = 0x3f00 + (uint16_t)(i * 40503u >> 9 & 0x7f);
  std::vector<float> O1((size_t)E * T * N), O2((size_t)E * T * N), O3((size_t)E * T * N);
  // PERM: which kp offset each transposed vector holds, found by transposing an index pattern
  {
    uint16_t idx[16 * K]; uint32_t b[KB / 2 * 32];
    for (int r = 0; r < 16; ++r) for (int k = 0; k < K; ++k) idx[r * K + k] = (uint16_t)(k / 2);
    std::vector<uint16_t> big(32 * K);
    for (int r = 0; r < 32; ++r) for (int k = 0; k < K; ++k) big[r * K + k] = (uint16_t)(k / 2);
    repack32(big.data(), 0, b);
    for (int i = 0; i < 16; ++i) PERM[i] = b[i * 32] & 0xffff;
  }
  for (int mode = 0; mode < 10; ++mode) {
    std::vector<double> ts;
    for (int rep = 0; rep < reps; ++rep) {
      // evict: touch a 64 MB buffer
      static std::vector<char> junk(64 << 20); for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
      double t0 = now();
      const int tasks = E * (N / 32);
#pragma omp parallel for schedule(dynamic, 1) num_threads(2)
      for (int task = 0; task < tasks; ++task) {
        const int e = task / (N / 32), n0 = (task % (N / 32)) * 32;
        const uint16_t* w = W + (size_t)e * per + (size_t)n0 * K;
        const uint16_t* x[T];
        for (int t = 0; t < T; ++t) x[t] = X.data() + ((size_t)e * T + t) * K;
        float* out = (mode == 0 ? O1.data() : mode == 1 ? O2.data() : O3.data()) + (size_t)e * T * N + n0;
        if (mode >= 6) {
          if (n0 % 64) continue;
          if (mode == 9) { for (int i = 0; i < 16; ++i) dot4x1(w + (size_t)i * K, x[0], out + i, nullptr, 16); }
          else if (mode == 6) { for (int r0 = 0; r0 < 64 && n0 + r0 < N; r0 += 4) dot4x1(w + (size_t)r0 * K, x[0], out + r0, w + (size_t)(r0 + 4) * K); }
          else if (n0 + 64 <= N) (mode == 7 ? r16x64x1<0> : r16x64x1<2048>)((const uint32_t*)w, x[0], out);
        } else if (mode >= 3) {
          if (n0 % 64) continue;  // 64-row chunks: each token group over both 32-row blocks
          for (int g = 0; g < 2; ++g)
            for (int b = 0; b < 2 && n0 + 32 * b < N; ++b)
              (mode == 3 ? bcast32x6<0> : mode == 4 ? bcast32x6<1024> : bcast32x6<4096>)(
                  (const uint32_t*)(w + (size_t)32 * b * K), x + 6 * g, out + 6 * g * N + 32 * b);
        } else if (mode == 0) {
          for (int r0 = 0; r0 < 32; r0 += 4) {
            const uint16_t* nx = w + (size_t)(r0 + 4) * K;
            dot_tile(w + (size_t)r0 * K, x, 6, out + r0, nx);
            dot_tile(w + (size_t)r0 * K, x + 6, 6, out + 6 * N + r0, nx);
          }
        } else {
          alignas(64) uint32_t buf[KB / 2 * 32];
          __m512 acc[2 * T];
          for (int i = 0; i < 2 * T; ++i) acc[i] = _mm512_setzero_ps();
          for (int k0 = 0; k0 < K; k0 += KB) {
            if (k0 + KB < K) for (int r = 0; r < 32; ++r) for (int l = 0; l < 2 * KB; l += 64) _mm_prefetch((const char*)(w + (size_t)r * K + k0 + KB) + l, _MM_HINT_T0);
            if (mode == 1) { repack32(w, k0, buf); bcast_block(buf, x, k0, acc); }
            else bcast_block((const uint32_t*)w + (size_t)(k0 / 2) * 32, x, k0, acc);  // as if repacked at load
          }
          for (int t = 0; t < T; ++t) {
            alignas(64) float tmp[32];
            _mm512_store_ps(tmp, acc[2 * t]); _mm512_store_ps(tmp + 16, acc[2 * t + 1]);
            for (int r = 0; r < 32; ++r) out[t * N + r] = tmp[r];
          }
        }
      }
      ts.push_back(now() - t0);
    }
    std::sort(ts.begin(), ts.end());
    double t = ts[ts.size() / 2];
    printf("mode %d (%2d tokens per expert): %.2f ms  %4.0f GFLOP/s  %.1f GB/s\n", mode, mode >= 6 ? 1 : T, t * 1e3,
           2.0 * E * N * K * (mode >= 6 ? 1 : T) / t / 1e9, 2.0 * per * E / t / 1e9);
  }
  double md = 0; for (size_t i = 0; i < O1.size(); ++i) md = std::max(md, (double)std::fabs(O1[i] - O2[i]) / (1e-3 + std::fabs(O1[i])));
  printf("modes 0 and 1 (same weights, same values): max relative difference %.3g\n", md);
}
