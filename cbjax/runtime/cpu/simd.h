// What every kernel file shares: the headers, XLA FFI's namespace, and the SIMD helpers (the
// vector types the matmul tiles and attention use, pausing and yielding in spin-waits).
#pragma once

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include <initializer_list>
#include <tuple>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// A spin-wait that, once it has spun a while (256 pauses, some microseconds: longer than a chunk
// takes), offers the core to another runnable thread every 16 pauses. On 2 cores the Python
// thread that dispatches the next step and records the last one is a third runnable thread:
// when it preempts a pool thread that holds a claimed chunk, the other spins until the OS gives
// the CPU back; yielding hands it over at once (docs/cpu_kernels.md: spin-waits).
inline void wait_a_little(int& spins) {
  cpu_relax();
  if (++spins > 256 && spins % 16 == 0) sched_yield();
}

inline float sum16(v16 v) {
#ifdef __AVX512F__
  __m512 m;
  std::memcpy(&m, &v, sizeof(m));
  return _mm512_reduce_add_ps(m);
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// The matmul's vector and tile follow the register file. 4 weight rows x 4 input rows of
// 16-float accumulators take 16 + 4 + 1 of AVX-512's 32 registers. On AVX2 (16 registers of
// 8 floats) that tile, each 16-float vector split in two, spilled on every step; there, 8-float
// vectors and 2 weight rows x 4 input rows (8 + 2 + 1 registers) (docs/cpu_kernels.md: tiles).
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kInputTile = 4;
constexpr int kWeightTile = 4;
#else
constexpr int kLanes = 8;
constexpr int kInputTile = 4;
constexpr int kWeightTile = 2;
#endif
typedef float vw __attribute__((vector_size(kLanes * 4)));

inline vw loadw(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sumw(vw v) {
  if constexpr (kLanes == 16) {
    v16 w;
    std::memcpy(&w, &v, sizeof(w));
    return sum16(w);
  }
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

#if defined(__AVX2__) && defined(__F16C__)
inline float sum8(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += lanes[i];
  return s;
}

// A mask of the first `m` of 8 lanes (m <= 8).
inline __m256 first_lanes(int64_t m) {
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// The sums of eight vectors' lanes, in their order: [sum a0, ..., sum a7].
inline __m256 lane_sums(const __m256 v[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
#endif

}  // namespace
