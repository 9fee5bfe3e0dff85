// y = x W' for fp32 (or fp16) weights stored transposed, W' = Wᵀ [K, N] (kernels.PackedLinear's layout), fp32
// activations and results.
//
// Why not PyTorch's x @ W' (MKL), which ran before: it gives a row other bits at another row count (from 5 rows
// on, on every shape tried), so a greedy answer could depend on its batch. Here each output of each row is one
// chain of fused multiply-adds in input order,
//   acc ← fma(x[k], W'[k, n], acc),  k = 0 … K − 1, from acc = 0,
// whatever the row count, the tile of rows and columns a row shares, the thread, or the chunk of K (between
// chunks the accumulator waits in y, in fp32: no bit changes). Columns past the last multiple of 16 take the same
// chain one at a time (fmaf), the same bits a vector lane would give.
#include "tensor.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace {

namespace vec = speculant::vec;
using vec::F;

// Rows × vectors of 16 columns a tile holds: AVX512's 32 registers take 24 accumulators and a row of weights;
// one or two rows take 8 vectors (a decode pass streams W' row by row: 16 were 0.9× MKL's speed, 8 as fast).
#if defined(__AVX512F__)
constexpr int kRows = 6;
constexpr int cols_for(int rows) { return rows <= 2 ? 8 : 4; }
#else  // AVX2: 16 registers, each F two of them
constexpr int kRows = 3;
constexpr int cols_for(int rows) { return rows == 1 ? 4 : 2; }
#endif
constexpr int64_t kChunk = 256;  // inputs a chunk of K when rows come in several tiles: a tile's W' within L2
// One tile of rows: chunks of 8 inputs across all of a thread's columns, W' streaming row by row as it lies in
// memory (as fast as MKL's, where chunks of 64 were 0.65× and all of K at once 0.5×, one row, 1.5B shapes).
constexpr int64_t kDecodeChunk = 8;
// One row streams W' as it lies (a decode pass's head is fastest so); more rows take it in runs of a tile's
// columns, chunk by chunk of K, which reuses each weight for every row while it is in a register.
constexpr int64_t kStreamedRows = 1;

inline F load_w(const float* p) { return vec::load(p); }
inline F load_w(const uint16_t* p) { return vec::load_fp16(p); }
inline float scalar(float w) { return w; }
inline float scalar(uint16_t w) { return (float)c10::Half(w, c10::Half::from_bits()); }  // exact, as F16C's

template <class T>
struct Operands {
  const float* X;  // [M, K]
  const T* W;      // [K, N]
  float* Y;        // [M, N]
  int64_t M, K, N;
};

// Rows r0 .. r0 + R, columns n0 .. n0 + 16·C, inputs k0 .. k1: accumulators from 0 (k0 = 0) or from y.
template <class T, int R, int C>
void tile(const Operands<T>& o, int64_t r0, int64_t n0, int64_t k0, int64_t k1) {
  F acc[R][C];
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++) acc[i][c] = k0 == 0 ? vec::zero() : vec::load(o.Y + (r0 + i) * o.N + n0 + 16 * c);
  const float* x = o.X + r0 * o.K;
  for (int64_t k = k0; k < k1; k++) {
    const T* wk = o.W + k * o.N + n0;
    F w[C];
    for (int c = 0; c < C; c++) w[c] = load_w(wk + 16 * c);
    for (int i = 0; i < R; i++) {
      const F xi = vec::set(x[i * o.K + k]);
      for (int c = 0; c < C; c++) acc[i][c] = vec::fmadd(w[c], xi, acc[i][c]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < C; c++) vec::store(o.Y + (r0 + i) * o.N + n0 + 16 * c, acc[i][c]);
}

// Vectors v0 .. v1 of 16 columns for rows r0 .. r0 + R, in tiles of cols_for(R) vectors, the last narrower.
template <class T, int R>
void tile_rows(const Operands<T>& o, int64_t r0, int64_t v0, int64_t v1, int64_t k0, int64_t k1) {
  constexpr int C = cols_for(R);
  int64_t v = v0;
  for (; v + C <= v1; v += C) tile<T, R, C>(o, r0, 16 * v, k0, k1);
  for (; v < v1; v++) tile<T, R, 1>(o, r0, 16 * v, k0, k1);
}

template <class T>
void any_rows(const Operands<T>& o, int64_t r0, int rows, int64_t v0, int64_t v1, int64_t k0, int64_t k1) {
  switch (rows) {
    case 1: return tile_rows<T, 1>(o, r0, v0, v1, k0, k1);
    case 2: return tile_rows<T, 2>(o, r0, v0, v1, k0, k1);
  }
  if constexpr (kRows == 6) {
    switch (rows) {
      case 3: return tile_rows<T, 3>(o, r0, v0, v1, k0, k1);
      case 4: return tile_rows<T, 4>(o, r0, v0, v1, k0, k1);
      case 5: return tile_rows<T, 5>(o, r0, v0, v1, k0, k1);
    }
  }
  tile_rows<T, kRows>(o, r0, v0, v1, k0, k1);
}

template <class T>
void f32_mm_impl(const Operands<T>& o) {
  const int64_t M = o.M, K = o.K, N = o.N, vectors = N / 16;
  // One tile of rows reads all of K at once; more tiles share each chunk of K's weights while they are in L2.
  const bool streamed = M <= kStreamedRows;
  const int64_t chunk = streamed ? kDecodeChunk : kChunk;
  // Threads take runs of 16 columns; a run of cols_for(1) vectors is a decode pass's unit.
  speculant::Team::parallel_for(0, vectors, 1, [&](int64_t v0, int64_t v1) {
    const int64_t run = streamed ? v1 - v0 : cols_for(std::min<int64_t>(M, kRows));
    for (int64_t a = v0; a < v1; a += run)
      for (int64_t k0 = 0; k0 < K; k0 += chunk)
        for (int64_t r0 = 0; r0 < M; r0 += kRows)
          any_rows(o, r0, (int)std::min<int64_t>(kRows, M - r0), a, std::min(v1, a + run), k0, std::min(K, k0 + chunk));
  });
  for (int64_t n = vectors * 16; n < N; n++)  // the last N mod 16 columns: each lane's chain, one at a time
    for (int64_t r = 0; r < M; r++) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; k++) acc = std::fmaf(o.X[r * K + k], scalar(o.W[k * N + n]), acc);
      o.Y[r * N + n] = acc;
    }
}

}  // namespace

// x [M, K] fp32; w [K, N] fp32 or fp16 → y [M, N] fp32.
torch::Tensor f32_mm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && w.dim() == 2 && w.size(0) == x.size(1),
              "fp32 x [M, K] and a weight [K, N]");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf, "fp32 or fp16 weights");
  auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* X = xc.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  if (w.scalar_type() == at::kFloat)
    f32_mm_impl(Operands<float>{X, wc.data_ptr<float>(), Y, M, K, N});
  else
    f32_mm_impl(Operands<uint16_t>{X, (const uint16_t*)wc.data_ptr<at::Half>(), Y, M, K, N});
  return y;
}
