// 16 lanes of fp32 or int32 (or 64 bytes), as the vector kernels compute them: one AVX512 register, or a pair
// of AVX2 ones where the module is built for the avx2 levels (native.py's LEVELS). Kernels written on these
// types build for every level; what only AVX512 has (AMX tiles, quantized.cpp's kernels) keeps its own files.
// Each level computes a row the same way at any row count: its bits may differ from another level's.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace speculant::vec {

// Partial vectors (a row's last 1..15 values) go through a 16-lane buffer on AVX2, masks on AVX512.
#if defined(__AVX512F__)

constexpr bool kAVX512 = true;
struct F { __m512 v; };
struct I { __m512i v; };

inline F zero() { return {_mm512_setzero_ps()}; }
inline F set(float x) { return {_mm512_set1_ps(x)}; }
inline F operator+(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F operator-(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F operator*(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F operator/(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F fmadd(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a·b + c
inline F fnmadd(F a, F b, F c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c − a·b
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F min(F a, F b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F abs(F a) { return {_mm512_abs_ps(a.v)}; }
inline float sum(F a) { return _mm512_reduce_add_ps(a.v); }
inline float top(F a) { return _mm512_reduce_max_ps(a.v); }
inline F round(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT)}; }
inline F scale2(F p, F n) { return {_mm512_scalef_ps(p.v, n.v)}; }  // p · 2^n, n integral

inline __mmask16 lanes(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F load(const float* p, int64_t n, float fill) { return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), lanes(n), p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline void store(float* p, F a, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline F keep(F a, int64_t n) { return {_mm512_maskz_mov_ps(lanes(n), a.v)}; }  // lanes n.. zeroed

inline F load_bf16(const uint16_t* p) { return {_mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)p))}; }
inline F load_bf16(const uint16_t* p, int64_t n, float fill) {
  const F v{_mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(lanes(n), p))};
  return {_mm512_mask_blend_ps(lanes(n), _mm512_set1_ps(fill), v.v)};
}
inline void store_bf16(uint16_t* p, F a) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(a.v)); }
inline void store_bf16(uint16_t* p, F a, int64_t n) {
  _mm256_mask_storeu_epi16(p, lanes(n), (__m256i)_mm512_cvtneps_pbh(a.v));
}
inline F load_fp16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }

// Lane masks as bits.
inline uint32_t ge(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ); }
inline uint32_t eq(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline uint32_t nan(F a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }

inline I zero_i() { return {_mm512_setzero_si512()}; }
inline I set8(int8_t x) { return {_mm512_set1_epi8(x)}; }
inline I set16(int16_t x) { return {_mm512_set1_epi16(x)}; }
inline I set32(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I load_bytes(const void* p) { return {_mm512_loadu_si512(p)}; }  // 64 bytes
inline I operator&(I a, I b) { return {_mm512_and_si512(a.v, b.v)}; }
inline I operator|(I a, I b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I shr16(I a, int n) { return {_mm512_srli_epi16(a.v, n)}; }
inline I shl16(I a, int n) { return {_mm512_slli_epi16(a.v, n)}; }
inline I add32(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I sub32(I a, I b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I mul32(I a, I b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline I widen_i8(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline I widen_u8(const uint8_t* p) { return {_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))}; }
inline F to_f(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I to_i(F a) { return {_mm512_cvtps_epi32(a.v)}; }  // nearest
inline int32_t sum_i(I a) { return _mm512_reduce_add_epi32(a.v); }
inline void store_i8(int8_t* p, I a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(a.v)); }

// acc + Σ of each lane's 4 products u·p (u unsigned bytes, p signed): VNNI's exact integer dot product.
// WIDE: u may pass 127 (only the AVX2 form without VNNI, whose 16-bit pair sums saturate, cares).
template <bool WIDE = false>
inline I dpbusd(I acc, I u, I p) { return {_mm512_dpbusd_epi32(acc.v, u.v, p.v)}; }

// acc + each lane's 2 products of int16 pairs a·b.
inline I dpwssd(I acc, I a, I b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
// Lane j: the int16 pair (p[j], p[16 + j]), two groups' bytes side by side; mul16 scales each int16.
inline I pair16(const uint8_t* p) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + 16));
  return {_mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)))};
}
inline I pair16(const int8_t* p) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + 16));
  return {_mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)))};
}
inline I mul16(I a, int16_t s) { return {_mm512_mullo_epi16(a.v, _mm512_set1_epi16(s))}; }

