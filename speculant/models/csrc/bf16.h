// bf16 helpers shared by the kernels; the __m512 ones for the files built on AVX512 alone.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace speculant {

inline uint16_t to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return u >> 16;
}

#if defined(__AVX512F__)
// The mask of a vector's first min(left, 16) lanes: a row's last, partial vector.
inline __mmask16 lanes(int64_t left) { return vec::lanes(left); }

inline __m512 load_bf16(const uint16_t* p) { return vec::load_bf16(p).v; }  // 16 bf16 values → fp32

inline __m512 exp_ps(__m512 x) { return vec::exp({x}).v; }
#endif

}  // namespace speculant
