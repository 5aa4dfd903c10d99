// Reads ParisKV's index as its selection does, and counts the cache lines that takes, on
// every thread, in one process: what bounds a ParisKV step once its index is out of cache.
// benchmarks/bench_index_reads.py builds and runs it; see its docstring.
//
//   index_lines N HEADS SIGN_BYTES RECORD_BYTES RATIO REPEATS EVICT_MB
//
// Per head, N sign rows of SIGN_BYTES (B, the coarse stage's bucket ids) and N records of
// RECORD_BYTES (the rerank's magnitudes, weights and scale), and the candidates: each row
// kept with probability RATIO, ascending (as the coarse stage lists them). Modes, each pass
// after a write of EVICT_MB MB that evicts the index from the caches:
//   signs        every sign row, in order (what the coarse stage streams);
//   candidates   each candidate's sign row and record, fetched into L2 48 candidates ahead
//                (as the rerank kernel does) and read by a load at each end (no arithmetic);
//   padded       the same with each record padded to a power of two of bytes, so that none
//                straddles two lines (a layout the index does not have: what it would gain).
// Prints one JSON object: seconds of every pass per mode, rows, bytes and lines read.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "timed_pass.h"

namespace {

constexpr int64_t kAhead = 48;  // the rerank kernel's prefetch distance
constexpr int64_t kLine = 64;

// n bytes starting on a cache line (the lines counted assume it).
class Region {
 public:
  explicit Region(int64_t n) : storage_(n + kLine) {
    const auto misalign = reinterpret_cast<uintptr_t>(storage_.data()) % kLine;
    start_ = storage_.data() + (misalign ? kLine - misalign : 0);
  }
  Region(const Region&) = delete;  // start_ points into storage_: moved with it, never copied
  Region(Region&&) noexcept = default;
  uint8_t* data() { return start_; }
  const uint8_t* data() const { return start_; }

 private:
  std::vector<uint8_t> storage_;
  uint8_t* start_;
};

struct Index {
  int64_t sign_bytes, record_bytes, padded_bytes;
  std::vector<Region> signs, records, padded;    // [head]: N rows of their bytes
  std::vector<std::vector<int64_t>> candidates;  // [head] ascending rows
};

uint32_t sum_bytes(const uint8_t* p, int64_t n) {
  uint32_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += p[i];
  return total;
}

// Reads the lines of p[0, n), n <= 64: its first and last 8 bytes (all n bytes when n < 8),
// with as little arithmetic as a read can have.
uint64_t touch(const uint8_t* p, int64_t n) {
  if (n < 8) return sum_bytes(p, n);
  uint64_t first, last;
  std::memcpy(&first, p, 8);
  std::memcpy(&last, p + n - 8, 8);
  return first ^ last;
}

// p[0, n), n <= 64, lies in at most two lines: both fetched into L2 (as the rerank kernel's
// fetch_candidate does; GCC deleted a loop over the lines, which has no side effects).
void fetch(const uint8_t* p, int64_t n) {
  __builtin_prefetch(p, 0, 2);
  __builtin_prefetch(p + n - 1, 0, 2);
}

// Row r's sign row and record. A function, as the rerank kernel's (GCC 12 dropped the
// prefetches of a lambda there).
void fetch_row(const Index& x, const uint8_t* signs, const uint8_t* records, int64_t stride, int64_t r) {
  fetch(signs + r * x.sign_bytes, x.sign_bytes);
  fetch(records + r * stride, x.record_bytes);
}

// What thread t of `threads` reads in `mode`; returns a sum so that nothing is optimised away.
uint32_t read_part(const Index& x, const std::string& mode, int64_t n, int t, int threads) {
  uint32_t total = 0;
  for (size_t h = 0; h < x.signs.size(); ++h) {
    if (mode == "signs") {
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      total += sum_bytes(x.signs[h].data() + begin * x.sign_bytes, (end - begin) * x.sign_bytes);
      continue;
    }
    const bool padded = mode == "padded";
    const uint8_t* records = (padded ? x.padded : x.records)[h].data();
    const int64_t stride = padded ? x.padded_bytes : x.record_bytes;
    const auto& rows = x.candidates[h];
    const int64_t count = static_cast<int64_t>(rows.size());
    const int64_t begin = count * t / threads, end = count * (t + 1) / threads;
    const uint8_t* signs = x.signs[h].data();
    for (int64_t i = begin; i < std::min(begin + kAhead, end); ++i) fetch_row(x, signs, records, stride, rows[i]);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) fetch_row(x, signs, records, stride, rows[i + kAhead]);
      total += static_cast<uint32_t>(touch(signs + rows[i] * x.sign_bytes, x.sign_bytes) +
                                     touch(records + rows[i] * stride, x.record_bytes));
    }
  }
  return total;
}

