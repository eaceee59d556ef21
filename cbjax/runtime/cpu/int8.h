// Matmuls over int8 weight rows with per-row scales (quantization='int8'), the blocks' widening reused.
#pragma once

#include "blocks.h"

namespace {

// ---------------------------------------------------------------- int8 rows

// quantization='int8' weights (cbjax/models/quant.py, QuantizedWeight): int8 values [N, K] and an
// f32 scale per `group` inputs of a row ([N, K / group]), group 32 times a power of two. Q8_0's
// loops with each 32 weights' scale read from their group's: one input row, scale * sum(x q) a
// block into two accumulators; several, kTileRows rows widened to scale * q floats (the
// reference's own products) for tile_rows. XLA widened every matrix to f32 in memory each
// call instead (docs/cpu_kernels.md: int8 rows).
struct Int8Weight {
  const int8_t* q;
  const float* scale;
  int64_t group;
};

// Whether the int8 loops take groups of `group` inputs in rows of K.
inline bool int8_group_fits(int64_t group, int64_t K) {
  const int64_t blocks = group / 32;
  return group >= 32 && group % 32 == 0 && (blocks & (blocks - 1)) == 0 && K % group == 0;
}

#if defined(__AVX2__) && defined(__F16C__)
void int8_rows(const BlockInput& in, const Int8Weight& w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = in.K, blocks = K / 32, groups = K / w.group;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(w.group / 32));  // block b is in group b >> shift
  const uint8_t* q = reinterpret_cast<const uint8_t*>(w.q);
  if (in.M == 1) {
    const float* x = in.x;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* r = q + n * K;
      const float* s = w.scale + n * groups;
      __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
      int64_t b = 0;
      const auto block = [&](int64_t i, __m256 acc) {  // acc + block i's scale * sum(x q)
        return _mm256_fmadd_ps(_mm256_broadcast_ss(s + (i >> shift)), int8_times_x(r + i * 32, x + i * 32), acc);
      };
      for (; b + 1 < blocks; b += 2) {
        prefetch(r + b * 32 + kPrefetchAhead);
        a = block(b, a);
        c = block(b + 1, c);
      }
      if (b < blocks) a = block(b, a);
      y[n] = sum8(_mm256_add_ps(a, c));
    }
    return;
  }
  const float* scale = w.scale;
  const auto widen = [=](int64_t row, int64_t b, __m256 v[4]) {
    widen_int8(q + row * K + b * 32, _mm256_broadcast_ss(scale + row * groups + (b >> shift)), v);
  };
  if (in.xt) return widened_rows(in.xt, widen, y, in.M, N, K, n0, n1);
  for (int64_t n = n0; n < n1; n += kTileRows)
    tile_rows(in.x, widen, q + (n + kTileRows) * K, kTileRows * K, y, in.M, N, K, n,
              static_cast<int>(std::min<int64_t>(kTileRows, n1 - n)));
}
#else
void int8_rows(const BlockInput& in, const Int8Weight& w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = in.K, groups = K / w.group;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < in.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k)
          t += in.x[m * K + k] * static_cast<float>(w.q[n * K + k]);
        acc += w.scale[n * groups + g] * t;
      }
      y[m * N + n] = acc;
    }
}
#endif

// About 16 KB of blocks a chunk, in whole tiles of kTileRows weight rows; kTransposedChunkRows
// where the input is transposed.
int64_t block_rows_per_chunk(int64_t row_bytes, int64_t kind, int64_t M) {
  if (takes_transposed(kind, M)) return kTransposedChunkRows;
  return std::max<int64_t>(16384 / row_bytes / kTileRows * kTileRows, kTileRows);
}

struct BlockMatmul {
  BlockInput in;
  const uint8_t* w;  // [N, row_bytes]
  float* y;  // [M, N]
  int64_t N, kind, rows_per_chunk;
};

void block_matmul_chunk(const void* context, int64_t c) {
  const BlockMatmul& p = *static_cast<const BlockMatmul*>(context);
  block_rows(p.in, p.w, p.kind, p.y, p.N, c * p.rows_per_chunk, chunk_end(c, p.rows_per_chunk, p.N));
}

ffi::Error MatmulBlocks(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                        int64_t kind) {
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  if (kind < 0 || kind > 2 || wd.size() != 2 || xd.size() < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_matmul_blocks: x [..., K], w [N, row bytes], kind 0-2");
  }
  const int64_t N = wd[0], K = xd.back();
  if (K % 32 || wd[1] != K / 32 * kBlockBytes[kind]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_matmul_blocks: w's rows are not K / 32 blocks");
  }
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (M > kMaxBlockRows) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_matmul_blocks: too many rows");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t rows = block_rows_per_chunk(wd[1], kind, M);
  const BlockMatmul m{block_input(x.typed_data(), M, K, kind != kQ8_0, takes_transposed(kind, M)), w.typed_data(), y->typed_data(), N, kind, rows};
  pool().run(block_matmul_chunk, &m, chunk_count(N, rows));
  return ffi::Error::Success();
}

struct Int8Matmul {
  BlockInput in;
  Int8Weight w;
  float* y;
  int64_t N, rows_per_chunk;
};

void int8_matmul_chunk(const void* context, int64_t c) {
  const Int8Matmul& p = *static_cast<const Int8Matmul*>(context);
  int8_rows(p.in, p.w, p.y, p.N, c * p.rows_per_chunk, chunk_end(c, p.rows_per_chunk, p.N));
}

ffi::Error MatmulInt8(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = q.dimensions(), sd = scale.dimensions(), xd = x.dimensions();
  if (qd.size() != 2 || sd.size() != 2 || xd.size() < 1 || sd[0] != qd[0] || sd[1] < 1 || xd.back() != qd[1] ||
      qd[1] % sd[1] || !int8_group_fits(qd[1] / sd[1], qd[1])) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cbjax_matmul_int8: x [..., K], q [N, K], scale [N, K / group], group 32 times a power of two");
  }
  const int64_t N = qd[0], K = qd[1];
  const int64_t M = static_cast<int64_t>(x.element_count()) / K;
  if (M > kMaxBlockRows) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_matmul_int8: too many rows");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t rows = block_rows_per_chunk(K, kI8, M);
  const Int8Matmul m{block_input(x.typed_data(), M, K, false, takes_transposed(kI8, M)), {q.typed_data(), scale.typed_data(), K / sd[1]},
                     y->typed_data(), N, rows};
  pool().run(int8_matmul_chunk, &m, chunk_count(N, rows));
  return ffi::Error::Success();
}

}  // namespace
