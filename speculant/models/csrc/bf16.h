// bf16 helpers shared by the kernels.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace speculant {

inline uint16_t to_bf16(float f) {  // round to nearest even, as PyTorch does
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return u >> 16;
}

inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 values → fp32
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)p));
}

}  // namespace speculant
