// The AMX tile registers, shared by the tile GEMM (amx.cpp) and attention's AMX form (attention.cpp): the
// tile configuration, the instructions as GCC's intrinsics (AmxHw: compiled with a function-level target,
// run only where cpuid reports AMX and Linux grants the tile state, amx_unavailable()) and a plain C++
// model of the same registers and instructions (AmxEmu), so that every tile kernel's logic is tested on
// every machine. Included inside an anonymous namespace of moetune.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace moetune {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig full_tiles() {  // every tile 16 rows × 64 bytes
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  return c;
}

#define MOETUNE_AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))

// GCC's tile intrinsics paste the register number into the instruction text, so each takes a
// literal: the template parameter selects one of the literal forms.
#define MOETUNE_TILE_CASES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
struct AmxHw {
  MOETUNE_AMX static void config(const TileConfig* c) { _tile_loadconfig(c); }
  MOETUNE_AMX static void release() { _tile_release(); }
  template <int T> MOETUNE_AMX static void zero() {
#define MOETUNE_Z(i) if constexpr (T == i) _tile_zero(i);
    MOETUNE_TILE_CASES(MOETUNE_Z)
#undef MOETUNE_Z
  }
  template <int T> MOETUNE_AMX static void load(const void* p, int64_t stride) {
#define MOETUNE_L(i) if constexpr (T == i) _tile_loadd(i, p, stride);
    MOETUNE_TILE_CASES(MOETUNE_L)
#undef MOETUNE_L
  }
  template <int T> MOETUNE_AMX static void store(void* p, int64_t stride) {
#define MOETUNE_S(i) if constexpr (T == i) _tile_stored(i, p, stride);
    MOETUNE_TILE_CASES(MOETUNE_S)
#undef MOETUNE_S
  }
  // accumulators 0–3 against A tiles 4–5 and B tiles 6–7: the four products of the 2 × 2 block
  template <int C, int A, int B> MOETUNE_AMX static void dp_bf16() {
    static_assert(C == 2 * (A - 4) + (B - 6), "the 2 × 2 block's (C, A, B) triples only");
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (C == 3) _tile_dpbf16ps(3, 5, 7);
  }
  template <int C, int A, int B> MOETUNE_AMX static void dp_int8() {
    static_assert(C == 2 * (A - 4) + (B - 6), "the 2 × 2 block's (C, A, B) triples only");
    if constexpr (C == 0) _tile_dpbssd(0, 4, 6);
    if constexpr (C == 1) _tile_dpbssd(1, 4, 7);
    if constexpr (C == 2) _tile_dpbssd(2, 5, 6);
    if constexpr (C == 3) _tile_dpbssd(3, 5, 7);
  }
};

// The tile registers and the three instructions as the ISA reference defines them (16 rows × 64
// bytes; TDPBF16PS: C.fp32[m][n] += A.bf16[m][2k]·B.bf16[k][2n] + A.bf16[m][2k+1]·B.bf16[k][2n+1];
// TDPBSSD: C.int32[m][n] += Σ_j A.s8[m][4k+j]·B.s8[k][4n+j]).
struct AmxEmu {
  static inline thread_local uint8_t reg[8][16][64];
  static void config(const TileConfig*) { std::memset(reg, 0, sizeof(reg)); }
  static void release() {}
  template <int T> static void zero() { std::memset(reg[T], 0, sizeof(reg[T])); }
  template <int T> static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(reg[T][r], static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T> static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, reg[T][r], 64);
  }
  static float bf(const uint8_t* p) {
    uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  template <int C, int A, int B> static void dp_bf16() {
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float c;
        std::memcpy(&c, &reg[C][m][4 * n], 4);
        for (int k = 0; k < 16; ++k) {
          c += bf(&reg[A][m][4 * k]) * bf(&reg[B][k][4 * n]);
          c += bf(&reg[A][m][4 * k + 2]) * bf(&reg[B][k][4 * n + 2]);
        }
        std::memcpy(&reg[C][m][4 * n], &c, 4);
      }
  }
  template <int C, int A, int B> static void dp_int8() {
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t c;
        std::memcpy(&c, &reg[C][m][4 * n], 4);
        for (int k = 0; k < 16; ++k)
          for (int j = 0; j < 4; ++j) c += (int8_t)reg[A][m][4 * k + j] * (int8_t)reg[B][k][4 * n + j];
        std::memcpy(&reg[C][m][4 * n], &c, 4);
      }
  }
};

// One product step of a block of NA ≤ 2 A tiles (tmm4 / 5) × NB ≤ 2 B tiles (tmm6 / 7) into the sum tiles
// 2i + j (tmm0-3): TDPBSSD (Int8) or TDPBF16PS.
template <class T, bool Int8, int C, int A, int B>
MOETUNE_AMX inline void tile_dp() {
  if constexpr (Int8) T::template dp_int8<C, A, B>();
  else T::template dp_bf16<C, A, B>();
}
template <class T, bool Int8, int NA, int NB>
MOETUNE_AMX inline void tile_products() {
  tile_dp<T, Int8, 0, 4, 6>();
  if constexpr (NB > 1) tile_dp<T, Int8, 1, 4, 7>();
  if constexpr (NA > 1) tile_dp<T, Int8, 2, 5, 6>();
  if constexpr (NA > 1 && NB > 1) tile_dp<T, Int8, 3, 5, 7>();
}

}  // namespace
}  // namespace moetune