// Lane j: the sum of v[j]'s 16 lanes, for 16 vectors at once (a tree of shuffles, where 16 sums one at a
// time take 4 shuffles each).
inline F sums16(const F* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; i++)  // 256-bit halves: lanes 0-7 v[2i]'s, 8-15 v[2i+1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; i++)  // 128-bit quarters: v[4i] .. v[4i+3]'s
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  // pairs of lanes
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // The tree leaves v[j]'s sum in lane 4·(j mod 4) + (j / 4) permuted: put it back in lane j.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, z)};
}

// dpbusd of the dword at p broadcast: the broadcast folded into the instruction (the compiler keeps a load
// and a shuffle of its own apart).
template <bool WIDE = false>
inline I dpbusd_at(I acc, I u, const int32_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(u.v), "m"(*p));
  return acc;
}

// AVX2 without VNNI sums product pairs to 16 bits first (pairs, add16, widen): never used here.
constexpr bool kPairSums = false;
inline I pairs(I, I) { return zero_i(); }
inline I add16(I a, I) { return a; }
inline I chained(I a) { return a; }
inline I widen(I acc, I, I) { return acc; }
inline I each_twice(const int8_t*) { return zero_i(); }

// acc + each lane's pair q[2i]·k[2i] + q[2i+1]·k[2i+1] of 32 bf16 values.
inline F dot_bf16(F acc, const uint16_t* q, const uint16_t* k) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k))};
}

#else  // AVX2 (+ FMA, F16C), with AVX-VNNI where the build has it

constexpr bool kAVX512 = false;
struct F { __m256 lo, hi; };
struct I { __m256i lo, hi; };

inline F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F operator+(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F operator-(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F operator*(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F operator/(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F fnmadd(F a, F b, F c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F min(F a, F b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F abs(F a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
template <class Op>
inline float reduce(F a, Op op) {  // a tree over the 16 lanes
  __m256 v = op(a.lo, a.hi);
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  x = op(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
inline float sum(F a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_add_ps(x, y); else return _mm_add_ps(x, y);
  });
}
inline float top(F a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_max_ps(x, y); else return _mm_max_ps(x, y);
  });
}
inline F round(F a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
inline F scale2(F p, F n) {  // n in [−126, 127]: 2^n is a normal float built from its exponent bits
  auto pow2 = [](__m256 e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
  };
  return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))};
}

inline F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F load(const float* p, int64_t n, float fill) {
  if (n >= 16) return load(p);
  alignas(32) float b[16];
  for (int i = 0; i < 16; i++) b[i] = i < n ? p[i] : fill;
  return load(b);
}
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline void store(float* p, F a, int64_t n) {
  if (n >= 16) return store(p, a);
  alignas(32) float b[16];
  store(b, a);
  memcpy(p, b, 4 * n);
}
inline F keep(F a, int64_t n) {
  if (n >= 16) return a;
  const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_epi32((int32_t)n);
  const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, at));
  const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_add_epi32(at, _mm256_set1_epi32(8))));
  return {_mm256_and_ps(a.lo, lo), _mm256_and_ps(a.hi, hi)};
}

