// y = x Wᵀ for weights repacked exactly from GGUF's block formats (models/ggml.py): Q4_0, Q4_1, Q5_0, Q8_0,
// Q4_K, Q5_K, Q6_K. One form holds them all: per block of 16 outputs and group of 32 inputs,
//   w = (D·sc_h)·(u − offset) + M·mn
// with u the stored unsigned value (BITS bits: a nibble plane, plus 1 or 2 high bits, or whole bytes), sc_h an
// int8 scale per half group of 16 inputs (H = 2, Q6_K) or per group (H = 1), D and M fp16 per superblock of S
// groups (8 for K-quants, 1 for the others), mn a uint8 per group (types with a minimum); sc and mn are not
// stored where they are all 1 (Q4_0, Q4_1, Q5_0, Q8_0). Every product and sum
// of that formula is exact in fp32 for these types, so the stored weights are the file's, value for value.
//
// The activations are int8 (x ≈ dx·p, as llama.cpp's Q8 activations), a half group's sum Σ u·p is VNNI's
// integer product. Legacy formats take per row and group of 32 (dx per 32)
//   y += dx·(D·(Σ u·p − offset·Σp)) + (dx·Σp)·M,
// K-quants per row and superblock (dx per 256, as llama.cpp's Q8_K), their integer sub-scales summed first:
//   y += dx·(D·Σ_g sc·(Σ u·p − offset·Σp)) + dx·(M·Σ_g mn·Σp).
// The same steps in the same order for every row: a row gets the same bits alone or in a verify pass.
#include <torch/extension.h>
#include <immintrin.h>

#include <optional>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "team.h"

