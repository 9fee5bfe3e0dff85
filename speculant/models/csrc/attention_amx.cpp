// Decode-time attention on AMX tiles: the rows of a call that read one key head (its query heads, at
// every new position) share each key and value tile, so a verify pass of 8 tokens costs little more
// than one (the vector kernel pays per row).
//
// Per task (a sequence, a key head, up to 16 of its rows):
// 1. scores: tiles of 16 keys (straight from the cache) × the rows' queries → [keys, rows], turned to
//    [rows, keys] in registers;
// 2. each row's softmax over exactly its keys, in the order its branch decoded alone would see them (a
//    draft tree's row compacts its ancestors behind the cached keys), as bf16 probabilities;
// 3. probabilities × values, 32 keys a tile step, values paired as the tiles read them.
//
// Exactness: a row's scores, softmax and sums use the same instructions on the same operands whatever
// the other rows: a tile's output element depends on its own row and column only, the keys a row does
// not see enter with probability 0, and a tile step's 32 keys are the same 32 (by a row's own key
// order) as when the row is alone. A tile step adds its products at a precision finer than fp32, so
// where a tree row's keys are not the cache's contiguous positions it takes its own tile steps.
#include "tensor.h"
#include <immintrin.h>

#include "amx.h"
#include "attention.h"
#include "bf16.h"
#include "team.h"

#if defined(__AVX512F__)  // the avx2 levels build the stubs at the end instead

namespace speculant {
namespace {

constexpr int64_t kStep = 32;  // keys per probability × value tile step (16 pairs)

// 16 × 16 32-bit elements, rows in r[0 .. 16) → columns in r[0 .. 16).
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; g++) {  // u[4g + c], 128-bit lane L: rows 4g .. 4g+3 of column 4L + c
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i odd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xDD);
  }
}

// The value tiles of one step: for each group of 16 dimensions in [g0, g0 + ng), 16 rows (key pairs) of 16
// (key 2p, key 2p + 1) elements. Pairing 32-dimension chunks with unpacklo/hi puts dimension
// 32c + 8L + 4h + i (L the 128-bit lane, i < 4) in group 2c + h, column 4L + i (see dimension()).
void pair_values(const uint16_t* const* rows, int64_t g0, int64_t ng, uint32_t* tiles) {
  for (int64_t p = 0; p < 16; p++)
    for (int64_t c = g0 / 2; c <= (g0 + ng - 1) / 2; c++) {
      const __m512i x0 = _mm512_loadu_si512(rows[2 * p] + 32 * c), x1 = _mm512_loadu_si512(rows[2 * p + 1] + 32 * c);
      if (2 * c >= g0) _mm512_store_si512(tiles + (2 * c - g0) * 256 + p * 16, _mm512_unpacklo_epi16(x0, x1));
      if (2 * c + 1 < g0 + ng) _mm512_store_si512(tiles + (2 * c + 1 - g0) * 256 + p * 16, _mm512_unpackhi_epi16(x0, x1));
    }
}

inline int64_t dimension(int64_t group, int64_t column) {
  return 32 * (group / 2) + 8 * (column / 4) + 4 * (group % 2) + column % 4;
}

// Tile instructions name their tiles in the instruction: the accumulators 0 .. 3 by a switch.
inline void zero_accumulator(int64_t g) {
  switch (g) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3);
  }
}

// Accumulator g += tile 4 × these values, loaded to a tile of their own (5, 6, 7 in turn) so that a load
// need not wait for the product before it.
inline void accumulate(int64_t g, const uint32_t* values) {
  switch (g) {
    case 0: _tile_loadd(5, values, 64); _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_loadd(6, values, 64); _tile_dpbf16ps(1, 4, 6); break;
    case 2: _tile_loadd(7, values, 64); _tile_dpbf16ps(2, 4, 7); break;
    default: _tile_loadd(5, values, 64); _tile_dpbf16ps(3, 4, 5);
  }
}

inline void store_accumulator(int64_t g, float* out) {
  switch (g) {
    case 0: _tile_stored(0, out, 64); break;
    case 1: _tile_stored(1, out, 64); break;
    case 2: _tile_stored(2, out, 64); break;
    default: _tile_stored(3, out, 64);
  }
}

