// Which of the two matmul forms each kind takes at each input-row count, measured on this machine.
#pragma once

#include <mutex>

#include "int8.h"

namespace {

// ---------------------------------------------------------------- the forms' crossover, measured

// For every matmul kind (the GGUF blocks, f32 rows, int8 rows) and input-row count from 2 to
// kMaxTransposedRows: the dot-product tiles, or the transposed input against broadcast weights
// (matmul.h). Not a threshold: the transposed form pads M to whole vectors (f32 at 10 rows, 16
// lanes of which 6 idle, lost where 8 and 16 won), and the kinds differ (Q4_1 at 8 rows kept
// the dot tiles, its widening in the way, where f32 took the transposed form from 2).
struct CrossoverTable {
  std::mutex lock;
  std::atomic<bool> decided[kKinds] = {};
  std::atomic<bool> transposed[kKinds][kMaxTransposedRows + 1] = {};
};

CrossoverTable& crossover() {
  static CrossoverTable table;
  return table;
}

constexpr int64_t kCrossoverInputs = 768;  // the width the forms are timed at when a kind is first met

// One kind's weights for timing: N rows of K, f32 or its bytes (GGUF blocks with a scale of
// 0.01, int8 with scales of 0.01: no subnormals to slow either form), and its matmul by form.
struct TimedMatmul {
  int64_t kind, N, K;
  std::vector<float> f32, scales;
  std::vector<uint8_t> bytes;

  TimedMatmul(int64_t kind, int64_t K) : kind(kind), K(K) {
    // 4M weights, streamed past the L2s as a step's are (f32 timed in the L2s, the dot tiles won
    // at 2-4 rows where in the step the transposed form was 25-35% faster).
    const int64_t weights = 4 << 20;
    N = std::max<int64_t>(kTransposedChunkRows, weights / K / kTransposedChunkRows * kTransposedChunkRows);
    if (kind == kF32) {
      f32.resize(N * K);
      fill_pattern(f32, 7919);
      return;
    }
    const int64_t row_bytes = kind == kI8 ? K : K / 32 * kBlockBytes[kind];
    bytes.resize(N * row_bytes);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>((i * 7919) >> 3);
    if (kind == kI8) {
      scales.assign(N * K / 32, 0.01f);
      return;
    }
    const uint16_t hundredth = 0x211F;  // f16 0.01
    for (int64_t b = 0; b < N * K / 32; ++b) {
      uint8_t* block = bytes.data() + b * kBlockBytes[kind];
      std::memcpy(block, &hundredth, 2);
      if (kind == kQ4_1) std::memcpy(block + 2, &hundredth, 2);
    }
  }

  void run(const BlockInput& in, float* y) const {
    if (kind == kF32) return weight_rows(in.x, in.xt, f32.data(), y, in.M, N, K, 0, N);
    if (kind == kI8) return int8_rows(in, {reinterpret_cast<const int8_t*>(bytes.data()), scales.data(), 32}, y, N, 0, N);
    block_rows(in, bytes.data(), kind, y, N, 0, N);
  }
};

// Sets `kind`'s forms by timing both in turn on one thread (each the best of 3) at every count
// from 2 to 16; above, at the lowest count of each padding class (17, 25, 33, 49): the
// transposed form costs the same across a class and the dot tiles least at its lowest
// count, so the class takes that count's winner. ~0.2 s for f32, less for the others.
void measure_kind(int64_t kind, int64_t K) {
  const TimedMatmul w(kind, K);
  const int64_t top = kMaxTransposedRows;
  std::vector<float> x(top * K), xt(K * padded_rows(top)), y(top * w.N);
  fill_pattern(x, 104729);
  const auto seconds = [&](const BlockInput& in) {
    const auto start = std::chrono::steady_clock::now();
    w.run(in, y.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const auto transposed_wins = [&](int64_t M) {
    transpose_input(x.data(), M, K, xt.data());
    const BlockInput dot_input{x.data(), nullptr, M, K, nullptr}, transposed_input{x.data(), nullptr, M, K, xt.data()};
    double dot = 1e30, transposed = 1e30;
    for (int r = 0; r < 3; ++r) {
      dot = std::min(dot, seconds(dot_input));
      transposed = std::min(transposed, seconds(transposed_input));
    }
    // A clear win only: one thread here, two in the step, and where the forms are this close
    // (the quantized kinds, their widening in the way) the step had sided with the dot tiles
    // (int8 at 8 rows: 22.0 ms on them, 26.0 transposed) while single timings flipped between them.
    return transposed < 0.95 * dot;
  };
  seconds({x.data(), nullptr, 8, K, nullptr});  // warm
  auto& table = crossover().transposed[kind];
  for (int64_t M = 2; M <= 16; ++M) table[M] = transposed_wins(M);
  const int64_t class_low[] = {17, 25, 33, 49, top + 1};
  for (int c = 0; c + 1 < 5; ++c) {
    const bool wins = transposed_wins(class_low[c]);
    for (int64_t M = class_low[c]; M < class_low[c + 1]; ++M) table[M] = wins;
  }
}

bool takes_transposed(int64_t kind, int64_t M) {
  if (M < 2 || M > kMaxTransposedRows || kind < 0 || kind >= kKinds) return false;
  CrossoverTable& t = crossover();
  if (!t.decided[kind].load(std::memory_order_acquire)) {  // the first matmul of this kind with rows to spare
    std::lock_guard<std::mutex> hold(t.lock);
    if (!t.decided[kind].load()) {
      measure_kind(kind, kCrossoverInputs);
      t.decided[kind].store(true, std::memory_order_release);
    }
  }
  return t.transposed[kind][M].load(std::memory_order_relaxed);
}

}  // namespace

// Times `kind`'s two forms again at K-wide rows and sets them; returns how many counts took the
// transposed form.
extern "C" int64_t cbjax_measure_crossover(int64_t kind, int64_t K) {
  if (kind < 0 || kind >= kKinds || K < 32 || K % 32) return -1;
  std::lock_guard<std::mutex> hold(crossover().lock);
  measure_kind(kind, K);
  crossover().decided[kind].store(true);
  int64_t taken = 0;
  for (int64_t M = 2; M <= kMaxTransposedRows; ++M) taken += crossover().transposed[kind][M];
  return taken;
}

// Sets `kind`'s form for input-row counts [first, last] (tests run both; a benchmark may pin one);
// a kind set before its first matmul is not timed.
extern "C" void cbjax_set_transposed(int64_t kind, int64_t first, int64_t last, int64_t on) {
  if (kind < 0 || kind >= kKinds) return;
  std::lock_guard<std::mutex> hold(crossover().lock);
  if (!crossover().decided[kind].load()) {
    measure_kind(kind, kCrossoverInputs);  // the counts outside [first, last] as measured
    crossover().decided[kind].store(true);
  }
  for (int64_t M = std::max<int64_t>(first, 2); M <= std::min(last, kMaxTransposedRows); ++M)
    crossover().transposed[kind][M] = on;
}

extern "C" int64_t cbjax_takes_transposed(int64_t kind, int64_t M) { return takes_transposed(kind, M); }
