// CPU kernel of sbd::block_attention_with_kvcache, compiled once per instruction set
// (attention_kernel_<isa>.cpp) inside namespace sbd::cpu::CPU_CAPABILITY. Math: sbd_kernels/ops/attention/naive.py.
//
// One matrix per (sequence b, KV head g): the G = Hq / Hkv query heads of the group times the c_b + K
// active rows (padding rows are skipped), M = G (c_b + K) rows, row m = t G + h for active token t (causal
// tokens first, then the block). Keys are indexed j in [0, N), N = L + c + K: cache slots, then the new
// causal rows, then the block rows, read in place from the cache / k / v (no concatenation). Token t sees
// keys [0, limit_t), limit_t = L + t + 1 for a causal token and N for a block token: the mask is a per-row
// prefix, so it is never materialised. Cache slots from L on are never read (keys j >= L come from k / v), so
// a NaN in an unused cache slot cannot leak (0 * NaN would be NaN); within a key tile, a row multiplies the
// values of the new keys it does not see by a weight of 0 (docs/algorithm.md §3.11: a NaN or inf in v there
// is unspecified for that row, as in the oracle).
//
// Keys are walked in tiles of kKeyTile: K^T and V of the tile are gathered (contiguous or paged cache, or
// new rows) into packed operands, S = Q K^T and O += P V run on ATen's batch-reduce GEMM
// (at::native::cpublas::brgemm, oneDNN micro-kernels), with an online softmax per row in between.
// brgemm is the one GEMM entry point libtorch exports (TORCH_API); cpublas::gemm is internal. bf16 runs
// bf16 x bf16 -> fp32 GEMMs on VNNI-2 operands packed here (cpublas::pack only exists on AMX machines),
// i.e. vdpbf16ps on AVX512-BF16 and tiles on AMX; fp16 and fp32 run fp32 GEMMs (fp16 brgemm needs
// AVX512-FP16, and fp16 x fp16 through torch.mm ran at ~1 GFLOP/s on this Zen 4; on a Xeon with AVX512-FP16
// and AMX-BF16 but no AMX-FP16 the fp16 brgemm ran 107-110 GFLOP/s a core against 145-160 in fp32:
// docs/performance.md §4.2).
// Work items are (b, g, split of the keys), split only when B * Hkv is too small to keep every thread
// busy; splits are merged by log-sum-exp. Split 0 of each (b, g) copies the causal rows' K/V into cache
// slots [L, L + c); no item reads those slots (keys j >= L come from k / v), so items need no ordering.
#pragma once

#include "cpu/x86_intrinsics.h"  // first: see there

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "cpu/attention.h"

namespace sbd::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;

// Keys per tile. At B=1, Hq=32, Hkv=8, D=128, C=K=16, L=4096 on one Zen 4 core (CPU time), tiles of
// 128 / 256 / 512 / 1024 keys ran fp32 at 67 / 69 / 70 / 59 GFLOP/s and bf16 at 107 / 110 / 109 / 106:
// 256 keeps K^T, V and the scores of 128 rows (3 x 128 KiB in fp32) well inside a 1 MiB L2.
constexpr int64_t kKeyTile = 256;
// A split of the keys below this many is not worth its share of the log-sum-exp merge (M x D per split).
constexpr int64_t kMinKeysPerSplit = 1024;
// Aim for this many work items per thread, so that ragged sequences still balance.
constexpr int64_t kItemsPerThread = 4;

// ---------------------------------------------------------------------------------------------------
// GEMM operands. `op_t` is the GEMM input type: float (fp32 / fp16 inputs) or BFloat16 (bf16 inputs).
// B operands are row-major for fp32 and VNNI-2 for bf16 (rows paired: element (r, c) at
// ((r / 2) * ld + c) * 2 + r % 2), which is what the bf16 micro-kernels read; bf16 pads K to even.

template <typename op_t>
constexpr bool kVnni = std::is_same_v<op_t, c10::BFloat16>;

template <typename op_t>
inline int64_t b_index(int64_t row, int64_t col, int64_t ld) {
  if constexpr (kVnni<op_t>) {
    return ((row >> 1) * ld + col) * 2 + (row & 1);
  } else {
    return row * ld + col;
  }
}

template <typename op_t>
inline int64_t gemm_pad(int64_t n) {
  return kVnni<op_t> ? (n + 1) / 2 * 2 : n;
}

