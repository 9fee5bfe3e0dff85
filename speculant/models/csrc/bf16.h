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

// The mask of a vector's first min(left, 16) lanes: a row's last, partial vector.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 values → fp32
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)p));
}

// e^x, x clamped to [−87, 88] (e^−87 is 0 next to any sum it joins, e^88 near fp32's largest): 2^n · p(r),
// r = x − n ln2 in [−ln2/2, ln2/2], degree-6 Taylor polynomial (relative error < 2e-7, far below bf16's).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace speculant
