// MagicPIG's inverted index on the CPU as XLA FFI handlers (jaxkv/native/__init__.py builds
// and registers them). They compute what jaxkv.attention.magicpig computes in XLA, exactly:
//   - magicpig_collide: the sampled keys of a query group (select_with_stats's hits, their
//     union's lowest C ids and each head's membership) from the buckets it reads;
//   - magicpig_merge: insert's merge of new keys into every table's sorted id list.
// XLA CPU works over static capacities: a query head's hits come from candidate_entries
// (N/2) slots and a histogram over all N keys, whatever its buckets hold, and a merge
// gathers every slot of every table. Here a head reads only the entries of its buckets
// and a merge moves each table's entries once, in place. Every leading axis of the
// arguments is a batch axis (vmap, broadcast_all).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv_native::parallel_for;
using jaxkv_native::product;

// The bucket [lo, hi) of `code` in one table's starts[n_buckets + 1], clamped to the id list.
std::pair<int64_t, int64_t> bucket_range(const int32_t* starts, int64_t n_buckets, int32_t code, int64_t cap) {
  const int64_t b = std::clamp<int64_t>(code, 0, n_buckets - 1);
  const int64_t lo = std::clamp<int64_t>(starts[b], 0, cap);
  return {lo, std::clamp<int64_t>(starts[b + 1], lo, cap)};
}

// ---------------------------------------------------------------- collide

// One query head: bit i of `sampled` (cap bits, zeroed here) is set iff key i occurs in at
// least min_hits of the buckets of the first `tables` tables. An id occurs at most once per
// table, so its hit count is its number of occurrences: counted in `hits` (cap entries, all
// zero on entry and on return), the bit set when a count reaches min_hits. Returns the
// number of sampled keys.
int64_t sample_head(const int32_t* ids, const int32_t* starts, const int32_t* codes, int64_t tables,
                    int64_t cap, int64_t n_buckets, int64_t min_hits, uint16_t* hits, uint64_t* sampled) {
  std::memset(sampled, 0, (cap + 63) / 64 * sizeof(uint64_t));
  const auto for_each_entry = [&](const auto& fn) {
    for (int64_t t = 0; t < tables; ++t) {
      const auto [lo, hi] = bucket_range(starts + t * (n_buckets + 1), n_buckets, codes[t], cap);
      const int32_t* table = ids + t * cap;
      for (int64_t e = lo; e < hi; ++e) fn(std::clamp<int64_t>(table[e], 0, cap - 1));
    }
  };
  for_each_entry([&](int64_t id) {
    const int64_t count = ++hits[id];
    sampled[id >> 6] |= static_cast<uint64_t>(count == min_hits) << (id & 63);  // no branch on the count
  });
  for_each_entry([&](int64_t id) { hits[id] = 0; });
  int64_t total = 0;
  for (int64_t w = 0; w < (cap + 63) / 64; ++w) total += __builtin_popcountll(sampled[w]);
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
    if (static_cast<int64_t>(hits.size()) < cap) hits.assign(cap, 0);
    const int64_t b = item / n_heads;
    const int64_t tables = std::clamp<int64_t>(tables_used.typed_data()[item], 0, n_tables);
    n_sampled->typed_data()[item] = static_cast<int32_t>(
        sample_head(sorted_ids.typed_data() + b * n_tables * cap, bucket_starts.typed_data() + b * n_tables * (n_buckets + 1),
                    codes.typed_data() + item * n_tables, tables, cap, n_buckets, min_hits, hits.data(),
                    sampled.data() + item * words));
  });
  parallel_for(pool, batch, [&](int64_t b) {
    n_union->typed_data()[b] = static_cast<int32_t>(
        union_of_heads(sampled.data() + b * n_heads * words, n_heads, words, capacity, idx->typed_data() + b * capacity,
                       mask->typed_data() + b * n_heads * capacity));
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- merge

// One table: new keys n, n+1, ... with codes[j * stride] (n_buckets marks an unused row)
// land after the old entries of their bucket, in id order; every old entry moves right by
// the new keys in smaller buckets. Buckets are moved from the last down, so a move never
// overwrites an entry not yet moved. starts [n_buckets + 1] is updated in place.
void merge_table(int32_t* ids, int32_t* starts, const int32_t* codes, int64_t stride, int64_t n_new, int64_t n,
                 int64_t n_buckets) {
  std::vector<int32_t> landed(n_buckets + 1, 0);  // landed[b + 1]: new keys in bucket b
  for (int64_t j = 0; j < n_new; ++j) {
    const int32_t code = codes[j * stride];
    if (code >= 0 && code < n_buckets) ++landed[code + 1];
  }
  for (int64_t b = 0; b < n_buckets; ++b) landed[b + 1] += landed[b];  // landed[b]: in buckets < b
  std::vector<int32_t> order(landed[n_buckets]);  // new keys by bucket, in id order
  std::vector<int32_t> next(landed.begin(), landed.end() - 1);
  for (int64_t j = 0; j < n_new; ++j) {
    const int32_t code = codes[j * stride];
    if (code >= 0 && code < n_buckets) order[next[code]++] = static_cast<int32_t>(n + j);
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
      for (int64_t j = 0; j < n_new; ++j) {
        const int32_t code = new_codes.typed_data()[(b * n_new + j) * n_tables + t];
        live += code >= 0 && code < n_buckets;
      }
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

}  // namespace

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
