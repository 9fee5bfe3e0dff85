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
void attend_row(const T* q, const T* k, const T* v, int64_t stride, int64_t n, int64_t D, float scale, float softcap,
                float* scores, T* out, const int64_t* index) {
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
  const float inv = 1.f / speculant::exponentiate(scores, n, softcap);
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
    std::vector<int64_t> index(a.tree || a.window ? a.S : 0);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / (a.Hq * a.T), h = (i / a.T) % a.Hq, t = i % a.T;
      bool indexed;
      const int64_t n = speculant::seen_keys(a, b, t, index, indexed);
      const int64_t base = a.slots[b] * a.sb + (h / group) * a.sh;
      attend_row(Q + b * a.qb + t * a.qt + h * a.qh, K + base, V + base, a.ss, n, a.D, a.scale, a.softcap, scores.data(),
                 O + ((b * a.T + t) * a.Hq + h) * a.D, indexed ? index.data() : nullptr);
    }
  });
}

// AVX2 and bf16: attend_row's products and sums in its order, so its bits, but each key and value turned into
// fp32 once for all the query heads that read it (the heads of one key head together), where attend_row
// converts both operands at every product: on AVX2 (no vdpbf16ps) that conversion was most of a long context's
// attention.
#if !defined(__AVX512F__)
namespace grouped {

constexpr int64_t kKeys = 32;  // keys converted at a time: 16 KB of fp32 at D = 128, within L1

// A row of D bf16 → D fp32 as dot_bf16 takes it apart: per 16 inputs, the 8 even ones, then the 8 odd ones.
inline void split_row(const uint16_t* p, float* out, int64_t D) {
  const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000);
  for (int64_t c = 0; c < D; c += 16) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(p + c));
    _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
    _mm256_storeu_ps(out + c + 8, _mm256_castsi256_ps(_mm256_and_si256(x, high)));
  }
}

// A row of D bf16 → D fp32 in order, as load_bf16 reads it.
inline void widen_row(const uint16_t* p, float* out, int64_t D) {
  for (int64_t c = 0; c < D; c += 16) vec::store(out + c, vec::load_bf16(p + c));
}

// Scores of a query against n keys, both split (split_row): attend_row's dot, its two chains of products
// (inputs 0–15 and 16–31 of every 32), summed by vec::sum and scaled. R keys at a time share the query's loads.
template <int R>
inline void scores_of(const float* q, const float* keys, int64_t D, float scale, float* out) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    const __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + c + 8), q2 = _mm256_loadu_ps(q + c + 16),
                 q3 = _mm256_loadu_ps(q + c + 24);
    for (int r = 0; r < R; r++) {
      const float* k = keys + r * D + c;
      lo[r] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + 8), _mm256_fmadd_ps(q0, _mm256_loadu_ps(k), lo[r]));
      hi[r] = _mm256_fmadd_ps(q3, _mm256_loadu_ps(k + 24), _mm256_fmadd_ps(q2, _mm256_loadu_ps(k + 16), hi[r]));
    }
  }
  for (int r = 0; r < R; r++) out[r] = vec::sum(vec::F{lo[r], hi[r]}) * scale;
}

