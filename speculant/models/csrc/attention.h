// What the two attention kernels share: the call's arguments, the keys a row sees, the softmax.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"

namespace speculant {

struct AttentionArgs {
  const uint16_t *q, *k, *v;  // bf16; an fp32 call's floats, reinterpreted (attention.cpp)
  uint16_t* out;  // [B, T, Hq, D]
  const int64_t *n_keys, *slots, *tree;  // [B, T], [B], [B, T] or null
  int64_t B, T, Hq, Hkv, D, S;
  int64_t qb, qt, qh;  // q's strides
  int64_t sb, sh, ss;  // the cache's strides (keys and values alike)
  float scale;
  int64_t window;  // a sliding window: a row sees the keys of its last `window` positions only (0: all)
  float softcap;  // > 0: each scaled score s becomes softcap·tanh(s / softcap) before the softmax (Gemma 2)
};

// Row t of a pass sees the keys 0 .. start − 1 and then, in a draft tree, the new tokens of its branch:
// their positions go to tail. Returns (start, the row's key count).
inline std::pair<int64_t, int64_t> row_keys(const AttentionArgs& a, int64_t b, int64_t t, int64_t* tail) {
  const int64_t n = std::min<int64_t>(a.n_keys[b * a.T + t], a.S);
  if (!a.tree) return {n, n};
  const int64_t start = std::max<int64_t>(n - 1 - t, 0);  // less only in a clamped padding row
  int64_t count = start;
  for (int64_t j = 0; j <= t && start + j < a.S; j++)
    if ((a.tree[b * a.T + t] >> j) & 1) tail[count++ - start] = start + j;
  return {start, count};
}

// The keys row (b, t) sees: their count, and where they are not the cache's first n (a tree, a window that
// cuts the row's keys) their positions in index[0 .. n), in position order, and `indexed` set.
inline int64_t seen_keys(const AttentionArgs& a, int64_t b, int64_t t, std::vector<int64_t>& index, bool& indexed) {
  int64_t tail[64];
  const auto [start, n] = row_keys(a, b, t, tail);
  // A key is in the window when its position on the row's branch is past the row's own minus the window; a
  // tree's new key stands at its depth, start + its rank among the row's ancestors.
  const int64_t low = a.window ? start + (n - start) - a.window : 0;
  indexed = a.tree || low > 0;
  if (!indexed) return n;
  int64_t count = 0;
  for (int64_t j = std::max<int64_t>(low, 0); j < start; j++) index[count++] = j;
  for (int64_t i = 0; i < n - start; i++)
    if (start + i >= low) index[count++] = a.tree ? tail[i] : start + i;
  return count;
}

// scores[0 .. n) → e^(score − max) in place, 16 at a time (the same lanes whoever calls); returns their sum. With
// a soft cap each score is capped first, here where every kernel's scores pass.
inline float exponentiate(float* scores, int64_t n, float softcap) {
  if (softcap > 0)
    for (int64_t j = 0; j < n; j++) scores[j] = std::tanh(scores[j] / softcap) * softcap;
  vec::F top = vec::set(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) top = vec::max(top, vec::load(scores + j, n - j, -INFINITY));
  const vec::F peak = vec::set(vec::top(top));
  vec::F total = vec::zero();
  for (int64_t j = 0; j < n; j += 16) {
    const vec::F p = vec::keep(vec::exp(vec::load(scores + j, n - j, 0.f) - peak), n - j);
    vec::store(scores + j, p, n - j);
    total = total + p;
  }
  return vec::sum(total);
}

// attention_amx.cpp: the whole call on AMX tiles.
void attention_amx(const AttentionArgs& a);

}  // namespace speculant
