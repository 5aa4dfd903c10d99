// What the CPU kernels share (models/native and jaxkv/native; build.py puts this directory on
// the include path): a cache-line prefetch, the lanes of a vector in use, the sums of 16
// vectors' lanes at once, the batch size of an FFI buffer's leading axes, a bfloat16's float32
// value, key and value rows widened in registers, softmax weights by libmvec's exp, weighted
// sums of value rows, and work split over XLA's intra-op thread pool.
//
// JAXKV_AVX512: the compiler targets AVX-512 (F, BW, VBMI, VBMI2), GFNI and BMI2, which every
// kernel is written for. Without them (an AVX2 CPU) only ParisKV's selection is built, in its
// AVX2 form (jaxkv/native/pariskv_cpu.cc); build.py registers what was built.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__) && \
    defined(__GFNI__) && defined(__BMI2__)
#define JAXKV_AVX512 1
#endif

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

#ifdef JAXKV_AVX512
// glibc's vector math (libmvec): 16 float32 lanes per call, within 4 ulp like its scalar
// functions and XLA's.
extern "C" {
__m512 _ZGVeN16v_expf(__m512);
}
#endif

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

#ifdef JAXKV_AVX512
// The lanes of a 16-lane vector that hold the first `remaining` elements (all 16, or none).
inline __mmask16 lanes_in_use(int64_t remaining) {
  return remaining >= 16 ? __mmask16{0xFFFF} : remaining <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << remaining) - 1);
}

#endif  // JAXKV_AVX512

// A bfloat16's float32 value (its bits are the float32's high half).
inline float bf16_to_f32(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef JAXKV_AVX512

// A key or value row's element: float32, or bfloat16 (its bits the high half of a float32's),
// widened in registers, so a bfloat16 cache is read in place at half the bytes.
using bf16 = uint16_t;
inline __m512 widen(__m256i bf16_bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits), 16)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const bf16* p, __mmask16 lanes) { return widen(_mm256_maskz_loadu_epi16(lanes, p)); }

// Lane r: the sum of v[r]'s 16 lanes. Halves, quarters, pairs and lanes of two vectors at a
// time are added, 31 shuffles for 16 rows where a reduction per row takes 4 each.
inline __m512 sum_each(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int k = 0; k < 8; ++k)  // 256-bit half 0: row 2k, half 1: row 2k + 1
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit quarter j: row 4k + j
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // in quarter j, lanes 0-1: row 8k + j, lanes 2-3: row 8k + 4 + j
    pairs[k] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * k], quarters[2 * k + 1], 0xEE));
  // Lane 4j + e: row 4e + j.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// An FFI buffer's rows as Row elements (float, or bf16 for bfloat16 or its bits).
template <typename Row>
const Row* rows_of(const ffi::AnyBuffer& buffer) { return static_cast<const Row*>(buffer.untyped_data()); }

// Whether keys and values are rows the kernels read: both float32, both bfloat16, or both
// uint16 holding bfloat16 bits (how models.KVCache and jaxkv.cache store a bfloat16 cache,
// which XLA CPU would otherwise widen whole at each write).
inline bool rows_supported(const ffi::AnyBuffer& keys, const ffi::AnyBuffer& values) {
  const auto type = keys.element_type();
  return type == values.element_type() &&
         (type == ffi::DataType::F32 || type == ffi::DataType::BF16 || type == ffi::DataType::U16);
}

// exp(x) per lane, 0 where x <= -87 (past float32's normal range; -inf for a key not
// attended). Those lanes get input 0: libmvec takes a slow scalar path for any lane whose
// input is -inf or far below -87 (docs/results/implementation_notes.md, "CPU kernels").
inline __m512 exp_or_zero(__m512 x) {
  const __mmask16 weighed = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  return _mm512_maskz_mov_ps(weighed, _ZGVeN16v_expf(_mm512_maskz_mov_ps(weighed, x)));
}

