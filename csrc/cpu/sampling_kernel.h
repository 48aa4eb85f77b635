// CPU kernel of sbd::entropy_sample, compiled once per instruction set (sampling_kernel_<isa>.cpp) inside
// namespace sbd::cpu::CPU_CAPABILITY. Math and random generator: sbd_kernels/ops/sampling/naive.py.
//
// One pass over the vocabulary per row. A row is cut into chunks of kChunk entries, fixed by V alone; work
// items are (row, run of consecutive chunks); each item walks its chunks in tiles of kTile entries
// converted to fp32 into an L1-resident buffer, then:
//   pass 1 over the tile: max, max of each kGroup entries, NaN flag (NaN / +inf rows are abandoned at once);
//   pass 2 over the tile: online sum exp(x - m) and sum exp(x - m) (x - m) (entropy), and the Gumbel-max
//   race. Each chunk leaves one partial; a row's partials are combined afterwards in vocabulary order
//   (lowest index wins ties), so its outputs are the same bits whatever the batch and the thread count.
// Filters (top-k, top-p, min-p) restrict the race to the entries above a threshold: section "Filters".
// A row whose best score is +-inf (x_max / T overflowed fp32) races again on (x - max) / T + g: naive.py's
// overflow rule, relative_race, tested once per row after the race.
//
// Gumbel-max without computing most of the noise: u <= 1 - 2^-24 bounds g <= 24 ln 2 = 16.64, and per
// entry g = -log(-log u) <= -log(1 - u) <= ln 2 * (24 - floor(log2(2^24 (1 - u)))), an exponent read off
// the integer. A group of 128 entries whose max logit / T + 16.64 is below the best score so far skips the
// Philox draws; an entry whose logit / T + its bound is below the best skips the two logs. The skips only
// drop entries that provably cannot win, so the token is exactly the full argmax. After a few hundred
// entries the best score is far above typical bounds (for N(0, 1) logits at T = 1 it is ~ ln(n) + 1 after
// n entries), so the logs run on a handful of entries per row.
#pragma once

#include "cpu/x86_intrinsics.h"  // first: see there

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu/sampling.h"