// Distinct lines of the rows' [row · stride, row · stride + bytes) in an array starting on a line.
int64_t lines_of(const std::vector<int64_t>& rows, int64_t stride, int64_t bytes) {
  int64_t lines = 0, last = -1;
  for (int64_t r : rows) {
    const int64_t first = r * stride / kLine, end = (r * stride + bytes - 1) / kLine;
    lines += end - std::max(first, last + 1) + 1;
    last = end;
  }
  return lines;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s N HEADS SIGN_BYTES RECORD_BYTES RATIO REPEATS EVICT_MB\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), heads = std::atoll(argv[2]);
  Index x;
  x.sign_bytes = std::atoll(argv[3]), x.record_bytes = std::atoll(argv[4]);
  const double ratio = std::atof(argv[5]);
  const int repeats = std::atoi(argv[6]);
  const int64_t evict_mb = std::atoll(argv[7]);
  if (n < 1 || heads < 1 || std::min(x.sign_bytes, x.record_bytes) < 1 || std::max(x.sign_bytes, x.record_bytes) > kLine ||
      !(ratio > 0 && ratio <= 1) || repeats < 1 || evict_mb < 1) {
    std::fprintf(stderr, "need N, HEADS, REPEATS, EVICT_MB >= 1, 1 <= SIGN_BYTES, RECORD_BYTES <= 64 and 0 < RATIO <= 1\n");
    return 2;
  }
  x.padded_bytes = 1;
  while (x.padded_bytes < x.record_bytes) x.padded_bytes *= 2;
  std::vector<char> evict(static_cast<size_t>(evict_mb) << 20);
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::mt19937_64 rng(0);
  std::bernoulli_distribution kept(ratio);
  int64_t rows = 0, lines_signs = 0, lines_candidates = 0, lines_padded = 0;
  for (int64_t h = 0; h < heads; ++h) {
    x.signs.emplace_back(n * x.sign_bytes), x.records.emplace_back(n * x.record_bytes);
    x.padded.emplace_back(n * x.padded_bytes);
    for (const auto& [part, bytes] : {std::pair{&x.signs.back(), x.sign_bytes}, std::pair{&x.records.back(), x.record_bytes},
                                      std::pair{&x.padded.back(), x.padded_bytes}})
      for (int64_t i = 0; i < n * bytes; ++i) part->data()[i] = static_cast<uint8_t>(rng());
    x.candidates.emplace_back();
    for (int64_t row = 0; row < n; ++row)
      if (kept(rng)) x.candidates.back().push_back(row);
    const auto& c = x.candidates.back();
    rows += static_cast<int64_t>(c.size());
    lines_signs += (n * x.sign_bytes + kLine - 1) / kLine;
    const int64_t sign_lines = lines_of(c, x.sign_bytes, x.sign_bytes);
    lines_candidates += sign_lines + lines_of(c, x.record_bytes, x.record_bytes);
    lines_padded += sign_lines + lines_of(c, x.padded_bytes, x.record_bytes);
  }
  const int64_t candidate_bytes = rows * (x.sign_bytes + x.record_bytes);
  std::printf("{\"threads\": %d, \"padded_bytes\": %lld, "
              "\"rows\": {\"signs\": %lld, \"candidates\": %lld, \"padded\": %lld}, "
              "\"bytes\": {\"signs\": %lld, \"candidates\": %lld, \"padded\": %lld}, "
              "\"lines\": {\"signs\": %lld, \"candidates\": %lld, \"padded\": %lld}, \"seconds\": {",
              threads, static_cast<long long>(x.padded_bytes), static_cast<long long>(n * heads),
              static_cast<long long>(rows), static_cast<long long>(rows), static_cast<long long>(n * heads * x.sign_bytes),
              static_cast<long long>(candidate_bytes), static_cast<long long>(candidate_bytes),
              static_cast<long long>(lines_signs), static_cast<long long>(lines_candidates),
              static_cast<long long>(lines_padded));
  const char* modes[] = {"signs", "candidates", "padded"};
  std::vector<std::vector<double>> seconds(3);
  uint32_t sink = 0;
  for (int rep = 0; rep < repeats; ++rep)  // modes alternate, so that a slow moment hits all of them
    for (int m = 0; m < 3; ++m) seconds[m].push_back(
        timed_pass(threads, evict, &sink, [&](int t) { return read_part(x, modes[m], n, t, threads); }));
  for (int m = 0; m < 3; ++m) {
    std::printf("%s\"%s\": [", m ? ", " : "", modes[m]);
    for (int rep = 0; rep < repeats; ++rep) std::printf("%s%.9f", rep ? ", " : "", seconds[m][rep]);
    std::printf("]");
  }
  std::printf("}, \"checksum\": %u}\n", sink);
  return 0;
}
