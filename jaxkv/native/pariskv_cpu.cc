// ParisKV's selection on the CPU as XLA FFI handlers (jaxkv/native/__init__.py builds
// and registers them). They compute what jaxkv.attention.pariskv computes in XLA:
//   - pariskv_coarse: most_voted_rows(coarse_votes(...)), the vote table included: the
//     `count` rows with the most votes, ties to the lower row, in ascending row order
//     (the same rows, exactly);
//   - pariskv_rerank: rsq.estimate of the candidates' code rows (the same value up to
//     float32 summation order);
//   - top_k: lax.top_k's positions (the same order and ties).
// XLA CPU runs the votes as int32 gathers, and the estimate as seven selects per
// coordinate over gathered copies of the rows. Here the vote table is bytes: with B = 8
// subspaces, 64 rows' votes take 16 byte permutes (AVX-512 VBMI); the estimate reads
// each row in place, a bit transpose (GFNI) giving every coordinate's sign and cell and
// one 16-entry permute per 16 coordinates its ±centre. Heads and blocks of
// rows are split over XLA's intra-op thread pool. Every leading axis of the arguments is
// a batch axis (vmap, broadcast_all).
//
// On a CPU without AVX-512 (parallel.h's JAXKV_AVX512 unset) the same three kernels are built
// from their AVX2 counterparts below (#else of each JAXKV_AVX512): the votes 32 rows at a
// time by byte shuffles of 16-byte pieces of the table, the estimate a subspace (8
// coordinates) per 8-lane step, the same answers.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv_native::bf16_to_f32;
using jaxkv_native::parallel_chunks;
using jaxkv_native::parallel_for;
using jaxkv_native::product;
#ifdef JAXKV_AVX512
using jaxkv_native::lanes_in_use;
using jaxkv_native::sum_each;
#endif

constexpr int kPatterns = 256;    // m = 8: a bucket id is one byte
constexpr int kMagnitudeBits = 3;  // rsq.MAGNITUDE_BITS
constexpr int kMaxVote = 255;      // votes + 1 are kept in a byte
constexpr int64_t kScaleBytes = 2;  // rsq.SCALE_BYTES: a record ends in its scale's bfloat16

// ---------------------------------------------------------------- coarse stage

// Each key's votes + 1 in a byte (0 for rows >= n). The vote table is bytes too, lut[B, 256]
// (a key earns at most 254 votes).

// Rows [begin, end) one at a time; the table stays in L1.
void vote_rows(const uint8_t* signs, int64_t begin, int64_t end, int64_t n_sub, const uint8_t* lut,
               uint8_t* votes) {
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = signs + r * n_sub;
    unsigned v = 1;
    for (int64_t b = 0; b < n_sub; ++b) v += lut[b * kPatterns + row[b]];
    votes[r] = static_cast<uint8_t>(v);
  }
}

#ifdef JAXKV_AVX512
// table[index[i]] for 64 byte indices, the 256-byte table in four registers: two 128-entry
// byte permutes and a blend on the index's top bit.
inline __m512i lookup_bytes(const __m512i (&table)[4], __m512i index) {
  const __m512i low = _mm512_permutex2var_epi8(table[0], index, table[1]);
  const __m512i high = _mm512_permutex2var_epi8(table[2], index, table[3]);
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high);
}

// B = 8 or 16: 64 rows at a time. Their sign bytes are transposed so that one register
// holds subspace b of all 64 rows, and subspace b's table is looked up by lookup_bytes.
template <int kSub>
struct VoteTableSimd {
  __m512i part[kSub][4];
  explicit VoteTableSimd(const uint8_t* lut) {
    for (int b = 0; b < kSub; ++b)
      for (int i = 0; i < 4; ++i) part[b][i] = _mm512_loadu_si512(lut + b * kPatterns + 64 * i);
  }
};

// r[k]: 8 bytes of each of rows 8k … 8k+7 (64 rows × 8 subspaces); out t[b], whose
// byte i is subspace b of row i. Inlined by force: called, GCC 12 passes the 16 registers
// through memory (docs/results/implementation_notes.md, "CPU kernels").
inline __attribute__((always_inline)) void transpose_signs(const __m512i r_in[8], __m512i t[8]) {
  alignas(64) static constexpr uint8_t kByteOrder[64] = {  // [row j][b] → [b][row j] within 8 rows
      0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57, 2, 10, 18, 26, 34, 42, 50, 58,
      3, 11, 19, 27, 35, 43, 51, 59, 4, 12, 20, 28, 36, 44, 52, 60, 5, 13, 21, 29, 37, 45, 53, 61,
      6, 14, 22, 30, 38, 46, 54, 62, 7, 15, 23, 31, 39, 47, 55, 63};
  const __m512i order = _mm512_load_si512(kByteOrder);
  __m512i r[8], a[8], q[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm512_permutexvar_epi8(order, r_in[k]);  // qword b: subspace b
  // An 8×8 transpose of qwords in three exchange stages (1, 2 and 4 qwords apart).
  for (int k = 0; k < 8; k += 2) {
    a[k] = _mm512_unpacklo_epi64(r[k], r[k + 1]);
    a[k + 1] = _mm512_unpackhi_epi64(r[k], r[k + 1]);
  }
  const __m512i low2 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), high2 = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int base : {0, 4})
    for (int k = 0; k < 2; ++k) {
      q[base + k] = _mm512_permutex2var_epi64(a[base + k], low2, a[base + k + 2]);
      q[base + k + 2] = _mm512_permutex2var_epi64(a[base + k], high2, a[base + k + 2]);
    }
  const __m512i low4 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), high4 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_permutex2var_epi64(q[k], low4, q[k + 4]);
    t[k + 4] = _mm512_permutex2var_epi64(q[k], high4, q[k + 4]);
  }
}

template <int kSub>
void vote_blocks(const uint8_t* signs, int64_t begin, int64_t end, const VoteTableSimd<kSub>& table,
                 uint8_t* votes) {
  static_assert(kSub == 8 || kSub == 16);
  // B = 16: each 8-row register holds one 8-byte half of each row, taken from two loads.
  const __m512i even = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0), odd = _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t r = begin; r < end; r += 64) {
    __m512i v = _mm512_set1_epi8(1);
    for (int half = 0; half < kSub / 8; ++half) {
      __m512i rows[8], t[8];
      for (int k = 0; k < 8; ++k) {
        if constexpr (kSub == 8) {
          rows[k] = _mm512_loadu_si512(signs + (r + 8 * k) * 8);
        } else {
          const __m512i first = _mm512_loadu_si512(signs + (r + 8 * k) * 16),
                        second = _mm512_loadu_si512(signs + (r + 8 * k) * 16 + 64);
          rows[k] = _mm512_permutex2var_epi64(first, half == 0 ? even : odd, second);
        }
      }
      transpose_signs(rows, t);
      for (int j = 0; j < 8; ++j) v = _mm512_add_epi8(v, lookup_bytes(table.part[8 * half + j], t[j]));
    }
    _mm512_storeu_si512(votes + r, v);
  }
}

