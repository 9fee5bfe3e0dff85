// A whole Llama decoder layer in one call, for bf16 activations and AMX weights (int4 or bf16): what
// llama.Block computes with the same kernels, in the same order, so the bits are the same.
//
// Called layer by layer from Python, a decode pass spent much of its time between kernels, in Python and
// PyTorch's dispatch, and the AMX unit runs slower after each idle gap than back to back.
#include "tensor.h"
#include <torch/csrc/utils/pybind.h>  // binding to Python: this file alone
#include <algorithm>
#include <cmath>
#include <cstring>

#include "amx.h"
#include "kernels.h"
#include "team.h"

// A projection's weights: (q, d, m) in int4_mm's layout, (w) in bf16_mm's, or ggml_mm's 7 tensors a part.
void project_into(const torch::Tensor& x, const std::vector<torch::Tensor>& p, torch::Tensor& y) {
  if (p.size() % 7 == 0)
    ggml_mm_into(x, p, y);
  else if (p.size() == 3)
    int4_mm_into(x, p[0], p[1], p[2], y);
  else
    bf16_mm_into(x, p[0], y);
}

namespace {

// Row (b, t)'s key and value heads (rotated) into its cache row slots[b] at position n_keys[b, t] − 1.
void write_kv(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
              const torch::Tensor& n_keys, int64_t n_heads, int64_t n_kv_heads) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && qkv.is_contiguous(), "layout");
  const int64_t B = n_keys.size(0), T = n_keys.size(1), L = k_cache.size(2), Dh = k_cache.size(3);
  const int64_t heads = n_heads + 2 * n_kv_heads;
  auto nk = n_keys.to(torch::kLong).contiguous();
  auto rows = slots.to(torch::kLong).contiguous();
  const int64_t *N = nk.data_ptr<int64_t>(), *R = rows.data_ptr<int64_t>();
  const at::BFloat16* src = qkv.data_ptr<at::BFloat16>();
  at::BFloat16 *K = k_cache.data_ptr<at::BFloat16>(), *V = v_cache.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) {
      const int64_t pos = N[b * T + t] - 1;
      TORCH_CHECK(pos >= 0 && pos < L, "cache position out of range");
      const at::BFloat16* row = src + (b * T + t) * heads * Dh;
      for (int64_t j = 0; j < n_kv_heads; j++) {
        const int64_t dst = ((R[b] * n_kv_heads + j) * L + pos) * Dh;
        std::memcpy(K + dst, row + (n_heads + j) * Dh, Dh * sizeof(at::BFloat16));
        std::memcpy(V + dst, row + (n_heads + n_kv_heads + j) * Dh, Dh * sizeof(at::BFloat16));
      }
    }
}


// The width of a projection's output: the down projection's tells the MLP's inner size.
int64_t input_width(const std::vector<torch::Tensor>& p) {
  if (p.size() % 7 == 0) return p[0].size(1) * 32;
  return p.size() == 3 ? p[1].size(1) * 32 : p[0].size(1) * 32;
}

// A pass's intermediate rows, allocated once for all its layers (each layer made ~10 allocations and
// views, and they add up over a pass). Outputs of a layer that outlive it are the caller's.
struct Workspace {
  torch::Tensor qkv, q, mixed, attended, o, h, h_normed, gate_up, act, down;

  Workspace(int64_t B, int64_t T, int64_t D, int64_t n_heads, int64_t n_kv_heads, int64_t Dh, int64_t inner,
            const at::TensorOptions& options) {
    const int64_t heads = n_heads + 2 * n_kv_heads;
    qkv = torch::empty({B * T, heads, Dh}, options);
    q = qkv.view({B, T, heads, Dh}).narrow(2, 0, n_heads);
    attended = torch::empty({B, T, n_heads, Dh}, options);
    mixed = attended.view({B * T, n_heads * Dh});
    o = torch::empty({B * T, D}, options);
    h = torch::empty({B * T, D}, options);
    h_normed = torch::empty({B * T, D}, options);
    gate_up = torch::empty({B * T, 2 * inner}, options);
    act = torch::empty({B * T, inner}, options);
    down = torch::empty({B * T, D}, options);
  }
};

