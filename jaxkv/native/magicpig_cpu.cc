// MagicPIG's sampling on the CPU as XLA FFI handlers (jaxkv/native/__init__.py builds
// and registers them). They compute what jaxkv.attention.magicpig computes in XLA, exactly:
//   - magicpig_query_buckets: a query group's codes (a bit may differ from XLA's where its
//     product is within float32 rounding of 0), and how many tables each head reads and
//     their entries (select_with_stats's tables_used and entries_read);
//   - magicpig_collide: the sampled keys of a query group (select_with_stats's hits, their
//     union's lowest C ids and each head's membership) from the buckets it reads;
//   - magicpig_merge: insert's merge of new keys into every table's sorted id list;
//   - magicpig_attend: the partial over the sampled rows, the importance correction
//     (collision_log_prob) included: cache._attend_rows's (o, l, m) up to float32 rounding;
//   - attend_rows: the same kernel without a correction, for any method's selected rows
//     (ParisKV's top-k).
// XLA CPU works over static capacities: a query head's hits come from candidate_entries
// (N/2) slots and a histogram over all N keys, whatever its buckets hold, and a merge
// gathers every slot of every table. Here a head reads only the entries of its buckets
// and a merge moves each table's entries once, in place. XLA gathers the sampled K and V
// rows into copies and evaluates the correction for every (query head, slot); here each
// row is read in place (from host memory too: on the CPU it is the same memory) and the
// correction is evaluated for the pairs a head sampled only. Every leading axis of the
// arguments is a batch axis (vmap: broadcast_all; expand_dims for magicpig_query_buckets,
// whose shared projection then stays one matrix).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
using jaxkv_native::parallel_for;
using jaxkv_native::prefetch_lines;
using jaxkv_native::rows_of;
using jaxkv_native::rows_supported;
using jaxkv_native::product;
using jaxkv_native::sum_each;

// The bucket of `code`, clamped to the table's n_buckets.
int64_t bucket_of(int32_t code, int64_t n_buckets) { return std::clamp<int64_t>(code, 0, n_buckets - 1); }

// Where table t's bucket of `code` starts, in the tables' starts [L, n_buckets + 1].
const int32_t* bucket_start(const int32_t* starts, int64_t t, int64_t n_buckets, int32_t code) {
  return starts + t * (n_buckets + 1) + bucket_of(code, n_buckets);
}

// The bucket [lo, hi) of `code` in one table's starts[n_buckets + 1], clamped to the id list.
std::pair<int64_t, int64_t> bucket_range(const int32_t* starts, int64_t n_buckets, int32_t code, int64_t cap) {
  const int64_t b = bucket_of(code, n_buckets);
  const int64_t lo = std::clamp<int64_t>(starts[b], 0, cap);
  return {lo, std::clamp<int64_t>(starts[b + 1], lo, cap)};
}

// ---------------------------------------------------------------- query buckets

// The SimHash codes of all `n_queries` rows of x [n_queries, d] against projection
// [d, k_bits * n_tables]: code[q, t] bit j = [x_q . R[:, t * k_bits + j] > 0]. A tile of
// kQueries queries by kBlocks blocks of 16 columns keeps its kQueries * kBlocks sums in
// registers (independent FMA chains) and reads the projection once per kQueries queries. Each
// product is summed over d in order in float32 (XLA's order may differ, so the sign of a
// product within rounding of 0 may differ from XLA's).
void simhash_codes(ffi::ThreadPool& pool, const float* x, int64_t n_queries, int64_t d, const float* projection,
                   int64_t k_bits, int64_t n_tables, int32_t* codes) {
  constexpr int kQueries = 3, kBlocks = 3, kLanes = 16, kTilesPerItem = 8;
  const int64_t columns = k_bits * n_tables, blocks = (columns + kLanes - 1) / kLanes + 4;  // + 8 bytes for the reads below
  const int64_t tiles = (columns + kBlocks * kLanes - 1) / (kBlocks * kLanes);
  // positive[q * blocks + c / 16] bit c % 16 = [x_q . R[:, c] > 0]
  std::vector<uint16_t> positive(n_queries * blocks, 0);
  // Items of kTilesPerItem column tiles, for the helper the pool starts tens of us late.
  parallel_for(pool, (tiles + kTilesPerItem - 1) / kTilesPerItem, [&](int64_t item) {
    const int64_t c_end = std::min(columns, (item + 1) * kTilesPerItem * kBlocks * kLanes);
    for (int64_t q0 = 0; q0 < n_queries; q0 += kQueries) {
      const float* rows[kQueries];  // past the last query: the last again, its signs not kept
      for (int k = 0; k < kQueries; ++k) rows[k] = x + std::min(q0 + k, n_queries - 1) * d;
      for (int64_t c0 = item * kTilesPerItem * kBlocks * kLanes; c0 < c_end; c0 += kBlocks * kLanes) {
        __mmask16 live[kBlocks];
        for (int b = 0; b < kBlocks; ++b) {
          const int64_t left = std::clamp<int64_t>(columns - c0 - b * kLanes, 0, kLanes);
          live[b] = static_cast<__mmask16>((uint32_t{1} << left) - 1);
        }
        __m512 sums[kQueries][kBlocks];
        for (int k = 0; k < kQueries; ++k)
          for (int b = 0; b < kBlocks; ++b) sums[k][b] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
          __m512 row[kBlocks];
          for (int b = 0; b < kBlocks; ++b) row[b] = _mm512_maskz_loadu_ps(live[b], projection + i * columns + c0 + b * kLanes);
          for (int k = 0; k < kQueries; ++k) {
            const __m512 xi = _mm512_set1_ps(rows[k][i]);
            for (int b = 0; b < kBlocks; ++b) sums[k][b] = _mm512_fmadd_ps(xi, row[b], sums[k][b]);
          }
        }
        for (int k = 0; k < kQueries && q0 + k < n_queries; ++k)
          for (int b = 0; b < kBlocks; ++b)
            positive[(q0 + k) * blocks + c0 / kLanes + b] =
                _mm512_mask_cmp_ps_mask(live[b], sums[k][b], _mm512_setzero_ps(), _CMP_GT_OQ);
      }
    }
  }, /*linger=*/true);  // the collide kernel follows
  // Table t's code is bits [t * k_bits, (t + 1) * k_bits) of a query's signs (k_bits <= 30:
  // within the 8 bytes read at the byte holding the first).
  const uint32_t code_mask = (uint32_t{1} << k_bits) - 1;
  for (int64_t q = 0; q < n_queries; ++q) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(positive.data() + q * blocks);
    for (int64_t t = 0; t < n_tables; ++t) {
      const int64_t bit = t * k_bits;
      uint64_t word;
      std::memcpy(&word, bytes + bit / 8, sizeof(word));
      codes[q * n_tables + t] = static_cast<int32_t>((word >> (bit % 8)) & code_mask);
    }
  }
}

