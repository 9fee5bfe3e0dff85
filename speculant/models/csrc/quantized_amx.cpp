// y = x Wᵀ for int8 weights in groups of 32 inputs (llama.cpp's Q8_0, w = d·q, q in −127..127), bf16
// activations, on Intel AMX (int8_mm): SmolLM2's lm_head, the tied embedding, which its GGUF file keeps
// as Q8_0: 30 MB a pass where bf16 streamed 57 MB.
//
// PyTorch's CPU int8 kernel costs in proportion to the rows it multiplies: a verify pass over 8 tokens
// paid 3x a plain one. Here each 16-output × 32-input block is unpacked to bf16 once and multiplied on
// AMX tiles by up to 16 rows at once.
//
// Exactness: every output row is computed by the same instructions in the same order whatever the
// number of rows and threads (a row's sums never mix with another's), so a verify pass scores
// exactly as plain decoding does.
//
// The tiles hold q, exact in bf16; the scales are applied per group on fp32 sums.
#include <torch/extension.h>
#include <immintrin.h>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

using speculant::amx_permitted;
using speculant::load_bf16;
using speculant::TileConfig;

struct Operands {
  const uint16_t* X;  // [M, K]
  const uint8_t* Q;
  const uint16_t* D;
  uint16_t* Y;  // [M, N]
  int64_t K, N, G;
};

struct Q8_0 {
  static constexpr int64_t kGroupBytes = 512;

  // One block's group: 16 rows of 32 int8, already in the tile's order → bf16.
  void unpack(const uint8_t* wg, uint32_t* tile) const {
    for (int r = 0; r < 16; r++) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wg + r * 32))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wg + r * 32 + 16))));
      _mm512_store_si512(tile + r * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }

  // acc[i] += d · sums[i] for rows i < rows ≤ R (`at`: the group's scales): with R known when compiled the
  // accumulators stay in registers.
  template <int R>
  void scale(const Operands& o, const float* sums, __m512* acc, int rows, int64_t at) const {
    const __m512 dv = load_bf16(o.D + at);
    for (int i = 0; i < R; i++)
      if (i < rows) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(sums + i * 16), dv, acc[i]);
  }
};

// Blocks b0 .. b1 of 16 outputs for rows r0 .. r0 + rows (rows ≤ R ≤ 16) and, on tiles 6 and 7, the next
// `more` rows (up to 16): the weights unpacked once serve both (a second row block unpacking them again
// cost as much as the first: 20 rows 7.1 ms for SmolLM2's 90 int4 products, 16 rows 4.9, when they ran here).
template <int R>
void multiply_rows(const Operands& o, const Q8_0& f, int64_t r0, int rows, int more, int64_t b0, int64_t b1,
                   uint32_t (*tiles)[256]) {
  alignas(64) float sums0[16 * 16], sums1[16 * 16];
  const int64_t G = o.G, K = o.K, bytes = Q8_0::kGroupBytes;
  const uint16_t* Xr = o.X + r0 * K;
  for (int64_t b = b0; b < b1; b++) {
    __m512 acc[R], acc_more[16];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int i = 0; i < more; i++) acc_more[i] = _mm512_setzero_ps();
    const uint8_t* Qb = o.Q + b * G * bytes;
    // The next two groups are unpacked while the tiles work on these two: a tile load waits for
    // the stores that made its data.
    uint32_t* cur[2] = {tiles[0], tiles[1]};
    uint32_t* next[2] = {tiles[2], tiles[3]};
    f.unpack(Qb, cur[0]);
    f.unpack(Qb + bytes, cur[1]);
    for (int64_t g = 0; g < G; g += 2) {
      speculant::prefetch_ahead(Qb + g * bytes, 2 * bytes);
      if (g + 2 < G) {
        f.unpack(Qb + (g + 2) * bytes, next[0]);
        f.unpack(Qb + (g + 3) * bytes, next[1]);
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
      f.scale<R>(o, sums0, acc, rows, at);
      f.scale<R>(o, sums1, acc, rows, at + 16);
      if (more) {  // the weights still in tiles 2 and 5
        _tile_loadd(6, Xr + 16 * K + g * 32, K * 2);
        _tile_zero(7);
        _tile_dpbf16ps(7, 6, 2);
        _tile_stored(7, sums0, 64);
        f.scale<16>(o, sums0, acc_more, more, at);
        _tile_loadd(6, Xr + 16 * K + (g + 1) * 32, K * 2);
        _tile_zero(7);
        _tile_dpbf16ps(7, 6, 5);
        _tile_stored(7, sums1, 64);
        f.scale<16>(o, sums1, acc_more, more, at + 16);
      }
      std::swap(cur, next);
    }
    for (int i = 0; i < rows; i++)
      _mm256_storeu_si256((__m256i*)(o.Y + (r0 + i) * o.N + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[i]));
    for (int i = 0; i < more; i++)
      _mm256_storeu_si256((__m256i*)(o.Y + (r0 + 16 + i) * o.N + b * 16), (__m256i)_mm512_cvtneps_pbh(acc_more[i]));
  }
}

}  // namespace

// x [M, K] bf16 × q int8 [N/16, G, 16, 32]: per block and group, row r holds for each output j the inputs
// (2r, 2r+1); d bf16 [N/16, G, 16] → [M, N] bf16. G = K/32 must be even: two groups are in flight on
// separate tiles.
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(amx_permitted(), "the kernel asked Linux for AMX tile state and was refused");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8 weights");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 64 == 0 && d.size(1) == G, "input size must be a multiple of 64 matching the weight");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const Operands o{(const uint16_t*)xc.data_ptr<at::BFloat16>(), (const uint8_t*)q.data_ptr(),
                   (const uint16_t*)d.data_ptr<at::BFloat16>(), (uint16_t*)y.data_ptr<at::BFloat16>(), K, N, G};
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    const Q8_0 f;
    alignas(64) uint32_t tiles[4][256];
    for (int64_t r0 = 0; r0 < M; r0 += 32) {
      const int rows = (int)std::min<int64_t>(16, M - r0), more = (int)std::clamp<int64_t>(M - r0 - 16, 0, 16);
      TileConfig cfg = {};
      cfg.palette_id = 1;
      for (int t : {0, 1, 3, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // sums and x: rows × 64 bytes
      for (int t : {2, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;          // weights: 16 input pairs
      for (int t : {6, 7}) cfg.rows[t] = more, cfg.colsb[t] = more ? 64 : 0;  // the next rows' x and sums
      speculant::load_tile_config(cfg);
      if (rows <= 4)
        multiply_rows<4>(o, f, r0, rows, more, b0, b1, tiles);
      else if (rows <= 8)
        multiply_rows<8>(o, f, r0, rows, more, b0, b1, tiles);
      else
        multiply_rows<16>(o, f, r0, rows, more, b0, b1, tiles);
      _tile_release();
    }
  });
  return y;
}
