// Matmuls over a GGUF file's own 32-weight blocks (Q8_0, Q4_0, Q4_1), widened in registers and
// never stored wider.
#pragma once

#include "matmul.h"

namespace {

// ---------------------------------------------------------------- GGUF blocks

// A GGUF file's matrices in its own 32-weight blocks (cbjax/models/gguf_blocks.py), each weight
// row `K / 32` blocks: Q8_0 (f16 d, 32 int8: d * q), Q4_0 (f16 d, 16 nibble bytes: d * (q - 8)),
// Q4_1 (f16 d, f16 m, 16 nibble bytes: d * q + m); nibble byte j holds weights j (low) and
// j + 16 (high). Each block is widened to 32 floats in registers once and multiplied against
// every input row: the weights are read in their 4.5-8.5 bits and never stored wider.
enum BlockKind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int64_t kBlockBytes[] = {34, 18, 20};
constexpr int64_t kMaxBlockRows = 64;  // input rows (decode and the mixed step); more go to XLA
constexpr int kTileRows = 6;  // weight rows widened together for several input rows (block_tile_rows)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t magnitude = exponent == 31 ? 0x7f800000u : (exponent + 112) << 23;  // inf/nan, or rebiased
  const uint32_t bits = sign | magnitude | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX2__) && defined(__F16C__)
// The same widening in AVX2, kept in registers: 8 bytes to 8 int32 to 8 floats at a time, d * q
// (+ m) as two roundings as the scalar code and the reference do (no fused multiply-add).
inline __m256 bytes_to_floats(__m128i bytes, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// Every f16 bit pattern's f32 value (256 KB, filled when the library loads): a block's scale is
// one load from the table (a broadcast load in the one-row loop, on a load port), where
// `vpbroadcastw` + `vcvtph2ps` took ~4 of the one-row Q4_1 loop's ~22 vector-pipe uops a scale,
// two scales a block. Only the patterns a model's scales use are read (a few hundred cache
// lines). Bit-exact: the table holds `_cvtsh_ss` of each pattern (docs/cpu_kernels.md: the f16 table).
struct HalfTable {
  float value[1 << 16];
  HalfTable() {
    for (int bits = 0; bits < (1 << 16); ++bits) value[bits] = _cvtsh_ss(static_cast<uint16_t>(bits));
  }
};
const HalfTable half_table;

// The table entry of the f16 at p.
inline const float* half_entry(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return &half_table.value[bits];
}

inline float half_at(const uint8_t* p) { return *half_entry(p); }

// 32 int8 weights at q times their scale d, as 4 x 8 floats (Q8_0 blocks and int8 rows).
inline void widen_int8(const uint8_t* q, __m256 d, __m256 v[4]) {
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_mul_ps(d, bytes_to_floats(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)), true));
}

template <int64_t Kind>
inline void widen_registers(const uint8_t* b, __m256 v[4]) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  if constexpr (Kind == kQ8_0) {
    widen_int8(b + 2, d, v);
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Kind == kQ4_1 ? 4 : 2)));
    const __m128i low = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    if constexpr (Kind == kQ4_1) {
      const __m256 m = _mm256_set1_ps(half_at(b + 2));
      for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(_mm256_mul_ps(d, bytes_to_floats(parts[i], false)), m);
    } else {
      const __m256 eight = _mm256_set1_ps(8.f);
      for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(d, _mm256_sub_ps(bytes_to_floats(parts[i], false), eight));
    }
  }
}

inline void widen_block(const uint8_t* b, int64_t kind, float* out) {
  __m256 v[4];
  if (kind == kQ8_0) widen_registers<kQ8_0>(b, v);
  else if (kind == kQ4_0) widen_registers<kQ4_0>(b, v);
  else widen_registers<kQ4_1>(b, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, v[i]);
}

// Several input rows: kTileRows weight rows widened once (`widen(row, b, v)`: the 32 floats of
// the row's b-th 32-weight block) into a thread-local buffer (L1), then
// every pair of input rows multiplied against all of them in one pass over k, a kTileRows x 2
// register tile (12 accumulators): each x vector loaded serves kTileRows weight rows and each
// widened vector two inputs, so x streams from L2 once per kTileRows weight rows (docs/cpu_kernels.md:
// the tile's shape). `next_tile`: the next tile's `tile_bytes`, asked for while this one computes.
// Weight row `row`'s K weights widened (`widen(row, b, v)`: its b-th 32-weight block) into `out`.
template <typename Widen>
inline void widen_row(Widen widen, int64_t row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    widen(row, b, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * 32 + 8 * i, v[i]);
  }
}