// One query head's tables read and their entries (magicpig._code_buckets's tables_used and
// _entries_read): tables in order while the running total of its bucket sizes is at most
// `limit`. All of the head's bucket starts are fetched first, so their misses (a random DRAM
// line per table) overlap. Every table is counted, as in XLA (the running total only grows,
// so the tables counted are the prefix that fits).
std::pair<int32_t, int32_t> tables_read(const int32_t* starts, int64_t n_buckets, const int32_t* codes,
                                        int64_t n_tables, int64_t limit) {
  for (int64_t t = 0; t < n_tables; ++t) {
    const int32_t* start = bucket_start(starts, t, n_buckets, codes[t]);
    prefetch_lines(start, start + 2);
  }
  int64_t running = 0, tables = 0, read = 0;
  for (int64_t t = 0; t < n_tables; ++t) {
    const int32_t* start = bucket_start(starts, t, n_buckets, codes[t]);
    running += start[1] - start[0];
    if (running <= limit) ++tables, read = running;
  }
  return {static_cast<int32_t>(tables), static_cast<int32_t>(read)};
}

// magicpig.select_with_stats's first steps for a query group q [..., G, d]: its codes
// (hash_codes with the projection [..., d, K * L]), then per head the tables read and their
// entries in the index's bucket_starts [..., L, 2^K + 1]. The projection's and the starts'
// batch is q's or 1 (one for all: vmap's expand_dims leaves the shared projection whole).
// XLA takes a YNNPACK product, a bit packing, two gathers of starts and a running sum for
// this (docs/results/implementation_notes.md, "CPU kernels").
ffi::Error query_buckets(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> projection, ffi::Buffer<ffi::S32> bucket_starts,
                         int64_t k_bits, int64_t limit, ffi::ResultBuffer<ffi::S32> codes,
                         ffi::ResultBuffer<ffi::S32> tables_used, ffi::ResultBuffer<ffi::S32> entries_read) {
  const auto qd = q.dimensions(), pd = projection.dimensions(), sd = bucket_starts.dimensions();
  if (qd.size() < 2 || pd.size() != qd.size() || sd.size() != qd.size())
    return ffi::Error::InvalidArgument("magicpig_query_buckets: q [..., G, d], projection [..., d, K*L], "
                                       "bucket_starts [..., L, 2^K + 1] of the same rank");
  const int64_t n_heads = qd[qd.size() - 2], d = qd.back(), batch = product(qd, 0, qd.size() - 2);
  const int64_t n_tables = sd[sd.size() - 2], n_buckets = sd.back() - 1;
  const int64_t matrix = d * k_bits * n_tables, table_starts = n_tables * (n_buckets + 1);
  const bool one_projection = projection.element_count() == matrix, one_index = bucket_starts.element_count() == table_starts;
  if (k_bits < 1 || k_bits > 30 || n_buckets != (int64_t{1} << k_bits) || pd[pd.size() - 2] != d ||
      pd.back() != k_bits * n_tables || (!one_projection && projection.element_count() != batch * matrix) ||
      (!one_index && bucket_starts.element_count() != batch * table_starts) ||
      codes->element_count() != batch * n_heads * n_tables || tables_used->element_count() != batch * n_heads ||
      entries_read->element_count() != batch * n_heads)
    return ffi::Error::InvalidArgument("magicpig_query_buckets: projection [..., d, K*L] and bucket_starts "
                                       "[..., L, 2^K + 1] with q's batch or 1; codes [..., G, L], tables_used and "
                                       "entries_read [..., G]");
  if (one_projection) {
    simhash_codes(pool, q.typed_data(), batch * n_heads, d, projection.typed_data(), k_bits, n_tables, codes->typed_data());
  } else {
    for (int64_t b = 0; b < batch; ++b)
      simhash_codes(pool, q.typed_data() + b * n_heads * d, n_heads, d, projection.typed_data() + b * matrix, k_bits,
                    n_tables, codes->typed_data() + b * n_heads * n_tables);
  }
  for (int64_t item = 0; item < batch * n_heads; ++item) {
    const int64_t b = one_index ? 0 : item / n_heads;
    const auto [tables, read] = tables_read(bucket_starts.typed_data() + b * table_starts, n_buckets,
                                            codes->typed_data() + item * n_tables, n_tables, limit);
    tables_used->typed_data()[item] = tables;
    entries_read->typed_data()[item] = read;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- collide

// One query head: bit i of `sampled` (cap bits, zeroed here) is set iff key i occurs in at
// least min_hits of the buckets of the first `tables` tables. An id occurs at most once per
// table, so its hit count is its number of occurrences. For min_hits <= 2 (the paper's
// rule) a bitmap of the ids seen once is count enough: cap / 8 bytes, 32 KB at 256k keys and
// mostly in L1. Higher thresholds count in `hits` (cap entries, all zero on entry and on
// return), the bit set when a count reaches min_hits; its 16-bit counters (512 KB at 256k)
// wait on L2 for every entry and take a second pass to clear. Returns the number of sampled
// keys.
int64_t sample_head(const int32_t* ids, const int32_t* starts, const int32_t* codes, int64_t tables,
                    int64_t cap, int64_t n_buckets, int64_t min_hits, uint16_t* hits, uint64_t* sampled) {
  const int64_t words = (cap + 63) / 64;
  std::memset(sampled, 0, words * sizeof(uint64_t));
  // A table's bucket start and its first entries are a random line each, usually from
  // DRAM: read table after table, each table waits for two misses. All starts are fetched
  // first, then the head of every bucket (the hardware prefetcher follows a long one), so
  // the misses of all tables overlap.
  constexpr int64_t kEntriesAhead = 64;  // four cache lines of ids
  for (int64_t t = 0; t < tables; ++t) {
    const int32_t* start = bucket_start(starts, t, n_buckets, codes[t]);
    prefetch_lines(start, start + 1);
  }
  thread_local std::vector<std::pair<int64_t, int64_t>> ranges;
  ranges.resize(tables);
  for (int64_t t = 0; t < tables; ++t) {
    ranges[t] = bucket_range(starts + t * (n_buckets + 1), n_buckets, codes[t], cap);
    const int32_t* table = ids + t * cap;
    prefetch_lines(table + ranges[t].first, table + std::min(ranges[t].second, ranges[t].first + kEntriesAhead));
  }
  const auto for_each_entry = [&](const auto& fn) {
    for (int64_t t = 0; t < tables; ++t) {
      const int32_t* table = ids + t * cap;
      for (int64_t e = ranges[t].first; e < ranges[t].second; ++e) fn(std::clamp<int64_t>(table[e], 0, cap - 1));
    }
  };
  if (min_hits <= 2) {
    thread_local std::vector<uint64_t> seen;
    seen.assign(words, 0);
    for_each_entry([&](int64_t id) {
      const uint64_t bit = uint64_t{1} << (id & 63);
      uint64_t& seen_once = seen[id >> 6];
      sampled[id >> 6] |= min_hits == 1 ? bit : seen_once & bit;
      seen_once |= bit;
    });
  } else {
    for_each_entry([&](int64_t id) {
      const int64_t count = ++hits[id];
      sampled[id >> 6] |= static_cast<uint64_t>(count == min_hits) << (id & 63);  // no branch on the count
    });
    for_each_entry([&](int64_t id) { hits[id] = 0; });
  }
  int64_t total = 0;
  for (int64_t w = 0; w < words; ++w) total += __builtin_popcountll(sampled[w]);
  return total;
}

// The lowest `capacity` ids of the union of the G heads' bitmaps, ascending, into idx (0
// past the union) and mask[g, c] = whether head g sampled idx[c] (false past the union).
// Returns the size of the whole union.
int64_t union_of_heads(const uint64_t* sampled, int64_t n_heads, int64_t words, int64_t capacity, int32_t* idx,
                       bool* mask) {
  int64_t total = 0;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t any = 0;
    for (int64_t g = 0; g < n_heads; ++g) any |= sampled[g * words + w];
    for (; any != 0 && total < capacity; any &= any - 1, ++total) {
      const int64_t id = w * 64 + __builtin_ctzll(any);
      idx[total] = static_cast<int32_t>(id);
      for (int64_t g = 0; g < n_heads; ++g) mask[g * capacity + total] = (sampled[g * words + w] >> (id & 63)) & 1;
    }
    total += __builtin_popcountll(any);  // the union's ids past the capacity
  }
  const int64_t filled = std::min(total, capacity);
  std::fill(idx + filled, idx + capacity, 0);
  for (int64_t g = 0; g < n_heads; ++g) std::fill(mask + g * capacity + filled, mask + (g + 1) * capacity, false);
  return total;
}

ffi::Error collide(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> bucket_starts,
                   ffi::Buffer<ffi::S32> codes, ffi::Buffer<ffi::S32> tables_used, int64_t min_hits,
                   ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::PRED> mask,
                   ffi::ResultBuffer<ffi::S32> n_sampled, ffi::ResultBuffer<ffi::S32> n_union) {
  const auto id_dims = sorted_ids.dimensions(), code_dims = codes.dimensions();
  if (id_dims.size() < 2 || code_dims.size() != id_dims.size())
    return ffi::Error::InvalidArgument("magicpig_collide: sorted_ids [..., L, cap], codes [..., G, L]");
  const int64_t n_tables = id_dims[id_dims.size() - 2], cap = id_dims.back(), batch = product(id_dims, 0, id_dims.size() - 2);
  const int64_t n_heads = code_dims[code_dims.size() - 2], capacity = idx->dimensions().back();
  const int64_t n_buckets = bucket_starts.dimensions().back() - 1, words = (cap + 63) / 64;
  if (code_dims.back() != n_tables || n_buckets < 1 || bucket_starts.element_count() != batch * n_tables * (n_buckets + 1) ||
      codes.element_count() != batch * n_heads * n_tables || tables_used.element_count() != batch * n_heads ||
      idx->element_count() != batch * capacity || mask->element_count() != batch * n_heads * capacity ||
      n_sampled->element_count() != batch * n_heads || n_union->element_count() != batch)
    return ffi::Error::InvalidArgument("magicpig_collide: starts [..., L, 2^K + 1], tables_used [..., G], "
                                       "idx [..., C], mask [..., G, C], n_sampled [..., G], n_union [...]");
  if (min_hits < 1 || min_hits > n_tables) return ffi::Error::InvalidArgument("magicpig_collide: need 1 <= min_hits <= L");
  std::vector<uint64_t> sampled(batch * n_heads * words);
  parallel_for(pool, batch * n_heads, [&](int64_t item) {
    thread_local std::vector<uint16_t> hits;  // zero between calls: sample_head leaves it so
    if (min_hits > 2 && static_cast<int64_t>(hits.size()) < cap) hits.assign(cap, 0);
    const int64_t b = item / n_heads;
    const int64_t tables = std::clamp<int64_t>(tables_used.typed_data()[item], 0, n_tables);
    n_sampled->typed_data()[item] = static_cast<int32_t>(
        sample_head(sorted_ids.typed_data() + b * n_tables * cap, bucket_starts.typed_data() + b * n_tables * (n_buckets + 1),
                    codes.typed_data() + item * n_tables, tables, cap, n_buckets, min_hits, hits.data(),
                    sampled.data() + item * words));
  }, /*linger=*/true);
  parallel_for(pool, batch, [&](int64_t b) {
    n_union->typed_data()[b] = static_cast<int32_t>(
        union_of_heads(sampled.data() + b * n_heads * words, n_heads, words, capacity, idx->typed_data() + b * capacity,
                       mask->typed_data() + b * n_heads * capacity));
  }, /*linger=*/true);  // the attend kernel follows
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- merge

// Whether a new key's code puts it in a bucket (code n_buckets marks a row not inserted).
bool inserted(int32_t code, int64_t n_buckets) { return code >= 0 && code < n_buckets; }

// One table: new keys n, n+1, ... with codes[j * stride] (n_buckets marks an unused row)
// land after the old entries of their bucket, in id order; every old entry moves right by
// the new keys in smaller buckets. Buckets are moved from the last down, so a move never
// overwrites an entry not yet moved. starts [n_buckets + 1] is updated in place.
void merge_table(int32_t* ids, int32_t* starts, const int32_t* codes, int64_t stride, int64_t n_new, int64_t n,
                 int64_t n_buckets) {
  std::vector<int32_t> landed(n_buckets + 1, 0);  // landed[b + 1]: new keys in bucket b
  for (int64_t j = 0; j < n_new; ++j) {
    const int32_t code = codes[j * stride];
    if (inserted(code, n_buckets)) ++landed[code + 1];
  }
  for (int64_t b = 0; b < n_buckets; ++b) landed[b + 1] += landed[b];  // landed[b]: in buckets < b
  std::vector<int32_t> order(landed[n_buckets]);  // new keys by bucket, in id order
  std::vector<int32_t> next(landed.begin(), landed.end() - 1);
  for (int64_t j = 0; j < n_new; ++j) {
    const int32_t code = codes[j * stride];
    if (inserted(code, n_buckets)) order[next[code]++] = static_cast<int32_t>(n + j);
  }
  for (int64_t b = n_buckets - 1; b >= 0 && landed[b + 1] > 0; --b) {
    const int64_t lo = starts[b], size = starts[b + 1] - lo, shift = landed[b];
    if (shift > 0) std::memmove(ids + lo + shift, ids + lo, size * sizeof(int32_t));
    std::copy(order.begin() + landed[b], order.begin() + landed[b + 1], ids + lo + shift + size);
  }
  for (int64_t b = 0; b <= n_buckets; ++b) starts[b] += landed[b];
}

ffi::Error merge(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> bucket_starts,
                 ffi::Buffer<ffi::S32> new_codes, ffi::Buffer<ffi::S32> n, ffi::ResultBuffer<ffi::S32> ids_out,
                 ffi::ResultBuffer<ffi::S32> starts_out) {
  const auto id_dims = sorted_ids.dimensions(), code_dims = new_codes.dimensions();
  if (id_dims.size() < 2 || code_dims.size() != id_dims.size())
    return ffi::Error::InvalidArgument("magicpig_merge: sorted_ids [..., L, cap], new_codes [..., U, L]");
  const int64_t n_tables = id_dims[id_dims.size() - 2], cap = id_dims.back(), batch = product(id_dims, 0, id_dims.size() - 2);
  const int64_t n_new = code_dims[code_dims.size() - 2], n_buckets = bucket_starts.dimensions().back() - 1;
  if (code_dims.back() != n_tables || n_buckets < 1 || bucket_starts.element_count() != batch * n_tables * (n_buckets + 1) ||
      new_codes.element_count() != batch * n_new * n_tables || n.element_count() != batch)
    return ffi::Error::InvalidArgument("magicpig_merge: bucket_starts [..., L, 2^K + 1], n [...]");
  for (int64_t b = 0; b < batch; ++b) {  // refused before anything is written: no table may overflow
    const int32_t* starts = bucket_starts.typed_data() + b * n_tables * (n_buckets + 1);
    for (int64_t t = 0; t < n_tables; ++t) {
      int64_t live = 0;
      for (int64_t j = 0; j < n_new; ++j)
        live += inserted(new_codes.typed_data()[(b * n_new + j) * n_tables + t], n_buckets);
      if (starts[t * (n_buckets + 1) + n_buckets] + live > cap || n.typed_data()[b] + live > cap)
        return ffi::Error::InvalidArgument("magicpig_merge: the new keys do not fit in the id lists");
    }
  }
  // In place when XLA aliases the result with the id lists (as jaxkv.native asks), else on a copy.
  if (ids_out->typed_data() != sorted_ids.typed_data())
    std::memcpy(ids_out->typed_data(), sorted_ids.typed_data(), sorted_ids.size_bytes());
  std::memcpy(starts_out->typed_data(), bucket_starts.typed_data(), bucket_starts.size_bytes());
  parallel_for(pool, batch * n_tables, [&](int64_t item) {
    const int64_t b = item / n_tables, t = item % n_tables;
    merge_table(ids_out->typed_data() + item * cap, starts_out->typed_data() + item * (n_buckets + 1),
                new_codes.typed_data() + b * n_new * n_tables + t, n_tables, n_new, n.typed_data()[b], n_buckets);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- attend

// glibc's vector math (libmvec): 16 float32 lanes per call, within 4 ulp like its scalar
// functions and XLA's.
extern "C" {
__m512 _ZGVeN16v_acosf(__m512);
__m512 _ZGVeN16v_expm1f(__m512);
__m512 _ZGVeN16v_logf(__m512);
__m512 _ZGVeN16v_log1pf(__m512);
}

// magicpig.collision_log_prob for 16 cosines, the same float32 steps, both branches
// evaluated and one kept per lane as there (see its docstring for why each is accurate where
// it is used): log u, u = P(Binomial(L, p^K) >= min_hits), p = 1 - arccos(c)/pi.
struct CollisionLogProb {
  float k_bits, n_tables;
  int min_hits, tail_terms;
  std::vector<float> log_choose;  // log C(L, j) for j <= min_hits, a running sum as the XLA path's

  CollisionLogProb(int64_t k, float tables, int64_t hits, int64_t tail)
      : k_bits(static_cast<float>(k)), n_tables(tables), min_hits(static_cast<int>(hits)),
        tail_terms(static_cast<int>(tail)), log_choose(hits + 1, 0.0f) {
    for (int i = 0; i < min_hits; ++i) {
      const float step = i < n_tables ? std::log(std::max(n_tables - i, 1.0f)) - std::log1p(static_cast<float>(i))
                                      : -std::numeric_limits<float>::infinity();
      log_choose[i + 1] = log_choose[i] + step;
    }
  }

  // log(1 - e^x), x <= 0, in the lanes of `wanted` (others are left 0). A branch is
  // evaluated only when a wanted lane takes it: the vector calls are most of this cost.
  static __m512 log1mexp(__m512 x, __mmask16 wanted) {
    const __mmask16 near_zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-0.6931472f), _CMP_GT_OQ);
    __m512 out = _mm512_setzero_ps();
    if (wanted & ~near_zero) out = _ZGVeN16v_log1pf(-_ZGVeN16v_expf(x));
    if (wanted & near_zero) out = _mm512_mask_blend_ps(near_zero, out, _ZGVeN16v_logf(-_ZGVeN16v_expm1f(x)));
    return out;
  }

  __m512 term(int j, __m512 log_hit, __m512 log_miss) const {  // log C(L, j) P^j (1 - P)^(L - j)
    __m512 t = _mm512_set1_ps(log_choose[j]);
    if (j) t = t + static_cast<float>(j) * log_hit;  // 0 · log 0 = 0
    if (n_tables > j) t = t + (n_tables - j) * log_miss;
    return t;
  }

  __m512 operator()(__m512 cosine) const {
    const __m512 c = _mm512_min_ps(_mm512_max_ps(cosine, _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
    const __m512 log_hit = k_bits * _ZGVeN16v_log1pf(-_ZGVeN16v_acosf(c) / 3.14159265358979f);
    const __m512 log_miss = log1mexp(log_hit, 0xFFFF);
    const __m512 odds =
        _ZGVeN16v_expf(_mm512_min_ps(log_hit - log_miss, _mm512_set1_ps(std::log(static_cast<float>(min_hits + 1)))));
    const __m512 first_ratio = std::max(n_tables - min_hits, 0.0f) / (min_hits + 1) * odds;
    // The upper tail by its running ratios. They fall (each factor is at most the first
    // ratio's, <= 1/2 where this branch is kept): once every kept lane's ratio is below
    // 2^-25, later ones are under half an ulp of total (>= 1) and would leave it as it is.
    const __mmask16 tail_lanes = _mm512_cmp_ps_mask(first_ratio, _mm512_set1_ps(0.5f), _CMP_LE_OQ);
    // Each branch only when some lane keeps it (lanes do not mix: the kept values are
    // those of evaluating both).
    __m512 tail = _mm512_setzero_ps(), complement = _mm512_setzero_ps();
    if (tail_lanes) {
      __m512 ratio = first_ratio, total = 1.0f + first_ratio;
      for (int j = min_hits + 1; j < min_hits + tail_terms - 1; ++j) {
        if (!_mm512_mask_cmp_ps_mask(tail_lanes, ratio, _mm512_set1_ps(0x1p-25f), _CMP_GE_OQ)) break;
        ratio = ratio * (std::max(n_tables - j, 0.0f) / (j + 1)) * odds;
        total = total + ratio;
      }
      tail = term(min_hits, log_hit, log_miss) + _ZGVeN16v_logf(total);
    }
    const __mmask16 complement_lanes = static_cast<__mmask16>(~tail_lanes);
    if (complement_lanes) {  // one minus the lower tail
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < min_hits; ++j) top = _mm512_max_ps(top, term(j, log_hit, log_miss));
      const __mmask16 finite =
          _mm512_cmp_ps_mask(top, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
      top = _mm512_maskz_mov_ps(finite, top);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < min_hits; ++j) sum = sum + _ZGVeN16v_expf(term(j, log_hit, log_miss) - top);
      complement = log1mexp(_mm512_min_ps(top + _ZGVeN16v_logf(sum), _mm512_setzero_ps()), complement_lanes);
    }
    return _mm512_min_ps(_mm512_mask_blend_ps(tail_lanes, complement, tail), _mm512_setzero_ps());
  }
};

// Lane j: Σ_i f(q_i, rows[j]_i) over d coordinates for 16 rows, f(q, r, acc) an FMA: 16
// coordinates of the 16 rows at a time (16 independent sums, one load of q), the last d % 16
// by masked loads. Not by a scalar loop (a float sum is not vectorised by the compiler: its
// order would change), whose rounding differed between float and bfloat16 rows with GCC 12
// on some CPUs, and so did their partials (d = 24 in test_native).
template <typename Row, typename Fma>
__m512 sums16(const float* q, const Row* const (&rows)[16], int64_t d, const Fma& fma) {
  __m512 partial[16];
  for (auto& p : partial) p = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) partial[j] = fma(qi, load16(rows[j] + i), partial[j]);
  }
  if (i < d) {
    const __mmask16 lanes = lanes_in_use(d - i);
    const __m512 qi = _mm512_maskz_loadu_ps(lanes, q + i);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) partial[j] = fma(qi, load16(rows[j] + i, lanes), partial[j]);
  }
  return sum_each(partial);
}

// Lane j: q · rows[j].
template <typename Row>
__m512 products16(const float* q, const Row* const (&rows)[16], int64_t d) {
  return sums16(q, rows, d, [](__m512 q, __m512 r, __m512 acc) { return _mm512_fmadd_ps(q, r, acc); });
}

// a · b for two float vectors (a query's norm, its product with mu).
float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 lanes = lanes_in_use(d - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, a + i), _mm512_maskz_loadu_ps(lanes, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Lane j: |rows[j] - mu|.
template <typename Row>
__m512 distances16(const float* mu, const Row* const (&rows)[16], int64_t d) {
  return _mm512_sqrt_ps(sums16(mu, rows, d, [](__m512 mu, __m512 r, __m512 acc) {
    const __m512 diff = r - mu;
    return _mm512_fmadd_ps(diff, diff, acc);
  }));
}

// The unnormalised partial (o [G, d], l [G], m [G]) of one block of slots: two passes, the
// scores (with the correction) first, then exp(s - m) times the value rows.
struct Partial {
  std::vector<float> o, l, m;
  Partial(int64_t heads, int64_t d, float masked) : o(heads * d, 0.0f), l(heads, 0.0f), m(heads, masked) {}
};

// The rows are scattered over the region, a few kB apart: while the keys are worked on,
// every cache line of the key and the value row kRowsAhead slots on is fetched into L2, so
// the values' pass finds its rows there. Into L2 (_MM_HINT_T1) rather than L1, more misses
// are in flight (docs/results/implementation_notes.md, "CPU kernels").
constexpr int64_t kRowsAhead = 16;

template <typename Row>
void prefetch_row(const Row* row, int64_t d) { prefetch_lines<_MM_HINT_T1>(row, row + d); }

template <typename Row>
struct AttendHead {
  const float *q, *mu;
  const Row *keys, *values;
  const int32_t* idx;
  const bool* mask;
  const std::vector<CollisionLogProb>* log_prob;  // one per query head (its tables read); null: no correction
  int64_t heads, d, cap, slots;
  float scale, log_u_floor;
};

// A row's first element (its slot's index clamped into the region).
template <typename Row>
int64_t row_at(const AttendHead<Row>& a, int64_t slot) { return std::clamp<int64_t>(a.idx[slot], 0, a.cap - 1) * a.d; }

// The kHeads heads' (from g0) sums of weight · value row (weights [head][slot - begin], lanes
// per head), 64 coordinates at a time, by add_weighted_rows: each row read once for all of
// them, a row added only to the heads that sampled it, not read again by every head that
// sampled it (docs/results/implementation_notes.md, "CPU kernels").
template <int kHeads, typename Row>
void sum_values_of_heads(const AttendHead<Row>& a, int64_t g0, int64_t begin, int64_t count, const float* weights,
                         int64_t lanes, Partial& out) {
  for (int64_t i0 = 0; i0 < a.d; i0 += 64) {
    const __mmask16 part[4] = {lanes_in_use(a.d - i0), lanes_in_use(a.d - i0 - 16), lanes_in_use(a.d - i0 - 32),
                               lanes_in_use(a.d - i0 - 48)};
    __m512 sum[kHeads][4];
    for (auto& head_sum : sum)
      for (auto& s : head_sum) s = _mm512_setzero_ps();
    add_weighted_rows<kHeads, 4, /*kSkipUnweighted=*/true>(sum, count, weights + g0 * lanes, lanes,
                                                           [&](int64_t c, __m512 (&row)[4]) {
      const Row* v = a.values + row_at(a, begin + c) + i0;
      for (int u = 0; u < 4; ++u) row[u] = load16(v + 16 * u, part[u]);
    });
    for (int64_t h = 0; h < kHeads; ++h)
      for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(out.o.data() + (g0 + h) * a.d + i0 + 16 * u, part[u], sum[h][u]);
  }
}

// sum_values_of_heads over the heads, four at a time (their 16 sums and a row in registers).
template <typename Row>
void sum_values(const AttendHead<Row>& a, int64_t begin, int64_t count, const float* weights, int64_t lanes,
                Partial& out) {
  for (int64_t g0 = 0; g0 < a.heads; g0 += 4) {
    switch (std::min<int64_t>(4, a.heads - g0)) {
      case 1: sum_values_of_heads<1>(a, g0, begin, count, weights, lanes, out); break;
      case 2: sum_values_of_heads<2>(a, g0, begin, count, weights, lanes, out); break;
      case 3: sum_values_of_heads<3>(a, g0, begin, count, weights, lanes, out); break;
      default: sum_values_of_heads<4>(a, g0, begin, count, weights, lanes, out); break;
    }
  }
}

template <typename Row>
void attend_block(const AttendHead<Row>& a, int64_t begin, int64_t end, Partial& out) {
  constexpr float kUnsampled = -std::numeric_limits<float>::infinity();
  const auto sampled_by_any = [&](int64_t c) {
    bool any = false;
    for (int64_t g = 0; g < a.heads; ++g) any |= a.mask[g * a.slots + c];
    return any;
  };
  // The sample fills the lowest slots: the block's work ends at its last sampled slot.
  while (end > begin && !sampled_by_any(end - 1)) --end;
  const int64_t count = end - begin, lanes = (count + 15) / 16 * 16;
  // Per head and slot: the scaled score, then the corrected score, kUnsampled where the
  // head did not sample the row; then its weight. The cosines of the rows a head sampled
  // are packed (with their slots), so the correction's vector math runs on full vectors: a
  // head samples a scattered part of its KV head's rows (docs/results/implementation_notes.md).
  // The cosine's numerator q·(k - mu) is q·k - q·mu: one product per row and head, shared
  // with the score.
  std::vector<float> score(a.heads * lanes, kUnsampled), cosine(a.heads * lanes, 0.0f), q_norm(a.heads), q_mu(a.heads);
  std::vector<int32_t> head_slots(a.heads * lanes);  // with a correction: each head's sampled slots, ascending
  std::vector<int64_t> n_sampled(a.heads, 0);
  for (int64_t g = 0; g < a.heads; ++g) {
    q_norm[g] = std::sqrt(dot(a.q + g * a.d, a.q + g * a.d, a.d));
    if (a.log_prob) q_mu[g] = dot(a.q + g * a.d, a.mu, a.d);
  }
  // The first kRowsAhead rows are fetched before the keys' loop, row c + kRowsAhead in it. (Not
  // through a lambda: GCC 12 at -O3 drops the prefetches of one.)
  const int64_t ahead = std::min(end, begin + kRowsAhead);
  for (int64_t c = begin; c < ahead; ++c) prefetch_row(a.keys + row_at(a, c), a.d), prefetch_row(a.values + row_at(a, c), a.d);
  // 16 slots at a time: a head's 16 products are summed together (sum_each), then kept where
  // it sampled the slot; with a correction its sampled slots and cosines are packed by a
  // compress. (One product and one horizontal sum per row and head kept the keys' pass on
  // their latency chains.)
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t first = begin; first < end; first += 16) {
    const Row* k[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t c = first + j;
      if (c + kRowsAhead < end) {
        prefetch_row(a.keys + row_at(a, c + kRowsAhead), a.d);
        prefetch_row(a.values + row_at(a, c + kRowsAhead), a.d);
      }
      k[j] = a.keys + row_at(a, std::min(c, end - 1));  // past the block's end: its last row again, lanes unused
    }
    const __mmask16 in_block = lanes_in_use(end - first);
    const __m512 k_norm = a.log_prob ? distances16(a.mu, k, a.d) : _mm512_setzero_ps();
    const __m512i slot = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first - begin)), lane);
    for (int64_t g = 0; g < a.heads; ++g) {
      const __m128i sampled_bytes = _mm_maskz_loadu_epi8(in_block, a.mask + g * a.slots + first);
      const __mmask16 sampled = _mm_test_epi8_mask(sampled_bytes, sampled_bytes);
      if (!sampled) continue;
      const __m512 qk = products16(a.q + g * a.d, k, a.d);
      _mm512_storeu_ps(score.data() + g * lanes + (first - begin),
                       _mm512_mask_blend_ps(sampled, _mm512_set1_ps(kUnsampled), qk * _mm512_set1_ps(a.scale)));
      if (a.log_prob) {
        // Full vectors stored from the head's count: their lanes past the kept ones are zero
        // (cosine 0 is a valid input where the correction reads padding), overwritten next.
        const int64_t packed = g * lanes + n_sampled[g];
        _mm512_storeu_si512(head_slots.data() + packed, _mm512_maskz_compress_epi32(sampled, slot));
        const __m512 norms = _mm512_set1_ps(q_norm[g]) * k_norm;
        const __mmask16 positive = _mm512_cmp_ps_mask(norms, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 cosine_lanes = _mm512_maskz_div_ps(positive, qk - _mm512_set1_ps(q_mu[g]), norms);
        _mm512_storeu_ps(cosine.data() + packed, _mm512_maskz_compress_ps(sampled, cosine_lanes));
        n_sampled[g] += _mm_popcnt_u32(sampled);
      }
    }
  }
  for (int64_t g = 0; g < a.heads; ++g) {
    float* head_score = score.data() + g * lanes;
    if (a.log_prob) {  // the correction of each packed cosine, subtracted from its slot's score
      float* head_cosine = cosine.data() + g * lanes;  // padding lanes hold cosine 0: a valid input
      for (int64_t i = 0; i < n_sampled[g]; i += 16) {
        const __m512 log_u = _mm512_max_ps((*a.log_prob)[g](_mm512_loadu_ps(head_cosine + i)),
                                           _mm512_set1_ps(a.log_u_floor));
        _mm512_storeu_ps(head_cosine + i, log_u);
      }
      for (int64_t i = 0; i < n_sampled[g]; ++i) head_score[head_slots[g * lanes + i]] -= head_cosine[i];
    }
    __m512 top = _mm512_set1_ps(out.m[g]);
    for (int64_t c = 0; c < lanes; c += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(head_score + c));
    out.m[g] = _mm512_reduce_max_ps(top);
    // Weights exp(s - m), 0 where not sampled (score -inf), and their sum.
    const __m512 m = _mm512_set1_ps(out.m[g]);
    __m512 weights = _mm512_setzero_ps();
    for (int64_t c = 0; c < lanes; c += 16) {
      float* s = score.data() + g * lanes + c;
      const __m512 w = exp_or_zero(_mm512_loadu_ps(s) - m);
      _mm512_storeu_ps(s, w);
      weights = weights + w;
    }
    out.l[g] = _mm512_reduce_add_ps(weights);
  }
  sum_values(a, begin, count, score.data(), lanes, out);
}

