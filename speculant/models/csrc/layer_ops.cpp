// The small per-layer operations of a bf16 decoder on CPU, one call each: RMSNorm (of rows, or in place of
// each q and k head), rotary embedding (in place), SwiGLU's silu(gate)·up and GeGLU's gelu_tanh(gate)·up.
//
// At decode time a row is 576 numbers and PyTorch spends more time dispatching these operations than
// computing them: its RMSNorm alone runs as about ten operations (upcast, square, mean, rsqrt, products,
// downcast), 61 norms per pass on SmolLM2-135M. Each function here computes a row in fp32 and
// rounds once; a row's result depends on that row alone, so verify passes and batches score rows as
// plain decoding does.
#include "tensor.h"
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#include <cmath>

namespace {

namespace vec = speculant::vec;

constexpr int64_t ROWS_PER_TASK = 64;  // decode rows are tiny: a thread per 64 of them, else one thread

// Lanes from `left` on (a row's last, partial vector) read 0 and are not written.
inline vec::F load(const uint16_t* p, int64_t left) { return vec::load_bf16(p, left, 0.f); }

inline void store(uint16_t* p, vec::F x, int64_t left) { vec::store_bf16(p, x, left); }

const uint16_t* bf16_data(const torch::Tensor& t) { return (const uint16_t*)t.data_ptr<at::BFloat16>(); }
uint16_t* bf16_data_mut(torch::Tensor& t) { return (uint16_t*)t.data_ptr<at::BFloat16>(); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bf16 CPU tensor");
}

// One row of D: y = x / rms(x) · w.
void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t D, double eps) {
  vec::F squares = vec::zero();
  for (int64_t i = 0; i < D; i += 16) {
    const vec::F v = load(x + i, D - i);
    squares = vec::fmadd(v, v, squares);
  }
  const vec::F scale = vec::set(1.f / std::sqrt(vec::sum(squares) / D + (float)eps));
  for (int64_t i = 0; i < D; i += 16) store(y + i, load(x + i, D - i) * scale * load(w + i, D - i), D - i);
}

}  // namespace

// x [..., D], weight [D] → out = x / rms(x) · weight, [..., D] contiguous (out may be x itself: a row is read
// before it is written).
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "weight size");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  check_output(out, xc.numel());
  const uint16_t *X = bf16_data(xc), *W = bf16_data(wc);
  uint16_t* Y = bf16_data_mut(out);
  speculant::Team::parallel_for(0, xc.numel() / D, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) norm_row(X + r * D, W, Y + r * D, D, eps);
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_into(x, weight, eps, out);
  return out;
}

// x [R, H, Dh] (contiguous): heads 0 .. n_q − 1 of every row normed in place by q_weight [Dh], the next n_k
// heads by k_weight (Qwen3's and Gemma 3's q/k norms): each head as rms_norm normalises a row of Dh.
void head_norms_(torch::Tensor x, const torch::Tensor& q_weight, const torch::Tensor& k_weight, int64_t n_q,
                 int64_t n_k, double eps) {
  check_bf16(x, "x");
  check_bf16(q_weight, "q_weight");
  check_bf16(k_weight, "k_weight");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous [rows, heads, head_dim] tensor");
  const int64_t R = x.size(0), H = x.size(1), Dh = x.size(2);
  TORCH_CHECK(n_q + n_k <= H && q_weight.numel() == Dh && k_weight.numel() == Dh, "shapes");
  auto qw = q_weight.contiguous(), kw = k_weight.contiguous();
  const uint16_t *Wq = bf16_data(qw), *Wk = bf16_data(kw);
  uint16_t* X = bf16_data_mut(x);
  speculant::Team::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t h = 0; h < n_q + n_k; h++) {
        uint16_t* head = X + (r * H + h) * Dh;
        norm_row(head, h < n_q ? Wq : Wk, head, Dh, eps);
      }
  });
}