// One layer over rows [B·T, D] and their input norm `normed`; writes the layer's output to `out` and, where
// next_norm is given (the next layer's input norm, or the model's final one), that output's norm to
// `out_normed` (else `out` is the sum alone).
void layer_rows(const torch::Tensor& rows, const torch::Tensor& normed, const torch::Tensor& post_attention_norm,
                double eps, const std::vector<torch::Tensor>& qkv_proj, const std::vector<torch::Tensor>& o_proj,
                const std::vector<torch::Tensor>& gate_up_proj, const std::vector<torch::Tensor>& down_proj,
                const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                const torch::Tensor& slots, const torch::Tensor& n_keys, int64_t n_heads, int64_t n_kv_heads,
                const c10::optional<torch::Tensor>& tree, const c10::optional<torch::Tensor>& next_norm,
                const c10::optional<torch::Tensor>& qkv_bias, Workspace& w, torch::Tensor& out,
                torch::Tensor& out_normed) {
  const int64_t Dh = k_cache.size(3);
  project_into(normed, qkv_proj, w.qkv);
  if (qkv_bias) w.qkv.view({normed.size(0), -1}).add_(*qkv_bias);  // as llama.Attention's qkv_proj adds it
  rope_(w.qkv, cos, sin, n_heads + n_kv_heads);
  write_kv(w.qkv, k_cache, v_cache, slots, n_keys, n_heads, n_kv_heads);
  attention_into(w.q, k_cache, v_cache, n_keys, std::pow((double)Dh, -0.5), slots, tree, true, w.attended);
  project_into(w.mixed, o_proj, w.o);
  add_rms_norm_into(rows, w.o, post_attention_norm, eps, w.h, w.h_normed);
  project_into(w.h_normed, gate_up_proj, w.gate_up);
  silu_mul_into(w.gate_up, w.act);
  project_into(w.act, down_proj, w.down);
  if (next_norm)
    add_rms_norm_into(w.h, w.down, *next_norm, eps, out, out_normed);
  else
    torch::add_out(out, w.h, w.down);
}

Workspace workspace_for(const torch::Tensor& rows, const torch::Tensor& n_keys, int64_t head_dim,
                        const std::vector<torch::Tensor>& down_proj, int64_t n_heads, int64_t n_kv_heads) {
  const int64_t inner = input_width(down_proj);
  return Workspace(n_keys.size(0), n_keys.size(1), rows.size(1), n_heads, n_kv_heads, head_dim, inner,
                   rows.options());
}

}  // namespace

// x [B, T, D]; each projection's weights as project_into() takes them; cos, sin [B, T, 1, Dh]; k_cache, v_cache
// one layer of the KV cache [rows, Hkv, L, Dh]; slots [B]: each sequence's cache row; n_keys [B, T]: row
// (b, t) sits at position n_keys[b, t] − 1 and sees the keys before it (a draft tree's: see attention's `tree`)
// → the layer's output [B, T, D].
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps,
                            std::vector<torch::Tensor> qkv_proj, std::vector<torch::Tensor> o_proj,
                            std::vector<torch::Tensor> gate_up_proj, std::vector<torch::Tensor> down_proj,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slots, torch::Tensor n_keys, int64_t n_heads, int64_t n_kv_heads,
                            c10::optional<torch::Tensor> tree, c10::optional<torch::Tensor> qkv_bias) {
  auto rows = x.reshape({-1, x.size(2)});
  Workspace w = workspace_for(rows, n_keys, k_cache.size(3), down_proj, n_heads, n_kv_heads);
  auto out = torch::empty_like(rows);
  torch::Tensor unused;
  layer_rows(rows, rms_norm(rows, input_norm, eps), post_attention_norm, eps, qkv_proj, o_proj, gate_up_proj,
             down_proj, cos, sin, k_cache, v_cache, slots, n_keys, n_heads, n_kv_heads, tree, c10::nullopt, qkv_bias, w,
             out, unused);
  return out.view(x.sizes());
}

// Every decoder layer of a model and its final norm, their weights handed over once: a pass is one call.
// Layer by layer from Python, each call cost interpreter work and argument conversion, one per layer.
// Each residual sum is taken with the norm that follows it (add_rms_norm), and the pass's parallel
// loops are handed to one team of threads (team.h).
class DecoderStack {
 public:
  // layers[i]: input norm, post-attention norm, then the qkv, o, gate_up and down projections' weights.
  DecoderStack(std::vector<std::vector<std::vector<torch::Tensor>>> layers, torch::Tensor final_norm, double eps,
               int64_t n_heads, int64_t n_kv_heads)
      : layers_(std::move(layers)), final_norm_(final_norm), eps_(eps), n_heads_(n_heads), n_kv_heads_(n_kv_heads) {
    for (const auto& layer : layers_)
      TORCH_CHECK((layer.size() == 6 || layer.size() == 7) && layer[0].size() == 1 && layer[1].size() == 1,
                  "a layer: two norms, four projections and optionally the qkv projection's bias");
  }

