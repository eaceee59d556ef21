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

// ---------------------------------------------------------------- many input rows

// Where crossover.h picked it, the input is transposed once a call (xt [K, Mp]: Mp is M rounded
// up to 8 lanes, 16 from kWideFrom rows, zero padded) and each weight is broadcast against them. The
// dot-product tile above ends every output in a horizontal sum (at K = 576, ~8 shuffles and adds
// against its 36 FMAs), and past 4 input rows reads its weight block again from L2 for every 4;
// here an output is its lanes as they stand and every weight is read once for all the rows
// (docs/cpu_kernels.md: many rows).
template <int L>
struct Lanes {
  typedef float type __attribute__((vector_size(4 * L)));
};
#ifdef __AVX512F__
constexpr int kBroadcastAccumulators = 24;  // of 32 vector registers
constexpr int64_t kWideFrom = 33;  // 16 lanes from here: 8-lane tiles' loads (MV x per k) outgrew the FMAs
#else
constexpr int kBroadcastAccumulators = 12;  // of AVX2's 16
constexpr int64_t kWideFrom = 1 << 30;
#endif
constexpr int64_t kMaxTransposedRows = 64;
// Weight rows a chunk with the input transposed: whole tiles of every broadcast_rows shape
// (12, 8 or 6 rows; 6, 4 or 3 on AVX2).
constexpr int64_t kTransposedChunkRows = 24;
// The matmul kinds: GGUF blocks (blocks.h's BlockKind 0-2), f32 rows, int8 rows (int8.h).
constexpr int64_t kF32 = 3;
constexpr int64_t kI8 = 4;
constexpr int64_t kKinds = 5;
// Whether a matmul of `kind` at M input rows takes the transposed form: timed for each kind
// when it first meets more than one row (crossover.h).
bool takes_transposed(int64_t kind, int64_t M);

inline int64_t lanes_for(int64_t M) { return M >= kWideFrom ? 16 : 8; }
inline int64_t padded_rows(int64_t M) { return (M + lanes_for(M) - 1) / lanes_for(M) * lanes_for(M); }

// A deterministic pattern in [-0.5, 0.5) for the measuring code's weights and inputs (crossover.h,
// bandwidth.h): no subnormals to slow either form.
void fill_pattern(std::vector<float>& v, size_t step, size_t offset = 0) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * step + offset) % 1000) * 1e-3f - 0.5f;
}

void transpose_input(const float* x, int64_t M, int64_t K, float* xt) {
  const int64_t Mp = padded_rows(M);
  for (int64_t m = 0; m < Mp; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * Mp + m] = m < M ? x[m * K + k] : 0.f;
}

// The caller's input transposed into a buffer of its thread where `wanted` (else nullptr): the
// pool's threads read it while the call runs.
const float* transposed_input(const float* x, int64_t M, int64_t K, bool wanted) {
  if (!wanted) return nullptr;
  thread_local std::vector<float> buffer;
  buffer.resize(K * padded_rows(M));
  transpose_input(x, M, K, buffer.data());
  return buffer.data();
}

// Weight rows [n0, n1) in tiles of NR against MV vectors of L input rows: NR * MV accumulators.
template <int L, int NR, int MV>
void broadcast_tile(const float* xt, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                    int64_t n1) {
  using vl = typename Lanes<L>::type;
  constexpr int64_t Mp = L * MV;
  for (int64_t n = n0; n + NR <= n1; n += NR) {
    vl acc[NR][MV] = {};
    const float* wn = w + n * K;
    const float* ahead = wn + NR * K;  // the next tile's rows, asked for a line at a time meanwhile
    for (int64_t k = 0; k < K; ++k) {
      if (k % 16 == 0)
        for (int j = 0; j < NR; ++j) __builtin_prefetch(ahead + j * K + k, 0, 2);
      vl xv[MV];
      for (int v = 0; v < MV; ++v) std::memcpy(&xv[v], xt + k * Mp + L * v, sizeof(vl));
      for (int j = 0; j < NR; ++j) {
        const float b = wn[j * K + k];
        for (int v = 0; v < MV; ++v) acc[j][v] += b * xv[v];
      }
    }
    // (One memcpy of all of xv above, or reading acc's lanes in place here, and GCC kept the
    // accumulators on the stack: a third of the speed.)
    for (int j = 0; j < NR; ++j)
      for (int v = 0; v < MV; ++v) {
        float lanes[L];
        std::memcpy(lanes, &acc[j][v], sizeof(lanes));
        for (int l = 0; l < L && L * v + l < M; ++l) y[(L * v + l) * N + n + j] = lanes[l];
      }
  }
}

// The weight rows of one broadcast tile at M input rows (broadcast_rows' NR).
constexpr int broadcast_tile_rows(int MV) { return std::max(1, std::min(12, kBroadcastAccumulators / MV)); }

inline int64_t broadcast_tile_rows_for(int64_t M) { return broadcast_tile_rows(padded_rows(M) / lanes_for(M)); }

template <int L, int MV>
void broadcast_rows(const float* xt, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                    int64_t n1) {
  constexpr int NR = broadcast_tile_rows(MV);
  const int64_t tiled = n0 + (n1 - n0) / NR * NR;
  broadcast_tile<L, NR, MV>(xt, w, y, M, N, K, n0, tiled);
  broadcast_tile<L, 1, MV>(xt, w, y, M, N, K, tiled, n1);
}

void transposed_rows(const float* xt, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                     int64_t n1) {
  if (lanes_for(M) == 16) {
    if (padded_rows(M) == 48) return broadcast_rows<16, 3>(xt, w, y, M, N, K, n0, n1);
    return broadcast_rows<16, 4>(xt, w, y, M, N, K, n0, n1);
  }
  switch (padded_rows(M) / 8) {
    case 1: return broadcast_rows<8, 1>(xt, w, y, M, N, K, n0, n1);
    case 2: return broadcast_rows<8, 2>(xt, w, y, M, N, K, n0, n1);
    case 3: return broadcast_rows<8, 3>(xt, w, y, M, N, K, n0, n1);
    default: return broadcast_rows<8, 4>(xt, w, y, M, N, K, n0, n1);
  }
}

// y [M, N] rows [n0, n1) of x @ w.T; xt: x transposed (transposed_input) or nullptr.
void weight_rows(const float* x, const float* xt, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  if (xt) return transposed_rows(xt, w, y, M, N, K, n0, n1);
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

// About 64 KB of weights a chunk, whole 4-row tiles: small enough to share out evenly
// (kTransposedChunkRows with the input transposed).
int64_t rows_per_chunk_for(int64_t K, int64_t M) {
  if (takes_transposed(kF32, M)) return kTransposedChunkRows;
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
  const float* xt;  // transposed_input's, or nullptr
  const float* w;
  float* y;
  int64_t M, N, K, rows_per_chunk;
};

void matmul_chunk(const void* context, int64_t c) {
  const Matmul& m = *static_cast<const Matmul*>(context);
  weight_rows(m.x, m.xt, m.w, m.y, m.M, m.N, m.K, c * m.rows_per_chunk, chunk_end(c, m.rows_per_chunk, m.N));
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
  const int64_t rows = rows_per_chunk_for(K, M);
  const Matmul m{x.typed_data(), transposed_input(x.typed_data(), M, K, takes_transposed(kF32, M)), w.typed_data(), y->typed_data(), M, N, K, rows};
  pool().run(matmul_chunk, &m, chunk_count(N, rows));
  return ffi::Error::Success();
}

}  // namespace
