// A mixture of experts' MLP in one call: each expert its tokens chose runs its gated MLP over them, and each
// token adds its experts' outputs, times the router's weights, in ascending expert order. models/moe.py's
// loop computes the same, one PyTorch op at a time: bf16 products and sums rounded as PyTorch rounds them, so
// the bits are the same whichever runs, and a row's output never depends on the other rows of the pass.
#include "tensor.h"
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

#include <cstring>
#include <vector>

#include "kernels.h"

Experts::Experts(std::vector<std::vector<torch::Tensor>> gate_up, std::vector<std::vector<torch::Tensor>> down,
                 int64_t inner)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), inner_(inner) {
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "one gate_up and one down projection an expert");
}

// x [N, D] bf16, chosen [N, k] int64 expert ids, weights [N, k] bf16 → [N, D] bf16.
torch::Tensor Experts::forward(const torch::Tensor& x, const torch::Tensor& chosen,
                               const torch::Tensor& weights) const {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weights.scalar_type() == at::kBFloat16, "x and weights: bf16");
  TORCH_CHECK(x.dim() == 2 && chosen.dim() == 2 && chosen.sizes() == weights.sizes() && chosen.size(0) == x.size(0),
              "x [N, D], chosen and weights [N, k]");
  const int64_t N = x.size(0), D = x.size(1), k = chosen.size(1), E = gate_up_.size();
  auto xc = x.contiguous();
  auto ids = chosen.to(torch::kLong).contiguous();
  auto wc = weights.contiguous();
  const int64_t* C = ids.data_ptr<int64_t>();
  const at::BFloat16* W = wc.data_ptr<at::BFloat16>();
  // Each expert's (row, slot) pairs, rows ascending.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> users(E);
  for (int64_t n = 0; n < N; n++)
    for (int64_t s = 0; s < k; s++) {
      const int64_t e = C[n * k + s];
      TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of [0, ", E, ")");
      users[e].emplace_back(n, s);
    }
  auto out = torch::full({N, D}, 0, x.options());
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  const at::BFloat16* X = xc.data_ptr<at::BFloat16>();
  for (int64_t e = 0; e < E; e++) {
    const auto& rows = users[e];
    const int64_t M = rows.size();
    if (M == 0) continue;
    auto xe = torch::empty({M, D}, x.options());
    at::BFloat16* XE = xe.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M; i++) std::memcpy(XE + i * D, X + rows[i].first * D, D * sizeof(at::BFloat16));
    auto gate_up = torch::empty({M, 2 * inner_}, x.options());
    project_into(xe, gate_up_[e], gate_up);
    auto act = torch::empty({M, inner_}, x.options());
    silu_mul_into(gate_up, act);
    auto y = torch::empty({M, D}, x.options());
    project_into(act, down_[e], y);
    const at::BFloat16* Y = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M; i++) {
      const float w = W[rows[i].first * k + rows[i].second];
      at::BFloat16* o = O + rows[i].first * D;
      const at::BFloat16* yi = Y + i * D;
      // PyTorch's order: the product rounded to bf16, then the sum (each conversion rounds to nearest even).
      for (int64_t d = 0; d < D; d++) o[d] = float(o[d]) + float(at::BFloat16(float(yi[d]) * w));
    }
  }
  return out;
}

torch::Tensor routed_mlp(const Experts& experts, const torch::Tensor& x, const torch::Tensor& router,
                         const Routing& routing) {
  const int64_t E = experts.count();
  // The router as kernels.PackedLinear computes it: fp32 products on the file's fp32 weights, or bf16 ones on
  // outputs padded to 16, rounded to the activations' bf16.
  torch::Tensor logits;
  if (router.scalar_type() == at::kBFloat16) {
    logits = torch::empty({x.size(0), router.size(0) * 16}, x.options());
    project_into(x, {router}, logits);
    logits = logits.narrow(1, 0, E);
  } else {
    logits = f32_mm(x.to(torch::kFloat), router).to(x.scalar_type());
  }
  TORCH_CHECK(logits.size(1) == E, "the router scores ", logits.size(1), " experts, the layer has ", E);
  torch::Tensor weights, chosen;
  if (routing.topk_softmax) {
    auto [top, ids] = torch::topk(logits, routing.top_k, -1);
    weights = torch::softmax(top.to(torch::kFloat), -1), chosen = ids;
  } else {
    std::tie(weights, chosen) = torch::topk(torch::softmax(logits.to(torch::kFloat), -1), routing.top_k, -1);
    if (routing.renormalise) weights = weights.div(weights.sum(-1, true));
  }
  return experts.forward(x, chosen, weights.to(x.scalar_type()));
}