// out[0 .. W·8) += Σ_i p[i]·values[i] over n values in order (fp32, row stride D): attend_row's chains.
template <int W>
inline void weigh(const float* p, const float* values, int64_t n, int64_t D, float* out) {
  __m256 acc[W];
  for (int c = 0; c < W; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);
  for (int64_t i = 0; i < n; i++) {
    const __m256 w = _mm256_set1_ps(p[i]);
    for (int c = 0; c < W; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + i * D + 8 * c), acc[c]);
  }
  for (int c = 0; c < W; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// A thread's scratch, kept from call to call.
struct Buffers {
  float *q, *block, *scores, *out;
  int64_t S;
  Buffers(int64_t G, int64_t D, int64_t S) : S(S) {
    static thread_local std::vector<float> memory;
    if ((int64_t)memory.size() < G * D * 2 + kKeys * D + G * S) memory.resize(G * D * 2 + kKeys * D + G * S);
    q = memory.data(), out = q + G * D, block = out + G * D, scores = block + kKeys * D;
  }
};

// Query heads q[0 .. G) (stride qh) of one row, sharing key head k, v (row stride `stride`), over its n keys
// (rows index[0 .. n) with a tree) → out (stride G·D apart: head h at out + h·D).
void attend_heads(const uint16_t* q, int64_t qh, int64_t G, const uint16_t* k, const uint16_t* v, int64_t stride,
                  int64_t n, int64_t D, float scale, float softcap, const int64_t* index, Buffers& buf, uint16_t* out) {
  float *qs = buf.q, *block = buf.block, *scores = buf.scores, *acc = buf.out;
  const int64_t S = buf.S;
  for (int64_t h = 0; h < G; h++) split_row(q + h * qh, qs + h * D, D);
  auto row = [&](int64_t j) { return index ? index[j] : j; };
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t nb = std::min(kKeys, n - j0);
    for (int64_t i = 0; i < nb; i++) split_row(k + row(j0 + i) * stride, block + i * D, D);
    for (int64_t h = 0; h < G; h++) {
      int64_t i = 0;
      for (; i + 4 <= nb; i += 4) scores_of<4>(qs + h * D, block + i * D, D, scale, scores + h * S + j0 + i);
      for (; i < nb; i++) scores_of<1>(qs + h * D, block + i * D, D, scale, scores + h * S + j0 + i);
    }
  }
  std::fill(acc, acc + G * D, 0.f);
  float inv[64];
  for (int64_t h = 0; h < G; h++) inv[h] = 1.f / speculant::exponentiate(scores + h * S, n, softcap);
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t nb = std::min(kKeys, n - j0);
    for (int64_t i = 0; i < nb; i++) widen_row(v + row(j0 + i) * stride, block + i * D, D);
    for (int64_t h = 0; h < G; h++)
      for (int64_t c = 0; c < D; c += 64) {
        if (D - c >= 64) weigh<8>(scores + h * S + j0, block + c, nb, D, acc + h * D + c);
        else weigh<4>(scores + h * S + j0, block + c, nb, D, acc + h * D + c);
      }
  }
  for (int64_t h = 0; h < G; h++)
    for (int64_t c = 0; c < D; c += 16) {
      alignas(64) float o[16];
      vec::store(o, vec::load(acc + h * D + c) * vec::set(inv[h]));
      for (int i = 0; i < 16; i++) put(out + h * D + c + i, o[i]);
    }
}

// One task per row and key head.
void attend(const AttentionArgs& a) {
  const int64_t G = a.Hq / a.Hkv;
  speculant::Team::parallel_for(0, a.B * a.T * a.Hkv, 1, [&](int64_t i0, int64_t i1) {
    Buffers buf(G, a.D, a.S);
    std::vector<int64_t> index(a.tree || a.window ? a.S : 0);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / (a.T * a.Hkv), t = (i / a.Hkv) % a.T, kvh = i % a.Hkv;
      bool indexed;
      const int64_t n = speculant::seen_keys(a, b, t, index, indexed);
      const int64_t base = a.slots[b] * a.sb + kvh * a.sh, h0 = kvh * G;
      attend_heads(a.q + b * a.qb + t * a.qt + h0 * a.qh, a.qh, G, a.k + base, a.v + base, a.ss, n, a.D, a.scale,
                   a.softcap, indexed ? index.data() : nullptr, buf, a.out + ((b * a.T + t) * a.Hq + h0) * a.D);
    }
  });
}

}  // namespace grouped
#endif

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
                    const c10::optional<torch::Tensor>& tree, bool amx, torch::Tensor& out, int64_t window,
                    double softcap) {
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
                           (float)scale, window, (float)softcap};
  if (type == at::kFloat)
    attend_rows<float>(args);
  else if (amx && speculant::amx_usable() && D <= 128 && !window)  // a window: the vector kernel, always
    speculant::attention_amx(args);
#if !defined(__AVX512F__)
  else if (Hq / Hkv <= 64)
    grouped::attend(args);
#endif
  else
    attend_rows<uint16_t>(args);
}

torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor n_keys,
                        double scale, c10::optional<torch::Tensor> slots, c10::optional<torch::Tensor> tree, bool amx,
                        int64_t window, double softcap) {
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
  attention_into(q, keys, values, n_keys, scale, slots, tree, amx, out, window, softcap);
  return out;
}
