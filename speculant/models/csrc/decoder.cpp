// A whole decoder layer in one call, for bf16 activations and native weights (GGUF blocks, int4, bf16): what
// llama.Block computes with the same kernels, in the same order, so the bits are the same; Llama's form and the
// families' variants of it (Qwen's bias and q/k norms, Gemma's sandwich norms, GeGLU, windows and caps).
//
// Called layer by layer from Python, a decode pass spent much of its time between kernels, in Python and
// PyTorch's dispatch, and the AMX unit runs slower after each idle gap than back to back.
#include "tensor.h"
#include <torch/csrc/utils/pybind.h>  // binding to Python: this file alone
#include <algorithm>
#include <cmath>
#include <cstring>

#include "amx.h"
#include "bf16.h"
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

// What sets one family's layer apart from Llama's, beside its weights: the sliding window (0: none), the scores'
// scale and soft cap (0: none, Gemma 2), GeGLU for SwiGLU, the second rotary table (Gemma 3's local layers), and
// a routed layer's rule (top k: 0 for a dense MLP).
struct Form {
  int64_t window;
  double scale, softcap;
  bool gelu, local_rope;
  Routing routing;
};
using FormArgs = std::tuple<int64_t, double, double, bool, bool, int64_t, bool, bool>;  // Form, in its order

Form form_of(const FormArgs& f) {
  return {std::get<0>(f), std::get<1>(f), std::get<2>(f), std::get<3>(f), std::get<4>(f),
          {std::get<5>(f), std::get<6>(f), std::get<7>(f)}};
}

// A layer's weights in the groups Python hands over (native.NativeLayer): [input norm], [post-attention norm],
// the qkv, o, gate_up and down projections (a routed layer's: []), then four optional groups ([] where absent):
// [qkv bias] (GGUF blocks), [q norm, k norm] (per head, before RoPE), [pre-MLP norm, post-MLP norm] (Gemma's
// sandwich: the post-attention norm then normalises attention's output before the residual sum), [router] (a
// routed layer's, whose experts come apart: moe.cpp's Experts, which Python holds).
struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  std::vector<torch::Tensor> qkv, o, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias, q_norm, k_norm, pre_mlp_norm, post_mlp_norm, router;
  const Experts* experts;
  Form form;

  Layer(const std::vector<std::vector<torch::Tensor>>& w, const FormArgs& f, const Experts* e)
      : experts(e), form(form_of(f)) {
    TORCH_CHECK(w.size() == 10 && w[0].size() == 1 && w[1].size() == 1 && w[6].size() <= 1 &&
                    (w[7].empty() || w[7].size() == 2) && (w[8].empty() || w[8].size() == 2) && w[9].size() <= 1,
                "a layer: two norms, four projections, [qkv bias], [q/k norms], [pre/post-MLP norms], [router]");
    input_norm = w[0][0], post_attention_norm = w[1][0];
    qkv = w[2], o = w[3], gate_up = w[4], down = w[5];
    if (!w[6].empty()) qkv_bias = w[6][0];
    if (!w[7].empty()) q_norm = w[7][0], k_norm = w[7][1];
    if (!w[8].empty()) pre_mlp_norm = w[8][0], post_mlp_norm = w[8][1];
    if (!w[9].empty()) router = w[9][0];
    TORCH_CHECK(router.has_value() == (experts != nullptr) && (experts != nullptr) == (form.routing.top_k > 0) &&
                    (experts != nullptr) == down.empty(),
                "a routed layer: its router, its experts and its top k, and no dense MLP");
  }
};

// What every layer of a pass reads: the rotary tables at its rows (global, and local where layers have their own:
// [B, T, 1, Dh] each), each row's cache slot and key count, the draft tree, the heads, the norms' eps.
struct PassArgs {
  torch::Tensor cos, sin;
  c10::optional<torch::Tensor> local_cos, local_sin;
  torch::Tensor slots, n_keys;
  c10::optional<torch::Tensor> tree;
  int64_t n_heads, n_kv_heads;
  double eps;
};

