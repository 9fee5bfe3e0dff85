// y = x Wᵀ for bf16 weights where the CPU has no AMX: AVX512-BF16's vdpbf16ps at the avx512 level, its AVX2
// form (two fp32 FMAs a pair) below, the weight in bf16_amx.cpp's tile layout (native.bf16_layout), which
// bf16_mm_into hands here when the tiles cannot run.
//
// Why not oneDNN's packed bf16 kernel, which ran here before: it gives a row other bits at another row count
// (on a 1.5B model's shapes from 2 rows on), so a greedy answer depended on the requests beside it. Here each
// output of each row is one chain of steps in input order,
//   acc ← acc + w[2i]·x[2i] + w[2i+1]·x[2i+1],  i = 0 … K/2 − 1, from acc = 0,
// whatever the row count, the tile of rows and blocks a row shares, the thread, or the chunk of K: between
// chunks an accumulator is stored and reloaded in fp32, which changes no bit. A row alone, in a verify pass,
// in a batch or in a 700-row prompt gets the same bits.
#include "tensor.h"
#include <immintrin.h>

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

namespace vec = speculant::vec;
using vec::F;

#if defined(__AVX512F__)
// 6 rows × 4 blocks of 16 outputs: 24 accumulators and 4 weight vectors of AVX512's 32 registers.
constexpr int kRows = 6, kBlocks = 4;

struct Pairs {  // 16 outputs' bf16 pairs (2i, 2i + 1): one row of a weight tile
  __m512i v;
};
inline Pairs load_pairs(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }

// acc + each lane's pair of w times the pair at x, broadcast: the broadcast folded into the instruction.
inline F dot_at(F acc, const Pairs& w, const uint16_t* x) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(w.v), "m"(*(const uint32_t*)x));
  return acc;
}

#else
// AVX2's 16 registers: each block's pairs take 4 (even and odd members, lanes 0-7 and 8-15).
constexpr int kRows = 4, kBlocks = 1;

struct Pairs {
  __m256 even_lo, even_hi, odd_lo, odd_hi;
};
inline Pairs load_pairs(const uint16_t* p) {
  const __m256i lo = _mm256_loadu_si256((const __m256i*)p), hi = _mm256_loadu_si256((const __m256i*)(p + 16));
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
}

// The same sum as two FMAs, the even member's product first: exact products (bf16 × bf16 fits fp32), each
// sum rounded once.
inline F dot_at(F acc, const Pairs& w, const uint16_t* x) {
  uint32_t even = (uint32_t)x[0] << 16, odd = (uint32_t)x[1] << 16;
  float xe, xo;
  memcpy(&xe, &even, 4), memcpy(&xo, &odd, 4);
  const __m256 e = _mm256_set1_ps(xe), o = _mm256_set1_ps(xo);
  acc.lo = _mm256_fmadd_ps(w.odd_lo, o, _mm256_fmadd_ps(w.even_lo, e, acc.lo));
  acc.hi = _mm256_fmadd_ps(w.odd_hi, o, _mm256_fmadd_ps(w.even_hi, e, acc.hi));
  return acc;
}
#endif

// Groups of 32 inputs a chunk of K when rows come in several tiles: kBlocks blocks' weights for a chunk
// (kBlocks × 32 KB) stay in L2 while every tile of rows reads them.
constexpr int64_t kChunkGroups = 32;

struct Operands {
  const uint16_t* X;  // [M, K]
  const uint16_t* W;  // [N/16, G, 16, 32]
  uint16_t* Y;        // [M, N]
  float* partial;     // [M, N]: accumulators between chunks of K (only where K is chunked)
  int64_t M, K, N, G;
};

