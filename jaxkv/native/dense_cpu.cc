// Dense attention of a decode step on the CPU, as an XLA FFI handler (jaxkv/native/__init__.py
// builds and registers it): models.prefix_causal_attention for one query per sequence, over one
// layer of a models.KVCache as it lies (each KV head's keys as columns [d, S], its values as
// rows [S, d]), float32 or bfloat16. A query at position p reads the keys 0..p only, where XLA
// reads every slot of the cache and masks the unseen ones.
//
// Why: XLA CPU's value contraction reads V well below the memory's stream rate
// (docs/results/implementation_notes.md, "CPU kernels"). Here both contractions stream:
// per block of 512 keys, the scores of up to four query heads are summed eight key columns at
// a time (block_scores says why), then the block's value rows are summed into each head's
// output, weighted. A block's scores stay in L1, its rows in L2.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAXKV_AVX512  // nothing of this file is built for AVX2 only (parallel.h)

namespace ffi = xla::ffi;

namespace {

using jaxkv_native::add_weighted_rows;
using jaxkv_native::bf16;
using jaxkv_native::exp_or_zero;
using jaxkv_native::lanes_in_use;
using jaxkv_native::load16;
using jaxkv_native::parallel_chunks;
using jaxkv_native::prefetch_lines;
using jaxkv_native::product;
using jaxkv_native::rows_of;
using jaxkv_native::rows_supported;

constexpr int64_t kTile = 64;  // keys whose score sums are in registers at once: 4 vectors per query head
constexpr int kMaxQueries = 4;  // query heads per pass: up to 16 score sums in registers
constexpr int64_t kBlock = 512;  // keys per softmax step: the group's scores [kQ, kBlock] stay in L1
constexpr int64_t kColumns = 8;  // key columns summed per pass over a block
// Keys per work item: a few items per KV head at 8k keys (both threads busy), few partials
// to merge at 1M.
constexpr int64_t kChunk = 2048;
// How far ahead of its reads the first pass over a block's value rows fetches them: the
// hardware prefetcher falls behind a stream read with arithmetic between the loads.
constexpr int64_t kValuesAheadBytes = 8192;

// A bfloat16 cache's elements are widened 32 at a time as two vectors, the even elements and
// the odd ones: a shift and a mask of one 64-byte load, where widening 16 in order takes a
// widening move and a shift (docs/results/implementation_notes.md, "CPU kernels"). Sums kept
// in that order are put back in order once per block (scores) or per pass (value sums).
// float32 rows are read in order.
template <typename Row>
constexpr bool kWidenedInPairs = std::is_same_v<Row, bf16>;

inline void widen_pair(const bf16* p, __m512& even, __m512& odd) {
  const __m512i bits = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 32 floats as (even, odd) halves stored at p in their order; in place; and loaded back.
inline void store_in_order(__m512 even, __m512 odd, float* p) {
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, low, odd));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(even, high, odd));
}
inline void pair_to_order(float* p) { store_in_order(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), p); }
inline void order_to_pair(const float* p, __m512& even, __m512& odd) {
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 first = _mm512_loadu_ps(p), second = _mm512_loadu_ps(p + 16);
  even = _mm512_permutex2var_ps(first, evens, second);
  odd = _mm512_permutex2var_ps(first, odds, second);
}

// One KV head's running softmax over some of its keys, unnormalised: o [G, d], l [G], m [G].
struct Partial {
  std::vector<float> o, l, m;
  Partial(int64_t heads, int64_t d)
      : o(heads * d, 0.0f), l(heads, 0.0f), m(heads, -std::numeric_limits<float>::infinity()) {}
};

template <typename Row>
struct Head {
  const float* q;   // [G, d]
  const Row* keys;  // [d, stride]: column s is key s
  const Row* values;  // [stride, d]
  int64_t heads, d, stride;
  int64_t visible;  // the keys attended: [0, visible)
  float scale;
};

