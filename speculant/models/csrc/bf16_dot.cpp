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
#include <vector>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

namespace vec = speculant::vec;
using vec::F;

#if defined(__AVX512F__)
// Tiles of up to 10 rows × 2 blocks of 16 outputs (20 accumulators), or 5 rows × 4 blocks: a few rows take more
// blocks at once (a decode pass's chains), prompts more rows per weight vector loaded (measured best of 6×4, 8×3,
// 10×2 and 4×6 on a 1.5B model's shapes). Threads take runs of kBlocks blocks.
constexpr int kRows = 10, kBlocks = 4;
constexpr int blocks_for(int rows) { return rows <= 5 ? 4 : 2; }

struct Pairs {  // 16 outputs' bf16 pairs (2i, 2i + 1): one row of a weight tile
  __m512i v;
};
inline Pairs load_pairs(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }

struct Pair {  // one input pair (2i, 2i + 1) of a row, in every lane
  __m512bh v;
};
inline Pair pair_at(const uint16_t* x) {
  int32_t bits;
  memcpy(&bits, x, 4);
  return {(__m512bh)_mm512_set1_epi32(bits)};
}

// acc + each lane's pair of w times the row's pair. A broadcast of its own, shared by a tile's blocks: with the
// broadcast folded into the instruction (asm), GCC stored every accumulator at every step, 3× slower.
inline F dot(F acc, const Pairs& w, const Pair& x) { return {_mm512_dpbf16_ps(acc.v, (__m512bh)w.v, x.v)}; }

#else
// AVX2's 16 registers: each block's pairs take 4 (even and odd members, lanes 0-7 and 8-15), a tile one block.
constexpr int kRows = 4, kBlocks = 1;
constexpr int blocks_for(int) { return 1; }

struct Pairs {
  __m256 even_lo, even_hi, odd_lo, odd_hi;
};
inline Pairs load_pairs(const uint16_t* p) {
  const __m256i lo = _mm256_loadu_si256((const __m256i*)p), hi = _mm256_loadu_si256((const __m256i*)(p + 16));
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))};
}

struct Pair {
  __m256 even, odd;
};
inline Pair pair_at(const uint16_t* x) {
  uint32_t even = (uint32_t)x[0] << 16, odd = (uint32_t)x[1] << 16;
  float xe, xo;
  memcpy(&xe, &even, 4), memcpy(&xo, &odd, 4);
  return {_mm256_set1_ps(xe), _mm256_set1_ps(xo)};
}

// The same sum as two FMAs, the even member's product first: exact products (bf16 × bf16 fits fp32), each
// sum rounded once.
inline F dot(F acc, const Pairs& w, const Pair& x) {
  acc.lo = _mm256_fmadd_ps(w.odd_lo, x.odd, _mm256_fmadd_ps(w.even_lo, x.even, acc.lo));
  acc.hi = _mm256_fmadd_ps(w.odd_hi, x.odd, _mm256_fmadd_ps(w.even_hi, x.even, acc.hi));
  return acc;
}
#endif

// Groups of 32 inputs a chunk of K, where rows come in several tiles: a run's weights for a chunk (256 KB) are
// read from memory once for all the tiles, the rows' inputs for a chunk (4 KB a row) once for all the runs. One
// chunk (no partial sums) up to K = 2048, a 1.5B model's but for its down projection.
constexpr int64_t kChunkGroups = 64;

struct Operands {
  const uint16_t* X;  // [M, K]
  const uint16_t* W;  // [N/16, G, 16, 32]
  uint16_t* Y;        // [M, N]
  int64_t M, K, N, G;
};

