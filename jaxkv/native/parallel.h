// What jaxkv's CPU kernels share: a cache-line prefetch, the batch size of an FFI buffer's
// leading axes, and work split over XLA's intra-op thread pool. Included by every kernel
// source of the library.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxkv_native {

namespace ffi = xla::ffi;

// Fetch every cache line of [begin, end) into the caches (L1 by default; kHint = _MM_HINT_T1
// fetches into L2, see the kernels' rows scattered over DRAM).
template <_mm_hint kHint = _MM_HINT_T0>
inline void prefetch_lines(const void* begin, const void* end) {
  constexpr uintptr_t kLine = 64;
  for (uintptr_t p = reinterpret_cast<uintptr_t>(begin) & ~(kLine - 1); p < reinterpret_cast<uintptr_t>(end); p += kLine)
    _mm_prefetch(reinterpret_cast<const char*>(p), kHint);
}

// The number of elements of dims[begin, end) (the batch of a buffer's leading axes).
inline int64_t product(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

// fn(i) for every i in [0, n), on the calling thread and XLA's intra-op thread pool (the
// FFI ThreadPool: no threads started per call). Items are claimed one at a time, so the
// caller only ever waits for items another thread is running: no deadlock when the pool
// is busy or absent. A helper that starts after the last claim touches nothing but the
// shared counters.
template <typename Fn>
inline void parallel_for(ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  const auto work = [progress, n, &fn] {
    for (int64_t i; (i = progress->next.fetch_add(1)) < n;) {
      fn(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (progress->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// fn(h, begin, end) for every chunk [begin, end) of at most `chunk` of the `n` rows of
// each of `batch` heads, the chunks split over the threads as parallel_for's items.
template <typename Fn>
inline void parallel_chunks(ffi::ThreadPool& pool, int64_t batch, int64_t n, int64_t chunk, const Fn& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  parallel_for(pool, batch * chunks, [&](int64_t item) {
    const int64_t begin = item % chunks * chunk;
    fn(item / chunks, begin, std::min(begin + chunk, n));
  });
}

}  // namespace jaxkv_native