template <typename Widen>
void tile_rows(const float* x, Widen widen, const uint8_t* next_tile, int64_t tile_bytes, float* y, int64_t M,
               int64_t N, int64_t K, int64_t n, int rows_here) {
  thread_local std::vector<float> widened;
  widened.resize(kTileRows * K);
  // Read once: GCC otherwise fetched the thread-local's address (a __tls_get_addr call) at
  // every block of the int8 widening.
  float* const buffer = widened.data();
  for (int r = 0; r < kTileRows; ++r)
    widen_row(widen, n + std::min(r, rows_here - 1), K, buffer + r * K);  // a short tile repeats its last row
  const float* wr[kTileRows];
  for (int r = 0; r < kTileRows; ++r) wr[r] = buffer + r * K;
  for (int64_t m = 0; m < M; m += 2) {
    const bool two = m + 1 < M;
    const float* x0p = x + m * K;
    const float* x1p = two ? x0p + K : x0p;
    __m256 acc[kTileRows][2];
    for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      // The first pass asks for the next tile's blocks (64 bytes a step) while it computes, so
      // memory is not idle until the next tile's widening.
      if (m == 0 && k * 8 < tile_bytes) prefetch(next_tile + k * 8);
      const __m256 x0 = _mm256_loadu_ps(x0p + k), x1 = _mm256_loadu_ps(x1p + k);
      for (int r = 0; r < kTileRows; ++r) {
        __m256 v = _mm256_loadu_ps(wr[r] + k);
        // Held in a register for both FMAs: GCC otherwise folds the load into each (14 loads a
        // step for 12 FMAs, load-bound).
        __asm__("" : "+x"(v));
        acc[r][0] = _mm256_fmadd_ps(x0, v, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x1, v, acc[r][1]);
      }
    }
    // The 12 accumulators' sums by two transposing reductions (8 + 4), not 12 one by one.
    static_assert(kTileRows == 6, "the reductions below take 6 x 2 accumulators");
    alignas(32) float sums[16];
    const __m256 zero = _mm256_setzero_ps();
    const __m256 first[8] = {acc[0][0], acc[0][1], acc[1][0], acc[1][1], acc[2][0], acc[2][1], acc[3][0], acc[3][1]};
    const __m256 rest[8] = {acc[4][0], acc[4][1], acc[5][0], acc[5][1], zero, zero, zero, zero};
    _mm256_store_ps(sums, lane_sums(first));
    _mm256_store_ps(sums + 8, lane_sums(rest));
    for (int r = 0; r < rows_here; ++r) {
      y[m * N + n + r] = sums[2 * r];
      if (two) y[(m + 1) * N + n + r] = sums[2 * r + 1];
    }
  }
}

// Many input rows, their transpose at hand (matmul.h: takes_transposed): one broadcast tile's
// weight rows at a time widened to f32 into a thread-local buffer (in L1), then matmul.h's
// broadcast tiles over all the input rows at once (every weight a broadcast, no horizontal
// sums; the 6 x 2 dot tiles above pass over the widened rows M / 2 times). Chunks of
// kTransposedChunkRows.

template <typename Widen>
void widened_rows(const float* xt, Widen widen, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t tile = broadcast_tile_rows_for(M);
  thread_local std::vector<float> widened;
  widened.resize(tile * K);
  float* const buffer = widened.data();  // read once (tile_rows: the __tls_get_addr calls)
  for (int64_t n = n0; n < n1; n += tile) {
    const int64_t rows = std::min(tile, n1 - n);
    for (int64_t r = 0; r < rows; ++r) widen_row(widen, n + r, K, buffer + r * K);
    transposed_rows(xt, buffer, y + n, M, N, K, 0, rows);
  }
}

// kTileRows rows of blocks of `Kind` from row n (tile_rows).
template <int64_t Kind>
void block_tile_rows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t row_bytes,
                     int64_t n, int rows_here) {
  const auto widen = [&](int64_t row, int64_t b, __m256 v[4]) {
    widen_registers<Kind>(w + row * row_bytes + b * kBlockBytes[Kind], v);
  };
  tile_rows(x, widen, w + (n + kTileRows) * row_bytes, kTileRows * row_bytes, y, M, N, K, n, rows_here);
}

// Each 32-block's sum(x) / 8, the one-row loop's Q4 offset terms.
void block_sums(const float* x, int64_t K, float* eighth_sums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + b * 32;
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    eighth_sums[b] = sum8(sum) * 0.125f;
  }
}

inline __m256 half_lanes(const uint8_t* p) { return _mm256_broadcast_ss(half_entry(p)); }

// 8 bytes at p as 8 int32 lanes (signed for Q8_0; Q4 bytes, their nibbles split by the caller).
inline __m256i bytes_at(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

// 32 int8 weights at q times their inputs x, summed to 8 lanes (Q8_0 blocks and int8 rows).
inline __m256 int8_times_x(const uint8_t* q, const float* x) {
  __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_cvtepi32_ps(bytes_at(q, true)));
  for (int i = 1; i < 4; ++i)
    t = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * i), _mm256_cvtepi32_ps(bytes_at(q + 8 * i, true)), t);
  return t;
}

