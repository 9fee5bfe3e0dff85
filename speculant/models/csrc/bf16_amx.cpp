// y = x Wᵀ for bf16 weights on Intel AMX, the weight stored as the tiles read it.
//
// oneDNN's packed bf16 kernel gives a row the same bits only up to 32 rows per call, so wider verify
// passes went in chunks, and its calls cannot join a decoder layer's single native call. Here each
// block of 16 outputs keeps one fp32 accumulator tile over all of K, whatever the rows: every row is
// computed by the same instructions in the same order, alone or among 100 others.
#include "tensor.h"
#include <immintrin.h>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

#if defined(__AVX512F__)  // the avx2 levels build the stubs at the end instead

// x [M, K] bf16; w bf16 [N/16, K/32, 16, 32]: block b, group g, input pair r, output j, member e holds
// W[16 b + j, 32 g + 2 r + e] (see native.bf16_layout) → y [M, N] bf16.
void bf16_mm_into(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) {
  if (!speculant::amx_usable()) return bf16_dot_into(x, w, y);  // no AMX, or a lower level forced
  TORCH_CHECK(speculant::amx_permitted(), "the kernel asked Linux for AMX tile state and was refused");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16, 2-D x");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.size(1) == G, "input size must be a multiple of 32 matching the weight");
  check_output(y, M * N);
  auto xc = x.contiguous();
  const uint16_t* X = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  const uint16_t* W = (const uint16_t*)w.data_ptr<at::BFloat16>();
  uint16_t* Y = (uint16_t*)y.data_ptr<at::BFloat16>();
  // Blocks outside, rows inside: a block's weights (K × 32 bytes) stay in cache for every row block
  // of a prompt.
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[16 * 16];
    int configured = -1;
    for (int64_t b = b0; b < b1; b++) {
      const uint16_t* Wb = W + b * G * 512;
      for (int64_t r0 = 0; r0 < M; r0 += 16) {
        const int rows = (int)std::min<int64_t>(16, M - r0);
        if (rows != configured) {
          speculant::TileConfig cfg = {};
          cfg.palette_id = 1;
          cfg.rows[0] = rows, cfg.colsb[0] = 64;  // sums: rows × 16 fp32
          cfg.rows[1] = rows, cfg.colsb[1] = 64;  // x: rows × 32 bf16
          cfg.rows[2] = 16, cfg.colsb[2] = 64;    // weights: 16 input pairs × 16 outputs
          speculant::load_tile_config(cfg);
          configured = rows;
        }
        _tile_zero(0);
        for (int64_t g = 0; g < G; g++) {
          _tile_loadd(1, X + r0 * K + g * 32, K * 2);
          _tile_loadd(2, Wb + g * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sums, 64);
        for (int i = 0; i < rows; i++)
          for (int j = 0; j < 16; j++) Y[(r0 + i) * N + b * 16 + j] = speculant::to_bf16(sums[i * 16 + j]);
      }
    }
    if (configured >= 0) _tile_release();
  });
}

#else
void bf16_mm_into(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) { bf16_dot_into(x, w, y); }
#endif

torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor w) {
  auto y = torch::empty({x.size(0), w.size(0) * 16}, x.options());
  bf16_mm_into(x, w, y);
  return y;
}