namespace {

namespace vec = speculant::vec;
using vec::F;
using vec::I;

// Rows a call takes at once: 8 weight vectors, 8 sums and 8 accumulators fill AVX512's 32 registers; AVX2's
// 16 (each vector a pair) take fewer.
constexpr int kRows = vec::kAVX512 ? 8 : 4;
constexpr int64_t kRunBlocks = 16;  // 256 outputs: ~100-400 KB of weights at K = 1536, within L2

template <class T>
T* reused(std::vector<T>& buffer, int64_t n) {
  if ((int64_t)buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// The rows' int8 activations, per group of `span` inputs (32 beside legacy formats; a K-quant superblock's
// 256, as llama.cpp's Q8_K, so its sub-blocks' integer sums add up before one float step), each group's
// scale dx and dx·Σp, and each half group of 16's Σp.
struct Activations {
  int8_t* p;       // [M, K]
  float *dx, *sx;  // [M, K / span]
  int32_t* half;   // [M, K / 16]
  int64_t span;

  Activations(const uint16_t* X, int64_t M, int64_t K, int64_t span) : span(span) {
    static thread_local std::vector<int8_t> p_buffer[2];
    static thread_local std::vector<float> dx_buffer[2], sx_buffer[2];
    static thread_local std::vector<int32_t> half_buffer[2];
    const int k = span == 32 ? 0 : 1;
    const int64_t n = M * K / span;
    p = reused(p_buffer[k], M * K), dx = reused(dx_buffer[k], n), sx = reused(sx_buffer[k], n);
    half = reused(half_buffer[k], M * K / 16);
    for (int64_t i = 0; i < n; i++) {
      const uint16_t* x = X + span * i;
      F amax = vec::zero();
      for (int64_t j = 0; j < span; j += 16) amax = vec::max(amax, vec::abs(vec::load_bf16(x + j)));
      const float top = vec::top(amax);
      const F inv = vec::set(top > 0 ? 127.f / top : 0.f);
      int32_t total = 0;
      for (int64_t j = 0; j < span; j += 16) {
        const I q = vec::to_i(vec::load_bf16(x + j) * inv);
        vec::store_i8(p + span * i + j, q);
        total += half[(span * i + j) / 16] = vec::sum_i(q);
      }
      dx[i] = top / 127.f;
      sx[i] = dx[i] * (float)total;
    }
  }
};

struct Weights {
  const uint8_t* low;   // [N/16, G, low bytes]: nibbles (BITS < 8) or bytes
  const uint8_t* high;  // [N/16, G, high bytes]: the bits above the nibble (BITS 5, 6)
  const int8_t* sc;     // [N/16, G, H, 16]
  const uint16_t* d;    // [N/16, G/S, 16] fp16
  const uint8_t* mn;    // [N/16, G, 16] (types with a minimum)
  const uint16_t* m;    // [N/16, G/S, 16] fp16
  int64_t K, G, S, offset;
  int64_t ld;  // the output's row stride: parts of one projection write side by side
};

template <int BITS>
struct Plane {
  static constexpr int64_t kLow = BITS == 8 ? 512 : 256;
  static constexpr int64_t kHigh = BITS == 8 ? 0 : (BITS - 4) * 64;

  // Group g of block b → 8 vectors of bytes, vector v holding for each output j its inputs 4v .. 4v+3.
  static void unpack(const Weights& w, int64_t bg, I* out) {
    const uint8_t* lo = w.low + bg * kLow;
    if constexpr (BITS == 8) {
      for (int v = 0; v < 8; v++) out[v] = vec::load_bytes(lo + 64 * v);
    } else {
      const I low4 = vec::set8(0x0F);
      for (int v = 0; v < 4; v++) {
        const I packed = vec::load_bytes(lo + 64 * v);
        out[v] = packed & low4;
        out[v + 4] = vec::shr16(packed, 4) & low4;
      }
      if constexpr (BITS == 5) {  // bit v of each byte: vector v's fifth bit
        const I hi = vec::load_bytes(w.high + bg * kHigh), one = vec::set8(1);
        for (int v = 0; v < 8; v++) out[v] = out[v] | vec::shl16(vec::shr16(hi, v) & one, 4);
      } else if constexpr (BITS == 6) {  // bits 2(v mod 4), +1 of vector v / 4: the two top bits
        const I three = vec::set8(3);
        for (int h = 0; h < 2; h++) {
          const I hi = vec::load_bytes(w.high + bg * kHigh + 64 * h);
          for (int s = 0; s < 4; s++) out[4 * h + s] = out[4 * h + s] | vec::shl16(vec::shr16(hi, 2 * s) & three, 4);
        }
      }
    }
  }

  static void prefetch(const Weights& w, int64_t bg) {
    for (int64_t line = 0; line < kLow; line += 64) _mm_prefetch((const char*)(w.low + bg * kLow + line), _MM_HINT_T0);
    for (int64_t line = 0; line < kHigh; line += 64)
      _mm_prefetch((const char*)(w.high + bg * kHigh + line), _MM_HINT_T0);
  }
};

inline F int8x16(const int8_t* p) { return vec::to_f(vec::widen_i8(p)); }

inline F uint8x16(const uint8_t* p) { return vec::to_f(vec::widen_u8(p)); }

// Group g of blocks b .. b + C unpacked, and the stream 16 groups ahead requested (past a block's end: the
// next call's block c).
template <int BITS, int C>
inline void unpack_group(const Weights& w, int64_t b, int64_t g, I (*u)[8]) {
  for (int c = 0; c < C; c++) {
    const int64_t bg = (b + c) * w.G + g;
    Plane<BITS>::prefetch(w, g + 16 < w.G ? bg + 16 : (b + c + C) * w.G + g + 16 - w.G);
    Plane<BITS>::unpack(w, bg, u[c]);
  }
}

template <int R, int C>
inline void store_rows(const Weights& w, const F (*acc)[R], uint16_t* Y, int64_t r0, int64_t b) {
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) vec::store_bf16(Y + (r0 + i) * w.ld + (b + c) * 16, acc[c][i]);
}

// Rows r0 .. r0 + R's sums Σ (u − offset)·p over half group h of group g (the whole group where H = 1), for
// blocks b .. b + C: R·C independent chains of dpbusd, then offset·Σp taken off (exact integers).
template <int BITS, int H, int R, int C>
inline void half_sums(const Weights& w, const Activations& x, int64_t r0, int64_t g, int h, const I (*u)[8],
                      I (*exact)[R]) {
  const int8_t* X = x.p + r0 * w.K + g * 32;
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) exact[c][i] = vec::zero_i();
  const int v0 = h * 8 / H, v1 = (h + 1) * 8 / H;
  if constexpr (vec::kPairSums && BITS < 8) {
    // Runs of vectors whose 16-bit pair sums cannot overflow (each |pair| ≤ 2·(2^BITS − 1)·127) widen once.
    constexpr int kRun = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
    for (int r = v0; r < v1; r += kRun)
      for (int i = 0; i < R; i++) {
        I s[C];
        for (int v = r; v < r + kRun; v++) {
          const I p = vec::set32(((const int32_t*)(X + i * w.K))[v]);
          for (int c = 0; c < C; c++) s[c] = v == r ? vec::pairs(u[c][v], p) : vec::add16(s[c], vec::pairs(u[c][v], p));
        }
        for (int c = 0; c < C; c++) exact[c][i] = vec::widen(exact[c][i], s[c]);
      }
  } else {
    for (int v = v0; v < v1; v++)
      for (int i = 0; i < R; i++) {
        const I p = vec::set32(((const int32_t*)(X + i * w.K))[v]);  // inputs 4v .. 4v+3
        for (int c = 0; c < C; c++) exact[c][i] = vec::dpbusd<BITS == 8>(exact[c][i], u[c][v], p);
      }
  }
  if (!w.offset) return;
  for (int i = 0; i < R; i++) {
    const int32_t* half = x.half + ((r0 + i) * w.G + g) * 2;
    const I lift = vec::set32((int32_t)w.offset * (H == 2 ? half[h] : half[0] + half[1]));
    for (int c = 0; c < C; c++) exact[c][i] = vec::sub32(exact[c][i], lift);
  }
}

// Blocks b .. b + C of 16 outputs for rows r0 .. r0 + R, a float step per group.
// UNIT: the format's scales and minimums are D and M alone (sc = mn = 1: Q4_0, Q4_1, Q5_0, Q8_0), not stored.
template <int BITS, int H, bool MINS, bool UNIT, int R, int C>
void blocks(const Weights& w, const Activations& x, uint16_t* Y, int64_t r0, int64_t b) {
  const int64_t G = w.G, S = w.S;
  F acc[C][R];
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) acc[c][i] = vec::zero();
  for (int64_t g = 0; g < G; g++) {
    I u[C][8];
    unpack_group<BITS, C>(w, b, g, u);
    for (int h = 0; h < H; h++) {
      I exact[C][R];
      half_sums<BITS, H, R, C>(w, x, r0, g, h, u, exact);
      for (int c = 0; c < C; c++) {
        const int64_t bg = (b + c) * G + g, sb = ((b + c) * (G / S) + g / S) * 16;
        const F scale = UNIT ? vec::load_fp16(w.d + sb) : vec::load_fp16(w.d + sb) * int8x16(w.sc + (bg * H + h) * 16);
        for (int i = 0; i < R; i++)
          acc[c][i] = vec::fmadd(vec::to_f(exact[c][i]) * scale, vec::set(x.dx[(r0 + i) * G + g]), acc[c][i]);
      }
    }
    if constexpr (MINS) {
      for (int c = 0; c < C; c++) {
        const int64_t bg = (b + c) * G + g, sb = ((b + c) * (G / S) + g / S) * 16;
        const F minimum = UNIT ? vec::load_fp16(w.m + sb) : vec::load_fp16(w.m + sb) * uint8x16(w.mn + bg * 16);
        for (int i = 0; i < R; i++) acc[c][i] = vec::fmadd(minimum, vec::set(x.sx[(r0 + i) * G + g]), acc[c][i]);
      }
    }
  }
  store_rows<R, C>(w, acc, Y, r0, b);
}