namespace sbd::cpu {
namespace CPU_CAPABILITY {
namespace sampling_detail {

using Vec = at::vec::Vectorized<float>;

// Entries drawn together: 32 consecutive counters x 4 output words (two 64-entry blocks of naive.py).
// Two independent 16-lane Philox chains hide the multiply latency: 0.70 ms instead of 1.00 ms per 2M
// entries on one Zen 4 core (one chain is latency-bound; four chains gain nothing more).
constexpr int64_t kGroup = 128;
constexpr int kCounters = 32;
// Entries converted per tile: 2048 fp32 = 8 KB, so both passes over a tile hit L1 (32-64 KB here).
constexpr int64_t kTile = 2048;
// Vocabulary chunk: chunk c of a row holds entries [c kChunk, min(V, (c + 1) kChunk)), whatever the batch
// and the thread count. Its entropy sums start afresh and end in a partial of its own, and the partials
// are combined in vocabulary order with the same arithmetic however the chunks were spread over work
// items: the entropy and logprob of a row do not depend on the rows beside it or on the thread count (they
// did when the chunk size came from B * K and the threads). 16384 entries (64 KB of fp32) amortise a
// chunk's reduction and combine; a [1, 1, 128256] row has 8 chunks. A multiple of kTile, so of kGroup:
// every Philox block lies inside one chunk.
constexpr int64_t kChunk = 16384;
static_assert(kChunk % kTile == 0 && kTile % kGroup == 0, "chunks are whole tiles, tiles whole groups");
// Items per thread aimed at, so that uneven rows (masked positions, NaN rows stopping early) balance. An
// item is a run of consecutive chunks of one row.
constexpr int64_t kItemsPerThread = 8;
// Largest Gumbel noise any u can give, -log(-log(1 - 2^-24)) = 16.6355, plus a margin for rounding.
constexpr float kGumbelMax = 16.64f;
// Margin added to the per-entry bound: the computed g is within a few ulp (< 1e-5) of the exact value.
constexpr float kBoundMargin = 1e-3f;
// Relative margin of the filter's x * (1/T) against x / T: two roundings differ by < 2^-22 relative.
constexpr float kScaleMargin = 1e-6f;
constexpr float kInf = std::numeric_limits<float>::infinity();
// Lower clamp of x - max in the entropy sums and of the shift between two maxima: below ln(smallest
// denormal) = -103.3, so e^(x - max) = 0 exactly as without the clamp, and sums * shift stays finite (a
// tile of finfo.min before ordinary logits shifts by -3.4e38: 2048 * -3.4e38 = -inf, and -inf * 0 = NaN).
constexpr float kExpFloor = -128.f;

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Per-row constants of the generator: the 10 round keys and the counter words c1..c3.
struct PhiloxRow {
  uint32_t k0[kPhiloxRounds];
  uint32_t k1[kPhiloxRounds];
  uint32_t c1, c2, c3;
  uint32_t round0_c0, round0_c1;  // words 0 and 1 after round 0, the same for every counter of the row
};

inline PhiloxRow make_philox_row(int64_t seed, int64_t offset, int64_t position) {
  PhiloxRow row;
  uint32_t k0 = static_cast<uint32_t>(static_cast<uint64_t>(seed));
  uint32_t k1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r) {
    row.k0[r] = k0;
    row.k1[r] = k1;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  row.c1 = static_cast<uint32_t>(position);
  row.c2 = static_cast<uint32_t>(static_cast<uint64_t>(offset));
  row.c3 = static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32);
  const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * row.c2;
  row.round0_c0 = static_cast<uint32_t>(p1 >> 32) ^ row.c1 ^ row.k0[0];
  row.round0_c1 = static_cast<uint32_t>(p1);
  return row;
}

// words[64 h + 16 w + l] = word w of Philox4x32-10 at counter (c0_base + 16 h + l, c1, c2, c3), for
// h = 0, 1 and l = 0..15: the raw random bits of the kGroup entries starting at vocabulary index
// 4 * c0_base, in vocabulary order. Chains of vector lanes run interleaved round by round.
#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
constexpr int kLanes = 16;
inline IVec set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline IVec lane_ids() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline IVec add(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec xor3(IVec a, IVec b, IVec c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
inline void store(uint32_t* dst, IVec v) { _mm512_storeu_si512(dst, v); }
inline IVec load(const uint32_t* src) { return _mm512_loadu_si512(src); }
// (high, low) 32 bits of m * c per lane from two vpmuludq (32x32->64 products of the even lanes and of
// the odd lanes moved down) and two masked in-lane word swaps, instead of vpmulld for the low words plus
// shifts and blends: 5 instructions per product instead of 6, none of them the slow vpmulld.
inline void mulhilo(IVec m, IVec c, IVec& hi, IVec& lo) {
  const IVec even = _mm512_mul_epu32(m, c);
  const IVec odd = _mm512_mul_epu32(m, _mm512_srli_epi64(c, 32));
  hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
  lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
}
#elif defined(CPU_CAPABILITY_AVX2)
using IVec = __m256i;
constexpr int kLanes = 8;
inline IVec set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline IVec lane_ids() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline IVec add(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec xor3(IVec a, IVec b, IVec c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
inline void store(uint32_t* dst, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }
inline IVec load(const uint32_t* src) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)); }
inline void mulhilo(IVec m, IVec c, IVec& hi, IVec& lo) {
  const IVec even = _mm256_srli_epi64(_mm256_mul_epu32(m, c), 32);
  const IVec odd = _mm256_mul_epu32(m, _mm256_srli_epi64(c, 32));
  hi = _mm256_blend_epi32(even, odd, 0xAA);
  lo = _mm256_mullo_epi32(m, c);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The 10 rounds on kChains vectors of counters (c0 per lane; c1..c3 of the row); returns the 4 words.
template <int kChains>
inline void philox_rounds(const PhiloxRow& row, const IVec* counters, IVec* c0, IVec* c1, IVec* c2, IVec* c3) {
  const IVec m0 = set1(kPhiloxM0), m1 = set1(kPhiloxM1);
  // Round 0: only c0 differs between counters, so its c0' and c1' (from c1, c2) are row constants.
  const IVec k1_0 = set1(row.k1[0]);
  for (int h = 0; h < kChains; ++h) {
    IVec hi0, lo0;
    mulhilo(m0, counters[h], hi0, lo0);
    c0[h] = set1(row.round0_c0);
    c1[h] = set1(row.round0_c1);
    c2[h] = xor3(hi0, set1(row.c3), k1_0);
    c3[h] = lo0;
  }
  for (int r = 1; r < kPhiloxRounds; ++r) {
    const IVec k0 = set1(row.k0[r]), k1 = set1(row.k1[r]);
    for (int h = 0; h < kChains; ++h) {
      IVec hi0, lo0, hi1, lo1;
      mulhilo(m0, c0[h], hi0, lo0);
      mulhilo(m1, c2[h], hi1, lo1);
      c0[h] = xor3(hi1, c1[h], k0);
      c2[h] = xor3(hi0, c3[h], k1);
      c1[h] = lo1;
      c3[h] = lo0;
    }
  }
}

inline void philox_block(const PhiloxRow& row, uint32_t c0_base, uint32_t* words) {
  constexpr int kChains = kCounters / kLanes;
  IVec counters[kChains], c0[kChains], c1[kChains], c2[kChains], c3[kChains];
  for (int h = 0; h < kChains; ++h) counters[h] = add(set1(c0_base + kLanes * h), lane_ids());
  philox_rounds<kChains>(row, counters, c0, c1, c2, c3);
  // Counter c0_base + n (n = 16 blk + l) holds entries 64 blk + 16 w + l.
  for (int h = 0; h < kChains; ++h) {
    const int blk = (kLanes * h) / 16, l = (kLanes * h) % 16;
    uint32_t* out = words + 64 * blk + l;
    store(out, c0[h]);
    store(out + 16, c1[h]);
    store(out + 32, c2[h]);
    store(out + 48, c3[h]);
  }
}

// words[16 w + l] = word w of Philox4x32-10 at counter (c0[l], c1, c2, c3) of the row, l = 0..15: the
// noise of 16 scattered entries (the filtered race draws only for the entries it keeps).
inline void philox_lanes(const PhiloxRow& row, const uint32_t* c0_in, uint32_t* words) {
  constexpr int kChains = 16 / kLanes;
  IVec counters[kChains], c0[kChains], c1[kChains], c2[kChains], c3[kChains];
  for (int h = 0; h < kChains; ++h) counters[h] = load(c0_in + kLanes * h);
  philox_rounds<kChains>(row, counters, c0, c1, c2, c3);
  for (int h = 0; h < kChains; ++h) {
    store(words + kLanes * h, c0[h]);
    store(words + 16 + kLanes * h, c1[h]);
    store(words + 32 + kLanes * h, c2[h]);
    store(words + 48 + kLanes * h, c3[h]);
  }
}
#else
inline void philox_counter(const PhiloxRow& row, uint32_t c0, uint32_t* out, int stride) {
  uint32_t c1 = row.c1, c2 = row.c2, c3 = row.c3;
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ row.k0[r];
    c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ row.k1[r];
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
  }
  out[0] = c0;
  out[stride] = c1;
  out[2 * stride] = c2;
  out[3 * stride] = c3;
}

inline void philox_block(const PhiloxRow& row, uint32_t c0_base, uint32_t* words) {
  for (uint32_t n = 0; n < kCounters; ++n) philox_counter(row, c0_base + n, words + 64 * (n / 16) + n % 16, 16);
}

inline void philox_lanes(const PhiloxRow& row, const uint32_t* c0_in, uint32_t* words) {
  for (int l = 0; l < 16; ++l) philox_counter(row, c0_in[l], words + l, 16);
}
#endif

// u = (2 (r >> 9) + 1) 2^-24 of the Vec::size() words at `words`: exact in fp32 (an odd integer < 2^24
// times a power of two). Only needed for the few entries that pass the filter below.
inline Vec uniforms(const uint32_t* words) {
  alignas(64) float u[Vec::size()];
  for (int64_t l = 0; l < Vec::size(); ++l) u[l] = static_cast<float>(2 * (words[l] >> 9) + 1) * 0x1p-24f;
  return Vec::loadu(u);
}

// Upper bound of g = -log(-log u) for the Vec::size() words at `words`: g <= -log(1 - u)
// = ln 2 (24 - log2 n) <= ln 2 (24 - floor(log2 n)), n = 2^24 (1 - u) = 2^24 - 1 - 2 (r >> 9), an integer
// exact in fp32 whose floor(log2) is its float exponent; kBoundMargin covers the rounding of g.
constexpr float kLn2 = 0.69314718f;
constexpr float kBoundAt0 = 24 * kLn2 + kBoundMargin;
#if defined(CPU_CAPABILITY_AVX512)
inline Vec gumbel_bound(const uint32_t* words) {
  const __m512i half = _mm512_srli_epi32(_mm512_loadu_si512(words), 9);
  const __m512i n = _mm512_sub_epi32(_mm512_set1_epi32((1 << 24) - 1), _mm512_add_epi32(half, half));
  const __m512 floor_log2_n = _mm512_getexp_ps(_mm512_cvtepi32_ps(n));
  return Vec(_mm512_fnmadd_ps(floor_log2_n, _mm512_set1_ps(kLn2), _mm512_set1_ps(kBoundAt0)));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec gumbel_bound(const uint32_t* words) {
  const __m256i half = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)), 9);
  const __m256i n = _mm256_sub_epi32(_mm256_set1_epi32((1 << 24) - 1), _mm256_add_epi32(half, half));
  const __m256i biased = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(n)), 23);
  const __m256 floor_log2_n = _mm256_cvtepi32_ps(_mm256_sub_epi32(biased, _mm256_set1_epi32(127)));
  return Vec(_mm256_fnmadd_ps(floor_log2_n, _mm256_set1_ps(kLn2), _mm256_set1_ps(kBoundAt0)));
}
#else
inline Vec gumbel_bound(const uint32_t* words) {
  alignas(64) float bound[Vec::size()];
  for (int64_t l = 0; l < Vec::size(); ++l) {
    const float n = static_cast<float>((1 << 24) - 1 - 2 * static_cast<int32_t>(words[l] >> 9));
    uint32_t bits;
    std::memcpy(&bits, &n, sizeof(bits));
    const int32_t floor_log2_n = static_cast<int32_t>(bits >> 23) - 127;
    bound[l] = kBoundAt0 - static_cast<float>(floor_log2_n) * kLn2;
  }
  return Vec::loadu(bound);
}
#endif

// Result of one vocabulary chunk of one row; combined over the row's chunks in vocabulary order.
struct Partial {
  float max = -kInf;        // max of the chunk's logits
  float sum_exp = 0.f;      // sum exp(x - max)
  float sum_xexp = 0.f;     // sum exp(x - max) (x - max)
  bool bad = false;         // a NaN or +inf logit was seen
  // The two races, over the chunk's entries and those of the work item's earlier chunks:
  float greedy = -kInf;     // first maximum and its index
  int64_t greedy_idx = -1;
  float best = -kInf;       // best Gumbel score x / T + g and its index (-1: none above -inf)
  int64_t best_idx = -1;
};

template <typename scalar_t>
inline void load_tile(const scalar_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
    i = n;
  } else {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      Vec v;
      at::vec::load_to_float<scalar_t>(src + i, v);
      v.store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The tile [src, src + n) as fp32 padded with -inf to `padded` entries, entry mask_offset (if >= 0) set to
// -inf: in place for an fp32 tile that needs neither (the copy cost 5% of the fp32 time), else in buf.
template <typename scalar_t>
inline const float* tile_data(const scalar_t* src, int64_t n, int64_t padded, int64_t mask_offset, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (n == padded && mask_offset < 0) return src;
  }
  load_tile(src, n, buf);
  std::fill(buf + n, buf + padded, -kInf);
  if (mask_offset >= 0) buf[mask_offset] = -kInf;
  return buf;
}

inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); },
                                        v);
}

