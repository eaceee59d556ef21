// LoRA adapters inside the layer kernel: each row's adapter (a slot of the pool,
// cbjax/models/lora.py) read in place and added to its projections (Punica's BGMV, one row at a
// time on the pool's threads). Rows of slot 0 (the base model) and padding rows read nothing.
// The XLA reference is `TokenAdapters.add`: `y + (x @ A[s].T * scale[s]) @ B[s].T`, in that order.
#pragma once

#include <cstdint>
#include <cstring>

#include "pool.h"
#include "simd.h"

namespace {

constexpr int64_t kMaxLoraRank = 256;

// One module's pool at one layer: A [slots, rank, in] and B [slots, out, rank] (null: the pool
// does not hold the module).
struct LoraModule {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t in = 0, out = 0;
};

// A layer's adapters: each row's slot, the slots' scales, and the seven modules' pools.
struct LayerLora {
  const int32_t* slots = nullptr;  // [M]
  const int32_t* valid = nullptr;  // [M]: 0 for padding rows
  const float* scale = nullptr;    // [slots]
  int64_t rank = 0;
  LoraModule q, k, v, o, gate, up, down;
};

struct LoraApply {
  const LayerLora* lora;
  const LoraModule* module;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
};

inline float dot_floats(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = sum8(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void lora_row(const void* context, int64_t i) {
  const LoraApply& c = *static_cast<const LoraApply*>(context);
  const LayerLora& l = *c.lora;
  const int32_t s = l.slots[i];
  if (s <= 0 || (l.valid && !l.valid[i])) return;
  const int64_t r = l.rank, K = c.module->in, N = c.module->out;
  const float* A = c.module->a + static_cast<int64_t>(s) * r * K;
  const float* B = c.module->b + static_cast<int64_t>(s) * N * r;
  const float* x = c.x + i * c.ldx;
  float low[kMaxLoraRank];
  for (int64_t j = 0; j < r; ++j) low[j] = dot_floats(A + j * K, x, K) * l.scale[s];
  float* y = c.y + i * c.ldy;
  for (int64_t n = 0; n < N; ++n) y[n] += dot_floats(B + n * r, low, r);
}

// y[i] += scale[s] * B[s] @ (A[s] @ x[i]) for each row i of slot s > 0, where the pool holds `module`.
inline void add_lora(const LayerLora* lora, const LoraModule& module, const float* x, int64_t ldx, float* y,
                     int64_t ldy, int64_t M) {
  if (lora == nullptr || module.a == nullptr) return;
  const LoraApply apply{lora, &module, x, ldx, y, ldy};
  pool().run(lora_row, &apply, M);
}

// One module's adapters for rows `x [M, K]` outside the layer kernel (prefill chunks, batches past
// its rows): `delta [M, N]`, each row's `scale[s] * B[s] @ (A[s] @ x)` (zeros for slot 0), the
// pool `a [layers, slots, rank, K]`, `b [layers, slots, N, rank]` read in place at `layer`.
ffi::Error LoraDelta(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> delta,
                     int64_t layer) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || ad[0] != bd[0] || ad[1] != bd[1] || ad[2] != bd[3] ||
      ad[3] != xd[1] || static_cast<int64_t>(scale.element_count()) != ad[1] ||
      static_cast<int64_t>(slots.element_count()) != xd[0] || ad[2] > kMaxLoraRank || layer < 0 || layer >= ad[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_lora_delta: inconsistent shapes");
  }
  const int64_t M = xd[0], S = ad[1], r = ad[2], K = ad[3], N = bd[2];
  float* y = delta->typed_data();
  std::memset(y, 0, sizeof(float) * M * N);
  LayerLora lora{slots.typed_data(), nullptr, scale.typed_data(), r};
  const LoraModule module{a.typed_data() + layer * S * r * K, b.typed_data() + layer * S * N * r, K, N};
  add_lora(&lora, module, x.typed_data(), K, y, N, M);
  return ffi::Error::Success();
}

}  // namespace
