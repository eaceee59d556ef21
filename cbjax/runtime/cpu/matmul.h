// f32 matmuls of decode-sized rows: the register tiles, and the chunked `MatmulNT` over the pool.
#pragma once

#include "pool.h"

namespace {

// Output rows [n0, n1) for input rows [m0, m0 + MB): NW weight rows at a time against MB input
// rows, NW * MB vector accumulators.
template <int NW, int MB>
void tile(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0, int64_t n0, int64_t n1,
          bool prefetch) {
  const int64_t KV = K / kLanes * kLanes;
  for (int64_t n = n0; n + NW <= n1; n += NW) {
    vw acc[NW][MB] = {};
    const float* wn = w + n * K;
    // With more than 4 input rows, later passes over this block read the weights from L2 and
    // leave memory idle; the first pass asks for the next tile's rows meanwhile, so the
    // stream never stalls on compute (an 8-wide tile in one pass was slower: eight input loads
    // a step; docs/cpu_kernels.md).
    const float* ahead = wn + NW * K;
    for (int64_t k = 0; k < KV; k += kLanes) {
      vw wv[NW];
      if (prefetch && k % 16 == 0)
        for (int j = 0; j < NW; ++j) __builtin_prefetch(ahead + j * K + k, 0, 2);
      for (int j = 0; j < NW; ++j) wv[j] = loadw(wn + j * K + k);
      for (int i = 0; i < MB; ++i) {
        const vw xv = loadw(x + (m0 + i) * K + k);
        for (int j = 0; j < NW; ++j) acc[j][i] += wv[j] * xv;
      }
    }
    // (A shuffle tree over a 4 x 4 tile's 16 accumulators measured no faster than these 16
    // horizontal reductions.)
    for (int i = 0; i < MB; ++i) {
      const float* xm = x + (m0 + i) * K;
      for (int j = 0; j < NW; ++j) {
        float s = sumw(acc[j][i]);
        for (int64_t k = KV; k < K; ++k) s += xm[k] * wn[j * K + k];
        y[(m0 + i) * N + n + j] = s;
      }
    }
  }
}

template <int MB>
void rows_for_inputs(const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t m0, int64_t n0,
                     int64_t n1, bool prefetch) {
  const int64_t n4 = n0 + (n1 - n0) / kWeightTile * kWeightTile;
  tile<kWeightTile, MB>(x, w, y, N, K, m0, n0, n4, prefetch);
  tile<1, MB>(x, w, y, N, K, m0, n4, n1, false);
}

// One input row: each weight row is read start to end, so a thread's part of the matrix is one
// sequential stream (the 4-row tile's four interleaved row streams the prefetchers follow worse).
void single_input_rows(const float* x, const float* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t K2 = K / (2 * kLanes) * (2 * kLanes);
  for (int64_t n = n0; n < n1; ++n) {
    const float* r = w + n * K;
    vw a0 = {}, a1 = {};
    for (int64_t k = 0; k < K2; k += 2 * kLanes) {
      a0 += loadw(r + k) * loadw(x + k);
      a1 += loadw(r + k + kLanes) * loadw(x + k + kLanes);
    }
    int64_t k = K2;
    for (; k + kLanes <= K; k += kLanes) a0 += loadw(r + k) * loadw(x + k);
    float s = sumw(a0 + a1);
    for (; k < K; ++k) s += r[k] * x[k];
    y[n] = s;
  }
}

void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 1) return single_input_rows(x, w, y, K, n0, n1);
  // 64 weight rows at a time (at most 64 x K floats) stay in L2 while every input row passes.
  const int64_t block = 64;
  for (int64_t b = n0; b < n1; b += block) {
    const int64_t e = b + block < n1 ? b + block : n1;
    int64_t m = 0;
    for (; m + kInputTile <= M; m += kInputTile)
      rows_for_inputs<kInputTile>(x, w, y, N, K, m, b, e, m == 0 && M > kInputTile);
    for (; m < M; ++m) rows_for_inputs<1>(x, w, y, N, K, m, b, e, false);
  }
}

// ---------------------------------------------------------------- matmul

// About 64 KB of weights a chunk, whole 4-row tiles: small enough to share out evenly.
int64_t rows_per_chunk_for(int64_t K) {
  const int64_t rows = (16384 / (K > 0 ? K : 1)) / 4 * 4;
  return rows < 4 ? 4 : rows;
}

int64_t chunk_count(int64_t N, int64_t rows_per_chunk) { return (N + rows_per_chunk - 1) / rows_per_chunk; }

// Weight rows [c * rows_per_chunk, chunk_end) are chunk c's.
int64_t chunk_end(int64_t c, int64_t rows_per_chunk, int64_t N) {
  return (c + 1) * rows_per_chunk < N ? (c + 1) * rows_per_chunk : N;
}

struct Matmul {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K, rows_per_chunk;
};

void matmul_chunk(const void* context, int64_t c) {
  const Matmul& m = *static_cast<const Matmul*>(context);
  weight_rows(m.x, m.w, m.y, m.M, m.N, m.K, c * m.rows_per_chunk, chunk_end(c, m.rows_per_chunk, m.N));
}

ffi::Error MatmulNT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  if (wd.size() != 2 || xd.size() < 1 || xd.back() != wd[1]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_matmul_nt: x [..., K] and w [N, K] expected");
  }
  const int64_t N = wd[0], K = wd[1];
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t rows = rows_per_chunk_for(K);
  const Matmul m{x.typed_data(), w.typed_data(), y->typed_data(), M, N, K, rows};
  pool().run(matmul_chunk, &m, chunk_count(N, rows));
  return ffi::Error::Success();
}

}  // namespace
