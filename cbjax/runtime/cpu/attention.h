// Decode attention: each row's query against its own history in the slot or paged cache, read once
// up to its own length.
#pragma once

#include "pool.h"

namespace {

// ---------------------------------------------------------------- decode attention

// One query token per row attends to the cached keys of its sequence at positions [lo, hi).
// The cache is pages: position p of row b is in page tables[b, p / page_size], at element
// head * head_stride + page * page_stride + (p % page_size) * D of the layer's buffer. The slot
// layout [slots, kv_heads, max_len, D] is one page per slot (page_size = max_len).
// A cache holds f32, or f16 (`half`: kv_cache_dtype float16, half the bytes each read streams).
struct Attention {
  const float* q;       // [B, kv_heads * G, D]
  const void* k;        // the layer's cache, float or _Float16
  const void* v;
  bool half;
  const int32_t* tables;  // [B, pages_per_row]
  const int32_t* lo;      // [B]
  const int32_t* hi;      // [B]
  float* out;             // [B, kv_heads, G, D], unnormalised
  float* top;             // [B, kv_heads, G]
  float* total;           // [B, kv_heads, G]
  int64_t kv_heads, G, D, pages_per_row, page_size, head_stride, page_stride, num_pages;
  float scale;
};

constexpr float kMasked = -1e30f;  // as cbjax/models/attention.py: a row that sees nothing stays finite

template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    if (D % 16 == 0) {
      v16 acc = {};
      for (int64_t d = 0; d < D; d += 16) acc += load16(a + d) * load16(b + d);
      return sum16(acc);
    }
  }
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * static_cast<float>(b[d]);
  return s;
}

// Query head g of (row b, kv head h): where its query and output are, the positions it attends to
// ([lo, hi), clipped to the row's room) and where position p's key (or value) lives; the output
// starts at zero and its max and sum at "nothing seen".
struct Head {
  const Attention& a;
  int64_t b, h, index, lo, hi;
  Head(const Attention& attention, int64_t row, int64_t kv_head, int64_t g)
      : a(attention), b(row), h(kv_head), index((row * attention.kv_heads + kv_head) * attention.G + g) {
    lo = a.lo[b] > 0 ? a.lo[b] : 0;
    hi = a.hi[b] < a.pages_per_row * a.page_size ? a.hi[b] : a.pages_per_row * a.page_size;
    std::memset(out(), 0, sizeof(float) * a.D);
    a.top[index] = kMasked, a.total[index] = 0.f;
  }
  const float* q() const { return a.q + index * a.D; }
  float* out() const { return a.out + index * a.D; }
  template <typename T>
  const T* row(const void* cache, int64_t p) const {
    int64_t page = a.tables[b * a.pages_per_row + p / a.page_size];
    page = page < 0 ? 0 : (page >= a.num_pages ? a.num_pages - 1 : page);  // as the reference's clip
    return static_cast<const T*>(cache) + h * a.head_stride + page * a.page_stride + (p % a.page_size) * a.D;
  }
  // keys[i], values[i]: position lo + i's key and value, one page lookup (and division) a page:
  // two divisions a position were ~half of SmolLM2's attention time at eight sequences.
  template <typename T>
  void rows(const T** keys, const T** values) const {
    for (int64_t p = lo; p < hi;) {
      const T *k = row<T>(a.k, p), *v = row<T>(a.v, p);
      const int64_t run = std::min(hi - p, a.page_size - p % a.page_size);
      for (int64_t i = 0; i < run; ++i) keys[p - lo + i] = k + i * a.D, values[p - lo + i] = v + i * a.D;
      p += run;
    }
  }
};

// Query head g of (row b, kv head h), any head size: scores, then e^(s - max) and the values.
template <typename T>
void attention_head_scalar(const Head& head) {
  const Attention& a = head.a;
  const int64_t D = a.D, lo = head.lo, hi = head.hi;
  if (hi <= lo) return;
  const float* q = head.q();
  float* out = head.out();
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(hi - lo));
  float top = kMasked, total = 0.f;
  for (int64_t p = lo; p < hi; ++p) {
    const float s = dot(q, head.row<T>(a.k, p), D) * a.scale;
    scores[p - lo] = s;
    top = s > top ? s : top;
  }
  for (int64_t p = lo; p < hi; ++p) {
    const T* value = head.row<T>(a.v, p);
    const float e = std::exp(scores[p - lo] - top);
    total += e;
    for (int64_t d = 0; d < D; ++d) out[d] += e * static_cast<float>(value[d]);
  }
  a.top[head.index] = top, a.total[head.index] = total;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// e^x for x <= 0 in 8 lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n put in