constexpr int64_t kBlockRows = 64;  // of vote_blocks
#else
// AVX2, B = 8 or 16: 32 rows at a time, their sign bytes transposed so that one register holds
// subspace b of all 32 rows. AVX2 has no 128-entry byte permute: a byte x is looked up in the
// 256-byte table as in 16 tables of 16 bytes, that of x's high nibble h by a byte shuffle of
// x − 16h plus 0x70 (saturated: bit 7, which makes the shuffle give 0, is set unless x's high
// nibble is h). The rows come out of the transpose in another order, restored once per block.
template <int kSub>
struct VoteTableSimd {
  __m256i part[kSub][16];  // [b][h]: lut[b, 16h … 16h + 15] in both lanes
  explicit VoteTableSimd(const uint8_t* lut) {
    for (int b = 0; b < kSub; ++b)
      for (int h = 0; h < 16; ++h)
        part[b][h] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut + b * kPatterns + 16 * h)));
  }
  __m256i lookup(int b, __m256i x) const {
    __m256i found = _mm256_setzero_si256();
    for (int h = 0; h < 16; ++h) {
      found = _mm256_or_si256(found, _mm256_shuffle_epi8(part[b][h], _mm256_adds_epu8(x, _mm256_set1_epi8(0x70))));
      x = _mm256_sub_epi8(x, _mm256_set1_epi8(16));
    }
    return found;
  }
};

// in[k]: qword i = 8 sign bytes of row 4k + i (32 rows); out t[b]: byte i of lane l is subspace
// b of row 4(i >> 1) + 2l + (i & 1). Each lane's two rows interleaved by a byte shuffle, then
// words, dwords and qwords of register pairs. Inlined by force, as the AVX-512 one.
inline __attribute__((always_inline)) void transpose_signs(const __m256i in[8], __m256i t[8]) {
  const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  __m256i r[8], u[8], w[4], x[4];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_shuffle_epi8(in[k], order);  // word b: subspace b of the lane's rows
  for (int k = 0; k < 8; k += 2)  // dword b: of four rows (b < 4, then b >= 4)
    u[k] = _mm256_unpacklo_epi16(r[k], r[k + 1]), u[k + 1] = _mm256_unpackhi_epi16(r[k], r[k + 1]);
  for (int i = 0; i < 2; ++i) {  // qword: of eight rows
    w[2 * i] = _mm256_unpacklo_epi32(u[i], u[i + 2]), w[2 * i + 1] = _mm256_unpackhi_epi32(u[i], u[i + 2]);
    x[2 * i] = _mm256_unpacklo_epi32(u[i + 4], u[i + 6]), x[2 * i + 1] = _mm256_unpackhi_epi32(u[i + 4], u[i + 6]);
  }
  for (int j = 0; j < 4; ++j) t[2 * j] = _mm256_unpacklo_epi64(w[j], x[j]), t[2 * j + 1] = _mm256_unpackhi_epi64(w[j], x[j]);
}

// transpose_signs's row order back to rows 0 … 31.
inline __m256i in_row_order(__m256i v) {
  const __m256i swapped = _mm256_permute2x128_si256(v, v, 1);
  return _mm256_permute2x128_si256(_mm256_unpacklo_epi16(v, swapped), _mm256_unpackhi_epi16(v, swapped), 0x20);
}

template <int kSub>
void vote_blocks(const uint8_t* signs, int64_t begin, int64_t end, const VoteTableSimd<kSub>& table,
                 uint8_t* votes) {
  static_assert(kSub == 8 || kSub == 16);
  const auto at = [&](int64_t row) { return reinterpret_cast<const __m256i*>(signs + row * kSub); };
  for (int64_t r = begin; r < end; r += 32) {
    __m256i v = _mm256_set1_epi8(1);
    for (int half = 0; half < kSub / 8; ++half) {
      __m256i rows[8], t[8];
      for (int k = 0; k < 8; ++k) {
        if constexpr (kSub == 8) {
          rows[k] = _mm256_loadu_si256(at(r + 4 * k));
        } else {  // one 8-byte half of each of four rows, from two loads of two rows each
          const __m256i first = _mm256_loadu_si256(at(r + 4 * k)), second = _mm256_loadu_si256(at(r + 4 * k + 2));
          rows[k] = _mm256_permute4x64_epi64(
              half == 0 ? _mm256_unpacklo_epi64(first, second) : _mm256_unpackhi_epi64(first, second), 0xD8);
        }
      }
      transpose_signs(rows, t);
      for (int j = 0; j < 8; ++j) v = _mm256_add_epi8(v, table.lookup(8 * half + j, t[j]));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(votes + r), in_row_order(v));
  }
}

constexpr int64_t kBlockRows = 32;
#endif

// Votes of rows [begin, end), begin a multiple of kBlockRows: blocks by vote_blocks where B
// allows, the rest row by row.
void vote_range(const uint8_t* signs, int64_t begin, int64_t end, int64_t n_sub, const uint8_t* lut,
                uint8_t* votes) {
  const int64_t blocks_end = n_sub == 8 || n_sub == 16 ? begin + (end - begin) / kBlockRows * kBlockRows : begin;
  if (n_sub == 8) vote_blocks<8>(signs, begin, blocks_end, VoteTableSimd<8>(lut), votes);
  if (n_sub == 16) vote_blocks<16>(signs, begin, blocks_end, VoteTableSimd<16>(lut), votes);
  vote_rows(signs, blocks_end, end, n_sub, lut, votes);
}

// The mask of the first min(rows, 64) of 64 bytes: a whole block, or the last one.
__mmask64 first_rows(int64_t rows) { return rows >= 64 ? ~0ull : (1ull << rows) - 1; }

