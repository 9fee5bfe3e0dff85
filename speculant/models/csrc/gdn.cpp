// Gated DeltaNet's recurrence (models/gdn.py), one value head of one row a task, token after token:
//
//   S ← S·exp(g);  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq      (q, k L2-normalised, q scaled by 1/√dk)
//
// In PyTorch each token made ~8 operations over the whole [heads, dk, dv] state, each writing a fresh 2 MiB
// tensor; here a token reads the state once and writes it once, and a state nobody keeps (inside a prompt)
// stays in a 64 KiB buffer of the task's. Each (row, head) runs its tokens in one fixed order whatever the
// batch, the pass's width or the thread that takes it, so a row's bits do not depend on its company.
#include "tensor.h"
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "kernels.h"
#include "team.h"
#include "vec.h"

namespace {

namespace vec = speculant::vec;

constexpr int64_t MAX_DV = 256;  // vectors of 16 per state row held in registers' place (on the stack)

// x / √(x·x + 1e-6) · scale, over d values.
void l2_normalise(const float* x, float* out, int64_t d, float scale) {
  vec::F squares = vec::zero();
  for (int64_t i = 0; i < d; i += 16) {
    const vec::F v = vec::load(x + i, d - i, 0.f);
    squares = vec::fmadd(v, v, squares);
  }
  const float s = scale / std::sqrt(vec::sum(squares) + 1e-6f);
  for (int64_t i = 0; i < d; i++) out[i] = x[i] * s;
}

struct Shapes {
  int64_t B, T, Hk, Hv, dk, dv;
  bool tiled;
};

// Row b's value head h over its T tokens. `src` the state it starts from; kept[t] (or null) where the state after
// t + 1 tokens goes, else the task's scratch.
void head_run(const Shapes& s, int64_t b, int64_t h, const float* Q, const float* K, const float* V, const float* beta,
              const float* g, const float* src, float* const* kept, float* out, float* scratch) {
  const int64_t dk = s.dk, dv = s.dv, nv = (dv + 15) / 16;
  const int64_t kh = s.tiled ? h % s.Hk : h / (s.Hv / s.Hk);
  float q[MAX_DV], k[MAX_DV];
  vec::F acc[MAX_DV / 16], delta[MAX_DV / 16];
  const float* S = src;
  for (int64_t t = 0; t < s.T; t++) {
    const int64_t bt = b * s.T + t;
    l2_normalise(Q + (bt * s.Hk + kh) * dk, q, dk, 1.f / std::sqrt((float)dk));
    l2_normalise(K + (bt * s.Hk + kh) * dk, k, dk, 1.f);
    const vec::F decay = vec::set(std::exp(g[bt * s.Hv + h])), b_t = vec::set(beta[bt * s.Hv + h]);
    // Sᵀk of the decayed state, then the update's row vector δ = β(v − Sᵀk).
    for (int64_t j = 0; j < nv; j++) acc[j] = vec::zero();
    for (int64_t i = 0; i < dk; i++) {
      const vec::F ki = vec::set(k[i]);
      for (int64_t j = 0; j < nv; j++) acc[j] = vec::fmadd(vec::load(S + i * dv + j * 16, dv - j * 16, 0.f), ki, acc[j]);
    }
    const float* v = V + (bt * s.Hv + h) * dv;
    for (int64_t j = 0; j < nv; j++) delta[j] = (vec::load(v + j * 16, dv - j * 16, 0.f) - acc[j] * decay) * b_t;
    // S' = S·decay + k ⊗ δ, row by row (in place where S is the scratch), and o = S'ᵀq as the rows pass.
    float* dst = kept[t] ? kept[t] : scratch;
    for (int64_t j = 0; j < nv; j++) acc[j] = vec::zero();
    for (int64_t i = 0; i < dk; i++) {
      const vec::F ki = vec::set(k[i]), qi = vec::set(q[i]);
      for (int64_t j = 0; j < nv; j++) {
        const int64_t left = dv - j * 16;
        const vec::F row = vec::fmadd(ki, delta[j], vec::load(S + i * dv + j * 16, left, 0.f) * decay);
        vec::store(dst + i * dv + j * 16, row, left);
        acc[j] = vec::fmadd(row, qi, acc[j]);
      }
    }
    float* o = out + (bt * s.Hv + h) * dv;
    for (int64_t j = 0; j < nv; j++) vec::store(o + j * 16, acc[j], dv - j * 16);
    S = dst;
  }
}

void check_f32(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.dim() == dims, name,
              " must be a contiguous fp32 CPU tensor of ", dims, " dimensions");
}

}  // namespace

// q, k [B, T, Hk, dk], v [B, T, Hv, dv], beta, g [B, T, Hv] (g the log of the decay), state [B, Hv, dk, dv]: every
// fp32, contiguous; keep [B, T] bool: the positions whose states are returned. → (out [B, T, Hv, dv], the kept
// states [Hv, dk, dv] each a tensor of its own, in (b, t) order). `state` is only read.
std::tuple<torch::Tensor, std::vector<torch::Tensor>> gdn_recurrence(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                                     torch::Tensor beta, torch::Tensor g,
                                                                     torch::Tensor state, torch::Tensor keep,
                                                                     bool tiled) {
  check_f32(q, "q", 4);
  check_f32(k, "k", 4);
  check_f32(v, "v", 4);
  check_f32(beta, "beta", 3);
  check_f32(g, "g", 3);
  check_f32(state, "state", 4);
  const Shapes s{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), tiled};
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == s.B && v.size(1) == s.T && s.Hv % s.Hk == 0, "q, k, v shapes");
  TORCH_CHECK(beta.size(0) == s.B && beta.size(1) == s.T && beta.size(2) == s.Hv && g.sizes() == beta.sizes(),
              "beta and g must be [B, T, value heads]");
  TORCH_CHECK(state.size(0) == s.B && state.size(1) == s.Hv && state.size(2) == s.dk && state.size(3) == s.dv,
              "state must be [B, value heads, dk, dv]");
  TORCH_CHECK(s.dk <= MAX_DV && s.dv <= MAX_DV, "head sizes above ", MAX_DV);
  auto keep_c = keep.to(torch::kBool).contiguous();
  TORCH_CHECK(keep_c.numel() == s.B * s.T, "keep must be [B, T]");
  const bool* kp = keep_c.data_ptr<bool>();
  std::vector<torch::Tensor> kept;
  std::vector<float*> where(s.B * s.T * s.Hv, nullptr);  // (b, t, h) → its kept state's head, or null
  for (int64_t bt = 0; bt < s.B * s.T; bt++)
    if (kp[bt]) {
      kept.push_back(torch::empty({s.Hv, s.dk, s.dv}, q.options()));
      for (int64_t h = 0; h < s.Hv; h++) where[bt * s.Hv + h] = kept.back().data_ptr<float>() + h * s.dk * s.dv;
    }
  auto out = torch::empty({s.B, s.T, s.Hv, s.dv}, q.options());
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *Bt = beta.data_ptr<float>(), *G = g.data_ptr<float>(), *S0 = state.data_ptr<float>();
  float* O = out.data_ptr<float>();
  speculant::Team::parallel_for(0, s.B * s.Hv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(s.dk * s.dv);
    std::vector<float*> dst(s.T);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / s.Hv, h = i % s.Hv;
      for (int64_t t = 0; t < s.T; t++) dst[t] = where[(b * s.T + t) * s.Hv + h];
      head_run(s, b, h, Q, K, V, Bt, G, S0 + (b * s.Hv + h) * s.dk * s.dv, dst.data(), O, scratch.data());
    }
  });
  return {out, kept};
}