inline __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline F load_bf16(const uint16_t* p) {
  return {bf16x8(_mm_loadu_si128((const __m128i*)p)), bf16x8(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline F load_bf16(const uint16_t* p, int64_t n, float fill) {
  if (n >= 16) return load_bf16(p);
  alignas(32) uint16_t b[16] = {};
  memcpy(b, p, 2 * n);
  const F v = load_bf16(b), live = keep(set(-1.f), n);  // sign bits set in the lanes below n
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), v.lo, live.lo), _mm256_blendv_ps(_mm256_set1_ps(fill), v.hi, live.hi)};
}
// Round to nearest even, as AVX512-BF16's conversion and PyTorch do.
inline __m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
}
inline void store_bf16(uint16_t* p, F a) {
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi));  // lanes 0-3, 8-11, 4-7, 12-15
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
}
inline void store_bf16(uint16_t* p, F a, int64_t n) {
  if (n >= 16) return store_bf16(p, a);
  alignas(32) uint16_t b[16];
  store_bf16(b, a);
  memcpy(p, b, 2 * n);
}
inline F load_fp16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}

inline uint32_t bits(__m256 lo, __m256 hi) {
  return (uint32_t)_mm256_movemask_ps(lo) | (uint32_t)_mm256_movemask_ps(hi) << 8;
}
inline uint32_t ge(F a, F b) { return bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)); }
inline uint32_t eq(F a, F b) { return bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)); }
inline uint32_t nan(F a) { return bits(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }

inline I zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I set8(int8_t x) { return {_mm256_set1_epi8(x), _mm256_set1_epi8(x)}; }
inline I set16(int16_t x) { return {_mm256_set1_epi16(x), _mm256_set1_epi16(x)}; }
inline I set32(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I load_bytes(const void* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
}
inline I operator&(I a, I b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I operator|(I a, I b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline I shr16(I a, int n) {
  const __m128i c = _mm_cvtsi32_si128(n);
  return {_mm256_srl_epi16(a.lo, c), _mm256_srl_epi16(a.hi, c)};
}
inline I shl16(I a, int n) {
  const __m128i c = _mm_cvtsi32_si128(n);
  return {_mm256_sll_epi16(a.lo, c), _mm256_sll_epi16(a.hi, c)};
}
inline I add32(I a, I b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I sub32(I a, I b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline I mul32(I a, I b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline I widen_i8(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)), _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
inline I widen_u8(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)))};
}
inline F to_f(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I to_i(F a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline int32_t sum_i(I a) {
  __m256i v = _mm256_add_epi32(a.lo, a.hi);
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}
inline void store_i8(int8_t* p, I a) {  // saturating, lanes in order
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
  _mm_storeu_si128((__m128i*)p, _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}

// Without VNNI, each 16-bit lane of pairs(u, p) is u·p summed over a byte pair (exact while it stays within
// ±32767), add16 sums such lanes, and widen adds them to acc's 32-bit lanes in pairs: ggml_mm sums several
// vectors' pairs before one widening, where dpbusd widens each.
#if defined(__AVXVNNI__)
constexpr bool kPairSums = false;
#else
constexpr bool kPairSums = true;
#endif
inline I pairs(I u, I p) { return {_mm256_maddubs_epi16(u.lo, p.lo), _mm256_maddubs_epi16(u.hi, p.hi)}; }
inline I add16(I a, I b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
// a, opaque to the compiler: a chain of integer sums stays a chain. Reassociated into a tree, its products
// all come first and spill from AVX2's 16 registers.
inline I chained(I a) {
  __asm__("" : "+x"(a.lo), "+x"(a.hi));
  return a;
}
// acc + each 32-bit lane's int16 pair of s summed, times that lane's int16 pair of w (a value twice: a
// sub-scale, which then costs no multiply of its own, or 1).
inline I widen(I acc, I s, I w) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(s.lo, w.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(s.hi, w.hi))};
}
// Lane j: the int16 pair (p[j], p[j]).
inline I each_twice(const int8_t* p) {
  const I x = widen_i8(p);
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  return {_mm256_or_si256(_mm256_and_si256(x.lo, low), _mm256_slli_epi32(x.lo, 16)),
          _mm256_or_si256(_mm256_and_si256(x.hi, low), _mm256_slli_epi32(x.hi, 16))};
}

inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i p) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, p);
#else  // pairs of products summed to 16 bits (exact while u ≤ 127 and |p| ≤ 127), then pairs of those
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, p), _mm256_set1_epi16(1)));
#endif
}
// acc + Σ of each lane's 4 products u·p (u unsigned bytes, p signed): VNNI's exact integer dot product.
// WIDE: u may pass 127; without VNNI its top bit is then taken apart (u = (u & 127) + 128·(u >> 7)).
template <bool WIDE = false>
inline I dpbusd(I acc, I u, I p) {
#if !defined(__AVXVNNI__)
  if constexpr (WIDE) {
    const I low = u & set8(0x7F), top = shr16(u, 7) & set8(1);
    const I high = dpbusd<false>(zero_i(), top, p);
    const __m128i seven = _mm_cvtsi32_si128(7);
    acc = dpbusd<false>(acc, low, p);
    return {_mm256_add_epi32(acc.lo, _mm256_sll_epi32(high.lo, seven)), _mm256_add_epi32(acc.hi, _mm256_sll_epi32(high.hi, seven))};
  }
#endif
  return {dpbusd8(acc.lo, u.lo, p.lo), dpbusd8(acc.hi, u.hi, p.hi)};
}
template <bool WIDE = false>
inline I dpbusd_at(I acc, I u, const int32_t* p) { return dpbusd<WIDE>(acc, u, set32(*p)); }

