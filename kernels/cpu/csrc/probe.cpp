// Machine limits for the roofline: streaming read bandwidth and peak arithmetic per ISA path.
#include <omp.h>
#include <chrono>
#include <cstdio>
#include "dot.h"
#include "ops.h"

namespace moetune {

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

// Seconds to read `buf` once with every thread (each a contiguous slice, 4 independent AVX-512
// accumulators); the sum is returned through `sink` so the loads are not optimised away.
double read_seconds(const at::Tensor& buf) {
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel();
  double sink = 0;
  const double t0 = now();
#pragma omp parallel reduction(+ : sink)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t chunk = (n / nt) & ~int64_t(63), b = id * chunk, e = id == nt - 1 ? n : b + chunk;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = b;
    for (; i + 64 <= e; i += 64) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
    }
    sink += hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  const double dt = now() - t0;
  if (sink == 1234.5) std::printf(" ");
  return dt;
}

// The same read as several interleaved streams per thread (each thread's slice cut into `streams`
// parts read in lockstep) with software prefetch `prefetch_bytes` ahead of each: the access pattern
// of the kernels (several weight rows at a time), which the plain sequential read can under-measure.
double read_seconds_streams(const at::Tensor& buf, int64_t streams, int64_t prefetch_bytes) {
  TORCH_CHECK(streams >= 1 && streams <= 16 && prefetch_bytes >= 0, "read_seconds_streams: 1..16 streams");
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel(), ahead = prefetch_bytes / 4;
  double sink = 0;
  const double t0 = now();
#pragma omp parallel reduction(+ : sink)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t chunk = (n / nt) & ~int64_t(63), b = id * chunk;
    const int64_t part = (chunk / streams) & ~int64_t(15);
    __m512 acc[16];
    for (int s = 0; s < streams; ++s) acc[s] = _mm512_setzero_ps();
    for (int64_t i = 0; i < part; i += 16) {
      for (int s = 0; s < streams; ++s) {
        const float* q = p + b + s * part + i;
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T0);
        acc[s] = _mm512_add_ps(acc[s], _mm512_loadu_ps(q));
      }
    }
    __m512 t = _mm512_setzero_ps();
    for (int s = 0; s < streams; ++s) t = _mm512_add_ps(t, acc[s]);
    sink += hsum(t);
  }
  const double dt = now() - t0;
  if (sink == 1234.5) std::printf(" ");
  return dt;
}

// The read as `streams` interleaved streams per thread, each reading `lines` consecutive 64-byte lines
// per step (wider unrolling: more loads in flight per stream), with software prefetch
// `prefetch_bytes` ahead (0: none) and optionally non-temporal loads (vmovntdqa). The probe tries
// several of these and keeps the best as the machine's read limit.
double read_seconds_method(const at::Tensor& buf, int64_t streams, int64_t lines, int64_t prefetch_bytes,
                           bool nontemporal) {
  TORCH_CHECK(streams >= 1 && streams <= 16 && lines >= 1 && lines <= 8 && prefetch_bytes >= 0,
              "read_seconds_method: 1..16 streams, 1..8 lines per step");
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel(), ahead = prefetch_bytes / 4, step = 16 * lines;
  double sink = 0;
  const double t0 = now();
#pragma omp parallel reduction(+ : sink)
  {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t chunk = (n / nt) & ~int64_t(127), b = id * chunk;
    const int64_t part = (chunk / streams) / step * step;
    __m512i acc[16];
    for (int s = 0; s < streams; ++s) acc[s] = _mm512_setzero_si512();
    for (int64_t i = 0; i < part; i += step) {
      for (int s = 0; s < streams; ++s) {
        const float* q = p + b + s * part + i;
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(q + ahead), _MM_HINT_T0);
        for (int l = 0; l < lines; ++l) {
          const __m512i v = nontemporal ? _mm512_stream_load_si512((void*)(q + 16 * l))
                                        : _mm512_loadu_si512((const void*)(q + 16 * l));
          acc[s] = _mm512_xor_si512(acc[s], v);
        }
      }
    }
    __m512i t = _mm512_setzero_si512();
    for (int s = 0; s < streams; ++s) t = _mm512_xor_si512(t, acc[s]);
    sink += (double)_mm512_reduce_add_epi32(t);
  }
  const double dt = now() - t0;
  if (sink == 1234.5) std::printf(" ");
  return dt;
}

// GFLOP/s of `iters` rounds of 12 independent FP32 FMA vectors per thread (2 flops × 16 lanes). The AVX2
// build runs it on 256-bit registers (2 flops × 8 lanes): its 512-bit model holds 12 vectors as 24 ymm, more
// than AVX2's 16, and the spilled loop measured half the peak (45 against 93 GFLOP/s per core on a Zen 3).
double fma_gflops(int64_t iters) {
  double sink = 0;
  const double t0 = now();
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
    threads = omp_get_num_threads();
#ifdef MOETUNE_AVX2_BUILD
    __m256 a[12];
    for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_ps(1.f + j * 1e-3f);
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
    for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
    __m256 s = a[0];
    for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, a[j]);
    sink += hsum8(s);
