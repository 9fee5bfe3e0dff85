// y = x Wᵀ for the weights of llama.cpp's quantized formats, in groups of 32 inputs:
// - Q4_1 (int4_mm, the decoder layers): w = d·q + m, q in 0..15;
// - Q8_0 (int8_mm, the lm_head: the tied embedding, which GGUF files keep at 8 bits): w = d·q, q in −127..127,
//   stored as q + 128 (unsigned: the weights are VNNI's and AMX's unsigned operand);
// with the activations quantized to int8 per group of 32 as llama.cpp does (x ≈ dx·p, dx = max|x|/127): a
// group's sum is then an integer, Σ q·p, taken on VNNI (up to 8 rows) or on AMX's int8 tiles (more), and
// y = Σ over groups of dx·(d·Σ q·p) (+ dx·Σp·m for Q4_1).
//
// Exactness: integer sums do not depend on their order, so both paths give a row the same sums, and the
// float steps after them (apply()) are the same instructions for every row, alone or among any number
// of rows, on any thread: a verify pass scores exactly as plain decoding does.
//
// Why int8 activations: with bf16 ones each group of weights had to be unpacked to bf16 tiles (stored,
// then loaded) for AMX's bf16 product, and that work bounded the product; nibbles unpacked to bytes stay
// in registers for VNNI. Their rounding error is small, as in llama.cpp. The Q8_0 lm_head the same way,
// its greedy choices unchanged (figures: docs/history.md, "models/ and its kernels").
#include "tensor.h"
#include <immintrin.h>
#include <type_traits>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

#if defined(__AVX512F__)  // the avx2 levels build the stubs at the end instead

namespace {

using speculant::load_bf16;
using speculant::prefetch_ahead;

constexpr int kVnniRows = 8;  // above, AMX: VNNI is faster up to 8 rows, AMX from 16

// The calling thread's buffers, kept from call to call (a pass makes 120 products: their 480 allocations
// cost more than quantizing a decode row).
template <class T>
T* reused(std::vector<T>& buffer, int64_t n) {
  if ((int64_t)buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Lane l of the result reduces v[l], 16 vectors' horizontal reductions at once: four rounds of shuffles
// that halve the lanes each vector spends on one input, ~3 instructions an input where a reduction of its
// own takes ~8. The rounds leave input kSlot[l] in lane l: loaded in that order, input j lands in lane j.
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

template <class Op>
inline __m512 reduce16(__m512* v, Op op) {
  for (int j = 0; j < 8; j++)
    v[j] = op(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
  for (int j = 0; j < 4; j++)
    v[j] = op(_mm512_shuffle_f32x4(v[j], v[j + 4], 0x88), _mm512_shuffle_f32x4(v[j], v[j + 4], 0xDD));
  for (int j = 0; j < 2; j++)
    v[j] = op(_mm512_shuffle_ps(v[j], v[j + 2], 0x44), _mm512_shuffle_ps(v[j], v[j + 2], 0xEE));
  return op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

inline __m512 max_ps(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

inline __m512 add_epi32(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

struct Activations {
  int8_t* p;        // [M, K]
  float *dx, *sx;   // [M, G]: each group's scale, and dx·Σp
  int32_t* lift;    // [M, G]: 128·Σp, what weights stored as q + 128 add to a group's sum

  // Groups 16 at a time, their maxima and sums reduced together (reduce16): the same values as one group
  // at a time (max and integer sums are exact, the divisions IEEE's), in less time; the last groups one
  // by one.
  Activations(const uint16_t* X, int64_t M, int64_t K) {
    static thread_local std::vector<int8_t> p_buffer;
    static thread_local std::vector<float> dx_buffer, sx_buffer;
    static thread_local std::vector<int32_t> lift_buffer;
    const int64_t n = M * K / 32;
    p = reused(p_buffer, M * K), dx = reused(dx_buffer, n), sx = reused(sx_buffer, n), lift = reused(lift_buffer, n);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 v[16];
      for (int s = 0; s < 16; s++) {
        const uint16_t* x = X + 32 * (i + kSlot[s]);
        v[s] = _mm512_max_ps(_mm512_abs_ps(load_bf16(x)), _mm512_abs_ps(load_bf16(x + 16)));
      }
      const __m512 amax = reduce16(v, max_ps);
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(127.f), amax));
      for (int s = 0; s < 16; s++) v[s] = _mm512_castsi512_ps(quantize(X, i + kSlot[s], inv[kSlot[s]]));
      const __m512i sum = _mm512_castps_si512(reduce16(v, add_epi32));
      const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
      _mm512_storeu_ps(dx + i, d);
      _mm512_storeu_ps(sx + i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
      _mm512_storeu_si512(lift + i, _mm512_mullo_epi32(sum, _mm512_set1_epi32(128)));
    }
    for (; i < n; i++) {
      const __m512 a = load_bf16(X + 32 * i), b = load_bf16(X + 32 * i + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const int32_t sum = _mm512_reduce_add_epi32(quantize(X, i, amax > 0 ? 127.f / amax : 0.f));
      dx[i] = amax / 127.f;
      sx[i] = dx[i] * (float)sum;
      lift[i] = 128 * sum;
    }
  }

  // Group g's inputs times `inv`, rounded to int8 into p → their pairwise sums (16 int32, still to be summed).
  __m512i quantize(const uint16_t* X, int64_t g, float inv) const {
    const __m512 f = _mm512_set1_ps(inv);
    const __m512i pa = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(X + 32 * g), f));
    const __m512i pb = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(X + 32 * g + 16), f));
    _mm_storeu_si128((__m128i*)(p + 32 * g), _mm512_cvtsepi32_epi8(pa));
    _mm_storeu_si128((__m128i*)(p + 32 * g + 16), _mm512_cvtsepi32_epi8(pb));
    return _mm512_add_epi32(pa, pb);
  }
};

struct Operands {
  const Activations& x;
  const uint8_t* Q;        // [N/16, G, F::kGroupBytes]
  const uint16_t *D, *Mn;  // [N/16, G, 16]; Mn for Q4_1 only
  uint16_t* Y;             // [M, N]
  int64_t K, N, G;
};

// Q4_1, 16 outputs × 32 inputs as nibbles (native.int4_layout).
struct Q4_1 {
  static constexpr int64_t kGroupBytes = 256;

  // → 8 vectors of bytes, vector v holding for each output j the inputs 4v .. 4v+3 (VNNI's operand, and
  // the AMX int8 tile's row v).
  static void unpack(const uint8_t* wg, __m512i* w) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; v++) {
      const __m512i packed = _mm512_loadu_si512(wg + 64 * v);
      w[v] = _mm512_and_si512(packed, low4);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
  }

  // acc += dx·(d·s) + sx·m for one row and group: every path's float arithmetic, in this order.
  static __m512 apply(__m512 acc, __m512i s, __m512 dv, __m512 mv, const Activations& x, int64_t rg) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dv), _mm512_set1_ps(x.dx[rg]), acc);
    return _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sx[rg]), acc);
  }
};