// Lane-wise max of two vectors, NaN handled by the caller: one vmaxps instead of at::vec::maximum's four
// instructions (max, unordered compare, mask to vector, or) that keep NaN.
inline Vec max_of_numbers(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

// Largest lane of a vector without NaN: four shuffle + vmaxps steps, without the unordered compare, mask
// to vector and or that reduce_max adds to each step to keep NaN.
inline float reduce_max_of_numbers(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  return reduce_max(v);
#endif
}

// e^d for d in [kExpFloor, 0]. AVX-512: d = n ln 2 + r with |r| <= ln 2 / 2, e^r by the degree-5
// polynomial of ATen's exp_u20 and 2^n applied by vscalefps: 9 instructions per vector where exp_u20
// spends 19 on range clamps and building 2^n from integer bits (the exp loop was 30% of the T = 1 time).
// Same polynomial, so the same accuracy; below ln(smallest denormal) = -103.3 both give 0. With the plain
// max of tile_max: 0.68 -> 0.47 ms at T = 0 and 1.50 -> 1.23 ms at T = 1 for [16, 128256] fp32 logits
// on one Zen 4 core (medians of 40).
inline Vec exp_nonpositive(const Vec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), d);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
  return Vec(_mm512_scalef_ps(p, n));
#else
  return d.exp_u20();
#endif
}