// counts[i]: how many of votes[0, rows) are >= t[i] (kProbes thresholds, one pass).
constexpr int kProbes = 7;
using Probes = std::array<int, kProbes>;
#ifdef JAXKV_AVX512
std::array<int64_t, kProbes> count_at_least(const uint8_t* votes, int64_t rows, const Probes& t) {
  __m512i threshold[kProbes];
  for (int i = 0; i < kProbes; ++i) threshold[i] = _mm512_set1_epi8(static_cast<char>(t[i]));
  std::array<int64_t, kProbes> total{};
  for (int64_t base = 0; base < rows; base += 64) {
    const __mmask64 in_range = first_rows(rows - base);
    const __m512i v = _mm512_maskz_loadu_epi8(in_range, votes + base);
    for (int i = 0; i < kProbes; ++i)
      total[i] += __builtin_popcountll(_mm512_mask_cmpge_epu8_mask(in_range, v, threshold[i]));
  }
  return total;
}
#else
// Votes [base, base + 64) (zero past `rows`) in two registers.
struct VoteBlock {
  __m256i half[2];
  VoteBlock(const uint8_t* votes, int64_t rows, int64_t base) {
    alignas(32) uint8_t tail[64] = {};
    const uint8_t* p = votes + base;
    if (rows - base < 64) p = static_cast<const uint8_t*>(std::memcpy(tail, p, rows - base));
    for (int i = 0; i < 2; ++i) half[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
  }
  // Bit i: vote base + i is >= t (unsigned); equal to t.
  uint64_t at_least(int t) const {
    const __m256i threshold = _mm256_set1_epi8(static_cast<char>(t));
    return bits([&](__m256i v) { return _mm256_cmpeq_epi8(_mm256_max_epu8(v, threshold), v); });
  }
  uint64_t equal(int t) const {
    const __m256i threshold = _mm256_set1_epi8(static_cast<char>(t));
    return bits([&](__m256i v) { return _mm256_cmpeq_epi8(v, threshold); });
  }
  template <typename Compare>
  uint64_t bits(const Compare& compare) const {
    return static_cast<uint32_t>(_mm256_movemask_epi8(compare(half[0]))) |
           static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(compare(half[1])))) << 32;
  }
};

std::array<int64_t, kProbes> count_at_least(const uint8_t* votes, int64_t rows, const Probes& t) {
  std::array<int64_t, kProbes> total{};
  for (int64_t base = 0; base < rows; base += 64) {
    const VoteBlock block(votes, rows, base);
    for (int i = 0; i < kProbes; ++i) total[i] += __builtin_popcountll(block.at_least(t[i]) & first_rows(rows - base));
  }
  return total;
}
#endif

// Sorts entries[n] ascending by the 32-bit key in bits [shift, shift + 32), stably: a
// radix sort, four 8-bit passes, with no data-dependent branches (a comparison sort of
// fresh data each step mispredicts about half its comparisons). `spare` holds n entries;
// returns whichever of the two buffers holds the result.
uint64_t* radix_sort(uint64_t* entries, uint64_t* spare, int64_t n, int shift) {
  std::array<std::array<int32_t, 256>, 4> histogram{};
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < 4; ++d) ++histogram[d][(entries[i] >> (shift + 8 * d)) & 255];
  for (int d = 0; d < 4 && n > 0; ++d) {
    const int digit_shift = shift + 8 * d;
    auto& slots = histogram[d];
    if (slots[(entries[0] >> digit_shift) & 255] == n) continue;  // one digit value: order unchanged
    int32_t next = 0;
    for (auto& slot : slots) next += std::exchange(slot, next);
    for (int64_t i = 0; i < n; ++i) spare[slots[(entries[i] >> digit_shift) & 255]++] = entries[i];
    std::swap(entries, spare);
  }
  return entries;
}

// A 32-bit key that sorts ascending as the float descending: the order-preserving bits,
// complemented.
uint32_t descending_key(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return (bits >> 31) ? bits : ~bits & 0x7fffffffu;
}

// subspace_votes's vector steps, each with its AVX2 counterpart: the score range (NaN
// noted); each pattern's bucket; the caps passed before each bucket; each pattern's votes
// where its bucket passes no cap; the patterns of a bucket among 64.
struct ScoreRange {
  float top, width;
  bool nan;
};

#ifdef JAXKV_AVX512
inline __m512 plus_zero(const float* score, int p) { return _mm512_add_ps(_mm512_loadu_ps(score + p), _mm512_setzero_ps()); }

inline ScoreRange score_range(const float* score) {
  __m512 lowest = _mm512_set1_ps(INFINITY), highest = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int p = 0; p < kPatterns; p += 16) {
    const __m512 s = plus_zero(score, p);
    lowest = _mm512_min_ps(lowest, s), highest = _mm512_max_ps(highest, s);
    nan |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
  }
  const float top = _mm512_reduce_max_ps(highest);
  return {top, top - _mm512_reduce_min_ps(lowest), nan != 0};
}

inline void bucket_patterns(const float* score, float top, float scale, uint8_t* bucket) {
  for (int p = 0; p < kPatterns; p += 16) {
    const __m512 offset = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(top), plus_zero(score, p)), _mm512_set1_ps(scale));
    // A NaN offset (∞ − ∞, only where scale is 0) converts to INT_MIN: bucket 0, as the rest.
    const __m512i b = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(offset), _mm512_setzero_si512()),
                                       _mm512_set1_epi32(kPatterns - 1));
    _mm_store_si128(reinterpret_cast<__m128i*>(bucket + p), _mm512_cvtepi32_epi8(b));
  }
}