// acc + the block at b times its 32 inputs x (eighth_sum: their sum / 8 in every lane, for the Q4 offsets).
template <int64_t Kind>
inline __m256 block_dot(const uint8_t* b, const float* x, __m256 eighth_sum, __m256 acc) {
  __m256 t;
  if constexpr (Kind == kQ8_0) {
    t = int8_times_x(b + 2, x);
  } else {
    const uint8_t* q = b + (Kind == kQ4_1 ? 4 : 2);
    const __m256i first = bytes_at(q, false), second = bytes_at(q + 8, false), low = _mm256_set1_epi32(0x0F);
    t = _mm256_mul_ps(_mm256_loadu_ps(x), _mm256_cvtepi32_ps(_mm256_and_si256(first, low)));
    t = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_cvtepi32_ps(_mm256_and_si256(second, low)), t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), t);
  }
  if constexpr (Kind == kQ4_0) t = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), eighth_sum, t);
  acc = _mm256_fmadd_ps(half_lanes(b), t, acc);
  if constexpr (Kind == kQ4_1) acc = _mm256_fmadd_ps(half_lanes(b + 2), eighth_sum, acc);
  return acc;
}

// Block b's sum(x) / 8 in every lane; Q8_0 rows have no offset term (and no sums: null).
template <int64_t Kind>
inline __m256 eighth_sum_lanes(const float* eighth_sums, int64_t b) {
  if constexpr (Kind == kQ8_0) return _mm256_setzero_ps();
  else return _mm256_broadcast_ss(eighth_sums + b);
}

// A block row's stream asks for the bytes 1 KB ahead of the block it reads: the hardware
// prefetchers alone left the one-row loop short of memory (docs/cpu_kernels.md: prefetch
// distance). A prefetch past the end of the matrix is harmless: it never faults.
constexpr int64_t kPrefetchAhead = 1024;

// One input row (a sequence's decode): per block d * sum(x q) (+ m * sum(x) for Q4_1, - 8 d * sum(x)
// for Q4_0), two weight rows at a time (Q4). Each block's sum(x) / 8, broadcast to 8 lanes, carries
// the m (or -8) term through the same accumulator. The bytes go to 32-bit lanes by byte-to-int32
// loads (`vpmovzxbd` / `vpmovsxbd`, 8 bytes each): a Q4 byte j holds weights j and j + 16, so
// bytes 0-7 masked are weights 0-7, shifted 16-23, and x is read in its own order. That is 10
// vector ops a Q4 block against 13 for the earlier shifts and masks of one broadcast load (which
// needed x permuted): the Q4 loop is bound by its f32 products, not by the stream. Widening each
// block to d * q + m floats first is slower; the sums differ from the widened ones in the last
// bits (3e-7 of the largest output). Figures: docs/cpu_kernels.md, the one-row loop.
template <int64_t Kind>
void block_rows_one_input(const float* x, const float* eighth_sums, const uint8_t* w, float* y, int64_t K,
                          int64_t row_bytes, int64_t n0, int64_t n1) {
  constexpr int64_t size = kBlockBytes[Kind];
  const int64_t blocks = K / 32;
  // Q8_0 one weight row at a time (two, sharing x's loads, streamed slower); Q4 rows, bound by
  // their products rather than the stream, two at a time (docs/cpu_kernels.md).
  constexpr int64_t step = Kind == kQ8_0 ? 1 : 2;
  for (int64_t n = n0; n < n1; n += step) {
    const bool pair = step == 2 && n + 1 < n1;
    const uint8_t* r0 = w + n * row_bytes;
    const uint8_t* r1 = pair ? r0 + row_bytes : r0;
    __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
    int64_t b = 0;
    if (step == 1) {
      // Two accumulators over alternate blocks: with one, each block's d * t waited on the last
      // (a 4-cycle chain a block).
      for (; b + 1 < blocks; b += 2) {
        prefetch(r0 + b * size + kPrefetchAhead);
        a = block_dot<Kind>(r0 + b * size, x + b * 32, eighth_sum_lanes<Kind>(eighth_sums, b), a);
        c = block_dot<Kind>(r0 + (b + 1) * size, x + (b + 1) * 32, eighth_sum_lanes<Kind>(eighth_sums, b + 1), c);
      }
      a = _mm256_add_ps(a, c);
    }
    for (; b < blocks; ++b) {
      if (step == 2) prefetch(r0 + b * size + kPrefetchAhead), prefetch(r1 + b * size + kPrefetchAhead);
      const __m256 eighth_sum = eighth_sum_lanes<Kind>(eighth_sums, b);
      a = block_dot<Kind>(r0 + b * size, x + b * 32, eighth_sum, a);
      if (step == 2) c = block_dot<Kind>(r1 + b * size, x + b * 32, eighth_sum, c);
    }
    y[n] = sum8(a);
    if (pair) y[n + 1] = sum8(c);
  }
}

