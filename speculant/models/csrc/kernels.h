// The compiled kernels, one extension module (decoder.cpp binds them): each file defines its own.
#pragma once
#include "tensor.h"

// What every `_into` form checks of the tensor it writes: numel values of bf16, contiguous.
inline void check_output(const torch::Tensor& out, int64_t numel) {
  TORCH_CHECK(out.is_contiguous() && out.numel() == numel && out.scalar_type() == at::kBFloat16,
              "the output must be a contiguous bf16 tensor of the result's size");
}

// quantized.cpp: x [M, K] bf16 × Q4_1 weights in the kernel's layout (native.int4_layout) → [M, N] bf16.
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m);
void int4_mm_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m,
                  torch::Tensor& y);

// quantized.cpp: x [M, K] bf16 × Q8_0 weights in the kernel's layout (native.int8_layout) → [M, N] bf16.
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor d);

// ggml_mm.cpp: x [M, K] bf16 × weights repacked from GGUF blocks (models/ggml.py's layout, 7 tensors) → [M, N] bf16.
torch::Tensor ggml_mm(torch::Tensor x, std::vector<torch::Tensor> p);
void ggml_mm_into(const torch::Tensor& x, const std::vector<torch::Tensor>& p, torch::Tensor& y);

// bf16_amx.cpp: x [M, K] bf16 × bf16 weights in the kernel's layout (native.bf16_layout) → [M, N] bf16, on AMX
// tiles where they run, else bf16_dot.cpp's vector kernel (the same layout).
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor w);
void bf16_mm_into(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y);
void bf16_dot_into(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y);

// f32_mm.cpp: x [M, K] fp32 × weights stored transposed [K, N], fp32 or fp16 → [M, N] fp32.
torch::Tensor f32_mm(torch::Tensor x, torch::Tensor w);

// attention.cpp: each query row over exactly its keys; `amx` false keeps the vector kernel on an AMX CPU;
// `window` > 0: a row sees its last `window` positions only; `softcap` > 0: scores soft-capped (Gemma 2).
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor n_keys,
                        double scale, c10::optional<torch::Tensor> slots, c10::optional<torch::Tensor> tree,
                        bool amx = true, int64_t window = 0, double softcap = 0);
void attention_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                    const torch::Tensor& n_keys, double scale, const c10::optional<torch::Tensor>& slots,
                    const c10::optional<torch::Tensor>& tree, bool amx, torch::Tensor& out, int64_t window = 0,
                    double softcap = 0);

// layer_ops.cpp: RMSNorm (alone, after a residual sum, or of each q and k head in place), rotary embedding in
// place, silu(gate) · up and gelu_tanh(gate) · up.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out);
void head_norms_(torch::Tensor x, const torch::Tensor& q_weight, const torch::Tensor& k_weight, int64_t n_q,
                 int64_t n_k, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight,
                                                      double eps);
void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& weight, double eps,
                       torch::Tensor& sum, torch::Tensor& normed);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
void gelu_tanh_mul_into(const torch::Tensor& gate_up, torch::Tensor& out);

// argmax.cpp: x [..., V] bf16 or fp32 → each row's first maximum (a NaN the largest), int64 [...].
torch::Tensor argmax_rows(torch::Tensor x);

// sampling.cpp: a row of logits [V] (bf16 or fp32) under temperature, top-k, top-p and min-p: the token an
// inverse-CDF draw u in [0, 1) lands on.
int64_t sample_row(torch::Tensor row, double inv_temperature, int64_t top_k, double top_p, double min_p, double u);

// gdn.cpp: Gated DeltaNet's recurrence over a pass's tokens (q, k [B, T, Hk, dk], v [B, T, Hv, dv], beta and the
// log-decay g [B, T, Hv], state [B, Hv, dk, dv], fp32) → (out [B, T, Hv, dv], the states after the `keep` [B, T]
// positions, each its own tensor).
std::tuple<torch::Tensor, std::vector<torch::Tensor>> gdn_recurrence(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                                     torch::Tensor beta, torch::Tensor g,
                                                                     torch::Tensor state, torch::Tensor keep,
                                                                     bool tiled);

// decoder.cpp: y = x Wᵀ for a projection's weights in any native layout: ggml_mm's 7 tensors a part, int4_mm's
// (q, d, m), bf16_mm's (w).
void project_into(const torch::Tensor& x, const std::vector<torch::Tensor>& p, torch::Tensor& y);

// moe.cpp: a mixture of experts' MLP (SwiGLU experts, each gate_up and down in a layout project_into takes).
class Experts {
 public:
  Experts(std::vector<std::vector<torch::Tensor>> gate_up, std::vector<std::vector<torch::Tensor>> down,
          int64_t inner);
  // x [N, D] bf16, chosen [N, k] expert ids, weights [N, k] bf16 → [N, D] bf16.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& chosen, const torch::Tensor& weights) const;
  int64_t count() const { return (int64_t)gate_up_.size(); }

 private:
  std::vector<std::vector<torch::Tensor>> gate_up_, down_;
  int64_t inner_;
};

// moe.cpp: how a routed layer picks a token's experts (models/moe.py's rules): its top k by the softmax over every
// expert (renormalised or not), or softmax over the top k logits alone.
struct Routing {
  int64_t top_k;
  bool topk_softmax, renormalise;
};

// moe.cpp: MoE.forward of models/moe.py for rows x [N, D] bf16: the router's logits (its weight fp32 in f32_mm's
// transposed layout, or bf16 in bf16_mm's), the rule, the experts → [N, D] bf16, the same ops on the same kernels.
torch::Tensor routed_mlp(const Experts& experts, const torch::Tensor& x, const torch::Tensor& router,
                         const Routing& routing);
