// The memory side of the CPU roofline (experiments/lib/cpu_roofline.py): how fast `threads`
// threads read a buffer larger than the caches, the way a decode step streams its weights.
// Plain C (ctypes calls it), not an XLA target: it measures the machine, not a step.
#pragma once

#include <thread>

#include "simd.h"

namespace {

// One thread's contiguous part, summed into eight vector accumulators so that the loads, not
// the adds' latency, bound the loop; each 512-byte step asks for its lines 1 KB ahead, as the
// decode kernels' one-row loops do (without it the loop read 27 GB/s in a run where the
// kernel's matvec read 32 and a one-row decode step streamed its weights at 35).
double read_part(const float* x, int64_t n) {
  v16 acc[8] = {};
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    for (int j = 0; j < 8; ++j) __builtin_prefetch(x + i + 256 + 16 * j, 0, 0);
    for (int j = 0; j < 8; ++j) acc[j] += load16(x + i + 16 * j);
  }
  double total = 0.0;
  for (; i < n; ++i) total += x[i];
  for (int j = 0; j < 8; ++j) total += sum16(acc[j]);
  return total;
}

}  // namespace

// The sum of `n` floats read by `threads` threads, each its own contiguous part (what keeps the
// compiler from dropping the reads; the caller times the call).
extern "C" double cbjax_read_sum(const float* x, int64_t n, int64_t threads) {
  threads = std::max<int64_t>(1, threads);
  std::vector<double> sums(threads, 0.0);
  const int64_t part = (n / threads + 127) / 128 * 128;
  auto run = [&](int64_t t) {
    const int64_t begin = std::min(n, t * part), end = std::min(n, begin + part);
    sums[t] = read_part(x + begin, end - begin);
  };
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < threads; ++t) helpers.emplace_back(run, t);
  run(0);
  for (auto& h : helpers) h.join();
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}