// One layer over rows [B·T, D] and their input norm `normed`; writes the layer's output to `out` and, where
// next_norm is given (the next layer's input norm, or the model's final one), that output's norm to
// `out_normed` (else `out` is the sum alone). llama.Block's operations, in its order, on the same kernels.
void layer_rows(const Layer& l, const torch::Tensor& rows, const torch::Tensor& normed, const PassArgs& p,
                torch::Tensor k_cache, torch::Tensor v_cache, const c10::optional<torch::Tensor>& next_norm,
                Workspace& w, torch::Tensor& out, torch::Tensor& out_normed) {
  const int64_t Dh = k_cache.size(3), H = p.n_heads, Hkv = p.n_kv_heads;
  project_into(normed, l.qkv, w.qkv);
  if (l.qkv_bias) w.qkv.view({normed.size(0), -1}).add_(*l.qkv_bias);  // as llama.Attention's qkv_proj adds it
  if (l.q_norm) head_norms_(w.qkv, *l.q_norm, *l.k_norm, H, Hkv, p.eps);
  TORCH_CHECK(!l.form.local_rope || p.local_cos, "a layer with local rotary tables needs them");
  rope_(w.qkv, l.form.local_rope ? *p.local_cos : p.cos, l.form.local_rope ? *p.local_sin : p.sin, H + Hkv);
  write_kv(w.qkv, k_cache, v_cache, p.slots, p.n_keys, H, Hkv);
  const double scale = l.form.scale > 0 ? l.form.scale : std::pow((double)Dh, -0.5);
  attention_into(w.q, k_cache, v_cache, p.n_keys, scale, p.slots, p.tree, true, w.attended, l.form.window,
                 l.form.softcap);
  project_into(w.mixed, l.o, w.o);
  if (l.post_mlp_norm) {  // sandwich: x + norm(attention), then the MLP's own input norm
    rms_norm_into(w.o, l.post_attention_norm, p.eps, w.o);
    add_rms_norm_into(rows, w.o, *l.pre_mlp_norm, p.eps, w.h, w.h_normed);
  } else {
    add_rms_norm_into(rows, w.o, l.post_attention_norm, p.eps, w.h, w.h_normed);
  }
  if (l.experts) {
    w.down.copy_(routed_mlp(*l.experts, w.h_normed, *l.router, l.form.routing));
  } else {
    project_into(w.h_normed, l.gate_up, w.gate_up);
    if (l.form.gelu)
      gelu_tanh_mul_into(w.gate_up, w.act);
    else
      silu_mul_into(w.gate_up, w.act);
    project_into(w.act, l.down, w.down);
  }
  if (l.post_mlp_norm) rms_norm_into(w.down, *l.post_mlp_norm, p.eps, w.down);
  if (next_norm)
    add_rms_norm_into(w.h, w.down, *next_norm, p.eps, out, out_normed);
  else
    torch::add_out(out, w.h, w.down);
}

// The dense MLPs' widest inner size sizes the workspace (1 where every layer is routed: experts keep their own).
Workspace workspace_for(const torch::Tensor& rows, const torch::Tensor& n_keys, int64_t head_dim,
                        const std::vector<Layer>& layers, int64_t n_heads, int64_t n_kv_heads) {
  int64_t inner = 1;
  for (const auto& l : layers)
    if (!l.down.empty()) inner = std::max(inner, input_width(l.down));
  return Workspace(n_keys.size(0), n_keys.size(1), rows.size(1), n_heads, n_kv_heads, head_dim, inner,
                   rows.options());
}

}  // namespace