// Key count a tile's GEMMs run with: n rounded up to a multiple of kKeyQuantum (zero keys, zero
// probabilities). oneDNN generates one micro-kernel per GEMM shape and thread; as L grows by a few tokens
// per decode step, the last tile would otherwise bring a new shape (a fresh JIT) on almost every call.
constexpr int64_t kKeyQuantum = 64;

inline int64_t key_pad(int64_t n, int64_t key_tile) {
  return std::min(key_tile, (n + kKeyQuantum - 1) / kKeyQuantum * kKeyQuantum);
}

// C[M, N] (+)= A[M, K] B[K, N] in fp32.
inline void gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                 const float* a, const float* b, float* c) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add_c, a, b, c, /*is_vnni=*/false);
}

inline void gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                 const c10::BFloat16* a, const c10::BFloat16* b, float* c) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add_c, a, b, c, /*is_vnni=*/true);
}

// Whether ATen's bf16 brgemm with VNNI operands runs on this machine (oneDNN micro-kernels built in and
// enabled, CPU with at least AVX512). Probed once on a 1 x 16 x 2 product with a known result.
bool bf16_gemm_probe() {
  try {
    c10::BFloat16 a[2] = {1.0f, 2.0f};
    c10::BFloat16 b[2 * 16];
    for (int64_t col = 0; col < 16; ++col) {
      b[b_index<c10::BFloat16>(0, col, 16)] = static_cast<float>(col);
      b[b_index<c10::BFloat16>(1, col, 16)] = 1.0f;
    }
    float c[16];
    gemm(1, 16, 2, 2, 16, 16, false, a, b, c);
    at::native::cpublas::brgemm_release(true);
    for (int64_t col = 0; col < 16; ++col) {
      if (c[col] != static_cast<float>(col) + 2.0f) return false;
    }
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

bool bf16_gemm_available() {
  static const bool probed = bf16_gemm_probe();
  return probed && at::globalContext().userEnabledMkldnn();
}

// ---------------------------------------------------------------------------------------------------
// Where the keys / values of one (sequence, KV head) live.

// One cache tensor seen from one (sequence, KV head): `base` is head g of slot 0 of sequence b
// (contiguous cache) or of page 0 (paged cache).
template <typename scalar_t>
struct CacheView {
  scalar_t* base;
  int64_t page_stride, slot_stride;
};

template <typename scalar_t>
struct HeadView {
  CacheView<scalar_t> k_cache, v_cache;
  const int32_t* pages;  // page ids of sequence b, or nullptr for a contiguous cache
  int64_t page_size;
  const scalar_t* k_rows;  // k[b, 0, g]
  const scalar_t* v_rows;
  int64_t row_stride;  // Hkv * D
  int64_t length, causal, causal_slots;  // L, c, C

  scalar_t* slot(const CacheView<scalar_t>& cache, int64_t j) const {
    if (pages == nullptr) return cache.base + j * cache.slot_stride;
    return cache.base + pages[j / page_size] * cache.page_stride + (j % page_size) * cache.slot_stride;
  }
  // Row of k / v holding key j >= L: causal row j - L, or block row C + (j - L - c).
  int64_t new_row(int64_t j) const {
    const int64_t t = j - length;
    return t < causal ? t : causal_slots + (t - causal);
  }
  const scalar_t* key(int64_t j) const {
    return j < length ? slot(k_cache, j) : k_rows + new_row(j) * row_stride;
  }
  const scalar_t* value(int64_t j) const {
    return j < length ? slot(v_cache, j) : v_rows + new_row(j) * row_stride;
  }
  void append_causal_rows(int64_t dim) const {
    for (int64_t i = 0; i < causal; ++i) {
      std::memcpy(slot(k_cache, length + i), k_rows + i * row_stride, dim * sizeof(scalar_t));
      std::memcpy(slot(v_cache, length + i), v_rows + i * row_stride, dim * sizeof(scalar_t));
    }
  }
};

// Sizes fixed for the whole call.
struct Geometry {
  int64_t batch, seq, causal_slots, block, q_heads, kv_heads, group, dim, dim_pad, max_rows;
  int64_t key_tile, splits, keys_per_split;
};

// Per-thread buffers, kept across calls (a fresh 1 MiB per call cost ~7% of the time in page faults).
template <typename op_t>
struct Workspace {
  std::vector<op_t> q;       // [M, dim_pad]          A of S = Q K^T
  std::vector<op_t> k;       // [dim_pad, key_tile]   B of S (K^T)
  std::vector<op_t> v;       // [key_tile, dim_pad]   B of O += P V
  std::vector<op_t> stage;   // [key_tile, dim_pad]   rows converted / padded before packing
  std::vector<float> s;      // [M, key_tile]         scores, then probabilities (fp32 GEMM reads them)
  std::vector<op_t> p;       // [M, key_tile]         probabilities for the bf16 GEMM
  std::vector<float> acc;    // [M, dim_pad]          unnormalised output
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> limit;
  std::vector<const op_t*> rows;  // [key_tile] source row of each key of the tile

  // Grows the buffers to the sizes of `geo`; every element a GEMM reads is written before each use.
  void reserve(const Geometry& geo) {
    grow(q, geo.max_rows * geo.dim_pad);
    grow(k, geo.dim_pad * geo.key_tile);
    grow(v, geo.key_tile * geo.dim_pad);
    grow(stage, geo.key_tile * geo.dim_pad);
    grow(s, geo.max_rows * geo.key_tile);
    grow(p, kVnni<op_t> ? geo.max_rows * geo.key_tile : 0);
    grow(acc, geo.max_rows * geo.dim_pad);
    grow(row_max, geo.max_rows);
    grow(row_sum, geo.max_rows);
    grow(limit, geo.max_rows);
    grow(rows, geo.key_tile);
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  }
};

template <typename op_t>
Workspace<op_t>& thread_workspace(const Geometry& geo) {
  static thread_local Workspace<op_t> ws;
  ws.reserve(geo);
  return ws;
}

// Active token t of a sequence with c causal tokens -> its row in q / out: causal t, or block C + t - c.
inline int64_t token_row(int64_t t, int64_t causal, int64_t causal_slots) {
  return t < causal ? t : causal_slots + (t - causal);
}

// ---------------------------------------------------------------------------------------------------
// Packing.

template <typename scalar_t, typename op_t>
void pack_queries(const scalar_t* q, const Geometry& geo, int64_t b, int64_t g, int64_t causal,
                  int64_t rows, op_t* dst) {
  const int64_t tokens = rows / geo.group;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = token_row(t, causal, geo.causal_slots);
    for (int64_t h = 0; h < geo.group; ++h) {
      const scalar_t* src = q + ((b * geo.seq + s) * geo.q_heads + g * geo.group + h) * geo.dim;
      op_t* out = dst + (t * geo.group + h) * geo.dim_pad;
      for (int64_t d = 0; d < geo.dim; ++d) out[d] = static_cast<op_t>(src[d]);
      for (int64_t d = geo.dim; d < geo.dim_pad; ++d) out[d] = op_t(0.0f);
    }
  }
}

// dst[0, n) = src[0, n) converted to op_t. fp16 -> fp32 uses the F16C instruction (the scalar c10::Half
// conversion held fp16 at 51 GFLOP/s per core, F16C at 68, fp32 at 75-80, at D = 128).
template <typename scalar_t, typename op_t>
inline void convert_row(const scalar_t* src, op_t* dst, int64_t n) {
  int64_t d = 0;
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<op_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    for (; d + 16 <= n; d += 16) {
      _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    for (; d + 8 <= n; d += 8) {
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
    }
#endif
  }
  for (; d < n; ++d) dst[d] = static_cast<op_t>(src[d]);
}

// Source rows (dim_pad elements of op_t each) of keys or values [j0, j0 + n) into ws.rows: pointers into
// the cache / k / v when they already hold op_t with an even-enough dim, else rows converted (fp16 -> fp32)
// or zero-padded (odd D for bf16) into ws.stage.
template <typename scalar_t, typename op_t, typename RowOf>
void gather_rows(RowOf row_of, int64_t j0, int64_t n, const Geometry& geo, Workspace<op_t>& ws) {
  constexpr bool kSameType = std::is_same_v<scalar_t, op_t>;
  if (kSameType && geo.dim_pad == geo.dim) {
    for (int64_t jj = 0; jj < n; ++jj) ws.rows[jj] = reinterpret_cast<const op_t*>(row_of(j0 + jj));
    return;
  }
  for (int64_t jj = 0; jj < n; ++jj) {
    const scalar_t* src = row_of(j0 + jj);
    op_t* dst = ws.stage.data() + jj * geo.dim_pad;
    convert_row(src, dst, geo.dim);
    for (int64_t d = geo.dim; d < geo.dim_pad; ++d) dst[d] = op_t(0.0f);
    ws.rows[jj] = dst;
  }
}

// dst[w * ld + jj] = rows[jj][w] over 32-bit words: K^T for fp32, and for bf16 the VNNI-2 K^T as well
// (a word is the pair (d, d + 1) of one key, which VNNI-2 keeps adjacent). Blocks of 16 keys keep the 16
// source lines in L1 while each destination line is written whole.
//
// The rows are read as bytes: a bf16 key row read in place (gather_rows) starts at any even byte address (a
// key or cache view at an odd element offset, or with odd strides), where a uint32_t read is undefined
// behaviour (UBSan: misaligned load) and also reads bf16 objects through another type. A 4-byte memcpy is
// one load.
inline uint32_t word_at(const void* row, int64_t w) {
  uint32_t word;
  std::memcpy(&word, static_cast<const char*>(row) + 4 * w, sizeof(word));
  return word;
}

#if defined(CPU_CAPABILITY_AVX512)
// Words [w0, w0 + 16) of 16 rows -> dst[(w0 + c) * ld + r] for c, r < 16: unpack 32 / 64-bit within
// 128-bit lanes (r[4i + k] lane L = column 4L + k, rows 4i..4i+3), then two rounds of lane shuffles.
template <typename T>
void transpose_16x16(const T* const* rows, int64_t w0, uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(reinterpret_cast<const char*>(rows[i]) + 4 * w0);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    const __m512i u1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
    _mm512_storeu_si512(dst + (w0 + k) * ld, _mm512_shuffle_i32x4(u0, v0, 0x88));
    _mm512_storeu_si512(dst + (w0 + 8 + k) * ld, _mm512_shuffle_i32x4(u0, v0, 0xdd));
    _mm512_storeu_si512(dst + (w0 + 4 + k) * ld, _mm512_shuffle_i32x4(u1, v1, 0x88));
    _mm512_storeu_si512(dst + (w0 + 12 + k) * ld, _mm512_shuffle_i32x4(u1, v1, 0xdd));
  }
}
#endif