// The same for K-quants (integer sub-scales sc, mn under one D, M a superblock of 8 groups), with activations
// per superblock: a row's integer sums Σ_g sc·(Σ u·p − offset·Σp) and Σ_g mn·Σp are taken over the superblock
// (they fit int32), then two float steps, where legacy formats take them per group.
template <int BITS, int H, bool MINS, int R, int C>
void super_blocks(const Weights& w, const Activations& x, uint16_t* Y, int64_t r0, int64_t b) {
  const int64_t G = w.G, S = w.S, n_super = G / S;
  F acc[C][R];
  for (int c = 0; c < C; c++)
    for (int i = 0; i < R; i++) acc[c][i] = vec::zero();
  for (int64_t sb = 0; sb < n_super; sb++) {
    I scaled[C][R], minimum[C][R];
    for (int c = 0; c < C; c++)
      for (int i = 0; i < R; i++) scaled[c][i] = minimum[c][i] = vec::zero_i();
    for (int64_t g = sb * S; g < (sb + 1) * S; g++) {
      I u[C][8];
      unpack_group<BITS, C>(w, b, g, u);
      for (int h = 0; h < H; h++) {
        I exact[C][R];
        half_sums<BITS, H, R, C>(w, x, r0, g, h, u, exact);
        for (int c = 0; c < C; c++) {
          const I sc = vec::widen_i8(w.sc + (((b + c) * G + g) * H + h) * 16);
          for (int i = 0; i < R; i++) scaled[c][i] = vec::add32(scaled[c][i], vec::mul32(exact[c][i], sc));
        }
      }
      if constexpr (MINS) {
        for (int c = 0; c < C; c++) {
          const I mn = vec::widen_u8(w.mn + ((b + c) * G + g) * 16);
          for (int i = 0; i < R; i++) {
            const int32_t* half = x.half + ((r0 + i) * G + g) * 2;
            minimum[c][i] = vec::add32(minimum[c][i], vec::mul32(mn, vec::set32(half[0] + half[1])));
          }
        }
      }
    }
    for (int c = 0; c < C; c++) {
      const int64_t at = ((b + c) * n_super + sb) * 16;
      const F d = vec::load_fp16(w.d + at);
      for (int i = 0; i < R; i++) {
        const F dx = vec::set(x.dx[(r0 + i) * n_super + sb]);
        acc[c][i] = vec::fmadd(vec::to_f(scaled[c][i]) * d, dx, acc[c][i]);
        if constexpr (MINS) acc[c][i] = vec::fmadd(vec::to_f(minimum[c][i]) * vec::load_fp16(w.m + at), dx, acc[c][i]);
      }
    }
  }
  store_rows<R, C>(w, acc, Y, r0, b);
}