// Every batch entry's partial from blocks of slots in parallel, each block a partial of its
// own, merged per head in order.
template <typename Row>
void attend_heads(ffi::ThreadPool& pool, const std::vector<AttendHead<Row>>& work, int64_t heads, int64_t d,
                  int64_t slots, float masked_score, ffi::ResultBuffer<ffi::F32>& o, ffi::ResultBuffer<ffi::F32>& l,
                  ffi::ResultBuffer<ffi::F32>& m) {
  const int64_t batch = static_cast<int64_t>(work.size());
  constexpr int64_t kBlock = 256;  // several per KV head even at 8k keys, for both threads
  const int64_t blocks = (slots + kBlock - 1) / kBlock;
  std::vector<Partial> parts(batch * blocks, Partial(heads, d, masked_score));
  parallel_chunks(pool, batch, slots, kBlock, [&](int64_t b, int64_t begin, int64_t end) {
    attend_block(work[b], begin, end, parts[b * blocks + begin / kBlock]);
  });
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < heads; ++g) {
      float top = masked_score;
      for (int64_t j = 0; j < blocks; ++j) top = std::max(top, parts[b * blocks + j].m[g]);
      float* out_o = o->typed_data() + (b * heads + g) * d;
      float& out_l = l->typed_data()[b * heads + g];
      std::fill(out_o, out_o + d, 0.0f);
      out_l = 0.0f;
      for (int64_t j = 0; j < blocks; ++j) {
        const Partial& part = parts[b * blocks + j];
        const float factor = part.l[g] > 0 ? std::exp(part.m[g] - top) : 0.0f;
        for (int64_t i = 0; i < d; ++i) out_o[i] += factor * part.o[g * d + i];
        out_l += factor * part.l[g];
      }
      m->typed_data()[b * heads + g] = top;
    }
}