// Rows r0 .. r0 + R, blocks b .. b + C, groups g0 .. g1: accumulators from 0 (g0 = 0) or from `partial`, to
// `partial` or, after the last group, rounded to bf16 into Y.
template <int R, int C>
void tile(const Operands& o, int64_t r0, int64_t b, int64_t g0, int64_t g1) {
  F acc[R][C];
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++)
      acc[i][c] = g0 == 0 ? vec::zero() : vec::load(o.partial + (r0 + i) * o.N + (b + c) * 16);
  const uint16_t* x = o.X + r0 * o.K;
  for (int64_t g = g0; g < g1; g++) {
    for (int c = 0; c < C; c++)  // this block's stream 4 groups (4 KB) ahead
      for (int line = 0; line < 1024; line += 64)
        _mm_prefetch((const char*)(o.W + ((b + c) * o.G + g + 4) * 512) + line, _MM_HINT_T0);
    for (int p = 0; p < 16; p++) {
      Pairs w[C];
      for (int c = 0; c < C; c++) w[c] = load_pairs(o.W + (((b + c) * o.G + g) * 16 + p) * 32);
      for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) acc[i][c] = dot_at(acc[i][c], w[c], x + i * o.K + g * 32 + 2 * p);
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++) {
      if (g1 == o.G)
        vec::store_bf16(o.Y + (r0 + i) * o.N + (b + c) * 16, acc[i][c]);
      else
        vec::store(o.partial + (r0 + i) * o.N + (b + c) * 16, acc[i][c]);
    }
}

template <int R>
void tile_rows(const Operands& o, int64_t r0, int64_t b, int blocks, int64_t g0, int64_t g1) {
  if constexpr (kBlocks == 4) {
    switch (blocks) {
      case 4: return tile<R, 4>(o, r0, b, g0, g1);
      case 3: return tile<R, 3>(o, r0, b, g0, g1);
      case 2: return tile<R, 2>(o, r0, b, g0, g1);
    }
  }
  tile<R, 1>(o, r0, b, g0, g1);
}

// Each row count its own instance: loops over exactly the rows there are.
void any_tile(const Operands& o, int64_t r0, int rows, int64_t b, int blocks, int64_t g0, int64_t g1) {
  switch (rows) {
    case 1: return tile_rows<1>(o, r0, b, blocks, g0, g1);
    case 2: return tile_rows<2>(o, r0, b, blocks, g0, g1);
    case 3: return tile_rows<3>(o, r0, b, blocks, g0, g1);
  }
  if constexpr (kRows == 6) {
    switch (rows) {
      case 4: return tile_rows<4>(o, r0, b, blocks, g0, g1);
      case 5: return tile_rows<5>(o, r0, b, blocks, g0, g1);
    }
  }
  tile_rows<kRows>(o, r0, b, blocks, g0, g1);
}

}  // namespace

// x [M, K] bf16; w bf16 [N/16, K/32, 16, 32] (native.bf16_layout) → y [M, N] bf16.
void bf16_dot_into(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.dim() == 4,
              "bf16, 2-D x and a weight in native.bf16_layout");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && w.size(1) == G, "input size must be a multiple of 32 matching the weight");
  check_output(y, M * N);
  auto xc = x.contiguous();
  // One tile of rows reads all of K at once; more tiles share each chunk of K's weights while they are in L2.
  const bool chunked = M > kRows && G > kChunkGroups;
  torch::Tensor partial = chunked ? torch::empty({M, N}, x.options().dtype(torch::kFloat)) : torch::Tensor();
  const Operands o{(const uint16_t*)xc.data_ptr<at::BFloat16>(), (const uint16_t*)w.data_ptr<at::BFloat16>(),
                   (uint16_t*)y.data_ptr<at::BFloat16>(), chunked ? partial.data_ptr<float>() : nullptr, M, K, N, G};
  const int64_t chunk = chunked ? kChunkGroups : G;
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += kBlocks) {
      const int blocks = (int)std::min<int64_t>(kBlocks, b1 - b);
      for (int64_t g0 = 0; g0 < G; g0 += chunk)
        for (int64_t r0 = 0; r0 < M; r0 += kRows)
          any_tile(o, r0, (int)std::min<int64_t>(kRows, M - r0), b, blocks, g0, std::min(G, g0 + chunk));
    }
  });
}
