// Each row's first maximum, as torch.argmax gives it (a NaN counts as the largest value), for the logits
// greedy decoding reads: bf16 straight from the lm_head (its fp32 copy is not needed) or fp32.
//
// torch.argmax on CPU reads a vocabulary-wide row slowly, and sampling.argmax's chunked amax took
// several small PyTorch operations a step.
#include "tensor.h"
#include <immintrin.h>
#include <cmath>
#include <cstring>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

namespace vec = speculant::vec;

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
  vec::F top[4];
  for (auto& t : top) t = vec::set(-INFINITY);
  uint32_t nan = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; u++) {
      const vec::F v = vec::load_row(x + i + 16 * u, 16, -INFINITY);
      top[u] = vec::max(top[u], v);
      nan |= vec::nan(v);
    }
  for (; i < n; i += 16) {
    const vec::F v = vec::load_row(x + i, n - i, -INFINITY);  // past the row: never wins
    top[0] = vec::max(top[0], v);
    nan |= vec::nan(v);
  }
  if (nan) {
    for (int64_t j = 0; j < n; j++)
      if (std::isnan(value(x, j))) return j;
  }
  const vec::F best = vec::set(vec::top(vec::max(vec::max(top[0], top[1]), vec::max(top[2], top[3]))));
  for (i = 0; i < n; i += 16) {
    const uint32_t hit = vec::eq(vec::load_row(x + i, n - i, -INFINITY), best);  // a fill lane lies past the row: a real maximum comes first
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
