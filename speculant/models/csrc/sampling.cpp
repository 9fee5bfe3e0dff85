// Sampling over one row of logits (bf16 straight from the lm_head, or fp32) under a request's transforms
// (temperature, top-k, top-p, min-p, as sampling.probabilities applies them): the token a uniform draw
// lands on, which sampled decoding writes and which verify.py checks deterministic drafts (lookup, the
// corpus table, draft trees) against.
//
// In PyTorch a sampled step took ~10 operations over the vocabulary (the fp32 copy, the division by the
// temperature, softmax, the fp64 running sum, ...; with top_p, top-k's partial sort of 256 candidates and
// a vocabulary-wide scatter), a sizeable share of a plain int4 step; here two passes over the row, and a
// sort of the few likeliest tokens.
//
// The distribution: e_i = exp((x_i − max x) / T) in fp32 (bf16.h's exp_ps). Without top-k, top-p or min-p,
// p_i = e_i / Σ e. With them, the tokens in descending e (ties: the lower index first) are kept: the first
// top_k; of those (or of all), each whose mass before it is below top_p of their total (the first always);
// of those, each with e ≥ min_p (e of the likeliest is 1) — and p is e renormalized over the kept tokens.
// A draw with u in [0, 1) is the first token whose running sum of e, in fp64, exceeds u · Σ e (over the
// vocabulary in order, or over the kept tokens in their order). Over the vocabulary, blocks of 256
// exponentials are summed first and the draw looks inside its block only (block sums in fp32, the running
// sum in fp64; where the two disagree by a rounding at a block's edge the scan goes on into the next block).
#include "tensor.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace {

namespace vec = speculant::vec;

constexpr int64_t kBlock = 256;

struct Transforms {
  float inv_temperature;
  int64_t top_k;  // 0: off
  double top_p;   // 1: off
  double min_p;   // 0: off

  bool any() const { return top_k > 0 || top_p < 1 || min_p > 0; }
};

struct Exponentials {
  std::vector<float>& e;      // [V]: e_i
  std::vector<float>& block;  // [V / kBlock rounded up]: each block's sum
  double total = 0;
};

// The row's e_i and their block sums.
template <typename T>
Exponentials exponentials(const T* x, int64_t V, float inv_temperature) {
  static thread_local std::vector<float> e, block;
  e.resize((V + 15) / 16 * 16);
  block.resize((V + kBlock - 1) / kBlock);
  vec::F top = vec::set(-INFINITY);
  for (int64_t i = 0; i < V; i += 16) top = vec::max(top, vec::load_row(x + i, V - i, -INFINITY));
  const vec::F peak = vec::set(vec::top(top)), scale = vec::set(inv_temperature);
  Exponentials out{e, block};
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    vec::F sum = vec::zero();
    for (int64_t i = b0; i < std::min(b0 + kBlock, V); i += 16) {
      const vec::F v = vec::keep(vec::exp((vec::load_row(x + i, V - i, 0.f) - peak) * scale), V - i);
      vec::store(e.data() + i, v);
      sum = sum + v;
    }
    block[b0 / kBlock] = vec::sum(sum);
    out.total += block[b0 / kBlock];
  }
  return out;
}

// The tokens with e ≥ floor, in descending e (ties: the lower index first).
std::vector<int32_t> likeliest(const std::vector<float>& e, int64_t V, float floor) {
  std::vector<int32_t> tokens;
  const vec::F f = vec::set(floor);
  for (int64_t i = 0; i < V; i += 16) {
    uint32_t m = vec::ge(vec::load(e.data() + i, V - i, -INFINITY), f);  // past the row: −inf, never kept
    for (; m; m &= m - 1) tokens.push_back((int32_t)(i + __builtin_ctz(m)));
  }
  std::sort(tokens.begin(), tokens.end(), [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
  return tokens;
}

// The kept tokens in their order (see the top of the file). Candidates are the tokens within a factor
// 10^3 of the likeliest (then 10^6, 10^12, all) until the transforms stop inside them: top_k of them, the
// mass top-p reads to, or min-p's floor above theirs.
std::vector<int32_t> kept_tokens(const Exponentials& ex, int64_t V, const Transforms& t) {
  for (float floor : {1e-3f, 1e-6f, 1e-12f, 0.f}) {
    const bool last = floor == 0;
    std::vector<int32_t> tokens = likeliest(ex.e, V, floor);
    bool cut = false;  // a transform stopped inside the candidates: the tokens below them do not matter
    if (t.top_k > 0) {
      if ((int64_t)tokens.size() < t.top_k && !last) continue;
      cut = (int64_t)tokens.size() >= t.top_k;
      if (cut) tokens.resize(t.top_k);
    }
    if (t.top_p < 1) {
      double reference = ex.total;  // top-p's mass is over the top-k tokens where top-k is on
      if (t.top_k > 0) {
        reference = 0;
        for (int32_t i : tokens) reference += ex.e[i];
      }
      double before = 0;
      size_t n = 0;
      while (n < tokens.size() && (n == 0 || before < t.top_p * reference)) before += ex.e[tokens[n++]];
      cut = cut || before >= t.top_p * reference;
      tokens.resize(n);
    }
    if (!cut && !last && t.min_p < floor) continue;
    if (t.min_p > 0)
      tokens.erase(std::remove_if(tokens.begin(), tokens.end(), [&](int32_t i) { return ex.e[i] < t.min_p; }),
                   tokens.end());
    return tokens;
  }
  return {};
}

template <typename T>
int64_t sample(const T* x, int64_t V, const Transforms& t, double u) {
  const Exponentials ex = exponentials(x, V, t.inv_temperature);
  if (t.any()) {
    const std::vector<int32_t> kept = kept_tokens(ex, V, t);
    double total = 0;
    for (int32_t i : kept) total += ex.e[i];
    double run = 0;
    for (int32_t i : kept) {
      run += ex.e[i];
      if (run > u * total) return i;
    }
    return kept.back();  // u · Σe rounded up to Σe
  }
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

Transforms transforms(const torch::Tensor& row, double inv_temperature, int64_t top_k, double top_p,
                      double min_p) {
  TORCH_CHECK(row.device().is_cpu() && row.dim() == 1 && row.is_contiguous() &&
                  (row.scalar_type() == at::kBFloat16 || row.scalar_type() == at::kFloat),
              "a row of logits: a contiguous 1-D bf16 or fp32 CPU tensor");
  TORCH_CHECK(inv_temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
              "temperature > 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1");
  return {(float)inv_temperature, top_k, top_p, min_p};
}

}  // namespace

int64_t sample_row(torch::Tensor row, double inv_temperature, int64_t top_k, double top_p, double min_p, double u) {
  const Transforms t = transforms(row, inv_temperature, top_k, top_p, min_p);
  TORCH_CHECK(u >= 0 && u < 1, "u must lie in [0, 1)");
  if (row.scalar_type() == at::kBFloat16) return sample((const uint16_t*)row.data_ptr(), row.size(0), t, u);
  return sample(row.data_ptr<float>(), row.size(0), t, u);
}
