// Sampling from softmax(x / temperature) over one row of logits (bf16 straight from the lm_head, or fp32),
// and the probability of one token: what verify.py's acceptance rule reads for drafts that come without a
// distribution (lookup, the corpus table) under temperature alone, the OpenAI API's default transforms.
//
// In PyTorch a sampled step took ~10 operations over the vocabulary (the fp32 copy, the division by the
// temperature, softmax, the fp64 running sum, ...): ~0.39 ms of a 2.8 ms plain int4 step (SmolLM2, 49152
// tokens, temperature 0.7), where this reads the row twice and keeps the exponentials in L2.
//
// The distribution: e_i = exp((x_i − max x) / T) in fp32 (bf16.h's exp_ps), p_i = e_i / Σ e. A draw with
// u in [0, 1) is the first token whose running sum of e, in fp64, exceeds u · Σ e; the excluded token (a
// rejected draft: the rule's residual) counts as e = 0. Blocks of 256 exponentials are summed first and
// the draw looks inside its block only: block sums in fp32, the running sum in fp64 over block sums then
// tokens, so its rounding stays far below any probability that matters; where the two disagree by a
// rounding at a block's edge the scan goes on into the next block.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace {

using speculant::exp_ps;
using speculant::lanes;

constexpr int64_t kBlock = 256;

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}

struct Exponentials {
  std::vector<float>& e;      // [V]: e_i, 0 for the excluded token
  std::vector<float>& block;  // [V / kBlock rounded up]: each block's sum
  double total = 0;
};

// The row's e_i (exclude: a token whose e_i is taken as 0, or −1) and their block sums.
template <typename T>
Exponentials exponentials(const T* x, int64_t V, float inv_temperature, int64_t exclude) {
  static thread_local std::vector<float> e, block;
  e.resize((V + 15) / 16 * 16);
  block.resize((V + kBlock - 1) / kBlock);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = lanes(V - i);
    top = _mm512_mask_max_ps(top, m, top, load(x + i, m));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top)), scale = _mm512_set1_ps(inv_temperature);
  Exponentials out{e, block};
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = b0; i < std::min(b0 + kBlock, V); i += 16) {
      __mmask16 m = lanes(V - i);
      if (exclude >= i && exclude < i + 16) m &= ~(__mmask16)(1u << (exclude - i));
      const __m512 v = _mm512_maskz_mov_ps(m, exp_ps(_mm512_mul_ps(_mm512_sub_ps(load(x + i, m), peak), scale)));
      _mm512_storeu_ps(e.data() + i, v);
      sum = _mm512_add_ps(sum, v);
    }
    block[b0 / kBlock] = _mm512_reduce_add_ps(sum);
    out.total += block[b0 / kBlock];
  }
  return out;
}

template <typename T>
double probability(const T* x, int64_t V, float inv_temperature, int64_t token) {
  const Exponentials ex = exponentials(x, V, inv_temperature, -1);
  return ex.e[token] / ex.total;
}

template <typename T>
int64_t sample(const T* x, int64_t V, float inv_temperature, double u, int64_t exclude) {
  const Exponentials ex = exponentials(x, V, inv_temperature, exclude);
  TORCH_CHECK(ex.total > 0, "no token left to draw");
  const double target = u * ex.total;
  double run = 0;
  int64_t b = 0, last = -1;
  for (; b + 1 < (int64_t)ex.block.size() && run + ex.block[b] <= target; b++) run += ex.block[b];
  for (int64_t i = b * kBlock; i < V; i++) {
    if (ex.e[i] <= 0) continue;
    last = i;
    run += ex.e[i];
    if (run > target) return i;
  }
  // u · Σe rounds up to Σe once in ~2^53 draws: the last token of positive probability.
  for (int64_t i = V - 1; last < 0 && i >= 0; i--)
    if (ex.e[i] > 0) last = i;
  return last;
}

void check_row(const torch::Tensor& row, int64_t token) {
  TORCH_CHECK(row.device().is_cpu() && row.dim() == 1 && row.is_contiguous() &&
                  (row.scalar_type() == at::kBFloat16 || row.scalar_type() == at::kFloat),
              "a row of logits: a contiguous 1-D bf16 or fp32 CPU tensor");
  TORCH_CHECK(token >= -1 && token < row.size(0), "token ", token, " is outside the row");
}

}  // namespace

double token_probability(torch::Tensor row, double inv_temperature, int64_t token) {
  check_row(row, token);
  TORCH_CHECK(token >= 0, "a token of the row");
  if (row.scalar_type() == at::kBFloat16)
    return probability((const uint16_t*)row.data_ptr(), row.size(0), (float)inv_temperature, token);
  return probability(row.data_ptr<float>(), row.size(0), (float)inv_temperature, token);
}

int64_t sample_row(torch::Tensor row, double inv_temperature, double u, int64_t exclude) {
  check_row(row, exclude);
  TORCH_CHECK(u >= 0 && u < 1, "u must lie in [0, 1)");
  if (row.scalar_type() == at::kBFloat16)
    return sample((const uint16_t*)row.data_ptr(), row.size(0), (float)inv_temperature, u, exclude);
  return sample(row.data_ptr<float>(), row.size(0), (float)inv_temperature, u, exclude);
}