// Q8_0 as q + 128, already in the 8 vectors' order (native.int8_layout).
struct Q8_0 {
  static constexpr int64_t kGroupBytes = 512;

  static void unpack(const uint8_t* wg, __m512i* w) {
    for (int v = 0; v < 8; v++) w[v] = _mm512_loadu_si512(wg + 64 * v);
  }

  // acc += dx·(d·(s − 128·Σp)), s − 128·Σp being Σ q·p.
  static __m512 apply(__m512 acc, __m512i s, __m512 dv, __m512, const Activations& x, int64_t rg) {
    const __m512i exact = _mm512_sub_epi32(s, _mm512_set1_epi32(x.lift[rg]));
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), dv), _mm512_set1_ps(x.dx[rg]), acc);
  }
};

template <class F>
inline __m512 minimums(const Operands& o, int64_t at) {
  if constexpr (std::is_same_v<F, Q4_1>) return load_bf16(o.Mn + at);
  return _mm512_setzero_ps();
}

inline void store_rows(const Operands& o, const __m512* acc, int64_t r0, int rows, int64_t b) {
  for (int i = 0; i < rows; i++)
    _mm256_storeu_si256((__m256i*)(o.Y + (r0 + i) * o.N + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

// Blocks b .. b + C of 16 outputs (C ≤ 2) for rows r0 .. r0 + R, the unpacked weights in registers.
// Each broadcast input feeds C blocks, and the rows' sums are taken input by input: R · C independent
// chains of dpbusd (5 cycles each) rather than one row's chain after another's, and loops over exactly
// R rows.
template <class F, int R, int C>
void vnni_blocks(const Operands& o, int64_t r0, int64_t b) {
  const int64_t G = o.G;
  const int8_t* P = o.x.p + r0 * o.K;
  __m512 acc[C][R];
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) acc[c][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512i w[C][8], s[C][R];
    for (int c = 0; c < C; c++) {
      const uint8_t* wg = o.Q + ((b + c) * G + g) * F::kGroupBytes;
      // 16 groups ahead in this block's stream, past its end in the next call's block c (4 KB ahead in
      // memory reached into block b + 1, read now anyway: slower without this)
      const int64_t ahead = g + 16 < G ? (b + c) * G + g + 16 : (b + c + C) * G + g + 16 - G;
      for (int64_t line = 0; line < F::kGroupBytes; line += 64)
        _mm_prefetch((const char*)(o.Q + ahead * F::kGroupBytes + line), _MM_HINT_T0);
      F::unpack(wg, w[c]);
    }
    for (int c = 0; c < C; c++)
      for (int i = 0; i < R; i++) s[c][i] = _mm512_setzero_si512();
    for (int v = 0; v < 8; v++)
      for (int i = 0; i < R; i++) {
        const __m512i p = _mm512_set1_epi32(((const int32_t*)(P + (i * G + g) * 32))[v]);  // inputs 4v .. 4v+3
        for (int c = 0; c < C; c++) s[c][i] = _mm512_dpbusd_epi32(s[c][i], w[c][v], p);
      }
    for (int c = 0; c < C; c++) {
      const int64_t at = ((b + c) * G + g) * 16;
      const __m512 dv = load_bf16(o.D + at), mv = minimums<F>(o, at);
      for (int i = 0; i < R; i++) acc[c][i] = F::apply(acc[c][i], s[c][i], dv, mv, o.x, (r0 + i) * G + g);
    }
  }
  for (int c = 0; c < C; c++) store_rows(o, acc[c], r0, R, b + c);
}

// Blocks b0 .. b1 for rows r0 .. r0 + R, two at a time.
template <class F, int R>
void vnni_rows(const Operands& o, int64_t r0, int64_t b0, int64_t b1) {
  constexpr int C = R <= 6 ? 2 : 1;  // 7 or 8 rows' two blocks spill registers: one block is faster
  int64_t b = b0;
  for (; b + C <= b1; b += C) vnni_blocks<F, R, C>(o, r0, b);
  if (b < b1) vnni_blocks<F, R, 1>(o, r0, b);
}

// Each row count its own instance: loops over exactly the rows there are.
template <class F>
void vnni(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  switch (rows) {
    case 1: return vnni_rows<F, 1>(o, r0, b0, b1);
    case 2: return vnni_rows<F, 2>(o, r0, b0, b1);
    case 3: return vnni_rows<F, 3>(o, r0, b0, b1);
    case 4: return vnni_rows<F, 4>(o, r0, b0, b1);
    case 5: return vnni_rows<F, 5>(o, r0, b0, b1);
    case 6: return vnni_rows<F, 6>(o, r0, b0, b1);
    case 7: return vnni_rows<F, 7>(o, r0, b0, b1);
    default: return vnni_rows<F, 8>(o, r0, b0, b1);
  }
}

// A group's weights as an AMX int8 tile of 8 rows (its 8 vectors): Q4_1's unpacked into `tile`, Q8_0's
// read where they lie.
template <class F>
inline const uint8_t* weight_tile(const uint8_t* wg, uint8_t* tile) {
  if constexpr (std::is_same_v<F, Q8_0>) return wg;
  __m512i w[8];
  F::unpack(wg, w);
  for (int v = 0; v < 8; v++) _mm512_store_si512(tile + 64 * v, w[v]);
  return tile;
}

// The same on AMX int8 tiles, two groups in flight: tiles 1, 4 the rows' inputs, 2, 5 the weights, 0, 3 the
// sums. The next two groups are unpacked while the tiles work on these two (a tile load waits for the
// stores that made its data).
template <class F>
void amx_rows(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  const int64_t G = o.G, K = o.K;
  alignas(64) uint8_t tiles[2][2][512];  // [pair of groups' parity][group of the pair]
  alignas(64) int32_t sums[2][16 * 16];
  const int8_t* P = o.x.p + r0 * K;
  for (int64_t b = b0; b < b1; b++) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t* Qb = o.Q + b * G * F::kGroupBytes;
    const uint8_t* cur[2] = {weight_tile<F>(Qb, tiles[0][0]), weight_tile<F>(Qb + F::kGroupBytes, tiles[0][1])};
    for (int64_t g = 0; g < G; g += 2) {
      prefetch_ahead(Qb + g * F::kGroupBytes, 2 * F::kGroupBytes);
      const uint8_t* next[2] = {};
      if (g + 2 < G) {
        uint8_t(*spare)[512] = tiles[(g / 2 + 1) % 2];
        next[0] = weight_tile<F>(Qb + (g + 2) * F::kGroupBytes, spare[0]);
        next[1] = weight_tile<F>(Qb + (g + 3) * F::kGroupBytes, spare[1]);
      }
      _tile_loadd(2, cur[0], 64);
      _tile_loadd(1, P + g * 32, K);
      _tile_loadd(5, cur[1], 64);
      _tile_loadd(4, P + (g + 1) * 32, K);
      _tile_zero(0);
      _tile_zero(3);
      _tile_dpbsud(0, 1, 2);
      _tile_dpbsud(3, 4, 5);
      _tile_stored(0, sums[0], 64);
      _tile_stored(3, sums[1], 64);
      for (int h = 0; h < 2; h++) {
        const int64_t at = (b * G + g + h) * 16;
        const __m512 dv = load_bf16(o.D + at), mv = minimums<F>(o, at);
        for (int i = 0; i < rows; i++)
          acc[i] = F::apply(acc[i], _mm512_load_si512(sums[h] + 16 * i), dv, mv, o.x, (r0 + i) * G + g + h);
      }
      cur[0] = next[0], cur[1] = next[1];
    }
    store_rows(o, acc, r0, rows, b);
  }
}

template <class F>
void amx_block(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  speculant::TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t : {0, 3}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // sums: rows × 16 int32
  for (int t : {1, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 32;  // inputs: rows × one group of int8
  for (int t : {2, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;     // weights: 8 rows of 16 outputs × 4 inputs
  speculant::load_tile_config(cfg);
  amx_rows<F>(o, r0, rows, b0, b1);
  _tile_release();
}

template <class F>
void quantized_mm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d, const uint16_t* m,
                  torch::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 64 == 0 && d.size(1) == G && q.numel() == N / 16 * G * F::kGroupBytes,
              "input size must be a multiple of 64 matching the weight");
  check_output(y, M * N);
  auto xc = x.contiguous();
  const Activations act((const uint16_t*)xc.data_ptr<at::BFloat16>(), M, K);
  const Operands o{act, (const uint8_t*)q.data_ptr(), (const uint16_t*)d.data_ptr<at::BFloat16>(), m,
                   (uint16_t*)y.data_ptr<at::BFloat16>(), K, N, G};
  // Without AMX, VNNI takes the rows 8 at a time: each row's sums are the same either way.
  const bool tiles = M > kVnniRows && speculant::amx_usable();
  const int64_t chunk = tiles ? 16 : kVnniRows;
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
      const int rows = (int)std::min<int64_t>(chunk, M - r0);
      if (rows > kVnniRows)
        amx_block<F>(o, r0, rows, b0, b1);
      else
        vnni<F>(o, r0, rows, b0, b1);
    }
  });
}

}  // namespace

