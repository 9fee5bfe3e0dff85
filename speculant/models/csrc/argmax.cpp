// Each row's first maximum, as torch.argmax gives it (a NaN counts as the largest value), for the logits
// greedy decoding reads: bf16 straight from the lm_head (its fp32 copy is not needed) or fp32.
//
// torch.argmax on CPU reads a vocabulary-wide row slowly, and sampling.argmax's chunked amax took
// several small PyTorch operations a step.
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

using speculant::lanes;

// Masked-off lanes read −inf: they never win.
inline __m512 load_row(const float* p, __mmask16 m) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p);
}

inline __m512 load_row(const uint16_t* p, __mmask16 m) {
  const __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), v);
}

inline float value(const float* x, int64_t i) { return x[i]; }

inline float value(const uint16_t* x, int64_t i) {
  const uint32_t bits = uint32_t{x[i]} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Two passes: the maximum (four independent chains: a single one waits on max_ps's latency), then the
// first value equal to it.
template <typename T>
int64_t first_maximum(const T* x, int64_t n) {
  __m512 top[4];
  for (auto& t : top) t = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; u++) {
      const __m512 v = load_row(x + i + 16 * u, 0xFFFF);
      top[u] = _mm512_max_ps(top[u], v);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
  for (; i < n; i += 16) {
    const __m512 v = load_row(x + i, lanes(n - i));
    top[0] = _mm512_max_ps(top[0], v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (nan) {
    for (int64_t j = 0; j < n; j++)
      if (std::isnan(value(x, j))) return j;
  }
  const __m512 best = _mm512_set1_ps(
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]))));
  for (i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load_row(x + i, m), best, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;
}

}  // namespace

// x [..., V] bf16 or fp32 on CPU → the index of each row's first maximum, int64 [...].
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a bf16 or fp32 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t{1} << 31), "a row of 1 to 2^31 - 1 values");
  auto xc = x.contiguous();
  const int64_t V = xc.size(-1), R = xc.numel() / V;
  auto out = torch::empty(xc.sizes().slice(0, xc.dim() - 1), x.options().dtype(torch::kLong));
  int64_t* Y = out.data_ptr<int64_t>();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const void* X = xc.data_ptr();
  speculant::Team::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      Y[r] = bf16 ? first_maximum((const uint16_t*)X + r * V, V) : first_maximum((const float*)X + r * V, V);
  });
  return out;
}
