// y = x Wᵀ for int4 weights in llama.cpp's Q4_1 format (w = d·q + m per group of 32 inputs, q in 0..15)
// with the activations quantized to int8 per group of 32 as llama.cpp does (x ≈ dx·p, dx = max|x|/127):
// a group's sum is then an integer, Σ q·p, taken on VNNI (up to 8 rows) or on AMX's int8 tiles (more),
// and y = Σ over groups of dx·(d·Σ q·p) + dx·Σp·m.
//
// Exactness: integer sums do not depend on their order, so both paths give a row the same sums, and the
// float steps after them (apply()) are the same instructions for every row, alone or among any number
// of rows, on any thread: a verify pass scores exactly as plain decoding does.
//
// Why int8 activations: with bf16 ones each group of weights was unpacked to bf16 tiles (1 KB stored,
// then loaded) for AMX's bf16 product: ~18 GB/s at one row, bounded by that work. Nibbles unpacked to
// bytes stay in registers for VNNI: SmolLM2-135M's 120 int4 products at one row 3.6 → 2.0 ms, at five
// rows 3.9 → 2.7 (random weights, medians, one run). The int8 activations cost ~0.6% of a product's
// norm (bf16 ones ~0.2%), as in llama.cpp.
#include <torch/extension.h>
#include <immintrin.h>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

using speculant::load_bf16;
using speculant::prefetch_ahead;

constexpr int64_t kGroupBytes = 256;  // 16 outputs × 32 inputs × 4 bits
constexpr int kVnniRows = 8;          // above, AMX: 16 rows 6.4 ms on VNNI, 5.8 on AMX; 8 rows 3.6 and 3.9

struct Activations {
  std::vector<int8_t> p;  // [M, K]
  std::vector<float> dx, sx;  // [M, G]: each group's scale, and dx·Σp

  Activations(const uint16_t* X, int64_t M, int64_t K) : p(M * K), dx(M * K / 32), sx(M * K / 32) {
    for (int64_t i = 0; i < M * K / 32; i++) {
      const __m512 a = load_bf16(X + 32 * i), b = load_bf16(X + 32 * i + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
      const __m512i pa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), pb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128((__m128i*)(p.data() + 32 * i), _mm512_cvtsepi32_epi8(pa));
      _mm_storeu_si128((__m128i*)(p.data() + 32 * i + 16), _mm512_cvtsepi32_epi8(pb));
      dx[i] = amax / 127.f;
      sx[i] = dx[i] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(pa, pb));
    }
  }
};

struct Operands {
  const Activations& x;
  const uint8_t* Q;          // [N/16, G, 4, 64]
  const uint16_t *D, *Mn;    // [N/16, G, 16]
  uint16_t* Y;               // [M, N]
  int64_t K, N, G;
};

// One group's weights, 16 outputs × 32 inputs → 8 vectors of bytes, vector v holding for each output j
// the inputs 4v .. 4v+3 (VNNI's operand, and the AMX int8 tile's row v).
inline void unpack(const uint8_t* wg, __m512i* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; v++) {
    const __m512i packed = _mm512_loadu_si512(wg + 64 * v);
    w[v] = _mm512_and_si512(packed, low4);
    w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
  }
}

// acc += dx·(d·s) + sx·m for one row and group: every path's float arithmetic, in this order.
inline __m512 apply(__m512 acc, __m512i s, __m512 dv, __m512 mv, float dx, float sx) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dv), _mm512_set1_ps(dx), acc);
  return _mm512_fmadd_ps(mv, _mm512_set1_ps(sx), acc);
}

