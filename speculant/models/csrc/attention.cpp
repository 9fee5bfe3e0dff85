// Decode-time attention for bf16 on CPU, one query row at a time over exactly the keys it sees.
//
// PyTorch's CPU attention sums in an order that depends on the key count and on the other rows of the
// call, so a verify pass (several rows, a causal mask) or a batch (ragged rows) scored a row differently
// from plain decoding, and one bf16 rounding made it visible. Here a row's scores, softmax and weighted
// sum depend on its query, its keys and nothing else: the same bits at batch 1 or 32, alone or in a
// verify pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include <cmath>

namespace {

using speculant::exp_ps;
using speculant::load_bf16;
using speculant::to_bf16;

// One query row q [D] over n keys/values of k, v (row stride `stride` elements) → out [D]: rows 0 .. n-1, or
// with `index` the rows index[0 .. n-1] (a draft tree's node sees the cache and its ancestors only).
void attend_row(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t D,
                float scale, float* scores, uint16_t* out, const int64_t* index) {
  const int64_t chunks = D / 32;
  __m512i qv[8];
  for (int64_t c = 0; c < chunks; c++) qv[c] = _mm512_loadu_si512(q + 32 * c);
  float top = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    const int64_t row = index ? index[j] : j;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(k + row * stride + 32 * c));
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
    top = std::max(top, scores[j]);
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j), _mm512_set1_ps(top)));
    p = _mm512_maskz_mov_ps(live, p);
    _mm512_mask_storeu_ps(scores + j, live, p);
    total = _mm512_add_ps(total, p);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(total);
  __m512 acc[8];
  for (int64_t c = 0; c < D / 16; c++) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j++) {
    const __m512 p = _mm512_set1_ps(scores[j]);
    const int64_t row = index ? index[j] : j;
    for (int64_t c = 0; c < D / 16; c++) acc[c] = _mm512_fmadd_ps(p, load_bf16(v + row * stride + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < D / 16; c++) {
    alignas(64) float o[16];
    _mm512_store_ps(o, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
    for (int i = 0; i < 16; i++) out[16 * c + i] = to_bf16(o[i]);
  }
}

}  // namespace

// q [B, T, Hq, D] (any strides, the last dimension contiguous: a view of the qkv projection); keys, values
// [B, Hkv, S, D] (last dimension contiguous), or with `slots` [B] a whole cache layer [rows, Hkv, S, D] whose row
// slots[b] is sequence b's; n_keys [B, T]: the keys row (b, t) sees, the first n_keys[b, t] → [B, T, Hq, D]
// bf16, the layout the output projection reads. Query head h reads key head h / (Hq / Hkv).
// With `tree` [B, T] (int64 bit masks) the pass's new tokens are a draft tree: row (b, t), written at position
// n_keys[b, t] − 1 = start + t, sees the keys before `start` and the new tokens start + j whose bit j is set
// (itself and its ancestors), in position order, so a node attends exactly as its branch decoded alone would.
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor n_keys,
                        double scale, c10::optional<torch::Tensor> slots, c10::optional<torch::Tensor> tree) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "bf16 only");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = keys.size(1), S = keys.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256 && Hq % Hkv == 0, "head size must be a multiple of 32, at most 256");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
              "layout");
  auto nk = n_keys.to(torch::kLong).contiguous();
  auto rows = slots ? slots->to(torch::kLong).contiguous() : torch::arange(B, torch::kLong);
  auto out = torch::empty({B, T, Hq, D}, q.options());
  const uint16_t* Q = (const uint16_t*)q.data_ptr<at::BFloat16>();
  const uint16_t* K = (const uint16_t*)keys.data_ptr<at::BFloat16>();
  const uint16_t* V = (const uint16_t*)values.data_ptr<at::BFloat16>();
  const int64_t* N = nk.data_ptr<int64_t>();
  const int64_t* R = rows.data_ptr<int64_t>();
  auto bits = tree ? tree->to(torch::kLong).contiguous() : torch::Tensor();
  const int64_t* TB = tree ? bits.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(!tree || T <= 64, "a draft tree has at most 64 nodes");
  uint16_t* O = (uint16_t*)out.data_ptr<at::BFloat16>();
  const int64_t sb = keys.stride(0), sh = keys.stride(1), ss = keys.stride(2);
  const int64_t qb = q.stride(0), qt = q.stride(1), qh = q.stride(2);
  const int64_t group = Hq / Hkv;
  at::parallel_for(0, B * Hq * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(S);
    std::vector<int64_t> index(TB ? S : 0);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / (Hq * T), h = (i / T) % Hq, t = i % T;
      int64_t n = std::min<int64_t>(N[b * T + t], S);
      if (TB) {
        const int64_t start = std::max<int64_t>(n - 1 - t, 0);  // less only in a clamped padding row
        for (int64_t j = 0; j < start; j++) index[j] = j;
        n = start;
        for (int64_t j = 0; j <= t && start + j < S; j++)
          if ((TB[b * T + t] >> j) & 1) index[n++] = start + j;
      }
      const int64_t base = R[b] * sb + (h / group) * sh;
      attend_row(Q + b * qb + t * qt + h * qh, K + base, V + base, ss, n, D, (float)scale, scores.data(),
                 O + ((b * T + t) * Hq + h) * D, TB ? index.data() : nullptr);
    }
  });
  return out;
}
