// Reads rows of floats as a sparse decode step does, and the same regions whole, on every
// thread: the read bandwidth of scattered rows against a stream, in one process.
// benchmarks/bench_scattered_rows.py builds and runs it; see its docstring.
//
//   scattered_rows N D HEADS DENSITY REPEATS EVICT_MB
//
// Per head, a K and a V region of N rows × D floats. Modes, each pass after a write of
// EVICT_MB MB that evicts the regions from the caches:
//   stream       every row of K and V, in order;
//   scattered    the rows of a random sample (each row kept with probability DENSITY,
//                ascending, as the kernels visit a sample), K and V rows each read whole,
//                both fetched into L2 16 rows ahead (as jaxkv's attention kernels do);
//   interleaved  the same rows from one region of [K row | V row] records.
// Prints one JSON object: seconds of every pass per mode, the rows, the bytes.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "timed_pass.h"

namespace {

constexpr int64_t kAhead = 16;

struct Regions {
  std::vector<std::vector<float>> keys, values, records;  // [head][N·D], [head][N·2D]
  std::vector<std::vector<int64_t>> sample;               // [head] ascending rows
};

void prefetch_row(const float* row, int64_t floats) {
  for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(row + f, 0, 2);  // into L2
}

float sum_row(const float* row, int64_t floats) {
  float total = 0;
  for (int64_t f = 0; f < floats; ++f) total += row[f];
  return total;
}

// What thread t of `threads` reads in `mode`; returns a sum so that nothing is optimised away.
float read_part(const Regions& r, const std::string& mode, int64_t n, int64_t d, int t, int threads) {
  float total = 0;
  for (size_t h = 0; h < r.keys.size(); ++h) {
    if (mode == "stream") {
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      total += sum_row(r.keys[h].data() + begin * d, (end - begin) * d);
      total += sum_row(r.values[h].data() + begin * d, (end - begin) * d);
      continue;
    }
    const auto& rows = r.sample[h];
    const int64_t count = static_cast<int64_t>(rows.size());
    const int64_t begin = count * t / threads, end = count * (t + 1) / threads;
    const bool interleaved = mode == "interleaved";
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        const int64_t ahead = rows[i + kAhead];
        if (interleaved) {
          prefetch_row(r.records[h].data() + ahead * 2 * d, 2 * d);
        } else {
          prefetch_row(r.keys[h].data() + ahead * d, d);
          prefetch_row(r.values[h].data() + ahead * d, d);
        }
      }
      if (interleaved) {
        total += sum_row(r.records[h].data() + rows[i] * 2 * d, 2 * d);
      } else {
        total += sum_row(r.keys[h].data() + rows[i] * d, d) + sum_row(r.values[h].data() + rows[i] * d, d);
      }
    }
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s N D HEADS DENSITY REPEATS EVICT_MB\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), d = std::atoll(argv[2]), heads = std::atoll(argv[3]);
  const double density = std::atof(argv[4]);
  const int repeats = std::atoi(argv[5]);
  const int64_t evict_mb = std::atoll(argv[6]);
  if (n < 1 || d < 1 || heads < 1 || !(density > 0 && density <= 1) || repeats < 1 || evict_mb < 1) {
    std::fprintf(stderr, "need N, D, HEADS, REPEATS, EVICT_MB >= 1 and 0 < DENSITY <= 1\n");
    return 2;
  }
  std::vector<char> evict(static_cast<size_t>(evict_mb) << 20);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Regions r;
  std::mt19937_64 rng(0);
  std::uniform_real_distribution<float> value(-1, 1);
  std::bernoulli_distribution kept(density);
  for (int64_t h = 0; h < heads; ++h) {
    r.keys.emplace_back(n * d), r.values.emplace_back(n * d), r.records.emplace_back(2 * n * d);
    for (auto* region : {&r.keys.back(), &r.values.back(), &r.records.back()})
      for (float& x : *region) x = value(rng);
    r.sample.emplace_back();
    for (int64_t row = 0; row < n; ++row)
      if (kept(rng)) r.sample.back().push_back(row);
  }
  int64_t sampled = 0;
  for (const auto& rows : r.sample) sampled += static_cast<int64_t>(rows.size());
  float sink = 0;
  std::printf("{\"threads\": %d, \"rows\": {\"stream\": %lld, \"scattered\": %lld, \"interleaved\": %lld}, "
              "\"row_bytes\": %lld, \"seconds\": {",
              threads, static_cast<long long>(n * heads), static_cast<long long>(sampled),
              static_cast<long long>(sampled), static_cast<long long>(2 * d * sizeof(float)));
  const char* modes[] = {"stream", "scattered", "interleaved"};
  std::vector<std::vector<double>> seconds(3);
  for (int rep = 0; rep < repeats; ++rep)  // modes alternate, so that a slow moment hits all of them
    for (int m = 0; m < 3; ++m) seconds[m].push_back(
        timed_pass(threads, evict, &sink, [&](int t) { return read_part(r, modes[m], n, d, t, threads); }));
  for (int m = 0; m < 3; ++m) {
    std::printf("%s\"%s\": [", m ? ", " : "", modes[m]);
    for (int rep = 0; rep < repeats; ++rep) std::printf("%s%.9f", rep ? ", " : "", seconds[m][rep]);
    std::printf("]");
  }
  std::printf("}, \"checksum\": %g}\n", static_cast<double>(sink));
  return 0;
}