// the exponent), within ~2 ulp of std::exp; below -87 it gives e^-87 (the softmax's weights
// there are < 1e-37 of the largest: zero in every sum they join).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// 8 cached floats at p (f16 widened by F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[d0, d0 + 8 V) = sum_i e_i values[i][d0, d0 + 8 V), out held in V registers (a count fixed at
// compile time: a runtime one left them on the stack).
template <int V, typename T>
inline void weighted_values(const float* e, const T* const* values, int64_t n, int64_t d0, float* out) {
  __m256 o[V];
  for (int v = 0; v < V; ++v) o[v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 ei = _mm256_broadcast_ss(e + i);
    const T* value = values[i] + d0;
    for (int v = 0; v < V; ++v) o[v] = _mm256_fmadd_ps(ei, load8(value + 8 * v), o[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + d0 + 8 * v, o[v]);
}

// Query head g of (row b, kv head h) for head sizes of whole 8-float vectors. Scores eight
// positions at a time, each key's dot product in its own accumulator and the eight summed
// together (one horizontal reduction per eight keys instead of one per key), e^(s - max) eight
// at a time, then out = sum e_p v_p with out in registers. SmolLM2's decode (9 query heads over 3
// kv heads of 64) spent 14% of a step at one sequence and 22% at eight in the per-key version.
template <typename T>
void attention_head_avx2(const Head& head) {
  const Attention& a = head.a;
  const int64_t D = a.D, n = head.hi - head.lo;
  if (n <= 0) return;
  const float* q = head.q();
  float* out = head.out();
  thread_local std::vector<float> scores;
  thread_local std::vector<const T*> keys, values;
  scores.resize(static_cast<size_t>(n + 8)), keys.resize(static_cast<size_t>(n + 8));
  values.resize(static_cast<size_t>(n));
  head.rows(keys.data(), values.data());
  // The last group of eight reads real keys past n (their scores are masked below): no test per
  // key in the loop, which kept the accumulators on the stack.
  for (int64_t i = n; i < n + 8; ++i) keys[i] = keys[0];
  const __m256 scale = _mm256_set1_ps(a.scale);
  __m256 top = _mm256_set1_ps(kMasked);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, load8(keys[i + j] + d), acc[j]);
    }
    __m256 s = _mm256_mul_ps(lane_sums(acc), scale);
    if (m < 8) s = _mm256_blendv_ps(_mm256_set1_ps(kMasked), s, first_lanes(m));
    _mm256_storeu_ps(scores.data() + i, s);
    top = _mm256_max_ps(top, s);
  }
  const float max = [&] {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    return *std::max_element(lanes, lanes + 8);
  }();
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + i), _mm256_set1_ps(max)));
    _mm256_storeu_ps(scores.data() + i, e);  // past n the masked lanes give 0 (clamped to e^-87 of ~-1e30: ~0)
    total = _mm256_add_ps(total, n - i >= 8 ? e : _mm256_and_ps(e, first_lanes(n - i)));
  }
  a.top[head.index] = max;
  a.total[head.index] = sum8(total);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(8, (D - d0) / 8)) {
      case 8: weighted_values<8, T>(scores.data(), values.data(), n, d0, out); break;
      case 7: weighted_values<7, T>(scores.data(), values.data(), n, d0, out); break;
      case 6: weighted_values<6, T>(scores.data(), values.data(), n, d0, out); break;
      case 5: weighted_values<5, T>(scores.data(), values.data(), n, d0, out); break;
      case 4: weighted_values<4, T>(scores.data(), values.data(), n, d0, out); break;
      case 3: weighted_values<3, T>(scores.data(), values.data(), n, d0, out); break;
      case 2: weighted_values<2, T>(scores.data(), values.data(), n, d0, out); break;
      default: weighted_values<1, T>(scores.data(), values.data(), n, d0, out);
    }
  }
}
#endif

// One (row, kv head, query head) a chunk: each query head's softmax is its own.
void attention_chunk(const void* context, int64_t c) {
  const Attention& a = *static_cast<const Attention*>(context);
  const int64_t g = c % a.G, h = c / a.G % a.kv_heads, b = c / a.G / a.kv_heads;
  const Head head(a, b, h, g);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (a.D % 8 == 0) return a.half ? attention_head_avx2<_Float16>(head) : attention_head_avx2<float>(head);
#endif
  a.half ? attention_head_scalar<_Float16>(head) : attention_head_scalar<float>(head);
}

// Whether a layer's caches are one of the kernel's kinds, both alike (f32 or f16).
bool cache_kind(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, bool* half) {
  *half = k.element_type() == ffi::DataType::F16;
  return k.element_type() == v.element_type() && (*half || k.element_type() == ffi::DataType::F32) &&
         k.element_count() == v.element_count();
}

ffi::Error HistoryAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> top,
                            ffi::ResultBuffer<ffi::F32> total, float scale, int64_t page_size, int64_t head_stride,
                            int64_t page_stride, int64_t num_pages) {
  const auto od = out->dimensions();  // [B, kv_heads, G, D]
  const auto td = tables.dimensions();  // [B, pages_per_row]
  bool half = false;
  if (od.size() != 4 || td.size() != 2 || td[0] != od[0] || q.element_count() != out->element_count() ||
      !cache_kind(k, v, &half) || num_pages < 1 || page_size < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_history_attention: inconsistent shapes or cache kinds");
  }
  const int64_t B = od[0];
  const Attention a{q.typed_data(), k.untyped_data(), v.untyped_data(), half, tables.typed_data(), lo.typed_data(),
                    hi.typed_data(), out->typed_data(), top->typed_data(), total->typed_data(),
                    od[1], od[2], od[3], td[1], page_size, head_stride, page_stride, num_pages, scale};
  const int64_t last = (num_pages - 1) * page_stride + (od[1] - 1) * head_stride + page_size * od[3];
  if (last > static_cast<int64_t>(k.element_count())) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_history_attention: strides exceed the cache");
  }
  pool().run(attention_chunk, &a, B * od[1] * od[2]);
  return ffi::Error::Success();
}

}  // namespace