// x [B, T, D]; `weights` and `form` one layer's as DecoderStack takes them; cos, sin [B, T, 1, Dh] the layer's
// rotary tables; k_cache, v_cache one layer of the KV cache [rows, Hkv, L, Dh]; slots [B]: each sequence's cache
// row; n_keys [B, T]: row (b, t) sits at position n_keys[b, t] − 1 and sees the keys before it (a draft tree's:
// see attention's `tree`) → the layer's output [B, T, D].
torch::Tensor decoder_layer(torch::Tensor x, std::vector<std::vector<torch::Tensor>> weights, FormArgs form, double eps,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slots, torch::Tensor n_keys, int64_t n_heads, int64_t n_kv_heads,
                            c10::optional<torch::Tensor> tree, const Experts* experts) {
  const std::vector<Layer> layers = {Layer(weights, form, experts)};
  const Layer& layer = layers[0];
  const PassArgs p{cos, sin, cos, sin, slots, n_keys, tree, n_heads, n_kv_heads, eps};  // the caller's tables
  auto rows = x.reshape({-1, x.size(2)});
  Workspace w = workspace_for(rows, n_keys, k_cache.size(3), layers, n_heads, n_kv_heads);
  auto out = torch::empty_like(rows);
  torch::Tensor unused;
  layer_rows(layer, rows, rms_norm(rows, layer.input_norm, eps), p, k_cache, v_cache, c10::nullopt, w, out, unused);
  return out.view(x.sizes());
}

// Every decoder layer of a model and its final norm, their weights handed over once: a pass is one call.
// Layer by layer from Python, each call cost interpreter work and argument conversion, one per layer.
// Each residual sum is taken with the norm that follows it (add_rms_norm), and the pass's parallel
// loops are handed to one team of threads (team.h).
class DecoderStack {
 public:
  // layers[i] and forms[i]: layer i's weights and form (see Layer, Form); embed_scale: decode's embeddings times
  // it (Gemma's √D, rounded to bf16 as transformers rounds it; 0: unscaled).
  // experts[i]: a routed layer's experts (None for a dense one). They stay Python's: it holds them for the model.
  DecoderStack(std::vector<std::vector<std::vector<torch::Tensor>>> layers, std::vector<FormArgs> forms,
               std::vector<const Experts*> experts, torch::Tensor final_norm, double eps, int64_t n_heads,
               int64_t n_kv_heads, double embed_scale)
      : final_norm_(final_norm), eps_(eps), n_heads_(n_heads), n_kv_heads_(n_kv_heads), embed_scale_(embed_scale) {
    TORCH_CHECK(!layers.empty() && layers.size() == forms.size() && layers.size() == experts.size(),
                "one form and one experts entry per layer");
    for (size_t i = 0; i < layers.size(); i++) layers_.emplace_back(layers[i], forms[i], experts[i]);
  }