// acc + each lane's 2 products of int16 pairs a·b.
inline __m256i dpwssd8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
inline I dpwssd(I acc, I a, I b) { return {dpwssd8(acc.lo, a.lo, b.lo), dpwssd8(acc.hi, a.hi, b.hi)}; }
// Lane j: the int16 pair (p[j], p[16 + j]), two groups' bytes side by side; mul16 scales each int16.
inline I pair16(const uint8_t* p) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + 16));
  return {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b))};
}
inline I pair16(const int8_t* p) {
  const __m128i a = _mm_loadu_si128((const __m128i*)p), b = _mm_loadu_si128((const __m128i*)(p + 16));
  return {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b))};
}
inline I mul16(I a, int16_t s) {
  const __m256i k = _mm256_set1_epi16(s);
  return {_mm256_mullo_epi16(a.lo, k), _mm256_mullo_epi16(a.hi, k)};
}

// Lane j: the sum of v[j]'s 16 lanes, for 16 vectors at once.
inline F sums16(const F* v) {
  alignas(32) float s[16];
  for (int j = 0; j < 16; j++) s[j] = sum(v[j]);
  return load(s);
}

// acc + each lane's pair q[2i]·k[2i] + q[2i+1]·k[2i+1] of 32 bf16 values.
inline F dot_bf16(F acc, const uint16_t* q, const uint16_t* k) {
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000);
  auto pairs = [&](__m256 a, const uint16_t* x, const uint16_t* y) {
    const __m256i qx = _mm256_loadu_si256((const __m256i*)x), ky = _mm256_loadu_si256((const __m256i*)y);
    a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(qx, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(ky, 16)), a);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(qx, high)), _mm256_castsi256_ps(_mm256_and_si256(ky, high)), a);
  };
  return {pairs(acc.lo, q, k), pairs(acc.hi, q + 16, k + 16)};
}

#endif

// 16 values of a row of fp32 or bf16 logits (sampling, argmax); lanes from n on read `fill`.
inline F load_row(const float* p, int64_t n, float fill) { return load(p, n, fill); }
inline F load_row(const uint16_t* p, int64_t n, float fill) { return load_bf16(p, n, fill); }

// e^x, x clamped to [−87, 88] (e^−87 is 0 next to any sum it joins, e^88 near fp32's largest): 2^n · p(r),
// r = x − n ln2 in [−ln2/2, ln2/2], degree-6 Taylor polynomial (relative error < 2e-7, far below bf16's).
inline F exp(F x) {
  x = min(max(x, set(-87.f)), set(88.f));
  const F n = round(x * set(1.44269504f));
  F r = fnmadd(n, set(0.693145752f), x);
  r = fnmadd(n, set(1.42860677e-6f), r);
  F p = set(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fmadd(p, r, set(c));
  return scale2(p, n);
}

}  // namespace speculant::vec
