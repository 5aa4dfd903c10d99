// Products with llama.cpp-quantised weight matrices read in their GGUF blocks (Q4_1, Q8_0),
// as an XLA FFI custom call (models/native/__init__.py builds and registers it). A decode
// step multiplies one row per sequence by every weight matrix: dequantised to float32 they
// are 8x (Q4_1) and 3.8x (Q8_0) the bytes the blocks are, and reading them is most of a
// token's time. Here each block is expanded in registers and never written.
//
// A block covers 32 consecutive inputs of one output row, d and m float16:
//   Q4_1: {d, m, 16 bytes: input j's code in the low nibble of byte j, input j+16's in the
//          high nibble}; weight = d*q + m, q in [0, 15]
//   Q8_0: {d, 32 int8 codes}; weight = d*q
// Row n of the output is sum_b w_b . x_b for Q4_1 (a block's weights formed in registers)
// and sum_b d_b*(q_b . x_b) for Q8_0: the dequantised matrix's products, summed in another
// order.

#include <cstring>

#include "parallel.h"

#ifdef JAXKV_AVX512  // nothing of this file is built for AVX2 only (parallel.h)

namespace jaxkv_native {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ41Bytes = 20, kQ80Bytes = 34;
constexpr int64_t kRowsPerItem = 32;  // output rows a pool item computes

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline float horizontal_sum(__m512 v) { return _mm512_reduce_add_ps(v); }

// One output row of Q4_1 blocks against one input row x. A block's 16 weights d*q + m,
// q in [0, 15], are one register: each code picks its weight by a float permute (which
// reads an index's low four bits, so the high nibble is the code shifted down by 4). The
// two halves of a block go to two sums, so consecutive blocks do not wait on one add.
inline float row_q4_1(const uint8_t* row, int64_t blocks, const float* x) {
  __m512 low_sum = _mm512_setzero_ps(), high_sum = _mm512_setzero_ps();
  const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < blocks; ++b, row += kQ41Bytes) {
    const __m512 weight = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(row)), q, _mm512_set1_ps(half_to_float(row + 2)));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4)));
    low_sum = _mm512_fmadd_ps(_mm512_permutexvar_ps(codes, weight), _mm512_loadu_ps(x + b * kBlock), low_sum);
    high_sum = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), weight),
                               _mm512_loadu_ps(x + b * kBlock + 16), high_sum);
  }
  return horizontal_sum(_mm512_add_ps(low_sum, high_sum));
}

// One output row of Q8_0 blocks against one input row x.
inline float row_q8_0(const uint8_t* row, int64_t blocks, const float* x) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += kQ80Bytes) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18))));
    const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + b * kBlock + 16),
                                       _mm512_mul_ps(lo, _mm512_loadu_ps(x + b * kBlock)));
    acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(half_to_float(row)), acc);
  }
  return horizontal_sum(acc);
}

// x f32 [..., M, K] times the blocks u8 [..., N, K/32 * bytes] of an [N, K] matrix: y f32
// [..., M, N]. Leading axes are a batch (a stacked layer axis, say) shared by x and blocks.
ffi::Error quantized_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks,
                            ffi::ResultBuffer<ffi::F32> y, int64_t q4_1) {
  const auto xd = x.dimensions(), bd = blocks.dimensions();
  const size_t rank = xd.size();
  if (rank < 2 || bd.size() != rank) return ffi::Error::InvalidArgument("x and blocks need one rank >= 2");
  const int64_t rows = xd[rank - 2], k = xd[rank - 1], n = bd[rank - 2];
  const int64_t block_bytes = q4_1 ? kQ41Bytes : kQ80Bytes, blocks_per_row = k / kBlock;
  if (k % kBlock != 0 || bd[rank - 1] != blocks_per_row * block_bytes)
    return ffi::Error::InvalidArgument("blocks' last axis must hold K/32 blocks of the format, K a multiple of 32");
  const int64_t batch = product(xd, 0, rank - 2);
  if (product(bd, 0, rank - 2) != batch) return ffi::Error::InvalidArgument("x and blocks need the same batch axes");

  const int64_t items_per_matrix = (n + kRowsPerItem - 1) / kRowsPerItem;
  parallel_for(pool, batch * items_per_matrix, [&](int64_t item) {
    const int64_t matrix = item / items_per_matrix, first = item % items_per_matrix * kRowsPerItem;
    const uint8_t* weights = blocks.typed_data() + matrix * n * blocks_per_row * block_bytes;
    for (int64_t out = first; out < std::min(first + kRowsPerItem, n); ++out) {
      const uint8_t* row = weights + out * blocks_per_row * block_bytes;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t input = matrix * rows + r;
        const float* xr = x.typed_data() + input * k;
        y->typed_data()[input * n + out] = q4_1 ? row_q4_1(row, blocks_per_row, xr) : row_q8_0(row, blocks_per_row, xr);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxkv_native

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, jaxkv_native::quantized_matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("q4_1"));

#endif  // JAXKV_AVX512