// dst[w * ld + jj] = rows[jj][w] over 32-bit words: K^T for fp32, and for bf16 the VNNI-2 K^T as well
// (a word is the pair (d, d + 1) of one key, which VNNI-2 keeps adjacent). Blocks of 16 keys keep the 16
// source lines in L1 while each destination line is written whole; AVX512 transposes 16 x 16 words in
// registers (the scalar loop took ~15% of the kernel's time at D = 128).
template <typename T>
void transpose_words(const T* const* rows, int64_t n, int64_t words, uint32_t* dst, int64_t ld) {
  constexpr int64_t kBlock = 16;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t jn = std::min(kBlock, n - j0);
    int64_t w = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if (jn == kBlock) {
      for (; w + kBlock <= words; w += kBlock) transpose_16x16(rows + j0, w, dst + j0, ld);
    }
#endif
    for (; w < words; ++w) {
      uint32_t* out = dst + w * ld + j0;
      for (int64_t jj = 0; jj < jn; ++jj) out[jj] = word_at(rows[j0 + jj], w);
    }
  }
}

// K^T of keys [j0, j0 + n) into ws.k [dim_pad, key_tile]; columns [n, n_pad) zero.
template <typename scalar_t, typename op_t>
void pack_keys(const HeadView<scalar_t>& view, int64_t j0, int64_t n, int64_t n_pad, const Geometry& geo,
               Workspace<op_t>& ws) {
  gather_rows<scalar_t>([&](int64_t j) { return view.key(j); }, j0, n, geo, ws);
  const int64_t words = geo.dim_pad * static_cast<int64_t>(sizeof(op_t)) / 4;
  auto* dst = reinterpret_cast<uint32_t*>(ws.k.data());
  transpose_words(ws.rows.data(), n, words, dst, geo.key_tile);
  for (int64_t jj = n; jj < n_pad; ++jj) {
    for (int64_t w = 0; w < words; ++w) dst[w * geo.key_tile + jj] = 0;
  }
}