inline void store_rows(const Operands& o, const __m512* acc, int64_t r0, int rows, int64_t b) {
  for (int i = 0; i < rows; i++)
    _mm256_storeu_si256((__m256i*)(o.Y + (r0 + i) * o.N + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

// Blocks b .. b + C of 16 outputs (C ≤ 2) for rows r0 .. r0 + R, the unpacked weights in registers.
// Each broadcast input feeds C blocks, and the rows' sums are taken input by input: R · C independent
// chains of dpbusd (5 cycles each) where one row's chain used to follow another's, and loops over exactly
// R rows. SmolLM2-135M's 120 int4 products, each pass's right after a whole pass as in decoding, at
// 1 / 4 / 5 / 8 rows: 1.68 / 2.20 / 2.60 / 3.53 → 1.62 / 1.96 / 2.20 / 3.02 ms (one block at a time,
// every row count up to 8 in the loop of 8 rows before).
template <int R, int C>
void vnni_blocks(const Operands& o, int64_t r0, int64_t b) {
  const int64_t G = o.G;
  const int8_t* P = o.x.p.data() + r0 * o.K;
  const float *DX = o.x.dx.data() + r0 * G, *SX = o.x.sx.data() + r0 * G;
  __m512 acc[C][R];
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) acc[c][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512i w[C][8], s[C][R];
    for (int c = 0; c < C; c++) {
      const uint8_t* wg = o.Q + ((b + c) * G + g) * kGroupBytes;
      // 16 groups ahead in this block's stream, past its end in the next call's block c (4 KB ahead in
      // memory reached into block b + 1, read now anyway: 1-row products 1.72 → 1.92 ms without this)
      const int64_t ahead = g + 16 < G ? (b + c) * G + g + 16 : (b + c + C) * G + g + 16 - G;
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch((const char*)(o.Q + ahead * kGroupBytes + line), _MM_HINT_T0);
      unpack(wg, w[c]);
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
      const __m512 dv = load_bf16(o.D + at), mv = load_bf16(o.Mn + at);
      for (int i = 0; i < R; i++) acc[c][i] = apply(acc[c][i], s[c][i], dv, mv, DX[i * G + g], SX[i * G + g]);
    }
  }
  for (int c = 0; c < C; c++) store_rows(o, acc[c], r0, R, b + c);
}

// Blocks b0 .. b1 for rows r0 .. r0 + R, two at a time.
template <int R>
void vnni_rows(const Operands& o, int64_t r0, int64_t b0, int64_t b1) {
  constexpr int C = R <= 6 ? 2 : 1;  // 7 or 8 rows' two blocks spill registers: 8 rows 3.3–3.6 ms, one 3.1
  int64_t b = b0;
  for (; b + C <= b1; b += C) vnni_blocks<R, C>(o, r0, b);
  if (b < b1) vnni_blocks<R, 1>(o, r0, b);
}

// Each row count its own instance: loops over exactly the rows there are.
void vnni(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  switch (rows) {
    case 1: return vnni_rows<1>(o, r0, b0, b1);
    case 2: return vnni_rows<2>(o, r0, b0, b1);
    case 3: return vnni_rows<3>(o, r0, b0, b1);
    case 4: return vnni_rows<4>(o, r0, b0, b1);
    case 5: return vnni_rows<5>(o, r0, b0, b1);
    case 6: return vnni_rows<6>(o, r0, b0, b1);
    case 7: return vnni_rows<7>(o, r0, b0, b1);
    default: return vnni_rows<8>(o, r0, b0, b1);
  }
}

// Unpacked for an AMX int8 tile: the 8 vectors stored as its 8 rows.
inline void unpack_tile(const uint8_t* wg, uint8_t* tile) {
  __m512i w[8];
  unpack(wg, w);
  for (int v = 0; v < 8; v++) _mm512_store_si512(tile + 64 * v, w[v]);
}

// The same on AMX int8 tiles, two groups in flight: tiles 1, 4 the rows' inputs, 2, 5 the weights, 0, 3 the
// sums. The next two groups are unpacked while the tiles work on these two (a tile load waits for the
// stores that made its data: 120 products at one row 3.0 → 2.3 ms).
void amx_rows(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  const int64_t G = o.G, K = o.K;
  alignas(64) uint8_t tiles[4][512];
  alignas(64) int32_t sums[2][16 * 16];
  const int8_t* P = o.x.p.data() + r0 * K;
  for (int64_t b = b0; b < b1; b++) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t* Qb = o.Q + b * G * kGroupBytes;
    uint8_t* cur[2] = {tiles[0], tiles[1]};
    uint8_t* next[2] = {tiles[2], tiles[3]};
    unpack_tile(Qb, cur[0]);
    unpack_tile(Qb + kGroupBytes, cur[1]);
    for (int64_t g = 0; g < G; g += 2) {
      prefetch_ahead(Qb + g * kGroupBytes, 2 * kGroupBytes);
      if (g + 2 < G) {
        unpack_tile(Qb + (g + 2) * kGroupBytes, next[0]);
        unpack_tile(Qb + (g + 3) * kGroupBytes, next[1]);
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
        const __m512 dv = load_bf16(o.D + at), mv = load_bf16(o.Mn + at);
        for (int i = 0; i < rows; i++) {
          const int64_t rg = (r0 + i) * G + g + h;
          acc[i] = apply(acc[i], _mm512_load_si512(sums[h] + 16 * i), dv, mv, o.x.dx[rg], o.x.sx[rg]);
        }
      }
      std::swap(cur, next);
    }
    store_rows(o, acc, r0, rows, b);
  }
}

void amx_block(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1) {
  speculant::TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t : {0, 3}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // sums: rows × 16 int32
  for (int t : {1, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 32;  // inputs: rows × one group of int8
  for (int t : {2, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;     // weights: 8 rows of 16 outputs × 4 inputs
  speculant::load_tile_config(cfg);
  amx_rows(o, r0, rows, b0, b1);
  _tile_release();
}

}  // namespace

// x [M, K] bf16; q uint8 [N/16, G, 4, 64] (native.int4_layout); d, m bf16 [N/16, G, 16] → [M, N] bf16.
// G = K/32 must be even: the AMX path keeps two groups in flight.
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(speculant::amx_permitted(), "the kernel asked Linux for AMX tile state and was refused");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 64 == 0 && d.size(1) == G, "input size must be a multiple of 64 matching the weight");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const Activations act((const uint16_t*)xc.data_ptr<at::BFloat16>(), M, K);
  const Operands o{act, (const uint8_t*)q.data_ptr(), (const uint16_t*)d.data_ptr<at::BFloat16>(),
                   (const uint16_t*)m.data_ptr<at::BFloat16>(), (uint16_t*)y.data_ptr<at::BFloat16>(), K, N, G};
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < M; r0 += 16) {
      const int rows = (int)std::min<int64_t>(16, M - r0);
      if (rows > kVnniRows)
        amx_block(o, r0, rows, b0, b1);
      else
        vnni(o, r0, rows, b0, b1);
    }
  });
  return y;
}
