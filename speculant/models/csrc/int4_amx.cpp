// y = x Wᵀ for int4 weights stored as llama.cpp's Q4_1 (w = d·q + m per 32 inputs), on Intel AMX.
//
// PyTorch's CPU int4 kernel costs in proportion to the rows it multiplies (4 at a time): a verify pass
// over 8 tokens paid 3x a plain one. Here each 16-output × 32-input block is unpacked to bf16 once and
// multiplied on AMX tiles by up to 16 rows at the cost of one: the pass cost stays flat up to 16 rows.
//
// Exactness: every output row is computed by the same instructions in the same order whatever the
// number of rows and threads (a row's sums never mix with another's), so a verify pass scores
// exactly as plain decoding does.
//
// Tiles hold 128 + q, exact in bf16 (bits 0x4300 | q): then x·w over a group is
// d·(x·(128 + q)) + (m − 128 d)·Σx, and the scales are applied per group on fp32 sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"

namespace {

using speculant::amx_permitted;
using speculant::load_bf16;
using speculant::TileConfig;
using speculant::to_bf16;

// One block's group: 16 rows of 16 bytes (byte j of row r: q[j][2r] | q[j][2r+1] << 4) → the B tile,
// row r = for each output j the input pair (2r, 2r+1) as bf16 128 + q.
inline void unpack(const uint8_t* wg, uint32_t* tile, const __m512i* pick, __m512i low4) {
  const __mmask64 nibbles = 0x5555555555555555ULL;  // even bytes take a nibble, odd bytes keep 0x43
  for (int r = 0; r < 16; r += 4) {
    __m512i v = _mm512_loadu_si512(wg + r * 16);
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    for (int i = 0; i < 4; i++)
      _mm512_store_si512(tile + (r + i) * 16, _mm512_mask2_permutex2var_epi8(lo, pick[i], nibbles, hi));
  }
}

// acc[i] += d · sums[i] + (m − 128 d) · Σx[i] for one group of 16 outputs and rows i < rows ≤ R: with R
// known when compiled the accumulators stay in registers (they went through memory: a third of a
// verify pass's extra cost over a plain one).
template <int R>
inline void scale_into(const float* sums, __m512* acc, int rows, const uint16_t* d, const uint16_t* m,
                       const float* xsum, int64_t G) {
  const __m512 dv = load_bf16(d);
  const __m512 mv = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dv, load_bf16(m));
  for (int i = 0; i < R; i++)
    if (i < rows)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * G]), mv, _mm512_fmadd_ps(_mm512_load_ps(sums + i * 16), dv, acc[i]));
}

struct Operands {
  const uint16_t* X;  // [M, K]
  const uint8_t* Q;
  const uint16_t *D, *Mn;
  const float* xsum;  // [M, G]
  uint16_t* Y;        // [M, N]
  int64_t K, N, G;
};

// Blocks b0 .. b1 of 16 outputs for rows r0 .. r0 + rows (rows ≤ R ≤ 16), the tiles configured for them.
template <int R>
void multiply_rows(const Operands& o, int64_t r0, int rows, int64_t b0, int64_t b1, uint32_t (*tiles)[256],
                   const __m512i* pick, __m512i low4) {
  alignas(64) float sums0[16 * 16], sums1[16 * 16];
  const int64_t G = o.G, K = o.K;
  const uint16_t* Xr = o.X + r0 * K;
  for (int64_t b = b0; b < b1; b++) {
    __m512 acc[R];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t* Qb = o.Q + b * G * 256;
    // The next two groups are unpacked while the tiles work on these two: a tile load waits for
    // the stores that made its data.
    uint32_t* cur[2] = {tiles[0], tiles[1]};
    uint32_t* next[2] = {tiles[2], tiles[3]};
    unpack(Qb, cur[0], pick, low4);
    unpack(Qb + 256, cur[1], pick, low4);
    for (int64_t g = 0; g < G; g += 2) {
      if (g + 2 < G) {
        unpack(Qb + (g + 2) * 256, next[0], pick, low4);
        unpack(Qb + (g + 3) * 256, next[1], pick, low4);
      }
      _tile_loadd(2, cur[0], 64);
      _tile_loadd(1, Xr + g * 32, K * 2);
      _tile_loadd(5, cur[1], 64);
      _tile_loadd(4, Xr + (g + 1) * 32, K * 2);
      _tile_zero(0);
      _tile_zero(3);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 4, 5);
      _tile_stored(0, sums0, 64);
      _tile_stored(3, sums1, 64);
      const int64_t at = (b * G + g) * 16;
      scale_into<R>(sums0, acc, rows, o.D + at, o.Mn + at, o.xsum + r0 * G + g, G);
      scale_into<R>(sums1, acc, rows, o.D + at + 16, o.Mn + at + 16, o.xsum + r0 * G + g + 1, G);
      std::swap(cur, next);
    }
    for (int i = 0; i < rows; i++)
      _mm256_storeu_si256((__m256i*)(o.Y + (r0 + i) * o.N + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[i]));
  }
}

}  // namespace

// x [M, K] bf16; q uint8 [N/16, G, 16, 16] (see unpack); d, m bf16 [N/16, G, 16] → [M, N] bf16.
// G = K/32 must be even: two groups are in flight on separate tiles.
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(amx_permitted(), "the kernel asked Linux for AMX tile state and was refused");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 64 == 0 && d.size(1) == G, "input size must be a multiple of 64 matching the weight");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* X = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  const uint8_t* Q = q.data_ptr<uint8_t>();
  const uint16_t* D = (const uint16_t*)d.data_ptr<at::BFloat16>();
  const uint16_t* Mn = (const uint16_t*)m.data_ptr<at::BFloat16>();
  uint16_t* Y = (uint16_t*)y.data_ptr<at::BFloat16>();

  std::vector<float> xsum(M * G);  // Σx per row and group, in a fixed order
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < G; g++)
      xsum[r * G + g] = _mm512_reduce_add_ps(
          _mm512_add_ps(load_bf16(X + r * K + g * 32), load_bf16(X + r * K + g * 32 + 16)));

  const Operands o{X, Q, D, Mn, xsum.data(), Y, K, N, G};
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t pick_bytes[4][64];
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 16; j++) {
        pick_bytes[i][4 * j] = 16 * i + j;
        pick_bytes[i][4 * j + 1] = 0x43;
        pick_bytes[i][4 * j + 2] = 64 + 16 * i + j;
        pick_bytes[i][4 * j + 3] = 0x43;
      }
    __m512i pick[4];
    for (int i = 0; i < 4; i++) pick[i] = _mm512_load_si512(pick_bytes[i]);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    alignas(64) uint32_t tiles[4][256];
    for (int64_t r0 = 0; r0 < M; r0 += 16) {
      const int rows = (int)std::min<int64_t>(16, M - r0);
      TileConfig cfg = {};
      cfg.palette_id = 1;
      for (int t : {0, 1, 3, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // sums and x: rows × 64 bytes
      for (int t : {2, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;          // weights: 16 input pairs
      _tile_loadconfig(&cfg);
      if (rows <= 4)
        multiply_rows<4>(o, r0, rows, b0, b1, tiles, pick, low4);
      else if (rows <= 8)
        multiply_rows<8>(o, r0, rows, b0, b1, tiles, pick, low4);
      else
        multiply_rows<16>(o, r0, rows, b0, b1, tiles, pick, low4);
      _tile_release();
    }
  });
  return y;
}