// Whether any lane of the vectors seen was NaN: one unordered compare per vector (plus a mask or), where
// the NaN-propagating at::vec::maximum costs four instructions (max, compare, mask to vector, or) per step.
#if defined(CPU_CAPABILITY_AVX512)
struct NanSeen {
  __mmask16 lanes = 0;
  void add(const Vec& v) { lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  bool any() const { return lanes != 0; }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct NanSeen {
  __m256 lanes = _mm256_setzero_ps();
  void add(const Vec& v) { lanes = _mm256_or_ps(lanes, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  bool any() const { return _mm256_movemask_ps(lanes) != 0; }
};
#else
struct NanSeen {
  bool seen = false;
  void add(const Vec& v) { seen |= v.isnan().zero_mask() != (1 << Vec::size()) - 1; }
  bool any() const { return seen; }
};
#endif

// Max of buf[0, n) (n a multiple of kGroup), NaN if any entry is NaN; the max of each group of kGroup
// entries goes to group_max[g] for the Gumbel race. Plain vmaxps plus a separate NaN flag: the
// NaN-propagating max was 17% of the T = 1 time. Two accumulators per group: one chain of dependent
// vmaxps runs at its latency; groups are independent and overlap.
inline float tile_max(const float* buf, int64_t n, float* group_max) {
  constexpr int64_t W = Vec::size();
  static_assert(kGroup % (2 * W) == 0, "a group is a whole number of vector pairs");
  NanSeen nan;
  float m = -kInf;
  for (int64_t g = 0; g < n; g += kGroup) {
    Vec a(-kInf), b(-kInf);
    for (int64_t i = g; i < g + kGroup; i += 2 * W) {
      const Vec x = Vec::loadu(buf + i), y = Vec::loadu(buf + i + W);
      a = max_of_numbers(a, x);
      b = max_of_numbers(b, y);
      nan.add(x);
      nan.add(y);
    }
    const float gm = reduce_max_of_numbers(max_of_numbers(a, b));
    group_max[g / kGroup] = gm;
    m = std::max(m, gm);
  }
  return nan.any() ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Online entropy sums of one item: lane-wise accumulators relative to the running max.
struct EntropySums {
  float max = -kInf;
  Vec sum_exp = Vec(0.f);
  Vec sum_xexp = Vec(0.f);

  // Moves the reference to new_max >= max: sum' = e^(max - new_max) (sum + sum_exp (max - new_max)),
  // the shift clamped to kExpFloor (then e^shift = 0 and the old sums vanish, without inf * 0).
  void rebase(float new_max) {
    if (max != -kInf) {
      const Vec shift(std::max(max - new_max, kExpFloor));
      const Vec scale = shift.exp();
      sum_xexp = (sum_xexp + sum_exp * shift) * scale;
      sum_exp = sum_exp * scale;
    }
    max = new_max;
  }

  // x - max is clamped to kExpFloor, so -inf entries add exactly 0 (never NaN) and e^(x - max) is exact
  // 0 below it. Two vectors per step into two pairs of sums: halves the dependent add / fma chains.
  void add(const float* buf, int64_t n) {
    constexpr int64_t W = Vec::size();
    const Vec m(max), floor(kExpFloor);
    Vec exp_b(0.f), xexp_b(0.f);
    for (int64_t i = 0; i < n; i += 2 * W) {
      const Vec da = max_of_numbers(Vec::loadu(buf + i) - m, floor);
      const Vec db = max_of_numbers(Vec::loadu(buf + i + W) - m, floor);
      const Vec ea = exp_nonpositive(da), eb = exp_nonpositive(db);
      sum_exp = sum_exp + ea;
      exp_b = exp_b + eb;
      sum_xexp = at::vec::fmadd(ea, da, sum_xexp);
      xexp_b = at::vec::fmadd(eb, db, xexp_b);
    }
    sum_exp = sum_exp + exp_b;
    sum_xexp = sum_xexp + xexp_b;
  }
};

// First index of `value` in buf[0, n).
inline int64_t first_index_of(const float* buf, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) {
    if (buf[i] == value) return i;
  }
  return n;
}

// Word prefilter of a group whose largest logit is group_max: an entry can only win if its bound
// kBoundAt0 - ln 2 floor(log2 n) reaches best - group_max / T, i.e. floor(log2 n) <= the returned exponent
// (-1: no entry of the group can win; 23 or more: any can). Computed in double with kBoundMargin and
// kScaleMargin slack, so that it keeps every entry the exact per-entry filter keeps. One unsigned compare
// per vector instead of the per-entry bound: 2.00 -> 1.94 ms per 2M fp32 entries on one Zen 4 core.
// Multiplies by inv_t = 1 / T and by 1 / ln 2 rather than dividing: two ~13-cycle divisions per group.
inline int64_t max_winning_exponent(float group_max, double inv_t, float best) {
  constexpr double kInvLn2 = 1.4426950408889634;
  if (best == -kInf) return 23;
  const double reach = static_cast<double>(group_max) * inv_t;
  const double need = best - (reach + std::abs(reach) * 4 * kScaleMargin) - 2 * kBoundMargin;
  const double exponent = std::floor((kBoundAt0 - need) * kInvLn2);
  return exponent >= 23 ? 23 : (exponent >= 0 ? static_cast<int64_t>(exponent) : -1);
}

// Smallest word r whose n = 2^24 - 1 - 2 (r >> 9) has floor(log2 n) <= max_exponent in [0, 23]:
// n < 2^(e + 1) <=> r >> 9 >= 2^23 - 2^e.
inline uint32_t min_winning_word(int64_t max_exponent) {
  return max_exponent >= 23 ? 0u : ((1u << 23) - (1u << max_exponent)) << 9;
}

// Whether any of the Vec::size() words at `words` is >= min_word (unsigned).
#if defined(CPU_CAPABILITY_AVX512)
inline bool any_word_at_least(const uint32_t* words, uint32_t min_word) {
  return _mm512_cmpge_epu32_mask(_mm512_loadu_si512(words), set1(min_word)) != 0;
}
#elif defined(CPU_CAPABILITY_AVX2)
inline bool any_word_at_least(const uint32_t* words, uint32_t min_word) {
  const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
  return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(r, set1(min_word)), r)) != 0;
}
#else
inline bool any_word_at_least(const uint32_t* words, uint32_t min_word) {
  for (int64_t l = 0; l < Vec::size(); ++l) {
    if (words[l] >= min_word) return true;
  }
  return false;
}
#endif

// The per-entry filter's cut for a best score: a lane whose x * (1/T) + bound is below it cannot win.
// x * (1/T) is within 2^-22 |x / T| of x / T, and a lane that can still win has x * (1/T) within
// 16.64 + 1 of the best, so lowering the best by (|best| + 64) kScaleMargin covers both roundings (of the
// product and of the sum) with room to spare; -inf - inf = -inf while nothing is best yet.
inline float reach_cut(float best) { return best - (std::abs(best) + 64.f) * kScaleMargin; }

// Gumbel-max race over one tile (n a multiple of kGroup, padded with -inf): updates best / best_idx.
// group_max[g]: largest entry of group g (from tile_max).
inline void gumbel_race_tile(const float* buf, const float* group_max, int64_t n, int64_t start,
                             float temperature, const PhiloxRow& row, float& best, int64_t& best_idx) {
  alignas(64) uint32_t words[kGroup];
  alignas(64) float score[Vec::size()];
  const Vec t(temperature), inv_t(1.f / temperature);
  const double inv_t_double = 1.0 / temperature;
  float cut = reach_cut(best);
  for (int64_t g = 0; g < n; g += kGroup) {
    if (group_max[g / kGroup] == -kInf) continue;  // all -inf (padding, or filtered out): never drawn
    const int64_t max_exponent = max_winning_exponent(group_max[g / kGroup], inv_t_double, best);
    if (max_exponent < 0) continue;
    philox_block(row, static_cast<uint32_t>((start + g) / 4), words);
    const uint32_t min_word = min_winning_word(max_exponent);
    for (int64_t i = 0; i < kGroup; i += Vec::size()) {
      if (!any_word_at_least(words + i, min_word)) continue;
      const Vec x = Vec::loadu(buf + g + i);
      // Filter with x * (1/T) (a multiply, ~5x cheaper than vdivps here) plus the lane's noise bound,
      // against the best lowered by reach_cut's margin. Skip only when every lane is provably below: a
      // NaN reach never is (1 / T overflows to inf for a subnormal T, and 0 * inf = NaN for tied maxima
      // x = 0, whose exact scores 0 / T + g are ordinary numbers), a -inf one always is.
      // zero_mask: bit l set when lane l of (reach < cut) is false.
      const Vec reach = x * inv_t + gumbel_bound(words + i);
      if ((reach < Vec(cut)).zero_mask() == 0) continue;
      const Vec gumbel = uniforms(words + i).log().neg().log().neg();
      (x / t + gumbel).store(score);
      for (int64_t l = 0; l < Vec::size(); ++l) {
        if (score[l] > best) {
          best = score[l];
          best_idx = start + g + i + l;
          cut = reach_cut(best);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Filters. top-k, top-p and min-p each keep the tokens whose logit is >= a threshold of the row, so
// together they keep {v : x_v >= tau}, tau = max(tau_k, tau_p, tau_m) (definitions: naive.py), and the
// race runs over that set alone: the same noise, the same winner when nothing is removed. No sort of the
// row anywhere; per row (plan_row, before the race):
//   - top-k: one pass gathers candidates (logit, index) >= the k-th largest so far, tau_k, tau_p and
//     tau_m come from selections over them, and the token is drawn from the kept candidates, with the
//     noise of those alone (top-k 50 costs less than the unfiltered race);
//   - min-p: tau_m needs the row max (one pass); the race of process_chunk skips what it removes;
//   - top-p without top-k: the race runs as usual, then top_p_keeps checks in one pass whether the token
//     lies in the top-p set, which it does with probability >= top_p; only otherwise top_p_redraw finds
//     tau_p (candidates above a mass bound, a selection) and draws again.

// The filters of one row (the scalars, or the row's entries of the [B] tensors).
struct RowFilters {
  int64_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  bool top_k_on(int64_t vocab) const { return top_k > 0 && top_k < vocab; }
  bool any(int64_t vocab) const { return top_k_on(vocab) || top_p < 1.f || min_p > 0.f; }
};

// What the filters decided for a row: the threshold, and the draw when it was made from the candidates.
struct RowPlan {
  float threshold = -kInf;  // -inf: nothing filtered
  bool drawn = false;       // token drawn from the kept candidates: process_chunk runs no race
  bool check_top_p = false;  // top-p without top-k: checked after the race (top_p_keeps)
  float best = -kInf;       // that draw's score and index (-1: every kept score is -inf, greedy)
  int64_t best_idx = -1;
};

// Smallest float >= v (v finite or -inf): the fp32 threshold that keeps exactly the floats >= v.
inline float ceil_to_float(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, kInf);
}

// Largest float <= v: a floor that never exceeds v.
inline float floor_to_float(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) <= v ? f : std::nextafter(f, -kInf);
}

// Bits l (l < Vec::size()) set where lane l of a >= b, a > b, a < b is true (one vcmpps on AVX-512).
#if defined(CPU_CAPABILITY_AVX512)
inline uint32_t ge_bits(const Vec& a, const Vec& b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline uint32_t gt_bits(const Vec& a, const Vec& b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline uint32_t lt_bits(const Vec& a, const Vec& b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
#else
inline uint32_t lane_bits(const Vec& mask) {
  return ~static_cast<uint32_t>(mask.zero_mask()) & ((1u << Vec::size()) - 1);
}
inline uint32_t ge_bits(const Vec& a, const Vec& b) { return lane_bits(a >= b); }
inline uint32_t gt_bits(const Vec& a, const Vec& b) { return lane_bits(a > b); }
inline uint32_t lt_bits(const Vec& a, const Vec& b) { return lane_bits(a < b); }
#endif

// Top-p weights q = e^((x - max) / T) (0 for -inf, and below e^kExpFloor), Vec::size() logits at a time.
// (x - max) * (1 / T) as in gumbel_race_tile (the check pass weighs every entry of the row, and vmulps
// is ~5x cheaper than vdivps); the two differ by an ulp of the exponent, a float near-tie. A subnormal
// T, whose 1 / T overflows, divides.
struct TopPWeights {
  Vec max, inv_t, t;
  bool divide;
  TopPWeights(float m, float temperature)
      : max(m), inv_t(1.f / temperature), t(temperature), divide(!std::isfinite(1.f / temperature)) {}
  Vec operator()(const Vec& x) const {
    const Vec d = divide ? (x - max) / t : (x - max) * inv_t;
    return exp_nonpositive(max_of_numbers(d, Vec(kExpFloor)));
  }
};

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

// Writes the lanes of (a, b) selected by `bits` to a_out[0, c), b_out[0, c) and returns c = popcount,
// for logits with their int32 indices (read from ids, or first + l when ids is nullptr) or for float
// pairs. AVX-512 compresses in registers and stores whole vectors (the outputs need Vec::size() entries
// of room): the memory-destination vpcompressd is microcoded on Zen 4.
inline int64_t compress_pair(const Vec& a, const int32_t* ids, int64_t first, uint32_t bits, float* a_out,
                             int32_t* b_out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = ids != nullptr ? _mm512_loadu_si512(ids)
                                   : _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)), lane_ids());
  _mm512_storeu_ps(a_out, _mm512_maskz_compress_ps(static_cast<__mmask16>(bits), a));
  _mm512_storeu_si512(b_out, _mm512_maskz_compress_epi32(static_cast<__mmask16>(bits), b));
  return __builtin_popcount(bits);
#else
  alignas(64) float lanes[Vec::size()];
  alignas(64) int32_t held[Vec::size()];
  a.store(lanes);
  for (int64_t l = 0; l < Vec::size(); ++l) held[l] = ids != nullptr ? ids[l] : static_cast<int32_t>(first + l);
  int64_t c = 0;
  for (; bits != 0; bits &= bits - 1, ++c) {
    const int l = __builtin_ctz(bits);
    a_out[c] = lanes[l];
    b_out[c] = held[l];
  }
  return c;
#endif
}

inline int64_t compress_pair(const Vec& a, const Vec& b, uint32_t bits, float* a_out, float* b_out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_storeu_ps(a_out, _mm512_maskz_compress_ps(static_cast<__mmask16>(bits), a));
  _mm512_storeu_ps(b_out, _mm512_maskz_compress_ps(static_cast<__mmask16>(bits), b));
  return __builtin_popcount(bits);
#else
  alignas(64) float la[Vec::size()], lb[Vec::size()];
  a.store(la);
  b.store(lb);
  int64_t c = 0;
  for (; bits != 0; bits &= bits - 1, ++c) {
    const int l = __builtin_ctz(bits);
    a_out[c] = la[l];
    b_out[c] = lb[l];
  }
  return c;
#endif
}

// Candidates of a row: logits and vocabulary indices, in index order.
struct Candidates {
  std::vector<float> x;
  std::vector<int32_t> index;
  int64_t n = 0;

  void clear() { n = 0; }

  // Room for `more` entries after the n held (plus a vector of slack for whole-vector stores).
  void reserve(int64_t more) {
    const int64_t need = n + more + Vec::size();
    if (static_cast<int64_t>(x.size()) < need) {
      x.resize(std::max<int64_t>(need, 2 * x.size()));
      index.resize(x.size());
    }
  }

  // Appends the entries of data[0, count) (count a multiple of Vec::size(); index start + i) >= floor.
  void append(const float* data, int64_t count, int64_t start, float floor) {
    reserve(count);
    const Vec cut(floor);
    float* xs = x.data();
    int32_t* ids = index.data();
    int64_t out = n;  // a local count: kept in a register, not reloaded from the struct per vector
    for (int64_t i = 0; i < count; i += Vec::size()) {
      const Vec v = Vec::loadu(data + i);
      const uint32_t bits = ge_bits(v, cut);
      if (bits != 0) out += compress_pair(v, nullptr, start + i, bits, xs + out, ids + out);
    }
    n = out;
  }

  // Keeps, in place and in order, the candidates >= floor.
  void keep_from(float floor) {
    const Vec cut(floor);
    float* xs = x.data();
    int32_t* ids = index.data();
    int64_t out = 0, i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec v = Vec::loadu(xs + i);
      out += compress_pair(v, ids + i, 0, ge_bits(v, cut), xs + out, ids + out);
    }
    for (; i < n; ++i) {
      if (xs[i] >= floor) {
        xs[out] = xs[i];
        ids[out++] = ids[i];
      }
    }
    n = out;
  }
};

// Sums of qs over the entries with x > pivot and with x == pivot.
inline std::pair<double, double> masses_around(const float* xs, const float* qs, int64_t n, float pivot) {
  Vec above(0.f), equal(0.f);
  const Vec p(pivot), zero(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec x = Vec::loadu(xs + i), q = Vec::loadu(qs + i);
    above = above + Vec::blendv(zero, q, x > p);
    equal = equal + Vec::blendv(zero, q, x == p);
  }
  double gt = reduce_sum(above), eq = reduce_sum(equal);
  for (; i < n; ++i) {
    gt += xs[i] > pivot ? qs[i] : 0.f;
    eq += xs[i] == pivot ? qs[i] : 0.f;
  }
  return {gt, eq};
}

// Keeps, in place, the pairs (xs[i], qs[i]) whose x has keep(x) (bits of a comparison); returns their
// count.
template <typename Keep>
inline int64_t compact_pairs(float* xs, float* qs, int64_t n, Keep keep) {
  int64_t out = 0, i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec x = Vec::loadu(xs + i);
    out += compress_pair(x, Vec::loadu(qs + i), keep(x), xs + out, qs + out);
  }
  for (; i < n; ++i) {
    if ((keep(Vec(xs[i])) & 1u) != 0) {
      const float x = xs[i], q = qs[i];
      xs[out] = x;
      qs[out++] = q;
    }
  }
  return out;
}

// tau_p over candidates (xs, qs) that hold every entry top-p can keep: the largest x value t with the sum
// of q over {x >= t} >= target. Quickselect on x with a three-way split around the median of three
// samples (a tie group is decided at once); expected O(n). Invariant: the answer is among the n left,
// `above` is the mass of the entries above all of them, and above < target <= above + their mass (up
// to the rounding of the sums). The arrays need Vec::size() entries of slack. A target <= 0 gives the
// largest x (no caller passes one: top_p, at least 2^-149 as a float32, times a mass that holds the
// maximum's weight e^0 is > 0 in double); n == 0 gives -inf. Every read stays in [0, n).
inline float weighted_threshold(float* xs, float* qs, int64_t n, double target) {
  double above = 0;
  while (n > 32) {
    float sample[3] = {xs[n / 4], xs[n / 2], xs[3 * n / 4]};
    std::sort(sample, sample + 3);
    const float pivot = sample[1];
    const auto [gt, eq] = masses_around(xs, qs, n, pivot);
    // One rounded sum for the test and the update: above + (gt + eq) could round up to the target where
    // (above + gt) + eq fell short, and a later split above the maximum would then keep nothing.
    const double through_pivot = above + gt + eq;
    if (above + gt >= target) {
      n = compact_pairs(xs, qs, n, [&](const Vec& x) { return gt_bits(x, Vec(pivot)); });
      if (n == 0) return pivot;  // nothing above the pivot (a target <= above): it is the largest left
    } else if (through_pivot >= target) {
      return pivot;
    } else {
      above = through_pivot;
      n = compact_pairs(xs, qs, n, [&](const Vec& x) { return lt_bits(x, Vec(pivot)); });
      if (n == 0) return pivot;  // the sums' rounding left no mass below: keep down to the pivot
    }
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return xs[a] > xs[b]; });
  for (int64_t i = 0; i < n; ++i) {
    above += qs[order[i]];
    // The last one when the sums' rounding falls short of the target: keep them all.
    if (above >= target || i == n - 1) return xs[order[i]];
  }
  return -kInf;
}

// The k-th largest of the n candidates (ties counted): weighted_threshold with unit weights (exact
// counts in fp32 below 2^24), on copies in `xs`, `qs`. With std::nth_element (and scalar appends) a
// [16, 128256] fp32 top-k 5000 call took 8.3 ms on one thread, 1.9 ms with these vectorised selections.
inline float kth_largest(const Candidates& c, int64_t k, std::vector<float>& xs, std::vector<float>& qs) {
  xs.resize(c.n + Vec::size());
  qs.assign(c.n + Vec::size(), 1.f);
  std::copy(c.x.begin(), c.x.begin() + c.n, xs.begin());
  return weighted_threshold(xs.data(), qs.data(), c.n, static_cast<double>(k));
}

// Gumbel-max over the n candidates (in index order): best / best_idx as gumbel_race_tile would find
// them over the row with every other entry at -inf. 16 candidates per Philox call on their own counters.
inline void gumbel_race_list(const float* xs, const int32_t* index, int64_t n, float temperature,
                             const PhiloxRow& row, float& best, int64_t& best_idx) {
  alignas(64) uint32_t c0[16], words[64], picked[16];
  alignas(64) float x[16], score[16];
  const Vec t(temperature);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t lanes = std::min<int64_t>(16, n - i);
    for (int64_t l = 0; l < 16; ++l) {
      const uint32_t v = static_cast<uint32_t>(index[i + std::min(l, lanes - 1)]);
      c0[l] = ((v >> 6) << 4) | (v & 15);
      x[l] = xs[i + std::min(l, lanes - 1)];
    }
    philox_lanes(row, c0, words);
    for (int64_t l = 0; l < 16; ++l) picked[l] = words[16 * ((index[i + std::min(l, lanes - 1)] >> 4) & 3) + l];
    for (int64_t l = 0; l < 16; l += Vec::size()) {
      const Vec gumbel = uniforms(picked + l).log().neg().log().neg();
      (Vec::loadu(x + l) / t + gumbel).store(score + l);
    }
    for (int64_t l = 0; l < lanes; ++l) {
      if (score[l] > best) {
        best = score[l];
        best_idx = index[i + l];
      }
    }
  }
}

// Per-thread buffers of the filters, reused across the rows of a work range.
struct FilterScratch {
  Candidates candidates;
  std::vector<float> xs, qs;  // selection pairs (logit, weight)
};

// Largest share of the vocabulary drawn from the candidate list: there each entry costs a Philox counter
// of its own, where the row's groups draw 4 entries per counter, so past V / 4 kept entries the race over
// the row's tiles is cheaper.
constexpr int64_t kListDrawFraction = 4;

// The race of gumbel_race_tile over the entries >= threshold of a tile only (the others set to -inf in
// `kept`); a group whose max is below the threshold is all -inf and skips its Philox draws.
inline void gumbel_race_tile_from(const float* data, const float* group_max, int64_t padded, int64_t start,
                                  float temperature, float threshold, const PhiloxRow& row, float* kept,
                                  float* kept_group_max, float& best, int64_t& best_idx) {
  const Vec cut(threshold), minus_inf(-kInf);
  for (int64_t i = 0; i < padded; i += Vec::size()) {
    const Vec x = Vec::loadu(data + i);
    Vec::blendv(minus_inf, x, x >= cut).store(kept + i);
  }
  for (int64_t g = 0; g < padded / kGroup; ++g) kept_group_max[g] = group_max[g] >= threshold ? group_max[g] : -kInf;
  gumbel_race_tile(kept, kept_group_max, padded, start, temperature, row, best, best_idx);
}

// Calls f(data, padded, start, group_max) for each tile of a row: fp32, padded with -inf to a multiple
// of kGroup, the mask token at -inf, with its group maxima; stops and returns false at a NaN / +inf.
template <typename scalar_t, typename F>
inline bool for_each_tile(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, F f) {
  alignas(64) float buf[kTile];
  float group_max[kTile / kGroup];
  for (int64_t start = 0; start < vocab; start += kTile) {
    const int64_t n = std::min(kTile, vocab - start);
    const int64_t padded = (n + kGroup - 1) / kGroup * kGroup;
    const int64_t mask_offset = mask_token_id >= start && mask_token_id < start + n ? mask_token_id - start : -1;
    const float* data = tile_data(row_ptr + start, n, padded, mask_offset, buf);
    const float tile_m = tile_max(data, padded, group_max);
    if (std::isnan(tile_m) || tile_m == kInf) return false;
    f(data, padded, start, group_max, tile_m);
  }
  return true;
}

// The draw from the candidates >= tau: from the list when few are kept, else a race over the row's tiles.
template <typename scalar_t>
void draw_kept(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, float temperature, float tau,
               const PhiloxRow& philox, Candidates& cand, float& best, int64_t& best_idx) {
  cand.keep_from(tau);
  if (cand.n * kListDrawFraction <= vocab) {
    gumbel_race_list(cand.x.data(), cand.index.data(), cand.n, temperature, philox, best, best_idx);
    return;
  }
  alignas(64) float kept[kTile];
  float kept_group_max[kTile / kGroup];
  for_each_tile(row_ptr, vocab, mask_token_id, [&](const float* data, int64_t padded, int64_t start,
                                                   const float* group_max, float) {
    gumbel_race_tile_from(data, group_max, padded, start, temperature, tau, philox, kept, kept_group_max, best,
                          best_idx);
  });
}

// The overflow rule of naive.py: the race again over the entries >= threshold, on (x - m) / T + g with m
// the row max, for a row whose best score x / T + g was +-inf (x_max / T overflowed fp32). Returns the
// winner (lowest index on ties; -1 if nothing is above -inf). Only such rows get here (tiny T, or logits
// near +-3e38), so it draws the noise of every group that holds a kept entry and divides, without the
// skips of gumbel_race_tile: finite rows pay one test of their best score, nothing more.
template <typename scalar_t>
int64_t relative_race(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, float temperature, float m,
                      float threshold, const PhiloxRow& philox) {
  alignas(64) uint32_t words[kGroup];
  alignas(64) float score[Vec::size()];
  const Vec t(temperature), max(m), cut(threshold), minus_inf(-kInf);
  float best = -kInf;
  int64_t best_idx = -1;
  for_each_tile(row_ptr, vocab, mask_token_id, [&](const float* data, int64_t padded, int64_t start,
                                                   const float* group_max, float) {
    for (int64_t g = 0; g < padded; g += kGroup) {
      if (group_max[g / kGroup] == -kInf || group_max[g / kGroup] < threshold) continue;
      philox_block(philox, static_cast<uint32_t>((start + g) / 4), words);
      for (int64_t i = 0; i < kGroup; i += Vec::size()) {
        const Vec x = Vec::loadu(data + g + i);
        const Vec gumbel = uniforms(words + i).log().neg().log().neg();
        Vec::blendv(minus_inf, (x - max) / t + gumbel, x >= cut).store(score);
        for (int64_t l = 0; l < Vec::size(); ++l) {
          if (score[l] > best) {
            best = score[l];
            best_idx = start + g + i + l;
          }
        }
      }
    }
  });
  return best_idx;
}

// tau_p of the candidates (they hold every entry >= tau_p): the selection over their weights
// q = e^((x - max) / T), of `mass` (the weights' total over the set top-p is taken of; <= 0: theirs).
inline float top_p_threshold(const Candidates& cand, float m, float temperature, float top_p, double mass,
                             FilterScratch& scratch) {
  scratch.xs.resize(cand.n + Vec::size());
  scratch.qs.resize(cand.n + Vec::size());
  float* xs = scratch.xs.data();
  float* qs = scratch.qs.data();
  std::copy(cand.x.begin(), cand.x.begin() + cand.n, xs);
  std::fill(xs + cand.n, xs + cand.n + Vec::size(), -kInf);
  Vec sum(0.f);
  const TopPWeights weight(m, temperature);
  for (int64_t i = 0; i < cand.n; i += Vec::size()) {
    const Vec q = weight(Vec::loadu(xs + i));
    q.store(qs + i);
    sum = sum + q;
  }
  if (mass <= 0) mass = reduce_sum(sum);
  return weighted_threshold(xs, qs, cand.n, static_cast<double>(top_p) * mass);
}

// The filters' plan of one row at temperature T > 0, before its race. With top-k, one pass gathers the
// candidates >= the k-th largest so far (the floor rises as the pass goes), tau is found on them (top-p
// and min-p included) and the token drawn from the kept ones. Without top-k, min-p's tau needs the row
// max (a pass of tile_max); top-p is checked after the race (see top_p_keeps). An invalid row (NaN /
// +inf / no finite logit) gets the empty plan: it is flagged later and never drawn.
template <typename scalar_t>
RowPlan plan_row(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, float temperature,
                 const RowFilters& filters, const PhiloxRow& philox, FilterScratch& scratch) {
  const bool top_k_on = filters.top_k_on(vocab);
  // Candidates held before a selection cuts them back to the k largest: a few selections per row.
  int64_t shrink_at = top_k_on ? std::max<int64_t>(4 * filters.top_k, 512) : 0;
  float floor_k = std::numeric_limits<float>::lowest();
  Candidates& cand = scratch.candidates;
  cand.clear();
  float m = -kInf;
  const bool finite = for_each_tile(row_ptr, vocab, mask_token_id, [&](const float* data, int64_t padded,
                                                                      int64_t start, const float*, float tile_m) {
    m = std::max(m, tile_m);
    if (!top_k_on || tile_m < floor_k) return;
    cand.append(data, padded, start, floor_k);
    if (cand.n >= shrink_at) {
      floor_k = kth_largest(cand, filters.top_k, scratch.xs, scratch.qs);
      cand.keep_from(floor_k);
      // Entries tied at the floor survive the cut. A row of many ties (a flat row, or disallowed tokens
      // set to finfo.min) would otherwise select over all of them at every tile: O(V^2 / kTile), 25 ms for
      // 16 rows of 151936 at top-k 50. Waiting for the list to double keeps the selections' work O(V).
      shrink_at = std::max(shrink_at, 2 * cand.n);
    }
  });
  RowPlan plan;
  if (!finite || m == -kInf) return plan;
  const double t = temperature;
  if (filters.min_p > 0.f) plan.threshold = ceil_to_float(m + t * std::log(double(filters.min_p)));
  if (!top_k_on) {
    plan.check_top_p = filters.top_p < 1.f;
    return plan;
  }
  // The candidates are now every entry >= floor_k: exactly the top-k set once cut at tau_k (fewer than k
  // entries above -inf: top-k keeps them all).
  if (cand.n >= filters.top_k) {
    const float tau_k = kth_largest(cand, filters.top_k, scratch.xs, scratch.qs);
    cand.keep_from(tau_k);
    plan.threshold = std::max(plan.threshold, tau_k);
  }
  if (filters.top_p < 1.f) {
    plan.threshold = std::max(plan.threshold, top_p_threshold(cand, m, temperature, filters.top_p, 0, scratch));
  }
  plan.drawn = true;
  draw_kept(row_ptr, vocab, mask_token_id, temperature, plan.threshold, philox, cand, plan.best, plan.best_idx);
  return plan;
}

// Whether the drawn token (logit x_w) is in the top-p set of a row with max m: x_w >= tau_p <=> the
// mass of the entries > x_w is < top_p of the total (tau_p is the largest t whose upper set reaches it).
// A draw from softmax(x / T) lands in the set with probability >= top_p, so the costly tau_p
// (top_p_redraw) is needed in at most 1 - top_p of the rows. One pass; at T = 1 the total is the
// entropy's sum_exp = e^log_z and the pass only weighs the few entries above x_w. Sets `mass`.
template <typename scalar_t>
bool top_p_keeps(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, float m, float log_z,
                 float temperature, float top_p, float x_w, double& mass) {
  alignas(64) float buf[kTile];
  const TopPWeights weight(m, temperature);
  const bool at_one = temperature == 1.f;
  const Vec vw(x_w), zero(0.f);
  Vec total(0.f), above(0.f);
  for (int64_t start = 0; start < vocab; start += kTile) {
    const int64_t n = std::min(kTile, vocab - start);
    const int64_t padded = (n + Vec::size() - 1) / Vec::size() * Vec::size();
    const int64_t mask_offset = mask_token_id >= start && mask_token_id < start + n ? mask_token_id - start : -1;
    const float* data = tile_data(row_ptr + start, n, padded, mask_offset, buf);
    for (int64_t i = 0; i < padded; i += Vec::size()) {
      const Vec x = Vec::loadu(data + i);
      if (at_one) {
        if (gt_bits(x, vw) != 0) above = above + Vec::blendv(zero, weight(x), x > vw);
      } else {
        const Vec q = weight(x);
        total = total + q;
        above = above + Vec::blendv(zero, q, x > vw);
      }
    }
  }
  mass = at_one ? std::exp(double(log_z)) : reduce_sum(total);
  return reduce_sum(above) < static_cast<double>(top_p) * mass;
}

// The draw of a row whose first draw fell outside its top-p set: tau_p from the candidates above
// max + T ln((1 - p) Z / (2 V)) (the entries below it hold less than (1 - p) / 2 of the mass Z, so the
// top-p set lies above it), tau = max(tau_p, min_tau), and the race over the kept entries; returns tau.
template <typename scalar_t>
float top_p_redraw(const scalar_t* row_ptr, int64_t vocab, int64_t mask_token_id, float m, float temperature,
                   float top_p, double mass, float min_tau, const PhiloxRow& philox, FilterScratch& scratch,
                   float& best, int64_t& best_idx) {
  Candidates& cand = scratch.candidates;
  cand.clear();
  const float floor = std::max(std::numeric_limits<float>::lowest(),
                               floor_to_float(m + double(temperature) * std::log((1.0 - top_p) * mass / (2.0 * vocab))));
  for_each_tile(row_ptr, vocab, mask_token_id, [&](const float* data, int64_t padded, int64_t start, const float*,
                                                   float tile_m) {
    if (tile_m >= floor) cand.append(data, padded, start, floor);
  });
  const float tau = std::max(min_tau, top_p_threshold(cand, m, temperature, top_p, mass, scratch));
  draw_kept(row_ptr, vocab, mask_token_id, temperature, tau, philox, cand, best, best_idx);
  return tau;
}

// Partial of entries [begin, end) of a row. The races (greedy maximum, Gumbel score) go on from those of
// `before`, the partial of the work item's previous chunk (empty for its first); the sums start afresh.
template <typename scalar_t>
Partial process_chunk(const scalar_t* row_ptr, int64_t begin, int64_t end, int64_t mask_token_id,
                      float temperature, float threshold, const PhiloxRow& row, const Partial& before) {
  alignas(64) float buf[kTile];
  alignas(64) float kept[kTile];
  float group_max[kTile / kGroup];
  float kept_group_max[kTile / kGroup];
  Partial out;
  out.greedy = before.greedy;
  out.greedy_idx = before.greedy_idx;
  out.best = before.best;
  out.best_idx = before.best_idx;
  EntropySums sums;
  for (int64_t start = begin; start < end; start += kTile) {
    const int64_t n = std::min(kTile, end - start);
    const int64_t padded = (n + kGroup - 1) / kGroup * kGroup;
    const bool has_mask_token = mask_token_id >= start && mask_token_id < start + n;
    const int64_t mask_offset = has_mask_token ? mask_token_id - start : -1;
    const float* data = tile_data(row_ptr + start, n, padded, mask_offset, buf);

    const float m = tile_max(data, padded, group_max);
    if (std::isnan(m) || m == kInf) {
      out.bad = true;
      return out;
    }
    if (m == -kInf) continue;  // nothing but -inf: no probability mass, never drawn
    if (m > out.greedy) {
      out.greedy = m;
      out.greedy_idx = start + first_index_of(data, n, m);
    }
    if (m > sums.max) sums.rebase(m);
    sums.add(data, padded);
    if (temperature > 0.f && threshold == -kInf) {
      gumbel_race_tile(data, group_max, padded, start, temperature, row, out.best, out.best_idx);
    } else if (temperature > 0.f) {  // filtered row: the race over the entries >= threshold only
      gumbel_race_tile_from(data, group_max, padded, start, temperature, threshold, row, kept, kept_group_max,
                            out.best, out.best_idx);
    }
  }
  out.max = sums.max;
  out.sum_exp = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; },
                                               sums.sum_exp);
  out.sum_xexp = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; },
                                                sums.sum_xexp);
  return out;
}