template <int BITS, int H, bool MINS, bool UNIT, int R>
void rows(const Weights& w, const Activations& x, uint16_t* Y, int64_t r0, int64_t b0, int64_t b1) {
  // Two blocks share each broadcast input where registers allow (at 5 rows and more the sums spill); one
  // row streams one block at a time, which keeps memory busier than two streams.
  constexpr int C = vec::kAVX512 && R > 1 && R <= 4 ? 2 : 1;
  int64_t b = b0;
  if constexpr (UNIT) {
    for (; b + C <= b1; b += C) blocks<BITS, H, MINS, UNIT, R, C>(w, x, Y, r0, b);
    if (b < b1) blocks<BITS, H, MINS, UNIT, R, 1>(w, x, Y, r0, b);
  } else {
    for (; b + C <= b1; b += C) super_blocks<BITS, H, MINS, R, C>(w, x, Y, r0, b);
    if (b < b1) super_blocks<BITS, H, MINS, R, 1>(w, x, Y, r0, b);
  }
}

template <int BITS, int H, bool MINS, bool UNIT>
void any_rows(const Weights& w, const Activations& x, uint16_t* Y, int64_t r0, int n, int64_t b0, int64_t b1) {
  switch (n) {  // the row counts above kRows never reach here: not instantiated
    case 1: return rows<BITS, H, MINS, UNIT, 1>(w, x, Y, r0, b0, b1);
    case 2: return rows<BITS, H, MINS, UNIT, 2>(w, x, Y, r0, b0, b1);
    case 3: return rows<BITS, H, MINS, UNIT, 3>(w, x, Y, r0, b0, b1);
    case 4: return rows<BITS, H, MINS, UNIT, 4>(w, x, Y, r0, b0, b1);
  }
  if constexpr (kRows == 8) {
    switch (n) {
      case 5: return rows<BITS, H, MINS, UNIT, 5>(w, x, Y, r0, b0, b1);
      case 6: return rows<BITS, H, MINS, UNIT, 6>(w, x, Y, r0, b0, b1);
      case 7: return rows<BITS, H, MINS, UNIT, 7>(w, x, Y, r0, b0, b1);
      default: return rows<BITS, H, MINS, UNIT, 8>(w, x, Y, r0, b0, b1);
    }
  }
}

using Kernel = void (*)(const Weights&, const Activations&, uint16_t*, int64_t, int, int64_t, int64_t);