// passed[b + 1]: how many caps covered[b] keys exceed.
inline void caps_passed(const int32_t* covered, const float* caps, int64_t n_tiers, uint8_t* passed) {
  for (int b = 0; b < kPatterns; b += 16) {
    const __m512 keys = _mm512_cvtepi32_ps(_mm512_load_si512(covered + b));
    __m512i n = _mm512_setzero_si512();
    for (int64_t t = 0; t < n_tiers; ++t)
      n = _mm512_mask_sub_epi32(n, _mm512_cmp_ps_mask(keys, _mm512_set1_ps(caps[t]), _CMP_GT_OQ), n, _mm512_set1_epi32(-1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(passed + b + 1), _mm512_cvtepi32_epi8(n));
  }
}

inline void votes_by_bucket(const uint8_t* passed, int64_t n_tiers, const uint8_t* bucket, uint8_t* lut) {
  __m512i votes[4];  // of each bucket's patterns, where it passes no cap
  for (int i = 0; i < 4; ++i)
    votes[i] = _mm512_sub_epi8(_mm512_set1_epi8(static_cast<char>(n_tiers)), _mm512_loadu_si512(passed + 1 + 64 * i));
  for (int p = 0; p < kPatterns; p += 64) _mm512_storeu_si512(lut + p, lookup_bytes(votes, _mm512_load_si512(bucket + p)));
}

inline uint64_t patterns_in_bucket(const uint8_t* bucket, int p, int b) {
  return _mm512_cmpeq_epi8_mask(_mm512_load_si512(bucket + p), _mm512_set1_epi8(static_cast<char>(b)));
}
#else
inline ScoreRange score_range(const float* score) {
  float lowest = INFINITY, highest = -INFINITY;
  bool nan = false;
  for (int p = 0; p < kPatterns; ++p) {
    const float s = score[p] + 0.0f;
    lowest = std::min(lowest, s), highest = std::max(highest, s);
    nan |= s != s;
  }
  return {highest, highest - lowest, nan};
}

inline void bucket_patterns(const float* score, float top, float scale, uint8_t* bucket) {
  for (int p = 0; p < kPatterns; ++p) {
    const float offset = (top - (score[p] + 0.0f)) * scale;  // NaN only where scale is 0: bucket 0
    bucket[p] = offset >= 0.0f ? static_cast<uint8_t>(std::min(offset, static_cast<float>(kPatterns - 1))) : 0;
  }
}

inline void caps_passed(const int32_t* covered, const float* caps, int64_t n_tiers, uint8_t* passed) {
  for (int b = 0; b < kPatterns; ++b) {
    int n = 0;
    for (int64_t t = 0; t < n_tiers; ++t) n += static_cast<float>(covered[b]) > caps[t];
    passed[b + 1] = static_cast<uint8_t>(n);
  }
}

inline void votes_by_bucket(const uint8_t* passed, int64_t n_tiers, const uint8_t* bucket, uint8_t* lut) {
  for (int p = 0; p < kPatterns; ++p) lut[p] = static_cast<uint8_t>(n_tiers - passed[bucket[p] + 1]);
}

inline uint64_t patterns_in_bucket(const uint8_t* bucket, int p, int b) {
  uint64_t in = 0;
  for (int i = 0; i < 64; ++i) in |= static_cast<uint64_t>(bucket[p + i] == b) << i;
  return in;
}
#endif

// One subspace's row of pariskv.vote_table, lut[256]: walking the patterns by score,
// descending, ties to the lower pattern (−0 counting as +0, as in the XLA path's float
// comparisons), a pattern gets n_tiers − (tier caps its cumulative key count exceeds)
// votes, at least 0. The comparisons are the XLA path's (count as float32 against the
// ascending float32 caps), so the table is the same.
//
// The order only matters where the walk passes a cap, at most n_tiers places. So the
// patterns go to 256 buckets of equal score ranges, by a monotone map (a higher score never
// lands in a later bucket, equal scores in the same one); a bucket whose keys pass no cap
// gives all its patterns one value, and only the patterns of a bucket that passes one are
// sorted, not all 256 (docs/results/implementation_notes.md, "CPU kernels").
void subspace_votes(const float* score, const int32_t* count, const float* caps, int64_t n_tiers, uint8_t* lut) {
  const auto [top, width, nan] = score_range(score);
  float scale = (kPatterns - 1) / width;  // one bucket for all when the range is empty, infinite or NaN
  if (nan || !(width > 0.0f) || !std::isfinite(width) || !std::isfinite(scale)) scale = 0.0f;
  alignas(64) uint8_t bucket[kPatterns];
  bucket_patterns(score, top, scale, bucket);
  alignas(64) int32_t covered[kPatterns] = {};  // keys in each bucket, then in it and those before
  for (int p = 0; p < kPatterns; ++p) covered[bucket[p]] += count[p];
  for (int b = 1; b < kPatterns; ++b) covered[b] += covered[b - 1];
  alignas(64) uint8_t passed[kPatterns + 1];  // caps passed before bucket b
  passed[0] = 0;
  caps_passed(covered, caps, n_tiers, passed);
  votes_by_bucket(passed, n_tiers, bucket, lut);
  for (int b = 0; b < kPatterns; ++b) {  // the walk itself through each bucket that passes a cap
    if (passed[b + 1] == passed[b]) continue;
    uint64_t entry[kPatterns];  // descending key << 8 | pattern: the walk's order
    int n = 0;
    for (int p = 0; p < kPatterns; p += 64)
      for (uint64_t in = patterns_in_bucket(bucket, p, b); in; in &= in - 1) {
        const int pattern = p + __builtin_ctzll(in);
        entry[n++] = static_cast<uint64_t>(descending_key(score[pattern] + 0.0f)) << 8 | static_cast<uint64_t>(pattern);
      }
    std::sort(entry, entry + n);
    int32_t walked = b > 0 ? covered[b - 1] : 0;
    int64_t walked_passed = passed[b];
    for (int i = 0; i < n; ++i) {
      const auto pattern = static_cast<uint8_t>(entry[i]);
      walked += count[pattern];
      while (walked_passed < n_tiers && static_cast<float>(walked) > caps[walked_passed]) ++walked_passed;
      lut[pattern] = static_cast<uint8_t>(n_tiers - walked_passed);
    }
  }
}

// A head's `count` rows: every row voting above a threshold t and the lowest rows at t,
// ascending. Rows >= n vote -1 (stored as 0), so with n < count the rows n, n+1, … fill in.
// The votes are counted and the rows written out block by block (kVoteRows rows), the
// blocks split over the threads as the votes are: split by whole heads, one thread would
// take two of SmolLM2's three.

// t is the largest value with at least `count` rows at or above it. Each pass counts
// kProbes thresholds spread over the bracket (lo, hi), ascending; once hi - lo <= kProbes + 1
// they are every value between, so that pass ends the search. With 6 tiers and B = 8
// (votes + 1 in 1 … 49) it takes two passes, the first run by the vote pass on each block's
// fresh votes, where a bisection over the byte's 256 values takes eight and a ninth for the
// count above t.
struct Search {
  int lo, hi;  // count_at_least(lo) >= count > count_at_least(hi)
  bool open() const { return hi - lo > 1; }
  Probes probes() const {
    Probes t;
    for (int i = 0; i < kProbes; ++i) t[i] = lo + (i + 1) * (hi - lo) / (kProbes + 1);
    return t;
  }
};

// One block's rows voting at least each probe of the pass, at least lo and at least hi;
// then where its rows start in the head's output and how many of its ties at lo it keeps.
struct BlockCounts {
  std::array<int64_t, kProbes> at_probe{};
  int64_t at_lo = 0, at_hi = 0, first = 0, ties_kept = 0;
};

// Moves the bracket to the pass's counts, summed over the head's blocks.
void narrow(Search& search, BlockCounts* blocks, int64_t n_blocks, int64_t count) {
  const Probes t = search.probes();
  for (int i = 0; i < kProbes; ++i) {
    int64_t total = 0;
    for (int64_t b = 0; b < n_blocks; ++b) total += blocks[b].at_probe[i];
    const bool enough = total >= count;
    (enough ? search.lo : search.hi) = t[i];
    for (int64_t b = 0; b < n_blocks; ++b) (enough ? blocks[b].at_lo : blocks[b].at_hi) = blocks[b].at_probe[i];
    if (!enough) return;
  }
}

// Once the search has ended (hi = t + 1): every row above t is kept, and the ties at t
// still wanted go to the lowest blocks first.
void place_blocks(BlockCounts* blocks, int64_t n_blocks, int64_t count) {
  int64_t ties_wanted = count, first = 0;
  for (int64_t b = 0; b < n_blocks; ++b) ties_wanted -= blocks[b].at_hi;
  for (int64_t b = 0; b < n_blocks; ++b) {
    blocks[b].ties_kept = std::min(blocks[b].at_lo - blocks[b].at_hi, ties_wanted);
    ties_wanted -= blocks[b].ties_kept;
    blocks[b].first = first;
    first += blocks[b].at_hi + blocks[b].ties_kept;
  }
}

// Rows [begin, end) voting above t and the lowest `ties` of those at t, ascending, into out.
// 64 rows at a time: the mask of the rows kept (the ties all, or the lowest still wanted by
// a bit deposit), their offsets compressed into a register's low bytes, written out 16 row
// numbers a store. The only branch on the votes is that loop's, whose second store (more than
// 16 of 64 rows kept) is rare at C = N/10 unless the kept rows cluster.
#ifdef JAXKV_AVX512
void write_rows(const uint8_t* votes, int64_t begin, int64_t end, int t, int64_t ties, int32_t* out) {
  alignas(64) static constexpr uint8_t kOffsets[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
      22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
      44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i offsets = _mm512_load_si512(kOffsets);
  const __m512i threshold = _mm512_set1_epi8(static_cast<char>(t));
  int64_t k = 0;
  for (int64_t base = begin; base < end; base += 64) {
    const __mmask64 in_range = first_rows(end - base);
    const __m512i v = _mm512_maskz_loadu_epi8(in_range, votes + base);
    const uint64_t tie = _mm512_mask_cmpeq_epu8_mask(in_range, v, threshold);
    const int64_t n_tie = __builtin_popcountll(tie);
    const uint64_t taken = n_tie <= ties ? tie : _pdep_u64((1ull << ties) - 1, tie);  // ties < n_tie <= 64
    ties -= std::min(n_tie, ties);
    const uint64_t keep = _mm512_mask_cmpgt_epu8_mask(in_range, v, threshold) | taken;
    const int64_t n_rows = __builtin_popcountll(keep);
    __m512i kept = _mm512_maskz_compress_epi8(keep, offsets);
    for (int64_t i = 0; i < n_rows; i += 16) {
      const __m512i rows = _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(kept)),
                                            _mm512_set1_epi32(static_cast<int32_t>(base)));
      _mm512_mask_storeu_epi32(out + k + i, lanes_in_use(n_rows - i), rows);
      kept = _mm512_alignr_epi32(_mm512_setzero_si512(), kept, 4);  // the next 16 offsets
    }
    k += n_rows;
  }
}
#else
// AVX2: the same masks, the kept rows' numbers written one by one.
void write_rows(const uint8_t* votes, int64_t begin, int64_t end, int t, int64_t ties, int32_t* out) {
  int64_t k = 0;
  for (int64_t base = begin; base < end; base += 64) {
    const VoteBlock block(votes, end, base);
    const uint64_t in_range = first_rows(end - base), at_least = block.at_least(t) & in_range;
    const uint64_t tie = block.equal(t) & in_range;
    const int64_t n_tie = __builtin_popcountll(tie);
    const uint64_t taken = n_tie <= ties ? tie : _pdep_u64((1ull << ties) - 1, tie);  // ties < n_tie <= 64
    ties -= std::min(n_tie, ties);
    for (uint64_t keep = (at_least & ~tie) | taken; keep; keep &= keep - 1)
      out[k++] = static_cast<int32_t>(base + __builtin_ctzll(keep));
  }
}
#endif