// One task's buffers, sized for the longest key range of the call.
struct Scratch {
  // Left uninitialized: a tile row past the task's rows reads whatever is there, into an output row
  // nobody reads (tile rows never mix).
  float* scores;     // [16 rows, width]
  uint16_t* probs;   // [16 rows, width] bf16, 0 past a row's keys
  static constexpr uint16_t zeros[128] = {};  // one key or value row of zeros (heads of at most 128)
  alignas(64) uint32_t queries[8][256];  // per 32-dimension chunk: 16 pairs × 16 rows
  alignas(64) uint32_t values[4][256];   // one step's value tiles
  alignas(64) float out[16][256];        // per group of 16 dimensions: 16 rows × 16
  alignas(64) uint16_t keys[2][16 * 128];  // blocks of keys past the cache's end, zero-padded
  alignas(64) uint16_t some_rows[16 * 32];  // a tile step's probabilities for some rows, 0 for the others
  int64_t width = 0;
};

void attend_block(const AttentionArgs& a, int64_t b, int64_t head, int64_t r0, Scratch& s) {
  const int64_t group = a.Hq / a.Hkv, rows = std::min<int64_t>(16, a.T * group - r0);
  const int64_t chunks = a.D / 32, n_groups = a.D / 16;
  const int64_t base = a.slots[b] * a.sb + head * a.sh;
  const uint16_t *K = a.k + base, *V = a.v + base;
  int64_t start[16], count[16], tail[16][64], extent = 0;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t t = (r0 + r) / group;
    std::tie(start[r], count[r]) = row_keys(a, b, t, tail[r]);
    extent = std::max(extent, std::min<int64_t>(a.n_keys[b * a.T + t], a.S));  // a tree row's keys lie below
  }
  const int64_t width = (extent + kStep - 1) / kStep * kStep;
  float* scores = s.scores;
  uint16_t* probs = s.probs;

  // The rows' queries as the B operand: pair p of chunk c, column r = (q[r][32c + 2p], q[r][32c + 2p + 1]).
  for (int64_t r = 0; r < 16; r++) {
    const int64_t t = (r0 + r) / group, h = head * group + (r0 + r) % group;
    const uint32_t* q = r < rows ? (const uint32_t*)(a.q + b * a.qb + t * a.qt + h * a.qh) : nullptr;
    for (int64_t c = 0; c < chunks; c++)
      for (int64_t p = 0; p < 16; p++) s.queries[c][p * 16 + r] = q ? q[16 * c + p] : 0;
  }

  // 1. Scores of every key up to the widest row's, by position: two blocks of 16 keys at a time, on
  // separate tiles, so that one block's products need not wait for the other's.
  auto key_block = [&](int64_t j0, uint16_t* spill, int64_t& stride) -> const uint16_t* {
    stride = a.ss * 2;
    if (j0 + 16 <= a.S) return K + j0 * a.ss;
    std::fill(spill, spill + 16 * a.D, 0);  // the cache ends inside this block
    for (int64_t j = j0; j < a.S; j++) std::copy(K + j * a.ss, K + j * a.ss + a.D, spill + (j - j0) * a.D);
    stride = a.D * 2;
    return spill;
  };
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < extent; j0 += 32) {
    for (int64_t j = j0 + 64; j < std::min(j0 + 96, extent); j++)
      for (int64_t c = 0; c < a.D; c += 32) _mm_prefetch((const char*)(K + j * a.ss + c), _MM_HINT_T0);
    int64_t stride0, stride1;
    const uint16_t* k0 = key_block(j0, s.keys[0], stride0);
    const uint16_t* k1 = key_block(j0 + 16, s.keys[1], stride1);
    _tile_zero(0);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
      _tile_loadd(2, s.queries[c], 64);
      _tile_loadd(1, k0 + 32 * c, stride0);
      _tile_loadd(4, k1 + 32 * c, stride1);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 4, 2);
    }
    alignas(64) __m512i block[2][16];
    _tile_stored(0, block[0], 64);
    _tile_stored(3, block[1], 64);
    for (int64_t half = 0; half < 2; half++) {
      transpose16(block[half]);
      for (int64_t r = 0; r < rows; r++)
        _mm512_storeu_ps(scores + r * s.width + j0 + 16 * half, _mm512_mul_ps(_mm512_castsi512_ps(block[half][r]), scale));
    }
  }

  // 2. Each row's probabilities over its own keys, in its own order.
  for (int64_t r = 0; r < rows; r++) {
    float* sc = scores + r * s.width;
    uint16_t* pr = probs + r * s.width;
    const int64_t n = count[r];
    for (int64_t j = start[r]; j < n; j++) sc[j] = sc[tail[r][j - start[r]]];  // a tree row's ancestors
    const __m512 inv = _mm512_set1_ps(1.f / exponentiate(sc, n, a.softcap));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = lanes(n - j);
      const __m256bh p = _mm512_cvtneps_pbh(_mm512_maskz_mul_ps(live, _mm512_loadu_ps(sc + j), inv));
      _mm256_storeu_si256((__m256i*)(pr + j), (__m256i)p);
    }
    std::fill(pr + (n + 15) / 16 * 16, pr + width, 0);
  }

  // 3. Probabilities × values. Rows read the cache's positions up to the shared end; past it, a tree
  // position's rows read their own keys.
  int64_t shared = width;
  if (a.tree) {
    shared = extent;
    for (int64_t r = 0; r < rows; r++) shared = std::min(shared, start[r]);
    shared = shared / kStep * kStep;
  }
  const uint16_t* key_rows[kStep];
  for (int64_t g0 = 0; g0 < n_groups; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, n_groups - g0);
    for (int64_t g = 0; g < ng; g++) zero_accumulator(g);
    auto step = [&](const uint16_t* p, int64_t stride) {
      pair_values(key_rows, g0, ng, s.values[0]);
      _tile_loadd(4, p, stride);
      for (int64_t g = 0; g < ng; g++) accumulate(g, s.values[g]);
    };
    for (int64_t j0 = 0; j0 < shared; j0 += kStep) {
      for (int64_t j = j0 + 2 * kStep; j < std::min(j0 + 3 * kStep, extent); j++)
        for (int64_t c = 0; c < a.D; c += 32) _mm_prefetch((const char*)(V + j * a.ss + c), _MM_HINT_T0);
      for (int64_t j = 0; j < kStep; j++) key_rows[j] = j0 + j < extent ? V + (j0 + j) * a.ss : Scratch::zeros;
      step(probs + j0, s.width * 2);
    }
    // A tree position's rows (its query heads) read the same keys: one step serves them all.
    for (int64_t r = 0, next; a.tree && r < rows; r = next) {
      for (next = r + 1; next < rows && (r0 + next) / group == (r0 + r) / group;) next++;
      for (int64_t j0 = shared; j0 < count[r]; j0 += kStep) {
        for (int64_t j = 0; j < kStep; j++) {
          const int64_t key = j0 + j;
          key_rows[j] = key >= count[r] ? Scratch::zeros : V + (key < start[r] ? key : tail[r][key - start[r]]) * a.ss;
        }
        std::fill(s.some_rows, s.some_rows + 16 * kStep, 0);
        for (int64_t i = r; i < next; i++)
          std::copy(probs + i * s.width + j0, probs + i * s.width + j0 + kStep, s.some_rows + i * kStep);
        step(s.some_rows, kStep * 2);
      }
    }
    for (int64_t g = 0; g < ng; g++) store_accumulator(g, s.out[g0 + g]);
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t t = (r0 + r) / group, h = head * group + (r0 + r) % group;
    uint16_t* o = a.out + ((b * a.T + t) * a.Hq + h) * a.D;
    for (int64_t g = 0; g < n_groups; g++)
      for (int64_t c = 0; c < 16; c++) o[dimension(g, c)] = to_bf16(s.out[g][r * 16 + c]);
  }
}

}  // namespace