// Number of chunks of a row of `vocab` entries (at least 1).
inline int64_t chunks_of(int64_t vocab) { return std::max<int64_t>(1, (vocab + kChunk - 1) / kChunk); }

// The partials of chunks [first, last) of a row, in order into parts[0, last - first). The races carry
// over from chunk to chunk, so a later chunk skips more noise and scans a tile for the greedy index (a
// scalar scan per new maximum) less often: with fresh races in each chunk, [8, 1, 128256] fp32 took ~12%
// longer on one thread. The token is the same either way. The entropy sums start afresh in each chunk. A
// NaN / +inf stops the row: the later partials are left empty.
template <typename scalar_t>
void process_chunks(const scalar_t* row_ptr, int64_t vocab, int64_t first, int64_t last, int64_t mask_token_id,
                    float temperature, float threshold, const PhiloxRow& row, Partial* parts) {
  for (int64_t c = first; c < last; ++c) {
    Partial& part = parts[c - first];
    part = process_chunk(row_ptr, c * kChunk, std::min(vocab, (c + 1) * kChunk), mask_token_id, temperature,
                         threshold, row, c > first ? parts[c - first - 1] : Partial{});
    if (part.bad) {
      std::fill(parts + (c - first) + 1, parts + (last - first), Partial{});
      return;
    }
  }
}