// Query heads [g0, g0 + kQ) over keys [t0, t0 + count), count <= kBlock: their scaled scores
// into score [kQ, kBlock], -inf past count. The sums go kColumns key columns at a time over the
// whole block: a cache's columns lie S elements apart (a power of two in the benchmark's
// caches), so a tile's d column pieces share a few cache sets; kColumns of them at a time
// stay within the sets' ways, and each column is read as a run of kBlock keys. Each tile
// fetches the same tile of the next kColumns columns (of the next block's first ones, after
// the last), so the reads run a group of columns ahead of the sums.
template <int kQ, typename Row>
void block_scores(const Head<Row>& h, int64_t g0, int64_t t0, int64_t count, float* score) {
  const float* q = h.q + g0 * h.d;
  for (int64_t c0 = 0; c0 < h.d; c0 += kColumns) {
    const int64_t c1 = std::min(c0 + kColumns, h.d);
    for (int64_t j0 = 0; j0 < count; j0 += kTile) {
      __mmask16 part[4];
      for (int u = 0; u < 4; ++u) part[u] = lanes_in_use(count - j0 - 16 * u);
      const bool whole = count - j0 >= kTile;
      __m512 sum[kQ][4];
      for (int g = 0; g < kQ; ++g)
        for (int u = 0; u < 4; ++u)
          sum[g][u] = c0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(score + g * kBlock + j0 + 16 * u);
      const bool last_group = c0 + kColumns >= h.d;
      const int64_t next_t = t0 + j0 + (last_group ? kBlock : 0);
      for (int64_t i = c0; i < c1; ++i) {
        const Row* column = h.keys + i * h.stride + t0 + j0;
        const int64_t next_i = last_group ? i - c0 : i + kColumns;
        if (next_i < h.d && next_t < h.visible) {
          const Row* next = h.keys + next_i * h.stride + next_t;
          prefetch_lines(next, next + std::min(kTile, h.visible - next_t));
        }
        __m512 k[4];
        if (!whole) {
          for (int u = 0; u < 4; ++u) k[u] = load16(column + 16 * u, part[u]);
        } else if constexpr (kWidenedInPairs<Row>) {
          widen_pair(column, k[0], k[1]);
          widen_pair(column + 32, k[2], k[3]);
        } else {
          for (int u = 0; u < 4; ++u) k[u] = load16(column + 16 * u);
        }
        for (int g = 0; g < kQ; ++g) {
          const __m512 qi = _mm512_set1_ps(q[g * h.d + i]);
          for (int u = 0; u < 4; ++u) sum[g][u] = _mm512_fmadd_ps(qi, k[u], sum[g][u]);
        }
      }
      for (int g = 0; g < kQ; ++g)
        for (int u = 0; u < 4; ++u) _mm512_store_ps(score + g * kBlock + j0 + 16 * u, sum[g][u]);
    }
  }
  if constexpr (kWidenedInPairs<Row>)  // whole tiles summed the even keys, then the odd ones
    for (int g = 0; g < kQ; ++g)
      for (int64_t j0 = 0; j0 + kTile <= count; j0 += kTile)
        for (int64_t half = 0; half < kTile; half += 32) pair_to_order(score + g * kBlock + j0 + half);
  const __m512 scale = _mm512_set1_ps(h.scale), unseen = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < kQ; ++g)
    for (int64_t j = 0; j < count; j += 16) {
      float* s = score + g * kBlock + j;
      _mm512_store_ps(s, _mm512_mask_blend_ps(lanes_in_use(count - j), unseen, _mm512_load_ps(s) * scale));
    }
}