// dst[2 d] = even[d], dst[2 d + 1] = odd[d] (0 when odd is null), as 32-bit words built from two 16-bit
// halves so that the compiler vectorises it (16-bit stores one by one took 45% of the kernel's own time).
inline void interleave_rows(const c10::BFloat16* even, const c10::BFloat16* odd, int64_t dim, c10::BFloat16* dst) {
  const auto* lo = reinterpret_cast<const uint16_t*>(even);
  const auto* hi = reinterpret_cast<const uint16_t*>(odd);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  if (hi == nullptr) {
    for (int64_t d = 0; d < dim; ++d) out[d] = lo[d];
    return;
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<uint32_t>(lo[d]) | (static_cast<uint32_t>(hi[d]) << 16);
}

// V of keys [j0, j0 + n) into ws.v [n_pad, dim_pad]: row copies for fp32, pairs of rows interleaved
// (VNNI-2) for bf16; rows [n, n_pad) are zero (their probabilities are zero, and 0 * stale NaN is NaN).
template <typename scalar_t, typename op_t>
void pack_values(const HeadView<scalar_t>& view, int64_t j0, int64_t n, int64_t n_pad, const Geometry& geo,
                 Workspace<op_t>& ws) {
  const int64_t dp = geo.dim_pad;
  if constexpr (!kVnni<op_t>) {
    for (int64_t jj = 0; jj < n; ++jj) {
      const scalar_t* src = view.value(j0 + jj);
      float* dst = ws.v.data() + jj * dp;
      if constexpr (std::is_same_v<scalar_t, float>) {
        std::memcpy(dst, src, dp * sizeof(float));
      } else {
        convert_row(src, dst, dp);
      }
    }
    std::fill(ws.v.data() + n * dp, ws.v.data() + n_pad * dp, 0.0f);
  } else {
    gather_rows<scalar_t>([&](int64_t j) { return view.value(j); }, j0, n, geo, ws);
    for (int64_t jj = 0; jj < n; jj += 2) {
      interleave_rows(ws.rows[jj], jj + 1 < n ? ws.rows[jj + 1] : nullptr, dp, ws.v.data() + jj * dp);
    }
    const int64_t written = (n + 1) / 2 * 2;
    std::fill(ws.v.data() + written * dp, ws.v.data() + n_pad * dp, op_t(0.0f));
  }
}

// ---------------------------------------------------------------------------------------------------
// Online softmax of one row of a tile: scores[0, lim) are the row's visible keys. Writes probabilities
// exp(scale s - new_max) into scores (and into probs for bf16), zero past lim up to n_pad; updates the
// running max / sum; returns the factor by which the row's accumulator must be rescaled.
//
// Non-finite scores (the contract of naive.py): a NaN or +inf score makes the row's out and lse NaN, a -inf
// score weighs 0, and a row of -inf scores only has no keys. The exponentials cannot carry a NaN there:
// exp_u20 clamps its argument with min/max instructions that return the bound for a NaN, so exp_u20(NaN)
// = +inf (AVX2 and AVX-512), and std::max(m, NaN) = m dropped the NaN from the max: a NaN in the
// vectorised part of a later tile gave sum +inf, lse +inf. So the max propagates NaN (max_or_nan), and a
// row whose max is NaN or +inf is set to max = sum = NaN here; the rescale by NaN carries it into acc.

// max(a, b), NaN if either is NaN (std::max(a, NaN) is a).
inline float max_or_nan(float a, float b) { return a > b || std::isnan(a) ? a : b; }

template <typename op_t>
float softmax_tile_row(float* scores, op_t* probs, int64_t lim, int64_t n_pad, float scale, float& row_max,
                       float& row_sum) {
  constexpr int64_t W = fVec::size();
  const fVec vscale(scale);
  fVec vmax(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= lim; i += W) {
    fVec x = fVec::loadu(scores + i) * vscale;
    x.store(scores + i);
    vmax = at::vec::maximum(vmax, x);  // NaN-propagating
  }
  float tile_max = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); },
                                                  vmax);
  for (; i < lim; ++i) {
    scores[i] *= scale;
    tile_max = max_or_nan(tile_max, scores[i]);
  }
  const float new_max = max_or_nan(row_max, tile_max);
  if (std::isnan(new_max) || new_max == std::numeric_limits<float>::infinity()) {
    std::fill(scores, scores + n_pad, 0.0f);
    if constexpr (kVnni<op_t>) std::fill(probs, probs + n_pad, op_t(0.0f));
    row_max = row_sum = std::numeric_limits<float>::quiet_NaN();
    return row_sum;
  }
  // Every score so far -inf: subtract 0 instead, so that exp(-inf - 0) = 0 rather than exp(NaN).
  const float base = new_max == -std::numeric_limits<float>::infinity() ? 0.0f : new_max;
  const float rescale = std::exp(row_max - base);  // row_max = -inf on the first tile: 0
  const fVec vnew(base);
  fVec vsum(0.0f);
  for (i = 0; i + W <= lim; i += W) {
    fVec e = (fVec::loadu(scores + i) - vnew).exp_u20();
    e.store(scores + i);
    vsum = vsum + e;
  }
  float tile_sum = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, vsum);
  for (; i < lim; ++i) {
    scores[i] = std::exp(scores[i] - base);
    tile_sum += scores[i];
  }
  std::fill(scores + lim, scores + n_pad, 0.0f);
  if constexpr (kVnni<op_t>) at::vec::convert(scores, probs, n_pad);
  row_max = new_max;
  row_sum = row_sum * rescale + tile_sum;
  return rescale;
}