// x [M, K] bf16; q uint8 [N/16, G, 4, 64] (native.int4_layout); d, m bf16 [N/16, G, 16] → y [M, N] bf16.
// G = K/32 must be even: the AMX path keeps two groups in flight.
void int4_mm_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m,
                  torch::Tensor& y) {
  quantized_mm<Q4_1>(x, q, d, (const uint16_t*)m.data_ptr<at::BFloat16>(), y);
}

torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  auto y = torch::empty({x.size(0), d.size(0) * 16}, x.options());
  int4_mm_into(x, q, d, m, y);
  return y;
}

// x [M, K] bf16; q uint8 [N/16, G, 8, 64] (native.int8_layout: q + 128); d bf16 [N/16, G, 16] → [M, N] bf16.
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.scalar_type() == at::kByte, "int8 weights are stored as q + 128, uint8");
  auto y = torch::empty({x.size(0), d.size(0) * 16}, x.options());
  quantized_mm<Q8_0>(x, q, d, nullptr, y);
  return y;
}

#else
// native.quantized_usable keeps the int4 and int8 layers off these kernels below AVX512.
void int4_mm_into(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&) {
  TORCH_CHECK(false, "the int4 kernel needs AVX512");
}
torch::Tensor int4_mm(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "the int4 kernel needs AVX512");
}
torch::Tensor int8_mm(torch::Tensor, torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "the int8 kernel needs AVX512"); }
#endif