#else
    __m512 a[12];
    for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_ps(1.f + j * 1e-3f);
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
    for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], m, c);
    __m512 s = a[0];
    for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, a[j]);
    sink += hsum(s);
#endif
  }
  const double dt = now() - t0;
  if (sink == 1234.5) std::printf(" ");
  return 2.0 * (kAvx2Build ? 8 : 16) * 12 * iters * threads / dt / 1e9;
}

// Independent chains the 512-bit integer and BF16 dot-product peaks run per thread: Intel's two 512-bit ports
// take one vpmaddwd / vpdpbusd / vdpbf16ps each per cycle at a latency of 5, so a peak needs 10 in flight (8
// measured 754 GOP/s of vpdpbusd on an Emerald Rapids VM, AVX512-BF16 and AMX hidden, where the INT8 GEMM then
// ran 884; 16 measure 1279).
constexpr int kDotChains = 16;

// GOP/s (multiply-adds × 2) of vpmaddwd on int16 (32 products; the INT8 path without VNNI), kDotChains
// independent chains, each product the next one's input (the int32 sums read again as int16 pairs); in the
// AVX2 build 8 chains on 256-bit registers (16 products), as fma_gflops. (Before: a[j] += madd(w, x) with the
// same w and x for every j, which GCC computed once per round: it timed one vpmaddwd and 8 vpaddd.)
double int16_madd_gops(int64_t iters) {
  int64_t sink = 0;
  const double t0 = now();
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
    threads = omp_get_num_threads();
#ifdef MOETUNE_AVX2_BUILD
    __m256i a[8];
    const __m256i w = _mm256_set1_epi16(3);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_set1_epi32(j);
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) a[j] = _mm256_madd_epi16(a[j], w);
    }
    for (int j = 1; j < 8; ++j) a[0] = _mm256_add_epi32(a[0], a[j]);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a[0]);
    for (int j = 0; j < 8; ++j) sink += lanes[j];
#else
    __m512i a[kDotChains];
    const __m512i w = _mm512_set1_epi16(3);
    for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_set1_epi32(j);
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_madd_epi16(a[j], w);
    }
    for (int j = 1; j < kDotChains; ++j) a[0] = _mm512_add_epi32(a[0], a[j]);
    sink += _mm512_reduce_add_epi32(a[0]);
#endif
  }
  const double dt = now() - t0;
  if (sink == 12345) std::printf(" ");
  return 2.0 * (kAvx2Build ? 16 * 8 : 32 * kDotChains) * iters * threads / dt / 1e9;
}

// GOP/s of vpdpbusd (AVX512-VNNI: 64 u8 × s8 multiply-adds per instruction), kDotChains chains per thread.
MOETUNE_TARGET_VNNI double vnni_int8_gops(int64_t iters) {
  TORCH_CHECK(usable_features() & kFeatVnni, "this CPU has no AVX512-VNNI (or it is masked off)");
#ifdef MOETUNE_AVX2_BUILD
  return 0;  // unreachable: the AVX2 build reports no VNNI
#else
  int64_t sink = 0;
  const double t0 = now();
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
    threads = omp_get_num_threads();
    __m512i a[kDotChains];
    const __m512i w = _mm512_set1_epi8(3);
    for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_set1_epi32(j);
    __m512i x = _mm512_set1_epi8(1);
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_dpbusd_epi32(a[j], x, w);
      x = _mm512_xor_si512(x, w);
    }
    for (int j = 1; j < kDotChains; ++j) a[0] = _mm512_add_epi32(a[0], a[j]);
    sink += _mm512_reduce_add_epi32(a[0]);
  }
  const double dt = now() - t0;
  if (sink == 12345) std::printf(" ");
  return 2.0 * 64 * kDotChains * iters * threads / dt / 1e9;
#endif
}

// GFLOP/s of vdpbf16ps (AVX512-BF16: 32 bf16 multiply-adds per instruction), kDotChains chains per thread.
MOETUNE_TARGET_BF16 double bf16_dot_gflops(int64_t iters) {
  TORCH_CHECK(usable_features() & kFeatBf16, "this CPU has no AVX512-BF16 (or it is masked off)");
#ifdef MOETUNE_AVX2_BUILD
  return 0;  // unreachable: the AVX2 build reports no AVX512-BF16
#else
  double sink = 0;
  const double t0 = now();
  int threads = 1;
#pragma omp parallel reduction(+ : sink)
  {
    threads = omp_get_num_threads();
    __m512 a[kDotChains];
    for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_set1_ps(1.f + j * 1e-3f);
    const __m512i m = _mm512_set1_epi16(0x3F80), c = _mm512_set1_epi16(0x3000);  // bf16 1.0, 2^-31
    for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < kDotChains; ++j) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)m, (__m512bh)c);
    __m512 s = a[0];
    for (int j = 1; j < kDotChains; ++j) s = _mm512_add_ps(s, a[j]);
    sink += hsum(s);
  }
  const double dt = now() - t0;
  if (sink == 1234.5) std::printf(" ");
  return 2.0 * 32 * kDotChains * iters * threads / dt / 1e9;
#endif
}

}  // namespace moetune