  // x [B, T, D]; k_cache, v_cache the whole KV cache [layers, rows, Hkv, L, Dh]; the rest as decoder_layer
  // → the last layer's output under the final norm [B, T, D]. capture [n, B·T, D] (x's dtype, contiguous):
  // capture[j] receives the residual stream entering layer capture_at[j] (the layer count: the last layer's
  // output before the final norm), an EAGLE-3 head's features; a copy, the pass's arithmetic unchanged.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor n_keys,
                        c10::optional<torch::Tensor> tree, c10::optional<torch::Tensor> capture = c10::nullopt,
                        std::vector<int64_t> capture_at = {}) const {
    TORCH_CHECK(k_cache.size(0) == (int64_t)layers_.size(), "one cache layer per decoder layer");
    auto rows = x.reshape({-1, x.size(2)}).contiguous();
    std::vector<char*> keep(capture_at.size(), nullptr);
    if (!capture_at.empty()) {
      TORCH_CHECK(capture && capture->is_contiguous() && capture->size(0) == (int64_t)capture_at.size() &&
                      capture->numel() == (int64_t)capture_at.size() * rows.numel() &&
                      capture->scalar_type() == rows.scalar_type(),
                  "capture: [n, rows, D] in the pass's dtype");
      for (size_t j = 0; j < capture_at.size(); j++)
        keep[j] = (char*)capture->data_ptr() + j * rows.numel() * rows.element_size();
    }
    const size_t row_bytes = rows.numel() * rows.element_size();
    auto take = [&](int64_t layer, const torch::Tensor& stream) {
      for (size_t j = 0; j < capture_at.size(); j++)
        if (capture_at[j] == layer) std::memcpy(keep[j], stream.data_ptr(), row_bytes);
    };
    auto normed = rms_norm(rows, layers_[0][0][0], eps_);
    Workspace w = workspace_for(rows, n_keys, k_cache.size(4), layers_[0][5], n_heads_, n_kv_heads_);
    // Each layer's output and its norm, alternating between two pairs: the next layer reads one pair
    // while writing the other. The last norm is the caller's, a tensor of its own.
    torch::Tensor sums[2] = {torch::empty_like(rows), torch::empty_like(rows)};
    torch::Tensor norms[2] = {torch::empty_like(rows), torch::empty_like(rows)};
    speculant::Team::run([&] {
      for (size_t i = 0; i < layers_.size(); i++) {
        take((int64_t)i, rows);
        const auto& l = layers_[i];
        const auto& next_norm = i + 1 < layers_.size() ? layers_[i + 1][0][0] : final_norm_;
        const auto bias = l.size() == 7 && !l[6].empty() ? c10::optional<torch::Tensor>(l[6][0]) : c10::nullopt;
        layer_rows(rows, normed, l[1][0], eps_, l[2], l[3], l[4], l[5], cos, sin, k_cache.select(0, i),
                   v_cache.select(0, i), slots, n_keys, n_heads_, n_kv_heads_, tree, next_norm, bias, w, sums[i % 2],
                   norms[i % 2]);
        rows = sums[i % 2], normed = norms[i % 2];
      }
      take((int64_t)layers_.size(), rows);
    });
    return normed.view(x.sizes());
  }

  // A chain pass from the cache's own bookkeeping: tokens [B, T] int64 appended to the cache rows slots [B]
  // after their lengths (lengths [rows] int64, the cache's), row b's first n_new[b] real (default T), the rest
  // padding, whose positions past max_len go to the cache's sink; embed [V, D] the token embedding; cos, sin
  // the rotary tables [P > max_len, Dh] → forward's output, the rows' lengths advanced. An undefined tensor,
  // nothing written, where a row would run past max_len (the caller raises). What prepare_pass and the
  // embedding computed in ~10 PyTorch calls, slow between passes that evict the interpreter's working set
  // from the caches.
  torch::Tensor decode(torch::Tensor tokens, torch::Tensor embed, torch::Tensor cos_table, torch::Tensor sin_table,
                       torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lengths, torch::Tensor slots,
                       int64_t max_len, c10::optional<torch::Tensor> n_new,
                       c10::optional<torch::Tensor> capture = c10::nullopt, std::vector<int64_t> capture_at = {}) const {
    const int64_t B = tokens.size(0), T = tokens.size(1), V = embed.size(0), D = embed.size(1);
    const int64_t Dh = cos_table.size(1);
    TORCH_CHECK(tokens.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
                "tokens and lengths must be int64");
    TORCH_CHECK(embed.is_contiguous() && cos_table.is_contiguous() && sin_table.is_contiguous() &&
                    cos_table.size(0) > max_len && sin_table.sizes() == cos_table.sizes(),
                "the rotary tables must cover every cache position");
    auto tok = tokens.contiguous();
    auto rows = slots.to(torch::kLong).contiguous();
    auto real = n_new ? n_new->to(torch::kLong).contiguous() : torch::full({B}, T, torch::kLong);
    const int64_t *Tk = tok.data_ptr<int64_t>(), *R = rows.data_ptr<int64_t>(), *N = real.data_ptr<int64_t>();
    int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      if (len[R[b]] + N[b] > max_len) return torch::Tensor();
    auto n_keys = torch::empty({B, T}, torch::kLong);
    auto cos = torch::empty({B, T, 1, Dh}, cos_table.options()), sin = torch::empty_like(cos);
    auto x = torch::empty({B, T, D}, embed.options());
    const size_t row_bytes = Dh * cos_table.element_size(), embed_bytes = D * embed.element_size();
    auto* nk = n_keys.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t < T; t++) {
        const int64_t at = b * T + t, pos = std::min(len[R[b]] + t, max_len), token = Tk[at];
        TORCH_CHECK(token >= 0 && token < V, "token id ", token, " is out of the vocabulary [0, ", V, ")");
        nk[at] = pos + 1;
        std::memcpy((char*)cos.data_ptr() + at * row_bytes, (const char*)cos_table.data_ptr() + pos * row_bytes,
                    row_bytes);
        std::memcpy((char*)sin.data_ptr() + at * row_bytes, (const char*)sin_table.data_ptr() + pos * row_bytes,
                    row_bytes);
        std::memcpy((char*)x.data_ptr() + at * embed_bytes, (const char*)embed.data_ptr() + token * embed_bytes,
                    embed_bytes);
      }
    auto hidden = forward(x, cos, sin, k_cache, v_cache, rows, n_keys, c10::nullopt, capture, capture_at);
    for (int64_t b = 0; b < B; b++) len[R[b]] += N[b];
    return hidden;
  }

 private:
  std::vector<std::vector<std::vector<torch::Tensor>>> layers_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t n_heads_, n_kv_heads_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // Every kernel lets go of the GIL while it runs: a server's other threads (its HTTP side, streaming the
  // last step's tokens) go on through a pass, where they would otherwise wait for it to end.
  const pybind11::call_guard<pybind11::gil_scoped_release> kFree;
  mod.def("set_amx", [](bool allowed) { speculant::amx_allowed() = allowed; });
  mod.def("int4_mm", &int4_mm, kFree);
  mod.def("int8_mm", &int8_mm, kFree);
  mod.def("ggml_mm", &ggml_mm, kFree);
  mod.def("bf16_mm", &bf16_mm, kFree);
  mod.def("f32_mm", &f32_mm, kFree);
  mod.def("attention", &attention, kFree, pybind11::arg("q"), pybind11::arg("keys"), pybind11::arg("values"),
          pybind11::arg("n_keys"), pybind11::arg("scale"), pybind11::arg("slots") = pybind11::none(),
          pybind11::arg("tree") = pybind11::none(), pybind11::arg("amx") = true, pybind11::arg("window") = 0,
          pybind11::arg("softcap") = 0.0);
  mod.def("rms_norm", &rms_norm, kFree);
  mod.def("add_rms_norm", &add_rms_norm, kFree);
  mod.def("rope_", &rope_, kFree);
  mod.def("silu_mul", &silu_mul, kFree);
  mod.def("argmax_rows", &argmax_rows, kFree);
  mod.def("sample_row", &sample_row, kFree);
  mod.def("decoder_layer", &decoder_layer, kFree, pybind11::arg("x"), pybind11::arg("input_norm"),
          pybind11::arg("post_attention_norm"), pybind11::arg("eps"), pybind11::arg("qkv_proj"), pybind11::arg("o_proj"),
          pybind11::arg("gate_up_proj"), pybind11::arg("down_proj"), pybind11::arg("cos"), pybind11::arg("sin"),
          pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("n_keys"),
          pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"), pybind11::arg("tree") = pybind11::none(),
          pybind11::arg("qkv_bias") = pybind11::none());
  pybind11::class_<Experts>(mod, "Experts")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>, int64_t>())
      .def("forward", &Experts::forward, kFree);
  pybind11::class_<DecoderStack>(mod, "DecoderStack")
      .def(pybind11::init<std::vector<std::vector<std::vector<torch::Tensor>>>, torch::Tensor, double, int64_t,
                          int64_t>())
      .def("forward", &DecoderStack::forward, kFree, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("n_keys"),
           pybind11::arg("tree") = pybind11::none(), pybind11::arg("capture") = pybind11::none(),
           pybind11::arg("capture_at") = std::vector<int64_t>())
      .def("decode", &DecoderStack::decode, kFree, pybind11::arg("tokens"), pybind11::arg("embed"), pybind11::arg("cos_table"),
           pybind11::arg("sin_table"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("lengths"),
           pybind11::arg("slots"), pybind11::arg("max_len"), pybind11::arg("n_new") = pybind11::none(),
           pybind11::arg("capture") = pybind11::none(), pybind11::arg("capture_at") = std::vector<int64_t>());
}