ffi::Error coarse(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> signs, ffi::Buffer<ffi::F32> scores,
                  ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::F32> caps, ffi::Buffer<ffi::S32> n,
                  ffi::ResultBuffer<ffi::S32> out) {
  const auto sd = signs.dimensions(), od = out->dimensions();
  if (sd.size() < 2 || od.size() != sd.size() - 1)
    return ffi::Error::InvalidArgument("pariskv_coarse: signs [..., cap, B], out [..., C]");
  const int64_t cap = sd[sd.size() - 2], n_sub = sd.back(), count = od.back();
  const int64_t batch = product(sd, 0, sd.size() - 2), n_tiers = caps.dimensions().back();
  if (scores.element_count() != batch * n_sub * kPatterns || counts.element_count() != batch * n_sub * kPatterns ||
      caps.element_count() != batch * n_tiers || n.element_count() != batch || product(od, 0, od.size() - 1) != batch)
    return ffi::Error::InvalidArgument(
        "pariskv_coarse: scores, counts [..., B, 256], caps [..., tiers], n [...] must match signs [..., cap, B]");
  if (count < 1 || count > cap) return ffi::Error::InvalidArgument("pariskv_coarse: need 1 <= C <= cap");
  if (n_tiers * n_sub >= kMaxVote)
    return ffi::Error::InvalidArgument("pariskv_coarse: a key's votes (tiers × B) must stay below 255");
  for (int64_t h = 0; h < batch; ++h) {
    const float* head_caps = caps.typed_data() + h * n_tiers;
    if (!std::is_sorted(head_caps, head_caps + n_tiers))
      return ffi::Error::InvalidArgument("pariskv_coarse: the tier caps must ascend");
  }
  // Passes split over the threads: the vote tables by subspace; the votes and the first
  // counts in blocks of kVoteRows rows; the searches' further counts; each head's blocks
  // placed; their rows written out.
  constexpr int64_t kVoteRows = 16384;  // a multiple of 64
  const int64_t n_blocks = (cap + kVoteRows - 1) / kVoteRows;
  const auto block_at = [&](int64_t h, int64_t begin) { return h * n_blocks + begin / kVoteRows; };
  std::vector<uint8_t> luts(batch * n_sub * kPatterns);
  parallel_for(pool, batch * n_sub, [&](int64_t item) {
    subspace_votes(scores.typed_data() + item * kPatterns, counts.typed_data() + item * kPatterns,
                   caps.typed_data() + item / n_sub * n_tiers, n_tiers, luts.data() + item * kPatterns);
  }, /*linger=*/true);
  std::unique_ptr<uint8_t[]> votes(new uint8_t[batch * cap]);
  const Search first_search{0, static_cast<int>(n_tiers * n_sub) + 2};  // votes + 1 <= tiers × B + 1
  std::vector<Search> search(batch, first_search);
  std::vector<BlockCounts> blocks(batch * n_blocks);
  parallel_chunks(pool, batch, cap, kVoteRows, [&](int64_t h, int64_t begin, int64_t end) {
    const int64_t valid_end = std::clamp<int64_t>(n.typed_data()[h], begin, end);
    uint8_t* head_votes = votes.get() + h * cap;
    vote_range(signs.typed_data() + h * cap * n_sub, begin, valid_end, n_sub, luts.data() + h * n_sub * kPatterns,
               head_votes);
    std::memset(head_votes + valid_end, 0, end - valid_end);  // rows >= n
    BlockCounts& block = blocks[block_at(h, begin)];
    block.at_probe = count_at_least(head_votes + begin, end - begin, first_search.probes());
    block.at_lo = end - begin;  // every row votes at least 0
  }, /*linger=*/true);
  for (bool open = true; open;) {
    open = false;
    for (int64_t h = 0; h < batch; ++h) {
      if (!search[h].open()) continue;
      narrow(search[h], &blocks[block_at(h, 0)], n_blocks, count);
      open |= search[h].open();
    }
    if (open)
      parallel_chunks(pool, batch, cap, kVoteRows, [&](int64_t h, int64_t begin, int64_t end) {
        if (search[h].open())
          blocks[block_at(h, begin)].at_probe = count_at_least(votes.get() + h * cap + begin, end - begin, search[h].probes());
      }, /*linger=*/true);
  }
  for (int64_t h = 0; h < batch; ++h) place_blocks(&blocks[block_at(h, 0)], n_blocks, count);
  parallel_chunks(pool, batch, cap, kVoteRows, [&](int64_t h, int64_t begin, int64_t end) {
    const BlockCounts& block = blocks[block_at(h, begin)];
    write_rows(votes.get() + h * cap, begin, end, search[h].lo, block.ties_kept, out->typed_data() + h * count + block.first);
  }, /*linger=*/true);  // the rerank kernel follows
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- rerank

#ifdef JAXKV_AVX512
// One row's estimate. m = 8, so coordinate 8b + j is bit j of byte b of the sign row and
// of each magnitude plane. A byte permute lays the row out as one qword per subspace,
// bytes [.., .., .., .., sign, plane 2, plane 1, plane 0], and a GF(2) affine transform
// with unit vectors (an 8×8 bit transpose per qword) turns it into one byte per
// coordinate: positive << 3 | cell, the index into ±centre. Dword j of a group of 64
// coordinates then holds coordinates 4j … 4j+3 in its four bytes; the float permute reads
// only an index's low four bits, so shifting the dword by 8t selects coordinate 4j + t.
struct RerankQuery {
  __m512 q[2][4];  // [group of 64 coordinates][t]: lane j = the rotated query's 64g + 4j + t (0 past P)
  __m512 signed_centres;  // [positive << 3 | cell]: −centre, then +centre
};

// The rotated query q[P] and the head's centres[8] as the estimate reads them.
RerankQuery rerank_query(const float* q, int64_t p, const float* centre) {
  RerankQuery rq;
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t t = 0; t < 4; ++t) {
      alignas(64) float lanes[16];
      for (int64_t j = 0; j < 16; ++j) lanes[j] = 64 * g + 4 * j + t < p ? q[64 * g + 4 * j + t] : 0.0f;
      rq.q[g][t] = _mm512_load_ps(lanes);
    }
  alignas(64) float table[16];
  for (int i = 0; i < 8; ++i) table[i] = -centre[i], table[8 + i] = centre[i];
  rq.signed_centres = _mm512_load_ps(table);
  return rq;
}

