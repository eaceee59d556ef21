// The CPU roofline's two sides (experiments/lib/cpu_roofline.py): how fast `threads` threads
// read a buffer larger than the caches, the way a decode step streams its weights; and how
// fast they multiply, each its own block in its L2. Plain C (ctypes calls them), not XLA
// targets: they measure the machine, not a step.
#pragma once

#include <thread>

#include "crossover.h"

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

// The compute side: GFLOP/s of the f32 matmul (the faster form at M, crossover.h) at M input rows
// of K, `threads` threads each multiplying its own 384 KB weight block, held in its L2, over and
// over for `seconds`: the arithmetic alone, with no stream and no call's dispatch (timed
// through XLA, one call a block, a 192 x 576 matmul read 92 GFLOP/s where its 576-row
// sibling read 152).
extern "C" double cbjax_matmul_gflops(int64_t M, int64_t K, int64_t threads, double seconds) {
  threads = std::max<int64_t>(1, threads);
  const int64_t N = std::max<int64_t>(24, (384 << 10) / (4 * K) / 24 * 24);
  const bool transposed = takes_transposed(kF32, M);
  std::vector<double> flops(threads, 0.0), elapsed(threads, 0.0);
  auto run = [&](int64_t t) {
    std::vector<float> x(M * K), xt(K * padded_rows(M)), w(N * K), y(M * N);
    fill_pattern(w, 7919, t);
    fill_pattern(x, 104729);
    transpose_input(x.data(), M, K, xt.data());
    const float* xt_or_null = transposed ? xt.data() : nullptr;
    weight_rows(x.data(), xt_or_null, w.data(), y.data(), M, N, K, 0, N);  // warm: the block into L2
    const auto start = std::chrono::steady_clock::now();
    int64_t calls = 0;
    double spent = 0.0;
    while (spent < seconds) {
      weight_rows(x.data(), xt_or_null, w.data(), y.data(), M, N, K, 0, N);
      ++calls;
      spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    flops[t] = 2.0 * M * N * K * calls;
    elapsed[t] = spent;
  };
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < threads; ++t) helpers.emplace_back(run, t);
  run(0);
  for (auto& h : helpers) h.join();
  double total = 0.0, longest = 0.0;
  for (int64_t t = 0; t < threads; ++t) total += flops[t], longest = std::max(longest, elapsed[t]);
  return total / longest / 1e9;
}