// Rows r0 .. r0 + R, blocks b .. b + C, groups g0 .. g1: accumulators from 0 (g0 = 0) or from `part` (the run's
// partial sums, [M][kBlocks × 16] from its block `at`, b's place in it), to `part` or, after the last group,
// rounded to bf16 into Y.
template <int R, int C>
void tile(const Operands& o, float* part, int64_t r0, int64_t b, int at, int64_t g0, int64_t g1) {
  F acc[R][C];
  float* rows = part + (r0 * kBlocks + at) * 16;
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++) acc[i][c] = g0 == 0 ? vec::zero() : vec::load(rows + (i * kBlocks + c) * 16);
  const uint16_t* x = o.X + r0 * o.K;
  for (int64_t g = g0; g < g1; g++) {
    for (int c = 0; c < C; c++)  // this block's stream 4 groups (4 KB) ahead
      for (int line = 0; line < 1024; line += 64)
        _mm_prefetch((const char*)(o.W + ((b + c) * o.G + g + 4) * 512) + line, _MM_HINT_T0);
    for (int p = 0; p < 16; p++) {
      Pairs w[C];
      for (int c = 0; c < C; c++) w[c] = load_pairs(o.W + (((b + c) * o.G + g) * 16 + p) * 32);
      for (int i = 0; i < R; i++) {
        const Pair xi = pair_at(x + i * o.K + g * 32 + 2 * p);
        for (int c = 0; c < C; c++) acc[i][c] = dot(acc[i][c], w[c], xi);
      }
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++) {
      if (g1 == o.G)
        vec::store_bf16(o.Y + (r0 + i) * o.N + (b + c) * 16, acc[i][c]);
      else
        vec::store(rows + (i * kBlocks + c) * 16, acc[i][c]);
    }
}

// A run's `blocks` blocks from b for rows r0 .. r0 + R, blocks_for(R) at a time. Each row and block count its own
// instance: loops over exactly the rows and blocks there are.
template <int R, int C = blocks_for(R)>
void tile_blocks(const Operands& o, float* part, int64_t r0, int64_t b, int at, int blocks, int64_t g0, int64_t g1) {
  if constexpr (C > 1)
    if (blocks < C) return tile_blocks<R, C - 1>(o, part, r0, b, at, blocks, g0, g1);
  tile<R, C>(o, part, r0, b, at, g0, g1);
  if (blocks > C) tile_blocks<R>(o, part, r0, b + C, at + C, blocks - C, g0, g1);
}

template <int R = kRows>
void any_tile(const Operands& o, float* part, int64_t r0, int rows, int64_t b, int blocks, int64_t g0, int64_t g1) {
  if constexpr (R > 1)
    if (rows < R) return any_tile<R - 1>(o, part, r0, rows, b, blocks, g0, g1);
  tile_blocks<R>(o, part, r0, b, 0, blocks, g0, g1);
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
  const Operands o{(const uint16_t*)xc.data_ptr<at::BFloat16>(), (const uint16_t*)w.data_ptr<at::BFloat16>(),
                   (uint16_t*)y.data_ptr<at::BFloat16>(), M, K, N, G};
  // One tile of rows reads all of K at once.
  const int64_t chunk = M > kRows ? kChunkGroups : G;
  speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    // Partial sums between chunks, each run's rows side by side ([M, N] rows lay N apart, a page each): the
    // thread's share of the output in fp32, kept from call to call as quantized.cpp's buffers are.
    static thread_local std::vector<float> partial;
    const int64_t run_floats = M * kBlocks * 16;
    if (chunk < G) partial.resize(std::max<size_t>(partial.size(), (b1 - b0 + kBlocks - 1) / kBlocks * run_floats));
    // Chunks of K outside, runs inside: a chunk of the rows' inputs stays in L2 for every run.
    for (int64_t g0 = 0; g0 < G; g0 += chunk)
      for (int64_t b = b0; b < b1; b += kBlocks) {
        float* part = chunk < G ? partial.data() + (b - b0) / kBlocks * run_floats : nullptr;
        for (int64_t r0 = 0; r0 < M; r0 += kRows)
          any_tile(o, part, r0, (int)std::min<int64_t>(kRows, M - r0), b, (int)std::min<int64_t>(kBlocks, b1 - b),
                   g0, std::min(G, g0 + chunk));
      }
  });
}
