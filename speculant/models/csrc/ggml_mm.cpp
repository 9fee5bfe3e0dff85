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
#include "tensor.h"
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
// 16 (each vector a pair) hold a weight vector and 5 rows' 16-bit sums, or with VNNI 4 rows' int32 sums.
constexpr int kRows = vec::kAVX512 ? 8 : vec::kPairSums ? 5 : 4;
constexpr int64_t kRunBlocks = 16;  // 256 outputs: ~100-400 KB of weights at K = 1536, within L2

template <class T>
T* reused(std::vector<T>& buffer, int64_t n) {
  if ((int64_t)buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

inline int32_t int16_pair(int32_t low, int32_t high) { return (int32_t)((uint32_t)(uint16_t)low | (uint32_t)high << 16); }

// The rows' int8 activations, per group of `span` inputs (32 beside legacy formats; a K-quant superblock's
// 256, as llama.cpp's Q8_K, so its sub-blocks' integer sums add up before one float step), each group's
// scale dx and dx·Σp, and the Σp that offsets and minimums take. Rows come in chunks of kRows (the last may be
// shorter), and a chunk of R rows keeps each item of its rows side by side, [items][R]: a kernel of R rows
// finds row i's item t at t·R + i, a fixed offset from the group it is at.
struct Activations {
  int32_t* p;       // [chunks][K/4][R]: 4 int8 inputs each
  float *dx, *sx;   // [chunks][K/span][R]
  int32_t* sum;     // [chunks][K/32][R]: Σp of a group of 32
  int32_t* halves;  // [chunks][K/32][R]: int16 pairs (Σp of inputs 0..15, of 16..31) of a group
  int32_t* pairs;   // [chunks][K/64][R]: int16 pairs (Σp of group 2j, of 2j+1)
  int64_t K, span;

  Activations(const uint16_t* X, int64_t M, int64_t K, int64_t span) : K(K), span(span) {
    static thread_local std::vector<int32_t> p_buffer[2], sum_buffer[2], halves_buffer[2], pairs_buffer[2];
    static thread_local std::vector<float> dx_buffer[2], sx_buffer[2];
    const int k = span == 32 ? 0 : 1;
    p = reused(p_buffer[k], M * K / 4);
    dx = reused(dx_buffer[k], M * K / span), sx = reused(sx_buffer[k], M * K / span);
    sum = reused(sum_buffer[k], M * K / 32), halves = reused(halves_buffer[k], M * K / 32);
    pairs = reused(pairs_buffer[k], M * (K / 64));
    for (int64_t r = 0; r < M; r++) {
      // Row r is row r − c0 of the chunk from c0, of R rows: its item t of `items` a row is at `at`.
      const int64_t c0 = r / kRows * kRows, R = std::min<int64_t>(kRows, M - c0);
      auto at = [&](int64_t items, int64_t t) { return c0 * items + t * R + r - c0; };
      for (int64_t i = 0; i < K / span; i++) {
        const uint16_t* x = X + r * K + span * i;
        F amax = vec::zero();
        for (int64_t j = 0; j < span; j += 16) amax = vec::max(amax, vec::abs(vec::load_bf16(x + j)));
        const float top = vec::top(amax);
        const F inv = vec::set(top > 0 ? 127.f / top : 0.f);
        int32_t total = 0, half[2];
        for (int64_t j = 0; j < span; j += 16) {
          const I q = vec::to_i(vec::load_bf16(x + j) * inv);
          int32_t dwords[4];
          vec::store_i8((int8_t*)dwords, q);
          const int64_t dword = (span * i + j) / 4, group = (span * i + j) / 32;
          for (int d = 0; d < 4; d++) p[at(K / 4, dword + d)] = dwords[d];
          total += half[j / 16 % 2] = vec::sum_i(q);
          if (j / 16 % 2 == 1) {
            sum[at(K / 32, group)] = half[0] + half[1];
            halves[at(K / 32, group)] = int16_pair(half[0], half[1]);
          }
        }
        dx[at(K / span, i)] = top / 127.f;
        sx[at(K / span, i)] = dx[at(K / span, i)] * (float)total;
      }
      for (int64_t j = 0; j < K / 64; j++)
        pairs[at(K / 64, j)] = int16_pair(sum[at(K / 32, 2 * j)], sum[at(K / 32, 2 * j + 1)]);
    }
  }
};

// The chunk of rows from r0 (a multiple of kRows): item t of its row i at [t·R + i].
struct Rows {
  const int32_t *p, *sum, *halves, *pairs;
  const float *dx, *sx;

  Rows(const Activations& x, int64_t r0)
      : p(x.p + r0 * x.K / 4), sum(x.sum + r0 * x.K / 32), halves(x.halves + r0 * x.K / 32),
        pairs(x.pairs + r0 * (x.K / 64)), dx(x.dx + r0 * x.K / x.span), sx(x.sx + r0 * x.K / x.span) {}
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

  // Group g of block b → vectors v0 .. v1 of its 8 (all, or one half group's 4), vector v holding for each
  // output j its inputs 4v .. 4v+3.
  static inline void unpack(const Weights& w, int64_t bg, I* out, int v0 = 0, int v1 = 8) {
    const uint8_t* lo = w.low + bg * kLow;
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int v = v0; v < v1; v++) out[v] = vec::load_bytes(lo + 64 * v);
    } else {
      const I low4 = vec::set8(0x0F);
#pragma GCC unroll 8
      for (int v = v0; v < v1; v++) {  // vectors v and v + 4 share a byte: its low and high nibbles
        const I packed = vec::load_bytes(lo + 64 * (v % 4));
        out[v] = (v < 4 ? packed : vec::shr16(packed, 4)) & low4;
      }
      if constexpr (BITS == 5) {  // bit v of each byte: vector v's fifth bit
        const I hi = vec::load_bytes(w.high + bg * kHigh), one = vec::set8(1);
#pragma GCC unroll 8
        for (int v = v0; v < v1; v++) out[v] = out[v] | vec::shl16(vec::shr16(hi, v) & one, 4);
      } else if constexpr (BITS == 6) {  // bits 2(v mod 4), +1 of vector v / 4: the two top bits
        const I three = vec::set8(3);
        for (int h = v0 / 4; h < (v1 + 3) / 4; h++) {
          const I hi = vec::load_bytes(w.high + bg * kHigh + 64 * h);
          for (int s = 0; s < 4; s++)
            if (4 * h + s >= v0 && 4 * h + s < v1) out[4 * h + s] = out[4 * h + s] | vec::shl16(vec::shr16(hi, 2 * s) & three, 4);
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


template <int R>
inline void store_rows(const Weights& w, const F* acc, uint16_t* Y, int64_t r0, int64_t b) {
  for (int i = 0; i < R; i++) vec::store_bf16(Y + (r0 + i) * w.ld + b * 16, acc[i]);
}

// Rows' sums Σ u·p over half group h of group g (the whole group where H = 1) of block b, added to `exact`,
// and, at a group's first half, the stream 16 groups ahead requested (past the block's end: the next block's).
// With VNNI: R independent chains of dpbusd, each input dword broadcast from the rows' interleaved layout.
// Without, pairs are summed to 16 bits first, and each widening multiplies by `times` (int16 pairs, each one
// value twice): a sub-scale folded into the multiply that widens anyway, exact in integers as a product after it.
template <int BITS, int H, int h, int R>
inline void half_sums(const Weights& w, int64_t b, int64_t g, const Rows& x, I* exact, I times) {
  const int32_t* P = x.p + g * 8 * R;  // the group's 8 dwords of each row, [8][R]
  constexpr int v0 = h * 8 / H, v1 = (h + 1) * 8 / H;
  const int64_t bg = b * w.G + g;
  if (h == 0) Plane<BITS>::prefetch(w, bg + 16);
  I u[8];
  if constexpr (vec::kPairSums && BITS < 8) {
    // Runs of vectors whose 16-bit pair sums cannot overflow (each |pair| ≤ 2·(2^BITS − 1)·127) widen once.
    // Each vector is unpacked where all rows take it: AVX2's 16 registers then hold it and the rows' sums.
    constexpr int kRun = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
#pragma GCC unroll 8
    for (int r = v0; r < v1; r += kRun) {
      I s[R];
#pragma GCC unroll 8
      for (int v = r; v < r + kRun; v++) {
        Plane<BITS>::unpack(w, bg, u, v, v + 1);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
          const I pair = vec::pairs(u[v], vec::set32(P[v * R + i]));
          s[i] = v == r ? pair : vec::chained(vec::add16(s[i], pair));
        }
      }
      for (int i = 0; i < R; i++) exact[i] = vec::widen(exact[i], s[i], times);
    }
  } else {
    Plane<BITS>::unpack(w, bg, u, v0, v1);
    for (int v = v0; v < v1; v++)
      for (int i = 0; i < R; i++) exact[i] = vec::dpbusd_at<BITS == 8>(exact[i], u[v], P + v * R + i);
  }
}

// Block b of 16 outputs for the R rows from r0, a float step per group, for the formats whose scales and
// minimums are D and M alone (sc = mn = 1, not stored: Q4_0, Q4_1, Q5_0, Q8_0). A group's sums start at
// −offset·Σp, so they end at Σ (u − offset)·p.
template <int BITS, bool MINS, int R>
void block(const Weights& w, const Activations& a, uint16_t* Y, int64_t r0, int64_t b) {
  const Rows x(a, r0);
  const I one = vec::set16(1);
  F acc[R];
  for (int i = 0; i < R; i++) acc[i] = vec::zero();
  for (int64_t g = 0; g < w.G; g++) {
    I exact[R];
    for (int i = 0; i < R; i++) exact[i] = vec::set32(-(int32_t)w.offset * x.sum[g * R + i]);
    half_sums<BITS, 1, 0, R>(w, b, g, x, exact, one);
    const F scale = vec::load_fp16(w.d + (b * w.G + g) * 16);
    for (int i = 0; i < R; i++) acc[i] = vec::fmadd(vec::to_f(exact[i]) * scale, vec::set(x.dx[g * R + i]), acc[i]);
    if constexpr (MINS) {
      const F minimum = vec::load_fp16(w.m + (b * w.G + g) * 16);
      for (int i = 0; i < R; i++) acc[i] = vec::fmadd(minimum, vec::set(x.sx[g * R + i]), acc[i]);
    }
  }
  store_rows<R>(w, acc, Y, r0, b);
}

// The same for K-quants (integer sub-scales sc, mn under one D, M a superblock of 8 groups), with activations
// per superblock: a row's integer sums Σ_g sc·(Σ u·p − offset·Σp) and Σ_g mn·Σp are taken over the superblock
// (they fit int32), then two float steps, where legacy formats take them per group. The offset's and the
// minimums' terms are products of int16 pairs (sub-scales or minimums of two halves or groups, by their Σp).
template <int BITS, int H, bool MINS, int R>
void super_block(const Weights& w, const Activations& a, uint16_t* Y, int64_t r0, int64_t b) {
  static_assert(!(H == 2 && MINS), "a K-quant with two sub-scales a group has an offset, no minimums");
  const Rows x(a, r0);
  const int64_t G = w.G, S = w.S, n_super = G / S;
  F acc[R];
  for (int i = 0; i < R; i++) acc[i] = vec::zero();
  for (int64_t sb = 0; sb < n_super; sb++) {
    I scaled[R];
    for (int i = 0; i < R; i++) scaled[i] = vec::zero_i();
    for (int64_t g = sb * S; g < (sb + 1) * S; g++) {
      if constexpr (H == 2) {  // −offset·(sc₀·Σp₀ + sc₁·Σp₁)
        const I lift = vec::mul16(vec::pair16(w.sc + (b * G + g) * 32), (int16_t)-w.offset);
        for (int i = 0; i < R; i++) scaled[i] = vec::dpwssd(scaled[i], lift, vec::set32(x.halves[g * R + i]));
      }
      auto half = [&](auto h) {  // h a compile-time constant: half_sums's loops over the half's vectors unroll
        const int8_t* sc = w.sc + ((b * G + g) * H + h) * 16;
        if constexpr (vec::kPairSums && BITS < 8) {  // the sub-scale multiplies as the sums widen
          half_sums<BITS, H, h, R>(w, b, g, x, scaled, vec::each_twice(sc));
        } else {
          I exact[R];
          for (int i = 0; i < R; i++) exact[i] = vec::zero_i();
          half_sums<BITS, H, h, R>(w, b, g, x, exact, vec::zero_i());
          const I scale = vec::widen_i8(sc);
          for (int i = 0; i < R; i++) scaled[i] = vec::add32(scaled[i], vec::mul32(exact[i], scale));
        }
      };
      half(std::integral_constant<int, 0>{});
      if constexpr (H == 2) half(std::integral_constant<int, 1>{});
    }
    const int64_t at = (b * n_super + sb) * 16;
    const F d = vec::load_fp16(w.d + at);
    for (int i = 0; i < R; i++) acc[i] = vec::fmadd(vec::to_f(scaled[i]) * d, vec::set(x.dx[sb * R + i]), acc[i]);
    if constexpr (MINS) {
      I minimum[R];
      for (int i = 0; i < R; i++) minimum[i] = vec::zero_i();
      for (int64_t g = sb * S; g < (sb + 1) * S; g += 2) {
        const I mn = vec::pair16(w.mn + (b * G + g) * 16);
        for (int i = 0; i < R; i++) minimum[i] = vec::dpwssd(minimum[i], mn, vec::set32(x.pairs[g / 2 * R + i]));
      }
      const F m = vec::load_fp16(w.m + at);
      for (int i = 0; i < R; i++) acc[i] = vec::fmadd(vec::to_f(minimum[i]) * m, vec::set(x.dx[sb * R + i]), acc[i]);
    }
  }
  store_rows<R>(w, acc, Y, r0, b);
}

// Blocks b0 .. b1 for the R rows from r0, one block at a time: with the rows' inputs broadcast from memory,
// two blocks sharing them gained nothing and spilled registers.
template <int BITS, int H, bool MINS, bool UNIT, int R>
void rows(const Weights& w, const Activations& x, uint16_t* Y, int64_t r0, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b++) {
    if constexpr (UNIT) block<BITS, MINS, R>(w, x, Y, r0, b);
    else super_block<BITS, H, MINS, R>(w, x, Y, r0, b);
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
  if constexpr (kRows == 5) return rows<BITS, H, MINS, UNIT, 5>(w, x, Y, r0, b0, b1);
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
Kernel kernel_for(int64_t bits, int64_t halves, bool mins, bool unit, int64_t offset) {
  TORCH_CHECK(unit || halves == 2 || offset == 0, "a K-quant's offset needs two sub-scales a group");
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
    const Kernel kernel = kernel_for(bits, halves, mins, unit, offset);
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