// The formats GGUF files of the Llama family use (models/ggml.py's FORMATS): bits, halves, minimum, unit scales.
Kernel kernel_for(int64_t bits, int64_t halves, bool mins, bool unit) {
  if (bits == 4 && halves == 1 && unit) return mins ? any_rows<4, 1, true, true> : any_rows<4, 1, false, true>;
  if (bits == 5 && halves == 1 && unit && !mins) return any_rows<5, 1, false, true>;
  if (bits == 8 && halves == 1 && unit && !mins) return any_rows<8, 1, false, true>;
  if (bits == 4 && halves == 1 && mins && !unit) return any_rows<4, 1, true, false>;
  if (bits == 5 && halves == 1 && mins && !unit) return any_rows<5, 1, true, false>;
  if (bits == 6 && halves == 2 && !mins && !unit) return any_rows<6, 2, false, false>;
  TORCH_CHECK(false, "no kernel for ", bits, "-bit weights with ", halves, " scales a group", mins ? " and minimums" : "",
              unit ? " (unit scales)" : "");
}

}  // namespace

// x [M, K] bf16; a projection as models/ggml.py lays it out: 7 tensors a part (low, high, sc, d, mn, m,
// format = bits, halves, offset, groups per superblock), parts of any formats side by side in the output
// columns (a fused qkv whose v is stored in other bits) → y [M, ΣN] bf16. The activations are quantized once.
void ggml_mm_into(const torch::Tensor& x, const std::vector<torch::Tensor>& p, torch::Tensor& y) {
  TORCH_CHECK(!p.empty() && p.size() % 7 == 0, "a GGML weight: 7 tensors a part (low, high, sc, d, mn, m, format)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be 2-D bf16");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  int64_t total = 0;
  for (size_t i = 0; i < p.size(); i += 7) total += p[i].size(0) * 16;
  check_output(y, M * total);
  bool legacy = false, super = false;
  for (size_t i = 0; i < p.size(); i += 7) (p[i + 2].numel() == 0 ? legacy : super) = true;
  TORCH_CHECK(!super || K % 256 == 0, "K-quant weights need inputs in multiples of 256");
  auto xc = x.contiguous();
  const auto* X = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  // Each granularity the parts need, quantized once for all of them.
  std::optional<Activations> per_group, per_super;
  if (legacy) per_group.emplace(X, M, K, 32);
  if (super) per_super.emplace(X, M, K, 256);
  int64_t col = 0;
  for (size_t i = 0; i < p.size(); i += 7) {
    const auto& low = p[i];
    const int64_t* format = p[i + 6].data_ptr<int64_t>();
    const int64_t bits = format[0], halves = format[1], offset = format[2], S = format[3];
    const bool mins = p[i + 5].numel() > 0, unit = p[i + 2].numel() == 0;
    const int64_t N = low.size(0) * 16;
    TORCH_CHECK(low.dim() == 3 && low.size(1) == G && K % 32 == 0 && G % S == 0, "input size ", K,
                " does not match the weight's ", low.size(1) * 32);
    const Kernel kernel = kernel_for(bits, halves, mins, unit);
    const Weights w{low.data_ptr<uint8_t>(),
                    p[i + 1].numel() ? p[i + 1].data_ptr<uint8_t>() : nullptr,
                    unit ? nullptr : p[i + 2].data_ptr<int8_t>(),
                    (const uint16_t*)p[i + 3].data_ptr(),
                    mins && !unit ? p[i + 4].data_ptr<uint8_t>() : nullptr,
                    mins ? (const uint16_t*)p[i + 5].data_ptr() : nullptr,
                    K, G, S, offset, total};
    auto* Y = (uint16_t*)y.data_ptr<at::BFloat16>() + col;
    const Activations& act = unit ? *per_group : *per_super;
    speculant::Team::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
      // More rows than a call takes: every row over a run of blocks that stays in L2, so the weights stream
      // from memory once, not once per kRows rows.
      const int64_t run = M <= kRows ? b1 - b0 : kRunBlocks;
      for (int64_t c0 = b0; c0 < b1; c0 += run)
        for (int64_t r0 = 0; r0 < M; r0 += kRows)
          kernel(w, act, Y, r0, (int)std::min<int64_t>(kRows, M - r0), c0, std::min(b1, c0 + run));
    });
    col += N;
  }
}

torch::Tensor ggml_mm(torch::Tensor x, std::vector<torch::Tensor> p) {
  int64_t total = 0;
  for (size_t i = 0; i < p.size(); i += 7) total += p[i].size(0) * 16;
  auto y = torch::empty({x.size(0), total}, x.options());
  ggml_mm_into(x, p, y);
  return y;
}