// What a row's top-p check needs from finish_row: its max, log Z (temperature 1) and greedy token.
struct RowSummary {
  float max = -kInf;
  float log_z = 0.f;
  int64_t greedy_idx = 0;
};

// Row outputs from its chunks' partials, combined in vocabulary order. rerun(m, threshold): the token of
// the overflow rule (relative_race), called only when the race's best score is +-inf.
template <typename scalar_t, typename Rerun>
void finish_row(const Partial* parts, int64_t n_parts, const scalar_t* row_ptr, float temperature,
                const RowPlan& plan, Rerun rerun, int64_t& token, float& entropy, float& logprob, bool& valid,
                RowSummary& summary) {
  float m = -kInf;
  bool bad = false;
  for (int64_t p = 0; p < n_parts; ++p) {
    bad |= parts[p].bad;
    m = std::max(m, parts[p].max);
  }
  if (bad || m == -kInf) {
    token = 0;
    entropy = kInf;
    logprob = -kInf;
    valid = false;
    return;
  }
  float sum_exp = 0.f, sum_xexp = 0.f, greedy = -kInf, best = -kInf;
  int64_t greedy_idx = -1, best_idx = -1;
  for (int64_t p = 0; p < n_parts; ++p) {
    const Partial& part = parts[p];
    if (part.max != -kInf) {
      const float shift = std::max(part.max - m, kExpFloor);
      const float scale = std::exp(shift);
      sum_exp += part.sum_exp * scale;
      sum_xexp += (part.sum_xexp + part.sum_exp * shift) * scale;
    }
    if (part.greedy > greedy) {
      greedy = part.greedy;
      greedy_idx = part.greedy_idx;
    }
    if (part.best_idx >= 0 && part.best > best) {
      best = part.best;
      best_idx = part.best_idx;
    }
  }
  const float log_z = std::log(sum_exp);
  if (plan.drawn) {
    best = plan.best;
    best_idx = plan.best_idx;
  }
  if (temperature > 0.f && (best_idx < 0 || std::isinf(best))) best_idx = rerun(m, plan.threshold);
  token = (temperature > 0.f && best_idx >= 0) ? best_idx : greedy_idx;
  entropy = log_z - sum_xexp / sum_exp;
  logprob = static_cast<float>(row_ptr[token]) - m - log_z;
  valid = true;
  summary = {m, log_z, greedy_idx};
}

