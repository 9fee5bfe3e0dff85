// Attention for bf16 and fp32 on CPU, one query row at a time over exactly the keys it sees.
//
// PyTorch's CPU attention sums in an order that depends on the key count and on the other rows of the
// call, so a verify pass (several rows, a causal mask) or a batch (ragged rows) scored a row differently
// from plain decoding, and one bf16 rounding made it visible. Here a row's scores, softmax and weighted
// sum depend on its query, its keys and nothing else: the same bits at batch 1 or 32, alone or in a
// verify pass.
//
// Two kernels compute this: attention_amx.cpp on CPUs with AMX (rows that share a key head go through
// its tiles together), the vector kernel below elsewhere. Each machine always runs the same one.
#include "tensor.h"
#include <immintrin.h>

#include "amx.h"
#include "attention.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

using speculant::AttentionArgs;
namespace vec = speculant::vec;
using speculant::to_bf16;

// The element types a cache holds: bf16 (2 products a lane per step, vdpbf16ps) and fp32 (fp32 folder models,
// whose PyTorch attention would otherwise go row by row to stay exact).
inline vec::F dot32(vec::F acc, const uint16_t* q, const uint16_t* k) { return vec::dot_bf16(acc, q, k); }
inline vec::F dot32(vec::F acc, const float* q, const float* k) {
  return vec::fmadd(vec::load(q + 16), vec::load(k + 16), vec::fmadd(vec::load(q), vec::load(k), acc));
}
inline vec::F load16(const uint16_t* p) { return vec::load_bf16(p); }
inline vec::F load16(const float* p) { return vec::load(p); }
inline void put(uint16_t* out, float x) { *out = to_bf16(x); }
inline void put(float* out, float x) { *out = x; }

// One query row q [D] over n keys/values of k, v (row stride `stride` elements) → out [D]: rows 0 .. n-1, or
// with `index` the rows index[0 .. n-1] (a draft tree's node sees the cache and its ancestors only).
template <typename T>
void attend_row(const T* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t D, float scale, float* scores,
                T* out, const int64_t* index) {
  auto dot = [&](int64_t j) {
    const int64_t row = index ? index[j] : j;
    vec::F acc = vec::zero();
    for (int64_t c = 0; c < D; c += 32) acc = dot32(acc, q + c, k + row * stride + c);
    return acc;
  };
  int64_t j = 0;
  // 16 keys' sums in one tree. Where the blocks of 16 end depends on n alone: a row scores its keys the
  // same way in any call.
  for (; j + 16 <= n; j += 16) {
    vec::F acc[16];
    for (int i = 0; i < 16; i++) acc[i] = dot(j + i);
    vec::store(scores + j, vec::sums16(acc) * vec::set(scale));
  }
  for (; j < n; j++) scores[j] = vec::sum(dot(j)) * scale;
  const float inv = 1.f / speculant::exponentiate(scores, n);
  vec::F acc[16];
  for (int64_t c = 0; c < D / 16; c++) acc[c] = vec::zero();
  for (int64_t j = 0; j < n; j++) {
    const vec::F p = vec::set(scores[j]);
    const int64_t row = index ? index[j] : j;
    for (int64_t c = 0; c < D / 16; c++) acc[c] = vec::fmadd(p, load16(v + row * stride + 16 * c), acc[c]);
  }
  for (int64_t c = 0; c < D / 16; c++) {
    alignas(64) float o[16];
    vec::store(o, acc[c] * vec::set(inv));
    for (int i = 0; i < 16; i++) put(out + 16 * c + i, o[i]);
  }
}

// The vector kernel: one task per row and query head. AttentionArgs's pointers hold elements of type T.
template <typename T>
void attend_rows(const AttentionArgs& a) {
  const T *Q = reinterpret_cast<const T*>(a.q), *K = reinterpret_cast<const T*>(a.k), *V = reinterpret_cast<const T*>(a.v);
  T* O = reinterpret_cast<T*>(a.out);
  const int64_t group = a.Hq / a.Hkv;
  speculant::Team::parallel_for(0, a.B * a.Hq * a.T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(a.S);
    std::vector<int64_t> index(a.tree ? a.S : 0);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / (a.Hq * a.T), h = (i / a.T) % a.Hq, t = i % a.T;
      int64_t tail[64];
      const auto [start, n] = speculant::row_keys(a, b, t, tail);
      if (a.tree) {
        for (int64_t j = 0; j < start; j++) index[j] = j;
        std::copy(tail, tail + (n - start), index.data() + start);
      }
      const int64_t base = a.slots[b] * a.sb + (h / group) * a.sh;
      attend_row(Q + b * a.qb + t * a.qt + h * a.qh, K + base, V + base, a.ss, n, a.D, a.scale, scores.data(),
                 O + ((b * a.T + t) * a.Hq + h) * a.D, a.tree ? index.data() : nullptr);
    }
  });
}

}  // namespace

// q [B, T, Hq, D] (any strides, the last dimension contiguous: a view of the qkv projection); keys, values
// [B, Hkv, S, D] (last dimension contiguous), or with `slots` [B] a whole cache layer [rows, Hkv, S, D] whose row
// slots[b] is sequence b's; n_keys [B, T]: the keys row (b, t) sees, the first n_keys[b, t] → [B, T, Hq, D]
// bf16, the layout the output projection reads. Query head h reads key head h / (Hq / Hkv).
// With `tree` [B, T] (int64 bit masks) the pass's new tokens are a draft tree: row (b, t), written at position
// n_keys[b, t] − 1 = start + t, sees the keys before `start` and the new tokens start + j whose bit j is set
// (itself and its ancestors), in position order, so a node attends exactly as its branch decoded alone would.
void attention_into(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                    const torch::Tensor& n_keys, double scale, const c10::optional<torch::Tensor>& slots,
                    const c10::optional<torch::Tensor>& tree, bool amx, torch::Tensor& out) {
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && keys.scalar_type() == type &&
              values.scalar_type() == type, "bf16 or fp32, the same for q, keys and values");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = keys.size(1), S = keys.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256 && Hq % Hkv == 0, "head size must be a multiple of 32, at most 256");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
              "layout");
  auto nk = n_keys.to(torch::kLong).contiguous();
  auto rows = slots ? slots->to(torch::kLong).contiguous() : torch::arange(B, torch::kLong);
  TORCH_CHECK(out.is_contiguous() && out.numel() == B * T * Hq * D && out.scalar_type() == type,
              "the output must be a contiguous tensor of q's type and the result's size");
  const uint16_t* Q = (const uint16_t*)q.data_ptr();
  const uint16_t* K = (const uint16_t*)keys.data_ptr();
  const uint16_t* V = (const uint16_t*)values.data_ptr();
  auto bits = tree ? tree->to(torch::kLong).contiguous() : torch::Tensor();
  TORCH_CHECK(!tree || T <= 64, "a draft tree has at most 64 nodes");
  const AttentionArgs args{Q, K, V, (uint16_t*)out.data_ptr(), nk.data_ptr<int64_t>(),
                           rows.data_ptr<int64_t>(), tree ? bits.data_ptr<int64_t>() : nullptr, B, T, Hq, Hkv, D, S,
                           q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
                           (float)scale};
  if (type == at::kFloat)
    attend_rows<float>(args);
  else if (amx && speculant::amx_usable() && D <= 128)
    speculant::attention_amx(args);
  else
    attend_rows<uint16_t>(args);
}

torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor n_keys,
                        double scale, c10::optional<torch::Tensor> slots, c10::optional<torch::Tensor> tree, bool amx) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  attention_into(q, keys, values, n_keys, scale, slots, tree, amx, out);
  return out;
}