template <typename Row>
void attend_sample(ffi::ThreadPool& pool, const float* q, const Row* keys, const Row* values, const float* mu,
                   const int32_t* idx, const bool* mask, const int32_t* tables_used, int64_t batch, int64_t heads,
                   int64_t d, int64_t cap, int64_t slots, int64_t k_bits, int64_t min_hits, int64_t tail_terms,
                   float log_u_floor, float masked_score, ffi::ResultBuffer<ffi::F32>& o, ffi::ResultBuffer<ffi::F32>& l,
                   ffi::ResultBuffer<ffi::F32>& m) {
  std::vector<std::vector<CollisionLogProb>> log_prob(batch);
  std::vector<AttendHead<Row>> work(batch);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < heads; ++g)
      log_prob[b].emplace_back(k_bits, static_cast<float>(tables_used[b * heads + g]), min_hits, tail_terms);
    work[b] = {q + b * heads * d, mu + b * d, keys + b * cap * d, values + b * cap * d, idx + b * slots,
               mask + b * heads * slots, &log_prob[b], heads, d, cap, slots, 1.0f / std::sqrt(static_cast<float>(d)),
               log_u_floor};
  }
  attend_heads(pool, work, heads, d, slots, masked_score, o, l, m);
}

ffi::Error attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                  ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::PRED> mask,
                  ffi::Buffer<ffi::S32> tables_used, int64_t k_bits, int64_t min_hits, int64_t tail_terms,
                  float log_u_floor, float masked_score, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> l,
                  ffi::ResultBuffer<ffi::F32> m) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() < 2 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("magicpig_attend: q [..., G, d], keys [..., cap, d]");
  if (!rows_supported(keys, values))
    return ffi::Error::InvalidArgument("magicpig_attend: keys and values both float32, bfloat16 or "
                                       "bfloat16 bits (uint16)");
  const int64_t heads = qd[qd.size() - 2], d = qd.back(), cap = kd[kd.size() - 2];
  const int64_t batch = product(qd, 0, qd.size() - 2), slots = idx.dimensions().back();
  if (kd.back() != d || static_cast<int64_t>(values.element_count()) != batch * cap * d ||
      mu.element_count() != batch * d || idx.element_count() != batch * slots ||
      mask.element_count() != batch * heads * slots || tables_used.element_count() != batch * heads ||
      o->element_count() != batch * heads * d || l->element_count() != batch * heads || m->element_count() != batch * heads)
    return ffi::Error::InvalidArgument("magicpig_attend: values [..., cap, d], mu [..., d], idx [..., C], "
                                       "mask [..., G, C], tables_used [..., G]; o [..., G, d], l and m [..., G]");
  const auto run = [&](auto row) {
    using Row = decltype(row);
    attend_sample(pool, q.typed_data(), rows_of<Row>(keys), rows_of<Row>(values), mu.typed_data(), idx.typed_data(),
                  mask.typed_data(), tables_used.typed_data(), batch, heads, d, cap, slots, k_bits, min_hits,
                  tail_terms, log_u_floor, masked_score, o, l, m);
  };
  keys.element_type() == ffi::DataType::F32 ? run(float{}) : run(bf16{});
  return ffi::Error::Success();
}

