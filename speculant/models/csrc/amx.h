// What the quantized-weight kernels share: the weights' prefetch, the tile configuration and Linux's
// permission to use the tiles.
#pragma once
#include <cpuid.h>
#include <immintrin.h>
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

namespace speculant {

// Each thread streams its blocks' weights from memory, and at one row per pass the work per group is
// too short for the hardware prefetcher to keep enough lines in flight: the weights are requested this
// far ahead of the group being unpacked, to L1 (the distance that did best of those tried).
constexpr int64_t kPrefetchBytes = 4096;

// Request the `bytes` of weights that lie kPrefetchBytes beyond `at`, to L1.
inline void prefetch_ahead(const uint8_t* at, int64_t bytes) {
  const char* ahead = (const char*)at + kPrefetchBytes;
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
}

#if defined(__AMX_TILE__)
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// GCC's _tile_loadconfig tells the compiler it reads only the configuration's first 8 bytes: once
// inlined into a loop the stores to the rest were dropped and the instruction faulted on garbage. The
// barrier makes every store to `cfg` happen first.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

#endif

inline bool amx_permitted() {
  // Linux hands out the tile state on request only (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Whether the caller allows AMX (native.py's level: SPECULANT_NATIVE=avx512 runs the vector kernels on an AMX CPU).
inline bool& amx_allowed() {
  static bool allowed = true;
  return allowed;
}

// Whether this CPU has AMX's bf16 tiles (CPUID leaf 7: AMX-BF16, AMX-TILE), Linux grants them, and they are allowed.
inline bool amx_usable() {
#if !defined(__AMX_TILE__)
  return false;  // a build without the tile instructions (the avx2 levels)
#endif
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1) && amx_permitted();
  }();
  return ok && amx_allowed();
}

}  // namespace speculant