  // x [B, T, D]; k_cache, v_cache the whole KV cache [layers, rows, Hkv, L, Dh]; local_cos, local_sin the local
  // layers' rotary tables where they have their own; the rest as decoder_layer → the last layer's output under the
  // final norm [B, T, D]. capture [n, B·T, D] (x's dtype, contiguous): capture[j] receives the residual stream
  // entering layer capture_at[j] (the layer count: the last layer's output before the final norm), an EAGLE-3
  // head's features; a copy, the pass's arithmetic unchanged.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor n_keys,
                        c10::optional<torch::Tensor> tree, c10::optional<torch::Tensor> capture = c10::nullopt,
                        std::vector<int64_t> capture_at = {}, c10::optional<torch::Tensor> local_cos = c10::nullopt,
                        c10::optional<torch::Tensor> local_sin = c10::nullopt) const {
    TORCH_CHECK(k_cache.size(0) == (int64_t)layers_.size(), "one cache layer per decoder layer");
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "local rotary tables: both or neither");
    const PassArgs p{cos, sin, local_cos, local_sin, slots, n_keys, tree, n_heads_, n_kv_heads_, eps_};
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
    auto normed = rms_norm(rows, layers_[0].input_norm, eps_);
    Workspace w = workspace_for(rows, n_keys, k_cache.size(4), layers_, n_heads_, n_kv_heads_);
    // Each layer's output and its norm, alternating between two pairs: the next layer reads one pair
    // while writing the other. The last norm is the caller's, a tensor of its own.
    torch::Tensor sums[2] = {torch::empty_like(rows), torch::empty_like(rows)};
    torch::Tensor norms[2] = {torch::empty_like(rows), torch::empty_like(rows)};
    speculant::Team::run([&] {
      for (size_t i = 0; i < layers_.size(); i++) {
        take((int64_t)i, rows);
        const auto& next_norm = i + 1 < layers_.size() ? layers_[i + 1].input_norm : final_norm_;
        layer_rows(layers_[i], rows, normed, p, k_cache.select(0, i), v_cache.select(0, i), next_norm, w,
                   sums[i % 2], norms[i % 2]);
        rows = sums[i % 2], normed = norms[i % 2];
      }
      take((int64_t)layers_.size(), rows);
    });
    return normed.view(x.sizes());
  }

  // A chain pass from the cache's own bookkeeping: tokens [B, T] int64 appended to the cache rows slots [B]
  // after their lengths (lengths [rows] int64, the cache's), row b's first n_new[b] real (default T), the rest
  // padding, whose positions past max_len go to the cache's sink; embed [V, D] the token embedding; cos, sin
  // the rotary tables [P > max_len, Dh] (local_cos, local_sin the local layers' where they have their own) →
  // forward's output, the rows' lengths advanced. An undefined tensor, nothing written, where a row would run
  // past max_len (the caller raises). What prepare_pass and the embedding computed in ~10 PyTorch calls, slow
  // between passes that evict the interpreter's working set from the caches.
  torch::Tensor decode(torch::Tensor tokens, torch::Tensor embed, torch::Tensor cos_table, torch::Tensor sin_table,
                       torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lengths, torch::Tensor slots,
                       int64_t max_len, c10::optional<torch::Tensor> n_new,
                       c10::optional<torch::Tensor> capture = c10::nullopt, std::vector<int64_t> capture_at = {},
                       c10::optional<torch::Tensor> local_cos_table = c10::nullopt,
                       c10::optional<torch::Tensor> local_sin_table = c10::nullopt) const {
    const int64_t B = tokens.size(0), T = tokens.size(1), V = embed.size(0), D = embed.size(1);
    const int64_t Dh = cos_table.size(1);
    TORCH_CHECK(tokens.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
                "tokens and lengths must be int64");
    TORCH_CHECK(embed.is_contiguous() && (embed_scale_ == 0 || embed.scalar_type() == at::kBFloat16),
                "the embedding: contiguous, bf16 where it is scaled");
    std::vector<torch::Tensor> tables = {cos_table, sin_table};
    if (local_cos_table) tables.insert(tables.end(), {*local_cos_table, local_sin_table.value()});
    for (const auto& t : tables)
      TORCH_CHECK(t.is_contiguous() && t.size(0) > max_len && t.sizes() == cos_table.sizes() &&
                      t.scalar_type() == cos_table.scalar_type(),
                  "the rotary tables must cover every cache position");
    auto tok = tokens.contiguous();
    auto rows = slots.to(torch::kLong).contiguous();
    auto real = n_new ? n_new->to(torch::kLong).contiguous() : torch::full({B}, T, torch::kLong);
    const int64_t *Tk = tok.data_ptr<int64_t>(), *R = rows.data_ptr<int64_t>(), *N = real.data_ptr<int64_t>();
    int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      if (len[R[b]] + N[b] > max_len) return torch::Tensor();
    auto n_keys = torch::empty({B, T}, torch::kLong);
    std::vector<torch::Tensor> at_rows;  // each table's rows at the pass's positions [B, T, 1, Dh]
    for (size_t i = 0; i < tables.size(); i++) at_rows.push_back(torch::empty({B, T, 1, Dh}, cos_table.options()));
    auto x = torch::empty({B, T, D}, embed.options());
    const size_t row_bytes = Dh * cos_table.element_size(), embed_bytes = D * embed.element_size();
    auto* nk = n_keys.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t < T; t++) {
        const int64_t at = b * T + t, pos = std::min(len[R[b]] + t, max_len), token = Tk[at];
        TORCH_CHECK(token >= 0 && token < V, "token id ", token, " is out of the vocabulary [0, ", V, ")");
        nk[at] = pos + 1;
        for (size_t i = 0; i < tables.size(); i++)
          std::memcpy((char*)at_rows[i].data_ptr() + at * row_bytes,
                      (const char*)tables[i].data_ptr() + pos * row_bytes, row_bytes);
        std::memcpy((char*)x.data_ptr() + at * embed_bytes, (const char*)embed.data_ptr() + token * embed_bytes,
                    embed_bytes);
      }
    if (embed_scale_ != 0) scale_bf16_(x, embed_scale_);
    const bool local = tables.size() == 4;
    auto hidden = forward(x, at_rows[0], at_rows[1], k_cache, v_cache, rows, n_keys, c10::nullopt, capture,
                          capture_at, local ? c10::optional<torch::Tensor>(at_rows[2]) : c10::nullopt,
                          local ? c10::optional<torch::Tensor>(at_rows[3]) : c10::nullopt);
    for (int64_t b = 0; b < B; b++) len[R[b]] += N[b];
    return hidden;
  }

 private:
  // x (bf16, contiguous) times s in place, each product rounded to bf16 as PyTorch's bf16 product is.
  static void scale_bf16_(torch::Tensor& x, double s) {
    auto* v = (uint16_t*)x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < x.numel(); i++) {
      const uint32_t bits = (uint32_t)v[i] << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      v[i] = speculant::to_bf16(f * (float)s);
    }
  }

  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t n_heads_, n_kv_heads_;
  double embed_scale_;
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
  mod.def("gelu_tanh_mul", &gelu_tanh_mul, kFree);
  mod.def("head_norms_", &head_norms_, kFree);
  mod.def("argmax_rows", &argmax_rows, kFree);
  mod.def("sample_row", &sample_row, kFree);
  mod.def("gdn_recurrence", &gdn_recurrence, kFree);
  mod.def("decoder_layer", &decoder_layer, kFree, pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("form"),
          pybind11::arg("eps"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_cache"),
          pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("n_keys"), pybind11::arg("n_heads"),
          pybind11::arg("n_kv_heads"), pybind11::arg("tree") = pybind11::none(),
          pybind11::arg("experts") = pybind11::none());
  pybind11::class_<Experts>(mod, "Experts")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>, int64_t>())
      .def("forward", &Experts::forward, kFree);
  pybind11::class_<DecoderStack>(mod, "DecoderStack")
      .def(pybind11::init<std::vector<std::vector<std::vector<torch::Tensor>>>, std::vector<FormArgs>,
                          std::vector<const Experts*>, torch::Tensor, double, int64_t, int64_t, double>())
      .def("forward", &DecoderStack::forward, kFree, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("n_keys"),
           pybind11::arg("tree") = pybind11::none(), pybind11::arg("capture") = pybind11::none(),
           pybind11::arg("capture_at") = std::vector<int64_t>(), pybind11::arg("local_cos") = pybind11::none(),
           pybind11::arg("local_sin") = pybind11::none())
      .def("decode", &DecoderStack::decode, kFree, pybind11::arg("tokens"), pybind11::arg("embed"), pybind11::arg("cos_table"),
           pybind11::arg("sin_table"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("lengths"),
           pybind11::arg("slots"), pybind11::arg("max_len"), pybind11::arg("n_new") = pybind11::none(),
           pybind11::arg("capture") = pybind11::none(), pybind11::arg("capture_at") = std::vector<int64_t>(),
           pybind11::arg("local_cos_table") = pybind11::none(), pybind11::arg("local_sin_table") = pybind11::none());
}
