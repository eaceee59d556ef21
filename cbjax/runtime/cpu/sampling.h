// Greedy sampling: each row's argmax over the vocabulary.
#pragma once

#include "pool.h"

namespace {

// ---------------------------------------------------------------- greedy sampling

// `jnp.argmax` over each row's last axis, as int32: the first maximum, or the first NaN where the
// row has one. XLA:CPU's version (YNNPACK's reduce_max, a select of the hits and a min over them:
// `Ops.argmax`) hands off between pool threads inside; this reads the row twice while it is in
// cache, the second pass stopping at the hit.
int32_t first_max(const float* x, int64_t n) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  // Four accumulators: one max a cycle instead of one per max latency. A NaN lane may leave a
  // NaN in `acc` (maxps returns its second operand then); `top` is not used when a NaN was seen.
  __m256 acc[4], unordered = _mm256_setzero_ps();
  for (auto& a : acc) a = _mm256_set1_ps(-INFINITY);
  for (; i + 32 <= n; i += 32) {
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      acc[u] = _mm256_max_ps(acc[u], v);
    }
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3])));
  for (float lane : lanes) top = std::max(top, lane);
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return static_cast<int32_t>(j);
  }
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 want = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), want, _CMP_EQ_OQ));
    if (hits) return static_cast<int32_t>(j + __builtin_ctz(hits));
  }
#endif
  for (; j < n; ++j)
    if (x[j] == top) return static_cast<int32_t>(j);
  return 0;
}

struct Argmax {
  const float* x;
  int32_t* out;
  int64_t n;
};

void argmax_chunk(const void* context, int64_t row) {
  const Argmax& a = *static_cast<const Argmax*>(context);
  a.out[row] = first_max(a.x + row * a.n, a.n);
}

ffi::Error ArgmaxRows(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() == 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_argmax: x [..., n] with n > 0 expected");
  }
  const int64_t n = xd.back(), rows = static_cast<int64_t>(x.element_count()) / n;
  const Argmax a{x.typed_data(), out->typed_data(), n};
  if (rows == 1) {
    argmax_chunk(&a, 0);  // one row: on the caller, no hand-off
  } else if (rows > 1) {
    pool().run(argmax_chunk, &a, rows);
  }
  return ffi::Error::Success();
}

}  // namespace