template <int64_t kChunks>  // P = 16 kChunks coordinates, B = 2 kChunks subspaces
struct RowLayout {
  static constexpr int64_t kPlaneBytes = 2 * kChunks, kGroups = (kChunks + 3) / 4;
  // Byte indices into (magnitude row | sign row) for group g: qword k gathers subspace 8g + k
  // (clamped into the row for P < 64: those lanes meet a zero query).
  static __m512i permute(int64_t g) {
    alignas(64) uint8_t index[64];
    for (int64_t k = 0; k < 8; ++k) {
      const auto b = static_cast<uint8_t>(std::min(8 * g + k, kPlaneBytes - 1));
      const uint8_t sign = 64 + b;  // bit 6: the second table
      const uint8_t bytes[8] = {sign, sign, sign, sign, sign, static_cast<uint8_t>(2 * kPlaneBytes + b),
                                static_cast<uint8_t>(kPlaneBytes + b), b};
      std::memcpy(index + 8 * k, bytes, 8);
    }
    return _mm512_load_si512(index);
  }
};

// The kBytes bytes at p in the low bytes of a register, the rest zero, read by loads of
// those bytes only, faster than a masked 64-byte load of them (docs/results/implementation_notes.md, "CPU kernels").
template <int64_t kBytes>
__m512i load_bytes(const uint8_t* p) {
  static_assert(0 < kBytes && kBytes <= 64);
  uint64_t q[8] = {};
  for (int64_t i = 0; i < kBytes; i += 8) std::memcpy(&q[i / 8], p + i, std::min<int64_t>(8, kBytes - i));
  return _mm512_set_epi64(q[7], q[6], q[5], q[4], q[3], q[2], q[1], q[0]);
}

// Σ_b w_b Σ_{i in b} q_i · ±centre[cell_i] for one row, w_b = the row's 4-bit multiple b (the
// scale is applied by the caller), as 16 lanes to be summed.
template <int64_t kChunks>
__m512 row_partials(const RerankQuery& rq, const __m512i (&permute)[2], const uint8_t* signs, const uint8_t* planes,
                    const uint8_t* weight_codes) {
  using Layout = RowLayout<kChunks>;
  const __m512i magnitude_row = load_bytes<kMagnitudeBits * Layout::kPlaneBytes>(planes);
  const __m512i sign_row = load_bytes<Layout::kPlaneBytes>(signs);
  uint64_t multiples = 0;  // nibble b = w_b; B/2 = kChunks bytes
  std::memcpy(&multiples, weight_codes, kChunks);
  const __m512i unit = _mm512_set1_epi64(0x8040201008040201ull);  // byte j = 1 << j
  const __m512i nibble_shift = _mm512_set_epi32(28, 28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0);
  __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t g = 0; g < Layout::kGroups; ++g) {
    const __m512i cells = _mm512_gf2p8affine_epi64_epi8(unit, _mm512_permutex2var_epi8(magnitude_row, permute[g], sign_row), 0);
    __m512 sum = _mm512_mul_ps(_mm512_permutexvar_ps(cells, rq.signed_centres), rq.q[g][0]);
    sum = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(cells, 8), rq.signed_centres), rq.q[g][1], sum);
    sum = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(cells, 16), rq.signed_centres), rq.q[g][2], sum);
    sum = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(cells, 24), rq.signed_centres), rq.q[g][3], sum);
    const __m512i w = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<uint32_t>(multiples >> (32 * g))), nibble_shift),
        _mm512_set1_epi32(15));  // lane j: subspace 8g + j/2
    total = _mm512_fmadd_ps(sum, _mm512_cvtepi32_ps(w), total);
  }
  return total;
}
#else
// AVX2: one subspace (8 coordinates, bit j of its byte of the sign row and of each plane) per
// step. Lane j takes the word sign | plane 2 << 8 | plane 1 << 16 | plane 0 << 24 shifted
// right by j, masked to bits 0, 8, 16 and 24; times 0x08040201 that puts positive << 3 | cell
// in bits 24-27 (the product's four terms land on distinct bits: no carries). The 8-entry
// permute reads the cell from the index's low three bits, and the sign moved to bit 31 turns
// −centre into +centre.
struct RerankQuery {
  alignas(32) float weighted[16][128];  // [w][i]: w × the rotated query's coordinate i (0 past P)
  __m256 minus_centres;
};