// Query heads [g0, g0 + kN) add their weights [kN, kBlock] times the value rows [t0, t0 + count)
// to their sums in out.o, 16 * kV coordinates of each row at a time (all of a row for d <= 16 * kV),
// the kN x kV sums in registers (add_weighted_rows). Whole rows per pass keep the rows a stream
// of contiguous lines (docs/results/implementation_notes.md, "CPU kernels"). The block's first
// pass (fetch_ahead) fetches the rows kValuesAheadBytes ahead; the later passes find the
// block's rows in L2. That fetch is in load_row, a lambda: GCC 12 keeps it there, though it
// dropped every prefetch of a lambda in pariskv_cpu.cc's rerank: check the object code when
// changing it.
template <int kN, int kV, typename Row>
void add_value_rows(const Head<Row>& h, int64_t g0, int64_t t0, int64_t count, const float* weight, Partial& out,
                    bool fetch_ahead) {
  const int64_t rows_ahead = std::max<int64_t>(1, kValuesAheadBytes / (h.d * static_cast<int64_t>(sizeof(Row))));
  static_assert(kV % 2 == 0);
  for (int64_t i0 = 0; i0 < h.d; i0 += 16 * kV) {
    __mmask16 part[kV];
    for (int u = 0; u < kV; ++u) part[u] = lanes_in_use(h.d - i0 - 16 * u);
    // A slice of whole vectors of a bfloat16 row is widened in pairs, its sums in pair order.
    const bool pairs = kWidenedInPairs<Row> && i0 + 16 * kV <= h.d;
    __m512 sum[kN][kV];
    for (int g = 0; g < kN; ++g) {
      const float* o = out.o.data() + (g0 + g) * h.d + i0;
      if (pairs) {
        for (int u = 0; u < kV; u += 2) order_to_pair(o + 16 * u, sum[g][u], sum[g][u + 1]);
      } else {
        for (int u = 0; u < kV; ++u) sum[g][u] = _mm512_maskz_loadu_ps(part[u], o + 16 * u);
      }
    }
    const auto load_row = [&](int64_t j, __m512 (&row)[kV]) {
      const Row* v = h.values + (t0 + j) * h.d + i0;
      if (fetch_ahead && i0 == 0 && t0 + j + rows_ahead < h.visible) {
        const Row* later = h.values + (t0 + j + rows_ahead) * h.d;
        prefetch_lines(later, later + h.d);
      }
      if (pairs) {
        if constexpr (kWidenedInPairs<Row>)
          for (int u = 0; u < kV; u += 2) widen_pair(v + 16 * u, row[u], row[u + 1]);
      } else {
        for (int u = 0; u < kV; ++u) row[u] = load16(v + 16 * u, part[u]);
      }
    };
    add_weighted_rows<kN, kV, /*kSkipUnweighted=*/false>(sum, count, weight, kBlock, load_row);
    for (int g = 0; g < kN; ++g) {
      float* o = out.o.data() + (g0 + g) * h.d + i0;
      if (pairs) {
        for (int u = 0; u < kV; u += 2) store_in_order(sum[g][u], sum[g][u + 1], o + 16 * u);
      } else {
        for (int u = 0; u < kV; ++u) _mm512_mask_storeu_ps(o + 16 * u, part[u], sum[g][u]);
      }
    }
  }
}

// The value rows of a block into the sums of query heads [g0, g0 + kQ), as many heads per pass
// as keep 16 sums in registers. The first pass of the first group (g0 = 0) reads the rows from DRAM.
template <int kQ, int kV, typename Row>
void add_values(const Head<Row>& h, int64_t g0, int64_t t0, int64_t count, const float* weight, Partial& out) {
  constexpr int kN = std::min(kQ, 16 / kV);
  for (int g = 0; g + kN <= kQ; g += kN)
    add_value_rows<kN, kV>(h, g0 + g, t0, count, weight + g * kBlock, out, g0 == 0 && g == 0);
  if constexpr (kQ % kN != 0)
    add_value_rows<kQ % kN, kV>(h, g0 + kQ - kQ % kN, t0, count, weight + (kQ - kQ % kN) * kBlock, out, false);
}

// Query heads [g0, g0 + kQ) take keys [t0, t0 + count) into their partial: the running max
// moves to the block's, the sums are rescaled to it, and each head adds its weights and its
// weights times the block's value rows.
template <int kQ, typename Row>
void add_block(const Head<Row>& h, int64_t g0, int64_t t0, int64_t count, Partial& out) {
  alignas(64) float weight[kQ * kBlock];
  block_scores<kQ>(h, g0, t0, count, weight);
  const int64_t lanes = (count + 15) / 16 * 16;
  for (int g = 0; g < kQ; ++g) {
    float* w = weight + g * kBlock;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < lanes; j += 16) top = _mm512_max_ps(top, _mm512_load_ps(w + j));
    const float m_old = out.m[g0 + g], m_new = std::max(m_old, _mm512_reduce_max_ps(top));
    const float rescale = std::exp(m_old - m_new);  // 0 while nothing was added (m_old = -inf)
    out.m[g0 + g] = m_new;
    const __m512 m = _mm512_set1_ps(m_new);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < lanes; j += 16) {
      const __m512 p = exp_or_zero(_mm512_load_ps(w + j) - m);
      _mm512_store_ps(w + j, p);
      total = total + p;
    }
    out.l[g0 + g] = out.l[g0 + g] * rescale + _mm512_reduce_add_ps(total);
    float* o = out.o.data() + (g0 + g) * h.d;
    for (int64_t i = 0; i < h.d; ++i) o[i] *= rescale;
  }
  const int64_t vectors = (h.d + 15) / 16;  // per value row
  if (vectors <= 4) {
    add_values<kQ, 4>(h, g0, t0, count, weight, out);
  } else if (vectors <= 8) {
    add_values<kQ, 8>(h, g0, t0, count, weight, out);
  } else {
    add_values<kQ, 16>(h, g0, t0, count, weight, out);
  }
}