inline void scale_row(float* row, int64_t n, float factor) {
  at::vec::map([factor](fVec x) { return x * fVec(factor); }, row, row, n);
}

// One tile of keys [j0, j0 + n) for all `rows` rows.
template <typename scalar_t, typename op_t>
void attend_tile(const HeadView<scalar_t>& view, int64_t j0, int64_t n, int64_t rows, const Geometry& geo,
                 float scale, Workspace<op_t>& ws) {
  const int64_t n_pad = key_pad(n, geo.key_tile);
  pack_keys(view, j0, n, n_pad, geo, ws);
  pack_values(view, j0, n, n_pad, geo, ws);
  gemm(rows, n_pad, geo.dim_pad, geo.dim_pad, geo.key_tile, geo.key_tile, false, ws.q.data(), ws.k.data(),
       ws.s.data());
  for (int64_t m = 0; m < rows; ++m) {
    float* scores = ws.s.data() + m * geo.key_tile;
    op_t* probs = kVnni<op_t> ? ws.p.data() + m * geo.key_tile : nullptr;
    const int64_t lim = std::clamp<int64_t>(ws.limit[m] - j0, 0, n);
    if (lim == 0) {  // every key of the tile is masked for this row: contributes nothing
      std::fill(scores, scores + n_pad, 0.0f);
      if constexpr (kVnni<op_t>) std::fill(probs, probs + n_pad, op_t(0.0f));
      continue;
    }
    const float rescale = softmax_tile_row(scores, probs, lim, n_pad, scale, ws.row_max[m], ws.row_sum[m]);
    if (rescale != 1.0f) scale_row(ws.acc.data() + m * geo.dim_pad, geo.dim_pad, rescale);
  }
  const op_t* probs = kVnni<op_t> ? ws.p.data() : reinterpret_cast<const op_t*>(ws.s.data());
  gemm(rows, geo.dim_pad, n_pad, geo.key_tile, geo.dim_pad, geo.dim_pad, true, probs, ws.v.data(), ws.acc.data());
}