// Adds weight × value row over `count` rows to the sums of kN query heads, 16 * kV
// coordinates of each row: each row loaded once for all kN heads, their kN × kV sums in
// registers from row to row (the dense kernel's blocks of rows, the sparse kernels' scattered
// ones). load_row(j, row) puts row j's coordinates in row[kV]; head g's weight of row j is
// weight[g * stride + j]. With kSkipUnweighted a row adds only to the heads whose weight is
// not 0: a row no head sampled may hold anything, NaN included.
template <int kN, int kV, bool kSkipUnweighted, typename LoadRow>
inline void add_weighted_rows(__m512 (&sum)[kN][kV], int64_t count, const float* weight, int64_t stride,
                              const LoadRow& load_row) {
  for (int64_t j = 0; j < count; ++j) {
    __m512 row[kV];
    load_row(j, row);
    for (int g = 0; g < kN; ++g) {
      const __m512 p = _mm512_set1_ps(weight[g * stride + j]);
      if constexpr (kSkipUnweighted) {
        const __mmask16 weighed = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int u = 0; u < kV; ++u) sum[g][u] = _mm512_mask3_fmadd_ps(p, row[u], sum[g][u], weighed);
      } else {
        for (int u = 0; u < kV; ++u) sum[g][u] = _mm512_fmadd_ps(p, row[u], sum[g][u]);
      }
    }
  }
}

#endif  // JAXKV_AVX512

// The number of elements of dims[begin, end) (the batch of a buffer's leading axes).
inline int64_t product(ffi::Span<const int64_t> dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

// A pool thread woken by Schedule starts tens of us late, much of a kernel that takes a
// hundred or two (docs/results/implementation_notes.md). So a helper done with one kernel's items
// may linger, spinning, for the next kernel's: a kernel that knows another follows within
// microseconds (MagicPIG's hash, then its collide, then its attend) asks for it.
constexpr std::chrono::microseconds kLinger{100};

struct Offer {  // a parallel_for's items, handed to a lingering helper
  std::function<void()> work;
  bool linger;  // whether the helper lingers again after these items
};

struct Handoff {
  std::atomic<Offer*> offered{nullptr};
  std::atomic<int> lingering{0};
};

inline Handoff& handoff() {
  static Handoff h;
  return h;
}

// On a pool thread: wait up to kLinger for an offer, run it, and go on while offers ask to.
inline void linger_for_offers() {
  Handoff& h = handoff();
  for (bool again = true; again;) {
    again = false;
    h.lingering.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + kLinger;
    Offer* offer = nullptr;
    for (int spin = 0; !(offer = h.offered.exchange(nullptr)); ++spin) {
      _mm_pause();
      if (spin % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    h.lingering.fetch_sub(1);
    if (offer) {
      offer->work();
      again = offer->linger;
      delete offer;
    }
  }
}

// fn(i) for every i in [0, n), on the calling thread and XLA's intra-op thread pool (the
// FFI ThreadPool: no threads started per call). Items are claimed one at a time, so the
// caller only ever waits for items another thread is running: no deadlock when the pool
// is busy or absent. A helper that starts after the last claim touches nothing but the
// shared counters. A lingering helper takes the items if one waits; `linger`: the helpers
// then wait for the next kernel's items.
template <typename Fn>
inline void parallel_for(ffi::ThreadPool& pool, int64_t n, const Fn& fn, bool linger = false) {
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
  Handoff& h = handoff();
  Offer* offer = nullptr;  // one helper's share, offered to a lingering one if one waits
  if (helpers > 0 && h.lingering.load() > 0) {
    Offer* expected = nullptr;
    offer = new Offer{work, linger};
    if (!h.offered.compare_exchange_strong(expected, offer)) delete offer, offer = nullptr;
  }
  for (int64_t i = offer ? 1 : 0; i < helpers; ++i)
    pool.Schedule([work, linger] {
      work();
      if (linger) linger_for_offers();
    });
  work();
  while (progress->done.load(std::memory_order_acquire) < n) _mm_pause();
  if (offer && h.offered.compare_exchange_strong(offer, nullptr)) delete offer;  // never taken
}

// fn(h, begin, end) for every chunk [begin, end) of at most `chunk` of the `n` rows of
// each of `batch` heads, the chunks split over the threads as parallel_for's items.
template <typename Fn>
inline void parallel_chunks(ffi::ThreadPool& pool, int64_t batch, int64_t n, int64_t chunk, const Fn& fn,
                            bool linger = false) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  parallel_for(pool, batch * chunks, [&](int64_t item) {
    const int64_t begin = item % chunks * chunk;
    fn(item / chunks, begin, std::min(begin + chunk, n));
  }, linger);
}

}  // namespace jaxkv_native