RerankQuery rerank_query(const float* q, int64_t p, const float* centre) {
  RerankQuery rq;
  for (int w = 0; w < 16; ++w)
    for (int64_t i = 0; i < 128; ++i) rq.weighted[w][i] = i < p ? static_cast<float>(w) * q[i] : 0.0f;
  alignas(32) float table[8];
  for (int i = 0; i < 8; ++i) table[i] = -centre[i];
  rq.minus_centres = _mm256_load_ps(table);
  return rq;
}

// Σ_b Σ_{i in b} w_b q_i · ±centre[cell_i] for one row (the scale applied by the caller).
template <int64_t kChunks>
float row_estimate(const RerankQuery& rq, const uint8_t* signs, const uint8_t* record) {
  constexpr int64_t kPlaneBytes = 2 * kChunks;  // = B, one byte per subspace
  uint64_t multiples = 0;  // nibble b = w_b
  std::memcpy(&multiples, record + kMagnitudeBits * kPlaneBytes, kChunks);
  const __m256i shift = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), low_bits = _mm256_set1_epi32(0x01010101);
  const __m256i gather = _mm256_set1_epi32(0x08040201), sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256 total = _mm256_setzero_ps();
  for (int64_t b = 0; b < kPlaneBytes; ++b) {
    const uint32_t word = signs[b] | record[2 * kPlaneBytes + b] << 8 | record[kPlaneBytes + b] << 16 |
                          static_cast<uint32_t>(record[b]) << 24;
    const __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shift), low_bits);
    const __m256i code = _mm256_mullo_epi32(bits, gather);
    const __m256 level = _mm256_permutevar8x32_ps(rq.minus_centres, _mm256_srli_epi32(code, 24));
    const __m256 value = _mm256_xor_ps(level, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(code, 4), sign)));
    total = _mm256_fmadd_ps(value, _mm256_load_ps(rq.weighted[(multiples >> (4 * b)) & 15] + 8 * b), total);
  }
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

// Fetches row r's sign bytes and both ends of its record into L2. A function, not a lambda:
// GCC 12 at -O3 dropped every prefetch of a lambda written for this (check the object code).
inline void fetch_candidate(const uint8_t* signs, const uint8_t* records, int64_t n_sub, int64_t record_bytes,
                            int64_t r) {
  _mm_prefetch(reinterpret_cast<const char*>(signs + r * n_sub), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(records + r * record_bytes), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(records + (r + 1) * record_bytes - 1), _MM_HINT_T1);
}

ffi::Error rerank(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> signs, ffi::Buffer<ffi::U8> records,
                  ffi::Buffer<ffi::F32> q_rot, ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> centres,
                  ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = signs.dimensions(), qd = q_rot.dimensions(), rd = rows.dimensions();
  if (sd.size() < 2 || qd.size() != sd.size() - 1 || rd.size() != sd.size() - 1)
    return ffi::Error::InvalidArgument("pariskv_rerank: signs [..., cap, B], q_rot [..., P], rows [..., C]");
  const int64_t cap = sd[sd.size() - 2], n_sub = sd.back(), p = qd.back(), count = rd.back();
  const int64_t batch = product(sd, 0, sd.size() - 2), weight_bytes = (n_sub + 1) / 2;
  if (p != 8 * n_sub || (p != 16 && p != 32 && p != 64 && p != 128))
    return ffi::Error::InvalidArgument("pariskv_rerank: needs m = 8 and P in {16, 32, 64, 128}");
  const int64_t record_bytes = kMagnitudeBits * (p / 8) + weight_bytes + kScaleBytes;
  if (records.element_count() != batch * cap * record_bytes || q_norm.element_count() != batch ||
      centres.element_count() != batch * 8 || rows.element_count() != batch * count)
    return ffi::Error::InvalidArgument("pariskv_rerank: records [..., cap, 3P/8 + B/2 + 2] must match signs [..., cap, B]");
  std::vector<RerankQuery> queries(batch);
  for (int64_t h = 0; h < batch; ++h)
    queries[h] = rerank_query(q_rot.typed_data() + h * p, p, centres.typed_data() + h * 8);
  // Items of kRerankRows candidates of one head, split over the threads.
  constexpr int64_t kRerankRows = 512;
  const auto rerank_rows = [&](auto chunks) {
    // A record: the magnitude planes, the B/2 = kChunks weight bytes, the scale.
    constexpr int64_t kChunks = decltype(chunks)::value, kWeightsAt = kMagnitudeBits * 2 * kChunks,
                      kScaleAt = kWeightsAt + kChunks, kRecordBytes = kScaleAt + kScaleBytes;
#ifdef JAXKV_AVX512
    const __m512i permute[2] = {RowLayout<kChunks>::permute(0), RowLayout<kChunks>::permute(1)};
#endif
    parallel_chunks(pool, batch, count, kRerankRows, [&](int64_t h, int64_t begin, int64_t end) {
      const uint8_t* s = signs.typed_data() + h * cap * n_sub;
      const uint8_t* rec = records.typed_data() + h * cap * kRecordBytes;
      const int32_t* row = rows.typed_data() + h * count;
      float* est = out->typed_data() + h * count;
      const float norm = q_norm.typed_data()[h];
      // The rows are scattered over the index, in ascending order, too sparse for the
      // hardware prefetcher: a row's signs and both ends of its record are fetched into L2
      // kFar rows ahead. Not into L1 as well: those prefetches hold line fill buffers that
      // the misses from DRAM wait for. The item's first kFar rows are fetched before its
      // loop, or each item would read them from DRAM unfetched
      // (docs/results/implementation_notes.md, "CPU kernels").
      constexpr int64_t kFar = 48;
      const auto row_at = [&](int64_t i) { return std::clamp<int64_t>(row[i], 0, cap - 1); };
      for (int64_t i = begin; i < std::min(begin + kFar, end); ++i) fetch_candidate(s, rec, n_sub, kRecordBytes, row_at(i));
#ifdef JAXKV_AVX512
      for (int64_t first = begin; first < end; first += 16) {  // 16 rows summed at once
        __m512 partials[16];
        alignas(64) float scales[16];
#pragma GCC unroll 16
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t i = first + j;
          if (i >= end) {
            partials[j] = _mm512_setzero_ps(), scales[j] = 0.0f;
            continue;
          }
          if (i + kFar < end) fetch_candidate(s, rec, n_sub, kRecordBytes, row_at(i + kFar));
          const int64_t r = row_at(i);
          const uint8_t* record = rec + r * kRecordBytes;
          uint16_t scale_bits;
          std::memcpy(&scale_bits, record + kScaleAt, sizeof scale_bits);
          scales[j] = bf16_to_f32(scale_bits);
          partials[j] = row_partials<kChunks>(queries[h], permute, s + r * n_sub, record, record + kWeightsAt);
        }
        const __m512 estimates = _mm512_mul_ps(_mm512_mul_ps(sum_each(partials), _mm512_load_ps(scales)), _mm512_set1_ps(norm));
        _mm512_mask_storeu_ps(est + first, lanes_in_use(end - first), estimates);
      }
#else
      for (int64_t i = begin; i < end; ++i) {
        if (i + kFar < end) fetch_candidate(s, rec, n_sub, kRecordBytes, row_at(i + kFar));
        const int64_t r = row_at(i);
        const uint8_t* record = rec + r * kRecordBytes;
        uint16_t scale_bits;
        std::memcpy(&scale_bits, record + kScaleAt, sizeof scale_bits);
        est[i] = row_estimate<kChunks>(queries[h], s + r * n_sub, record) * bf16_to_f32(scale_bits) * norm;
      }
#endif
    }, /*linger=*/true);  // the final top-k follows
  };
  switch (p / 16) {  // 1, 2, 4 or 8, checked above
    case 1: rerank_rows(std::integral_constant<int64_t, 1>()); break;
    case 2: rerank_rows(std::integral_constant<int64_t, 2>()); break;
    case 4: rerank_rows(std::integral_constant<int64_t, 4>()); break;
    default: rerank_rows(std::integral_constant<int64_t, 8>()); break;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- final top-k

#ifdef JAXKV_AVX512
// descending_key of 16 values: the bits of a negative float as they are, of a positive one
// with the low 31 flipped.
inline __m512i descending_keys(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  return _mm512_xor_si512(bits, _mm512_andnot_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(0x7fffffff)));
}