// Weight rows [n0, n1) against M input rows: one (block_rows_one_input), many with their transpose
// (widened_rows), or tiles of kTileRows weight rows (block_tile_rows).
template <int64_t Kind>
void block_rows_avx2(const float* x, const float* xt, const float* eighth_sums, const uint8_t* w, float* y, int64_t M,
                     int64_t N, int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  if (M == 1) return block_rows_one_input<Kind>(x, eighth_sums, w, y, K, row_bytes, n0, n1);
  if (xt) {
    const auto widen = [&](int64_t row, int64_t b, __m256 v[4]) {
      widen_registers<Kind>(w + row * row_bytes + b * kBlockBytes[Kind], v);
    };
    return widened_rows(xt, widen, y, M, N, K, n0, n1);
  }
  for (int64_t n = n0; n < n1; n += kTileRows)
    block_tile_rows<Kind>(x, w, y, M, N, K, row_bytes, n, static_cast<int>(std::min<int64_t>(kTileRows, n1 - n)));
}
#else
inline void widen_block(const uint8_t* b, int64_t kind, float* out) {
  const float d = half_to_float(b);
  if (kind == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
  } else if (kind == kQ4_0) {
    const uint8_t* q = b + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>((q[j] & 0xF) - 8);
      out[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
    }
  } else {
    const float m = half_to_float(b + 2);
    const uint8_t* q = b + 4;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(q[j] & 0xF) + m;
      out[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
    }
  }
}
#endif

// A block matmul's operands; one input row also comes with its blocks' sums for block_rows_one_input.
struct BlockInput {
  const float* x;  // [M, K]
  const float* eighth_sums;  // M == 1: each 32-block's sum(x) / 8 (block_sums)
  int64_t M, K;
  const float* xt;  // x transposed (matmul.h: transposed_input) where M takes that form, else nullptr
};

// Weight rows [n0, n1) of blocks `w` of `kind` against the input: y [M, N].
void block_rows(const BlockInput& in, const uint8_t* w, int64_t kind, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t row_bytes = in.K / 32 * kBlockBytes[kind];
#if defined(__AVX2__) && defined(__F16C__)
  const float *x = in.x, *sums = in.eighth_sums;
  if (kind == kQ8_0) return block_rows_avx2<kQ8_0>(x, in.xt, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
  if (kind == kQ4_0) return block_rows_avx2<kQ4_0>(x, in.xt, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
  return block_rows_avx2<kQ4_1>(x, in.xt, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
#endif
  const int64_t blocks = in.K / 32, size = kBlockBytes[kind];
  constexpr int kVectors = 32 / kLanes;
  alignas(64) float widened[32];
  // An accumulator per input row and vector of the block: no add waits on the one before it.
  vw acc[kMaxBlockRows][kVectors];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < in.M; ++m)
      for (int v = 0; v < kVectors; ++v) acc[m][v] = vw{};
    for (int64_t b = 0; b < blocks; ++b) {
      widen_block(row + b * size, kind, widened);
      for (int v = 0; v < kVectors; ++v) {
        const vw t = loadw(widened + v * kLanes);
        const float* x = in.x + b * 32 + v * kLanes;
        for (int64_t m = 0; m < in.M; ++m) acc[m][v] += loadw(x + m * in.K) * t;
      }
    }
    for (int64_t m = 0; m < in.M; ++m) {
      vw total = acc[m][0];
      for (int v = 1; v < kVectors; ++v) total += acc[m][v];
      y[m * N + n] = sumw(total);
    }
  }
}

// The input as block_rows reads it: for one row read by Q4 blocks (`q4`), its block sums in a
// buffer of this thread's that stays valid until its next call (a layer prepares each matmul's
// input before its job runs); else none.
// The input as a matmul of `kind` reads it: without the transpose where that kind's rows take the dot tiles.
BlockInput input_for(BlockInput in, int64_t kind) {
  if (!takes_transposed(kind, in.M)) in.xt = nullptr;
  return in;
}

// `transposed`: whether any matmul reading the input takes the transposed form.
BlockInput block_input(const float* x, int64_t M, int64_t K, bool q4, bool transposed) {
#if defined(__AVX2__) && defined(__F16C__)
  if (M == 1 && q4) {
    thread_local std::vector<float> eighth_sums;
    eighth_sums.resize(K / 32);
    block_sums(x, K, eighth_sums.data());
    return {x, eighth_sums.data(), M, K, nullptr};
  }
#endif
  return {x, nullptr, M, K, transposed_input(x, M, K, transposed)};
}

}  // namespace
