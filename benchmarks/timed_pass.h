// One timed pass of a benchmark program (scattered_rows.cc, index_lines.cc): a write of the
// eviction buffer (64 bytes apart) that drives the data read out of the caches, then
// read(t) on each of `threads` threads, t = 0 on the calling one. Its results are added to
// *sink, so that nothing is optimised away. Returns the seconds of the reads.
#pragma once

#include <chrono>
#include <thread>
#include <vector>

template <typename Sum, typename Read>
double timed_pass(int threads, std::vector<char>& evict, Sum* sink, const Read& read) {
  for (size_t i = 0; i < evict.size(); i += 64) evict[i] += 1;
  std::vector<Sum> sums(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { sums[t] = read(t); });
  sums[0] = read(0);
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (Sum s : sums) *sink += s;
  return seconds;
}