// The residual sum and the next norm in one call (a decoder layer's two ATen additions each cost about as
// much as its norms): x, y [..., D] → sum = x + y rounded to bf16 as PyTorch's sum is, normed = rms_norm of
// that sum.
void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& weight, double eps,
                       torch::Tensor& sum, torch::Tensor& normed) {
  check_bf16(x, "x");
  check_bf16(y, "y");
  check_bf16(weight, "weight");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D && x.sizes() == y.sizes() && sum.numel() == x.numel() &&
                  normed.numel() == x.numel() && sum.is_contiguous() && normed.is_contiguous(),
              "shapes: x and y alike, sum and normed contiguous of their size, weight [D]");
  auto xc = x.contiguous(), yc = y.contiguous(), wc = weight.contiguous();
  const uint16_t *X = bf16_data(xc), *Y = bf16_data(yc), *W = bf16_data(wc);
  uint16_t *S = bf16_data_mut(sum), *N = bf16_data_mut(normed);
  speculant::Team::parallel_for(0, xc.numel() / D, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      for (int64_t i = 0; i < D; i += 16)
        store(S + r * D + i, load(X + r * D + i, D - i) + load(Y + r * D + i, D - i), D - i);
      norm_row(S + r * D, W, N + r * D, D, eps);
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight,
                                                      double eps) {
  auto sum = torch::empty_like(x, at::MemoryFormat::Contiguous), normed = torch::empty_like(sum);
  add_rms_norm_into(x, y, weight, eps, sum, normed);
  return {sum, normed};
}

// x [R, H, Dh] (contiguous): the first n_heads heads of every row rotated in place by the row's cos and
// signed sin [R, Dh] (rotate-half layout, sin's first half negated: y = x·cos + roll(x, Dh/2)·sin).
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n_heads) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be a contiguous [rows, heads, head_dim] tensor");
  const int64_t R = x.size(0), H = x.size(1), Dh = x.size(2), half = Dh / 2;
  TORCH_CHECK(Dh % 2 == 0 && n_heads <= H && cos.numel() == R * Dh && sin.numel() == R * Dh, "shapes");
  auto cc = cos.contiguous(), sc = sin.contiguous();
  const uint16_t *C = bf16_data(cc), *S = bf16_data(sc);
  uint16_t* X = bf16_data_mut(x);
  speculant::Team::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const uint16_t *c = C + r * Dh, *s = S + r * Dh;
      for (int64_t h = 0; h < n_heads; h++) {
        uint16_t* v = X + (r * H + h) * Dh;
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t m = half - i;
          const vec::F a = load(v + i, m), b = load(v + half + i, m);
          const vec::F ya = vec::fmadd(b, load(s + i, m), a * load(c + i, m));
          const vec::F yb = vec::fmadd(a, load(s + half + i, m), b * load(c + half + i, m));
          store(v + i, ya, m);
          store(v + half + i, yb, m);
        }
      }
    }
  });
}

namespace {

// gate_up [..., 2n] (gate, then up) → out = act(gate) · up, [..., n], act(g) computed 16 lanes at a time.
template <typename Act>
void gated_into(const torch::Tensor& gate_up, torch::Tensor& out, Act act) {
  check_bf16(gate_up, "gate_up");
  const int64_t n = gate_up.size(-1) / 2;
  auto gu = gate_up.contiguous();
  const int64_t R = gu.numel() / (2 * n);
  check_output(out, R * n);
  const uint16_t* G = bf16_data(gu);
  uint16_t* Y = bf16_data_mut(out);
  speculant::Team::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const uint16_t *g = G + r * 2 * n, *u = g + n;
      for (int64_t i = 0; i < n; i += 16) store(Y + r * n + i, act(load(g + i, n - i)) * load(u + i, n - i), n - i);
    }
  });
}

torch::Tensor gated(const torch::Tensor& gate_up, void (*into)(const torch::Tensor&, torch::Tensor&)) {
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() /= 2;
  auto out = torch::empty(shape, gate_up.options());
  into(gate_up, out);
  return out;
}

}  // namespace

void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out) {
  gated_into(gate_up, out, [](vec::F g) { return g * (vec::set(1.f) / (vec::set(1.f) + vec::exp(vec::zero() - g))); });
}

// GELU's tanh form, 0.5·g·(1 + tanh(u)) with u = √(2/π)·(g + 0.044715·g³), as g·sigmoid(2u): one exp, rounded
// once with the product (PyTorch rounds the GELU to bf16 before it).
void gelu_tanh_mul_into(const torch::Tensor& gate_up, torch::Tensor& out) {
  gated_into(gate_up, out, [](vec::F g) {
    const vec::F u2 = g * vec::fmadd(g * g, vec::set(2 * 0.7978845608f * 0.044715f), vec::set(2 * 0.7978845608f));
    return g / (vec::set(1.f) + vec::exp(vec::zero() - u2));
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) { return gated(gate_up, silu_mul_into); }
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) { return gated(gate_up, gelu_tanh_mul_into); }