template <typename Row>
void attend_selected(ffi::ThreadPool& pool, const float* q, const Row* keys, const Row* values, const int32_t* idx,
                     const bool* mask, int64_t batch, int64_t heads, int64_t d, int64_t cap, int64_t slots,
                     float masked_score, ffi::ResultBuffer<ffi::F32>& o, ffi::ResultBuffer<ffi::F32>& l,
                     ffi::ResultBuffer<ffi::F32>& m) {
  std::vector<AttendHead<Row>> work(batch);
  for (int64_t b = 0; b < batch; ++b)
    work[b] = {q + b * heads * d, nullptr, keys + b * cap * d, values + b * cap * d, idx + b * slots,
               mask + b * heads * slots, nullptr, heads, d, cap, slots, 1.0f / std::sqrt(static_cast<float>(d)), 0.0f};
  attend_heads(pool, work, heads, d, slots, masked_score, o, l, m);
}

ffi::Error attend_rows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                       ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::PRED> mask, float masked_score,
                       ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> m) {
  const auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() < 2 || kd.size() != qd.size())
    return ffi::Error::InvalidArgument("attend_rows: q [..., G, d], keys [..., cap, d]");
  if (!rows_supported(keys, values))
    return ffi::Error::InvalidArgument("attend_rows: keys and values both float32, bfloat16 or "
                                       "bfloat16 bits (uint16)");
  const int64_t heads = qd[qd.size() - 2], d = qd.back(), cap = kd[kd.size() - 2];
  const int64_t batch = product(qd, 0, qd.size() - 2), slots = idx.dimensions().back();
  if (kd.back() != d || static_cast<int64_t>(values.element_count()) != batch * cap * d ||
      idx.element_count() != batch * slots || mask.element_count() != batch * heads * slots ||
      o->element_count() != batch * heads * d || l->element_count() != batch * heads || m->element_count() != batch * heads)
    return ffi::Error::InvalidArgument("attend_rows: values [..., cap, d], idx [..., C], mask [..., G, C]; "
                                       "o [..., G, d], l and m [..., G]");
  const auto run = [&](auto row) {
    using Row = decltype(row);
    attend_selected(pool, q.typed_data(), rows_of<Row>(keys), rows_of<Row>(values), idx.typed_data(),
                    mask.typed_data(), batch, heads, d, cap, slots, masked_score, o, l, m);
  };
  keys.element_type() == ffi::DataType::F32 ? run(float{}) : run(bf16{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigQueryBuckets, query_buckets,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("limit")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigCollide, collide,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("min_hits")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigMerge, merge,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigAttend, attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("k_bits")
                                  .Attr<int64_t>("min_hits")
                                  .Attr<int64_t>("tail_terms")
                                  .Attr<float>("log_u_floor")
                                  .Attr<float>("masked_score")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttendRows, attend_rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("masked_score")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#endif  // JAXKV_AVX512