// ---------------------------------------------------------------------------------------------------
// Results: out = acc / sum, lse = max + log(sum), written for row m of (b, g).

template <typename scalar_t>
void store_row(const BlockAttentionArgs& args, const Geometry& geo, int64_t b, int64_t g, int64_t causal,
               int64_t m, const float* acc, float row_max, float row_sum) {
  const int64_t s = token_row(m / geo.group, causal, geo.causal_slots);
  const int64_t h = g * geo.group + m % geo.group;
  scalar_t* out = args.out.data_ptr<scalar_t>() + ((b * geo.seq + s) * geo.q_heads + h) * geo.dim;
  float& lse = args.lse.data_ptr<float>()[(b * geo.q_heads + h) * geo.seq + s];
  if (row_sum == 0.0f) {  // every score -inf: no keys, out 0 even where a value is NaN (0 * NaN in acc)
    std::fill(out, out + geo.dim, static_cast<scalar_t>(0.0f));
    lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const float inv = 1.0f / row_sum;  // NaN for a row with a NaN or +inf score: out and lse NaN
  for (int64_t d = 0; d < geo.dim; ++d) out[d] = static_cast<scalar_t>(acc[d] * inv);
  lse = row_max + std::log(row_sum);
}

template <typename scalar_t>
CacheView<scalar_t> cache_view(const at::Tensor& cache, bool paged, int64_t b, int64_t g) {
  const int64_t batch_offset = paged ? 0 : b * cache.stride(0);
  return {cache.data_ptr<scalar_t>() + batch_offset + g * cache.stride(2), cache.stride(0), cache.stride(1)};
}

template <typename scalar_t>
HeadView<scalar_t> head_view(const BlockAttentionArgs& args, const Geometry& geo, int64_t b, int64_t g) {
  const bool paged = args.block_table != nullptr;
  const int64_t row_offset = b * geo.seq * geo.kv_heads * geo.dim + g * geo.dim;
  return HeadView<scalar_t>{cache_view<scalar_t>(args.k_cache, paged, b, g),
                            cache_view<scalar_t>(args.v_cache, paged, b, g),
                            paged ? args.block_table + b * args.table_stride : nullptr,
                            args.k_cache.size(1),
                            args.k.data_ptr<scalar_t>() + row_offset,
                            args.v.data_ptr<scalar_t>() + row_offset,
                            geo.kv_heads * geo.dim,
                            args.cache_seqlens[b],
                            args.num_causal[b],
                            geo.causal_slots};
}

// Partial results of the splits of every (b, g): acc [items, max_rows, dim_pad], max / sum [items, max_rows].
struct Partials {
  float* acc;
  float* row_max;
  float* row_sum;
};

// One work item: keys [split * keys_per_split, ...) of (b, g). Finishes the rows itself when unsplit.
template <typename scalar_t, typename op_t>
void run_item(const BlockAttentionArgs& args, const Geometry& geo, int64_t item, Workspace<op_t>& ws,
              const Partials& partials) {
  const int64_t split = item % geo.splits;
  const int64_t g = (item / geo.splits) % geo.kv_heads;
  const int64_t b = item / (geo.splits * geo.kv_heads);
  const HeadView<scalar_t> view = head_view<scalar_t>(args, geo, b, g);
  if (split == 0) view.append_causal_rows(geo.dim);
  const int64_t rows = geo.group * (view.causal + geo.block);
  const int64_t keys = view.length + view.causal + geo.block;
  const int64_t begin = split * geo.keys_per_split;
  const int64_t end = std::min(keys, begin + geo.keys_per_split);
  std::fill(ws.acc.begin(), ws.acc.begin() + rows * geo.dim_pad, 0.0f);
  std::fill(ws.row_max.begin(), ws.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(ws.row_sum.begin(), ws.row_sum.begin() + rows, 0.0f);
  if (rows > 0 && begin < end) {
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t t = m / geo.group;
      ws.limit[m] = t < view.causal ? view.length + t + 1 : keys;
    }
    pack_queries(args.q.data_ptr<scalar_t>(), geo, b, g, view.causal, rows, ws.q.data());
    for (int64_t j0 = begin; j0 < end; j0 += geo.key_tile) {
      attend_tile(view, j0, std::min(geo.key_tile, end - j0), rows, geo, args.scale, ws);
    }
  }
  if (geo.splits == 1) {
    for (int64_t m = 0; m < rows; ++m) {
      store_row<scalar_t>(args, geo, b, g, view.causal, m, ws.acc.data() + m * geo.dim_pad, ws.row_max[m],
                          ws.row_sum[m]);
    }
    return;
  }
  std::copy(ws.acc.begin(), ws.acc.begin() + rows * geo.dim_pad, partials.acc + item * geo.max_rows * geo.dim_pad);
  std::copy(ws.row_max.begin(), ws.row_max.begin() + rows, partials.row_max + item * geo.max_rows);
  std::copy(ws.row_sum.begin(), ws.row_sum.begin() + rows, partials.row_sum + item * geo.max_rows);
}

// Log-sum-exp merge of the splits of (b, g): max* = max_s max_s, sum = sum_s sum_s e^(max_s - max*),
// acc = sum_s acc_s e^(max_s - max*). Empty splits (and splits of -inf scores only) have sum 0 and are
// skipped; a split whose row saw a NaN or +inf score has max = sum = NaN, so its weight and the total are NaN.
template <typename scalar_t>
void merge_splits(const BlockAttentionArgs& args, const Geometry& geo, int64_t bg, const Partials& partials,
                  std::vector<float>& acc) {
  const int64_t b = bg / geo.kv_heads;
  const int64_t g = bg % geo.kv_heads;
  const int64_t causal = args.num_causal[b];
  const int64_t rows = geo.group * (causal + geo.block);
  const int64_t first = bg * geo.splits;
  for (int64_t m = 0; m < rows; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < geo.splits; ++s) best = std::max(best, partials.row_max[(first + s) * geo.max_rows + m]);
    float total = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < geo.splits; ++s) {
      const int64_t at = (first + s) * geo.max_rows + m;
      if (partials.row_sum[at] == 0.0f) continue;
      const float weight = std::exp(partials.row_max[at] - best);
      total += partials.row_sum[at] * weight;
      const float* part = partials.acc + at * geo.dim_pad;
      at::vec::map2([weight](fVec x, fVec y) { return x + y * fVec(weight); }, acc.data(), acc.data(), part,
                    geo.dim_pad);
    }
    store_row<scalar_t>(args, geo, b, g, causal, m, acc.data(), best, total);
  }
}