void attention_amx(const AttentionArgs& a) {
  TORCH_CHECK(a.D <= 128, "the AMX attention kernel takes heads of at most 128");
  const int64_t blocks = (a.T * (a.Hq / a.Hkv) + 15) / 16;
  int64_t longest = 0;
  for (int64_t i = 0; i < a.B * a.T; i++) longest = std::max(longest, std::min<int64_t>(a.n_keys[i], a.S));
  speculant::Team::parallel_for(0, a.B * a.Hkv * blocks, 1, [&](int64_t i0, int64_t i1) {
    TileConfig cfg = {};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    speculant::load_tile_config(cfg);
    // Each thread's, kept from call to call: a pass makes 30 calls.
    static thread_local std::vector<float> scores;
    static thread_local std::vector<uint16_t> probs;
    Scratch s;
    s.width = (longest + kStep - 1) / kStep * kStep;
    if ((int64_t)scores.size() < 16 * s.width) scores.resize(16 * s.width), probs.resize(16 * s.width);
    s.scores = scores.data(), s.probs = probs.data();
    for (int64_t i = i0; i < i1; i++)
      attend_block(a, i / (a.Hkv * blocks), (i / blocks) % a.Hkv, i % blocks * 16, s);
    _tile_release();
  });
}

}  // namespace speculant

#else
void speculant::attention_amx(const speculant::AttentionArgs&) { TORCH_CHECK(false, "attention_amx needs AMX"); }
#endif