// Keys [begin, end) of one KV head into its partial, block by block, query heads kMaxQueries at a time.
template <typename Row>
void add_keys(const Head<Row>& h, int64_t begin, int64_t end, Partial& out) {
  for (int64_t t0 = begin; t0 < end; t0 += kBlock) {
    const int64_t count = std::min(kBlock, end - t0);
    for (int64_t g0 = 0; g0 < h.heads; g0 += kMaxQueries) {
      switch (std::min<int64_t>(h.heads - g0, kMaxQueries)) {
        case 1: add_block<1>(h, g0, t0, count, out); break;
        case 2: add_block<2>(h, g0, t0, count, out); break;
        case 3: add_block<3>(h, g0, t0, count, out); break;
        default: add_block<4>(h, g0, t0, count, out); break;
      }
    }
  }
}

// Every (batch entry, chunk of keys) on the threads, then per head the chunks' partials merged
// in order and normalised into out [batch, G, d] (0 for a head that saw no key).
template <typename Row>
void attend_heads(ffi::ThreadPool& pool, const std::vector<Head<Row>>& work,
                  int64_t heads_per_entry, int64_t d, int64_t capacity, float* out) {
  const int64_t batch = static_cast<int64_t>(work.size()), chunks = (capacity + kChunk - 1) / kChunk;
  std::vector<Partial> parts(batch * chunks, Partial(heads_per_entry, d));
  parallel_chunks(pool, batch, capacity, kChunk, [&](int64_t b, int64_t begin, int64_t end) {
    const Head<Row>& head = work[b];
    if (begin < head.visible) add_keys(head, begin, std::min(end, head.visible), parts[b * chunks + begin / kChunk]);
  });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < heads_per_entry; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, parts[b * chunks + c].m[g]);
      float* o = out + (b * heads_per_entry + g) * d;
      std::fill(o, o + d, 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial& part = parts[b * chunks + c];
        if (part.l[g] == 0.0f) continue;
        const float factor = std::exp(part.m[g] - top);
        for (int64_t i = 0; i < d; ++i) o[i] += factor * part.o[g * d + i];
        total += factor * part.l[g];
      }
      if (total > 0.0f)
        for (int64_t i = 0; i < d; ++i) o[i] /= total;
    }
}

// q float32 [..., H, G, d]; keys [..., H, d, S] and values [..., H, S, d], both float32 or both
// bfloat16 (or its bits as uint16, as a models.KVCache stores it); visible int32 [...]: the
// keys each batch entry attends (its query's position + 1).
// out float32 [..., H, G, d]: the softmax-weighted sum of the visible values, by 1/sqrt(d)-scaled
// scores.
ffi::Error dense_decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                        ffi::Buffer<ffi::S32> visible, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() < 3 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("dense_decode: q [..., H, G, d], keys [..., H, d, S]");
  if (!rows_supported(keys, values))
    return ffi::Error::InvalidArgument("dense_decode: keys and values both float32, bfloat16 or "
                                       "bfloat16 bits (uint16)");
  const int64_t kv_heads = qd[qd.size() - 3], heads = qd[qd.size() - 2], d = qd.back(), capacity = kd.back();
  const int64_t entries = product(qd, 0, qd.size() - 3);
  if (kd[kd.size() - 3] != kv_heads || kd[kd.size() - 2] != d ||
      static_cast<int64_t>(keys.element_count()) != entries * kv_heads * d * capacity ||
      static_cast<int64_t>(values.element_count()) != entries * kv_heads * capacity * d ||
      visible.element_count() != entries || out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument("dense_decode: keys [..., H, d, S], values [..., H, S, d], visible [...], "
                                       "out like q [..., H, G, d]");
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const auto run = [&](auto row) {
    using Row = decltype(row);
    std::vector<Head<Row>> work(entries * kv_heads);  // one per (batch entry, KV head)
    for (int64_t e = 0; e < entries * kv_heads; ++e)
      work[e] = {q.typed_data() + e * heads * d, rows_of<Row>(keys) + e * d * capacity,
                 rows_of<Row>(values) + e * capacity * d, heads, d, capacity,
                 std::clamp<int64_t>(visible.typed_data()[e / kv_heads], 0, capacity), scale};
    attend_heads(pool, work, heads, d, capacity, out->typed_data());
  };
  keys.element_type() == ffi::DataType::F32 ? run(float{}) : run(bf16{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DenseDecode, dense_decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#endif  // JAXKV_AVX512