Geometry make_geometry(const BlockAttentionArgs& args, int64_t dim_pad) {
  Geometry geo{};
  geo.batch = args.q.size(0);
  geo.seq = args.q.size(1);
  geo.q_heads = args.q.size(2);
  geo.dim = args.q.size(3);
  geo.kv_heads = args.k.size(2);
  geo.group = geo.q_heads / geo.kv_heads;
  geo.causal_slots = args.num_causal_slots;
  geo.block = args.block_size;
  geo.dim_pad = dim_pad;
  geo.max_rows = geo.group * geo.seq;
  int64_t max_keys = 1;
  for (int64_t b = 0; b < geo.batch; ++b) {
    max_keys = std::max<int64_t>(max_keys, int64_t{args.cache_seqlens[b]} + args.num_causal[b] + geo.block);
  }
  const int64_t units = geo.batch * geo.kv_heads;
  const int64_t wanted = (kItemsPerThread * at::get_num_threads() + units - 1) / units;
  const int64_t most = (max_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  const int64_t splits = std::clamp<int64_t>(wanted, 1, most);
  geo.key_tile = kKeyTile;
  const int64_t tiles = (max_keys + geo.key_tile - 1) / geo.key_tile;
  geo.keys_per_split = (tiles + splits - 1) / splits * geo.key_tile;
  geo.splits = (max_keys + geo.keys_per_split - 1) / geo.keys_per_split;
  return geo;
}

template <typename scalar_t, typename op_t>
void run(const BlockAttentionArgs& args) {
  const Geometry geo = make_geometry(args, gemm_pad<op_t>(args.q.size(3)));
  const int64_t items = geo.batch * geo.kv_heads * geo.splits;
  std::vector<float> partial_acc, partial_stats;
  Partials partials{nullptr, nullptr, nullptr};
  if (geo.splits > 1) {
    partial_acc.resize(items * geo.max_rows * geo.dim_pad);
    partial_stats.resize(2 * items * geo.max_rows);
    partials = {partial_acc.data(), partial_stats.data(), partial_stats.data() + items * geo.max_rows};
  }
  // Items are taken from a shared counter rather than in fixed ranges: items are ragged (L_b, c_b differ),
  // and on a shared machine a thread that is descheduled would otherwise hold back its whole range (at
  // L = 512 with 2 threads on a loaded 2-core machine, fixed ranges took 36 ms against 14 ms on 1 thread).
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(items, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Workspace<op_t>& ws = thread_workspace<op_t>(geo);
    for (int64_t item = next_item.fetch_add(1); item < items; item = next_item.fetch_add(1)) {
      run_item<scalar_t, op_t>(args, geo, item, ws, partials);
    }
    if constexpr (kVnni<op_t>) at::native::cpublas::brgemm_release(true);
  });
  if (geo.splits == 1) return;
  at::parallel_for(0, geo.batch * geo.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(geo.dim_pad);
    for (int64_t bg = begin; bg < end; ++bg) merge_splits<scalar_t>(args, geo, bg, partials, acc);
  });
}

}  // namespace

void block_attention_kernel(const BlockAttentionArgs& args) {
  switch (args.q.scalar_type()) {
    case at::kFloat:
      run<float, float>(args);
      break;
    case at::kHalf:
      run<c10::Half, float>(args);
      break;
    case at::kBFloat16:
      if (bf16_gemm_available()) {
        run<c10::BFloat16, c10::BFloat16>(args);
      } else {
        run<c10::BFloat16, float>(args);
      }
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "block_attention_kernel: unexpected dtype ", args.q.scalar_type());
  }
}

}  // namespace sbd::cpu::CPU_CAPABILITY