template <typename scalar_t>
void entropy_sample_typed(const EntropySampleArgs& args) {
  const at::Tensor& logits = args.logits;
  const int64_t batch = logits.size(0), positions = logits.size(1), vocab = logits.size(2);
  const int64_t rows = batch * positions;
  const scalar_t* base = logits.const_data_ptr<scalar_t>();
  const int64_t stride_b = logits.stride(0), stride_k = logits.stride(1);

  // Chunks come from V alone (kChunk); only how they are spread over work items depends on the rows and
  // the threads: `items` runs of `per_item` consecutive chunks per row (the last run may be shorter). One
  // thread takes a row in one item: nothing to balance.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = chunks_of(vocab);
  const int64_t wanted =
      threads == 1 ? 1 : std::clamp<int64_t>((kItemsPerThread * threads + rows - 1) / rows, 1, chunks);
  const int64_t per_item = (chunks + wanted - 1) / wanted;
  const int64_t items = (chunks + per_item - 1) / per_item;

  auto row_ptr = [&](int64_t r) { return base + (r / positions) * stride_b + (r % positions) * stride_k; };
  auto row_temperature = [&](int64_t b) {
    return args.temperature != nullptr ? args.temperature[b * args.temperature_stride] : args.temperature_val;
  };
  auto computed = [&](int64_t r) { return args.compute_mask == nullptr || args.compute_mask[r]; };
  auto row_filters = [&](int64_t b) {
    return RowFilters{args.top_k != nullptr ? args.top_k[b * args.top_k_stride] : args.top_k_val,
                      args.top_p != nullptr ? args.top_p[b * args.top_p_stride] : args.top_p_val,
                      args.min_p != nullptr ? args.min_p[b * args.min_p_stride] : args.min_p_val};
  };

  auto philox_of = [&](int64_t r) {
    const int64_t b = r / positions;
    return make_philox_row(args.seed[b * args.seed_stride], args.offset[b * args.offset_stride], r % positions);
  };
  auto not_computed = [&](int64_t r) {
    args.tokens[r] = -1;
    args.entropy[r] = kInf;
    args.logprob[r] = -kInf;
    args.valid[r] = false;
  };
  // The overflow rule's race of row r (finish_row calls it only for a row whose best score is +-inf).
  auto rerun_of = [&](int64_t r) {
    return [&, r](float m, float threshold) {
      return relative_race(row_ptr(r), vocab, args.mask_token_id, row_temperature(r / positions), m, threshold,
                           philox_of(r));
    };
  };
  // The filters' plan of a sampled row (T > 0, a filter on), before its race.
  auto plan_for = [&](int64_t r, FilterScratch& scratch) {
    const int64_t b = r / positions;
    const float t = row_temperature(b);
    const RowFilters filters = row_filters(b);
    if (!computed(r) || !(t > 0.f) || !filters.any(vocab)) return RowPlan{};
    return plan_row(row_ptr(r), vocab, args.mask_token_id, t, filters, philox_of(r), scratch);
  };
  // top-p without top-k, after the race: keep the token if it lies in the row's top-p set, else draw
  // again from the set.
  auto check_top_p = [&](int64_t r, const RowPlan& plan, const RowSummary& row, FilterScratch& scratch) {
    if (!plan.check_top_p || !args.valid[r]) return;
    const scalar_t* logits_row = row_ptr(r);
    const float t = row_temperature(r / positions), top_p = row_filters(r / positions).top_p;
    double mass = 0;
    if (top_p_keeps(logits_row, vocab, args.mask_token_id, row.max, row.log_z, t, top_p,
                    static_cast<float>(logits_row[args.tokens[r]]), mass)) {
      return;
    }
    float best = -kInf;
    int64_t best_idx = -1;
    const PhiloxRow philox = philox_of(r);
    const float tau = top_p_redraw(logits_row, vocab, args.mask_token_id, row.max, t, top_p, mass, plan.threshold,
                                   philox, scratch, best, best_idx);
    if (best_idx < 0 || std::isinf(best)) {
      best_idx = relative_race(logits_row, vocab, args.mask_token_id, t, row.max, tau, philox);
    }
    args.tokens[r] = best_idx >= 0 ? best_idx : row.greedy_idx;
    args.logprob[r] = static_cast<float>(logits_row[args.tokens[r]]) - row.max - row.log_z;
  };

  if (items == 1) {
    // One item per row: its passes (plan, race and sums, outputs, top-p check) run back to back on one
    // core, so the row comes from memory once and from L2 after ([16, 128256] fp32, top-p 0.9, one thread:
    // 1.40 -> 1.24 ms), and its partials stay in a buffer of the thread.
    at::parallel_for(0, rows, 1, [&](int64_t row_begin, int64_t row_end) {
      FilterScratch scratch;
      std::vector<Partial> row_parts(chunks);
      for (int64_t r = row_begin; r < row_end; ++r) {
        if (!computed(r)) {
          not_computed(r);
          continue;
        }
        const RowPlan plan = args.filters ? plan_for(r, scratch) : RowPlan{};
        process_chunks(row_ptr(r), vocab, 0, chunks, args.mask_token_id,
                       plan.drawn ? 0.f : row_temperature(r / positions), plan.threshold, philox_of(r),
                       row_parts.data());
        RowSummary summary;
        finish_row(row_parts.data(), chunks, row_ptr(r), row_temperature(r / positions), plan, rerun_of(r),
                   args.tokens[r], args.entropy[r], args.logprob[r], args.valid[r], summary);
        if (args.filters) check_top_p(r, plan, summary, scratch);
      }
    });
    return;
  }

  // Rows split over several items: the plans, the items, the rows' outputs, the top-p checks.
  std::vector<RowPlan> plans(args.filters ? rows : 0);
  if (args.filters) {
    at::parallel_for(0, rows, 1, [&](int64_t row_begin, int64_t row_end) {
      FilterScratch scratch;
      for (int64_t r = row_begin; r < row_end; ++r) plans[r] = plan_for(r, scratch);
    });
  }
  const RowPlan unfiltered;
  auto plan_of = [&](int64_t r) -> const RowPlan& { return args.filters ? plans[r] : unfiltered; };

  std::vector<Partial> parts(rows * chunks);
  at::parallel_for(0, rows * items, 1, [&](int64_t item_begin, int64_t item_end) {
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t r = item / items, b = r / positions;
      const int64_t first = (item % items) * per_item, last = std::min(chunks, first + per_item);
      if (!computed(r)) continue;
      const RowPlan& plan = plan_of(r);
      // A row drawn from its candidates needs no race here: temperature 0 skips it.
      process_chunks(row_ptr(r), vocab, first, last, args.mask_token_id, plan.drawn ? 0.f : row_temperature(b),
                     plan.threshold, philox_of(r), parts.data() + r * chunks + first);
    }
  });
  std::vector<RowSummary> summaries(args.filters ? rows : 1);
  at::parallel_for(0, rows, 256, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
      if (!computed(r)) {
        not_computed(r);
        continue;
      }
      finish_row(parts.data() + r * chunks, chunks, row_ptr(r), row_temperature(r / positions), plan_of(r),
                 rerun_of(r), args.tokens[r], args.entropy[r], args.logprob[r], args.valid[r],
                 summaries[args.filters ? r : 0]);
    }
  });
  if (!args.filters) return;
  at::parallel_for(0, rows, 1, [&](int64_t row_begin, int64_t row_end) {
    FilterScratch scratch;
    for (int64_t r = row_begin; r < row_end; ++r) check_top_p(r, plans[r], summaries[r], scratch);
  });
}

}  // namespace sampling_detail

void entropy_sample_kernel(const EntropySampleArgs& args) {
  switch (args.logits.scalar_type()) {
    case at::kFloat:
      sampling_detail::entropy_sample_typed<float>(args);
      break;
    case at::kHalf:
      sampling_detail::entropy_sample_typed<c10::Half>(args);
      break;
    case at::kBFloat16:
      sampling_detail::entropy_sample_typed<c10::BFloat16>(args);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "sbd.entropy_sample: unexpected logits dtype ", args.logits.scalar_type());
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd::cpu