// The positions of the values[C] whose key is <= bound, ascending, into out[C]; returns
// how many. 16 values at a time, compressed in a register and stored (no branch on the
// values; a compressing store to memory is microcoded on AMD's Zen 4).
int64_t positions_at_most(const float* values, int64_t c, uint32_t bound, int32_t* out) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0;
  for (int64_t i = 0; i < c; i += 16) {
    const __mmask16 lanes = lanes_in_use(c - i);
    const __m512i key = descending_keys(_mm512_maskz_loadu_ps(lanes, values + i));
    const __mmask16 kept = _mm512_mask_cmple_epu32_mask(lanes, key, _mm512_set1_epi32(static_cast<int>(bound)));
    const int n_kept = _mm_popcnt_u32(kept);
    const __m512i position = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_mask_storeu_epi32(out + n, static_cast<__mmask16>((1u << n_kept) - 1), _mm512_maskz_compress_epi32(kept, position));
    n += n_kept;
  }
  return n;
}
#else
// AVX2: one value at a time, its position written and kept or not (no branch on the values).
int64_t positions_at_most(const float* values, int64_t c, uint32_t bound, int32_t* out) {
  int64_t n = 0;
  for (int64_t i = 0; i < c; ++i) {
    out[n] = static_cast<int32_t>(i);
    n += descending_key(values[i]) <= bound;
  }
  return n;
}
#endif

// A key bound that about k + 3·sqrt(k·C/S) + 9·C/S of the C values meet (at least k nearly
// always): the quantile of a strided sample of S = min(1024, C/4) keys three standard
// deviations and 8 past k/C. Where that would keep half the values or more, or S < 64, the
// bound keeps every value: sorting them all is then cheaper than the sample.
uint32_t sampled_key_bound(const float* values, int64_t c, int64_t k) {
  constexpr int64_t kSample = 1024, kMinSample = 64;
  const int64_t size = std::min(kSample, c / 4);
  const double rank = static_cast<double>(k) * static_cast<double>(size) / static_cast<double>(c);
  const int64_t bound_rank = static_cast<int64_t>(rank + 3 * std::sqrt(rank) + 8);
  if (size < kMinSample || 2 * bound_rank >= size) return std::numeric_limits<uint32_t>::max();
  std::array<uint64_t, kSample> sample, spare;
  for (int64_t s = 0; s < size; ++s) sample[s] = descending_key(values[s * c / size]);
  const uint64_t* sorted = radix_sort(sample.data(), spare.data(), size, 0);
  return static_cast<uint32_t>(sorted[bound_rank]);
}

// Positions [k] of the k largest values[C], largest first, ties to the lower position:
// lax.top_k's answer for values without NaN (its total order: −0 below +0). The values
// whose keys are within a bound from a sample (or all of them, when fewer than k are) are
// radix sorted by key, stably: the first k are the answer. No branch depends on the values
// (a heap mispredicts on every step's fresh scores), and far less of a radix select over
// all C values (docs/results/implementation_notes.md, "CPU kernels").
void top_k_row(const float* values, int64_t c, int64_t k, int32_t* out) {
  std::unique_ptr<int32_t[]> kept(new int32_t[c]);
  int64_t n = positions_at_most(values, c, sampled_key_bound(values, c, k), kept.get());
  if (n < k) n = positions_at_most(values, c, std::numeric_limits<uint32_t>::max(), kept.get());
  std::vector<uint64_t> entry(n), spare(n);
  for (int64_t j = 0; j < n; ++j)
    entry[j] = static_cast<uint64_t>(descending_key(values[kept[j]])) << 32 | static_cast<uint64_t>(kept[j]);
  const uint64_t* sorted = radix_sort(entry.data(), spare.data(), n, 32);
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int32_t>(sorted[i]);
}

ffi::Error top_k(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> out) {
  const auto vd = values.dimensions(), od = out->dimensions();
  if (vd.size() < 1 || od.size() != vd.size())
    return ffi::Error::InvalidArgument("top_k: values [..., C], out [..., k]");
  const int64_t c = vd.back(), k = od.back(), batch = product(vd, 0, vd.size() - 1);
  if (k < 1 || k > c || product(od, 0, od.size() - 1) != batch)
    return ffi::Error::InvalidArgument("top_k: need 1 <= k <= C and the same batch axes");
  parallel_for(pool, batch,
               [&](int64_t h) { top_k_row(values.typed_data() + h * c, c, k, out->typed_data() + h * k); },
               /*linger=*/true);  // ParisKV attends the rows next
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopK, top_k,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PariskvCoarse, coarse,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PariskvRerank, rerank,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
