// One whole decoder layer (RMSNorm, RoPE, attention, gated SiLU) in one call, its weights by address.
#pragma once

#include "attention.h"
#include "crossover.h"
#include "lora.h"

namespace {

// ---------------------------------------------------------------- one decoder layer

// A whole pre-norm decoder layer (RMSNorm, RoPE, gated SiLU MLP: the Llama / Mistral / Qwen3
// shape) for rows of one token each, in one call. The per-op version ran 7 matmul calls, one
// attention call and ~26 small XLA fusions per layer, each a thunk of XLA's executor on its
// own threads beside ours; here the layer is five jobs of this file's pool and a few loops on
// the caller.

// A layer's matrix: f32 rows (kF32), rows of GGUF blocks of a kind (a file's layer may mix
// kinds), or int8 rows with their groups' scales (kI8).
struct Weight {
  const void* data;
  int64_t kind;
  const float* scale = nullptr;  // kI8: [N, K / group]
  int64_t group = 0;
};

// The input of a layer's matmul as its weights read it: one row's block sums (block_input) only
// when a Q4 weight reads it.
BlockInput layer_input(const float* x, int64_t M, int64_t K, const Weight* readers, int64_t count) {
  bool q4 = false;
  bool transposed = false;
  for (int64_t i = 0; i < count; ++i) {
    q4 |= readers[i].kind == kQ4_0 || readers[i].kind == kQ4_1;
    transposed |= takes_transposed(readers[i].kind, M);
  }
  return block_input(x, M, K, q4, transposed);
}

BlockInput layer_input(const float* x, int64_t M, int64_t K, std::initializer_list<Weight> readers) {
  return layer_input(x, M, K, readers.begin(), static_cast<int64_t>(readers.size()));
}

void any_rows(const BlockInput& shared, Weight w, float* y, int64_t N, int64_t n0, int64_t n1) {
  const BlockInput in = input_for(shared, w.kind);
  if (w.kind == kF32) return weight_rows(in.x, in.xt, static_cast<const float*>(w.data), y, in.M, N, in.K, n0, n1);
  if (w.kind == kI8) return int8_rows(in, {static_cast<const int8_t*>(w.data), w.scale, w.group}, y, N, n0, n1);
  block_rows(in, static_cast<const uint8_t*>(w.data), w.kind, y, N, n0, n1);
}

int64_t rows_per_chunk_for(Weight w, int64_t K, int64_t M) {
  if (w.kind == kF32) return rows_per_chunk_for(K, M);
  return block_rows_per_chunk(w.kind == kI8 ? K : K / 32 * kBlockBytes[w.kind], w.kind, M);
}

// Several matmuls sharing one input, chunked over all their weight rows as one job.
struct Segments {
  BlockInput x;
  Weight w[3];
  float* y[3];
  int64_t N[3];
  int64_t first_chunk[4];  // chunk index where each segment starts; [count] = total
  int64_t rows_per_chunk;
  int count;
};

Segments segments(const float* x, int64_t M, int64_t K, std::initializer_list<std::tuple<Weight, float*, int64_t>> parts) {
  Segments s{};
  s.rows_per_chunk = rows_per_chunk_for(std::get<0>(*parts.begin()), K, M);
  for (const auto& [w, y, n] : parts) {
    s.w[s.count] = w, s.y[s.count] = y, s.N[s.count] = n;
    s.first_chunk[s.count + 1] = s.first_chunk[s.count] + chunk_count(n, s.rows_per_chunk);
    ++s.count;
  }
  s.x = layer_input(x, M, K, s.w, s.count);
  return s;
}

void segments_chunk(const void* context, int64_t c) {
  const Segments& s = *static_cast<const Segments*>(context);
  int i = 0;
  while (c >= s.first_chunk[i + 1]) ++i;
  const int64_t local = c - s.first_chunk[i];
  any_rows(s.x, s.w[i], s.y[i], s.N[i], local * s.rows_per_chunk, chunk_end(local, s.rows_per_chunk, s.N[i]));
}

// out = residual + x @ w.T (out may be residual: each element is read, then written, by one chunk).
struct ResidualMatmul {
  BlockInput x;
  Weight w;
  float* y;  // scratch [M, N]
  int64_t N, rows_per_chunk;
  const float* residual;
  float* out;
};

ResidualMatmul residual_matmul(const float* x, int64_t M, int64_t K, Weight w, float* y, int64_t N,
                               const float* residual, float* out) {
  return {layer_input(x, M, K, {w}), w, y, N, rows_per_chunk_for(w, K, M), residual, out};
}

void residual_chunk(const void* context, int64_t c) {
  const ResidualMatmul& r = *static_cast<const ResidualMatmul*>(context);
  const int64_t n0 = c * r.rows_per_chunk, n1 = chunk_end(c, r.rows_per_chunk, r.N);
  any_rows(r.x, r.w, r.y, r.N, n0, n1);
  for (int64_t i = 0; i < r.x.M; ++i)
    for (int64_t n = n0; n < n1; ++n) r.out[i * r.N + n] = r.residual[i * r.N + n] + r.y[i * r.N + n];
}

// act = silu(x @ gate.T) * (x @ up.T): a chunk takes the same rows of both weights.
struct GatedMatmul {
  BlockInput x;
  Weight gate, up;
  float *gate_y, *up_y;  // scratch [M, N] each
  int64_t N, rows_per_chunk;
  float* act;
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// silu(a) * u in 8 lanes: a * sigmoid(a), the sigmoid from t = e^-|a| (exp_nonpositive, ~2 ulp of
// std::exp): 1 / (1 + t) where a >= 0, t / (1 + t) below. std::exp one element at a time was ~3%
// of the CPU time of a 32-sequence SmolLM2 step (`perf`: the gated chunks' own time and libm's
// expf). A NaN stays NaN (a * anything).
inline __m256 silu_times(__m256 a, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), a);
  const __m256 t = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 below = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, t, below), _mm256_add_ps(one, t));
  return _mm256_mul_ps(_mm256_mul_ps(a, sigmoid), u);
}
#endif

void gated_chunk(const void* context, int64_t c) {
  const GatedMatmul& g = *static_cast<const GatedMatmul*>(context);
  const int64_t N = g.N, n0 = c * g.rows_per_chunk, n1 = chunk_end(c, g.rows_per_chunk, N);
  any_rows(g.x, g.gate, g.gate_y, N, n0, n1);
  any_rows(g.x, g.up, g.up_y, N, n0, n1);
  for (int64_t i = 0; i < g.x.M; ++i) {
    const float *gate = g.gate_y + i * N, *up = g.up_y + i * N;
    float* act = g.act + i * N;
    int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    for (; n + 8 <= n1; n += 8)
      _mm256_storeu_ps(act + n, silu_times(_mm256_loadu_ps(gate + n), _mm256_loadu_ps(up + n)));
#endif
    for (; n < n1; ++n) act[n] = gate[n] / (1.f + std::exp(-gate[n])) * up[n];
  }
}

void rms_norm_rows(const float* x, const float* scale, float* out, int64_t M, int64_t D, float eps) {
  for (int64_t i = 0; i < M; ++i) {
    const float* r = x + i * D;
    vw squares = {};  // lanes of partial sums: one running sum made a 4-cycle chain an element
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) squares += loadw(r + d) * loadw(r + d);
    float ss = sumw(squares);
    for (; d < D; ++d) ss += r[d] * r[d];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = scale[d] * (r[d] * inv);
  }
}

// Rotate-half RoPE (the Hugging Face layout) of `heads` heads of one row, in place.
void rope_heads(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t j = 0; j < half; ++j) {
      const float a = v[j], b = v[j + half];
      v[j] = a * cos[j] - b * sin[j];
      v[j + half] = b * cos[j] + a * sin[j];
    }
  }
}

// One decoder layer's weights: norms f32, matrices [out, in] f32 rows or GGUF blocks; q_norm and
// k_norm are null where the model has none.
struct LayerWeights {
  const float* attn_norm;
  Weight wq, wk, wv, wo;
  const float *q_norm, *k_norm, *mlp_norm;
  Weight w_gate, w_up, w_down;
};

// D floats into a cache at element `at`: copied, or rounded to f16 (to nearest even, as XLA's
// convert: the reference path stores the same values), 8 at a time by F16C (one conversion at a
// time was ~1% of a 32-sequence step's CPU time).
inline void store_cached(void* cache, bool half, int64_t at, const float* x, int64_t D) {
  if (!half) return static_cast<void>(std::memcpy(static_cast<float*>(cache) + at, x, D * sizeof(float)));
  _Float16* out = static_cast<_Float16*>(cache) + at;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; d + 8 <= D; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < D; ++d) out[d] = static_cast<_Float16>(x[d]);
}

ffi::Error decoder_layer(const LayerWeights& w, int64_t F, int64_t D, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k,
                         ffi::AnyBuffer cache_v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                         ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> x_out,
                         ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float eps, float scale,
                         int64_t num_heads, int64_t num_kv_heads, int64_t window, int64_t page_size,
                         int64_t head_stride, int64_t page_stride, int64_t num_pages,
                         const LayerLora* lora = nullptr) {
  const auto xd = x.dimensions();     // [M, H]
  const auto td = tables.dimensions();  // [M, pages_per_row]
  if (xd.size() != 2 || td.size() != 2 || td[0] != xd[0] || num_kv_heads < 1 || num_heads % num_kv_heads ||
      page_size < 1 || num_pages < 1 || D < 2 || D % 2 || F < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer: inconsistent shapes");
  }
  const int64_t M = xd[0], H = xd[1];
  const int64_t QD = num_heads * D, KD = num_kv_heads * D, G = num_heads / num_kv_heads;
  const int64_t pages_per_row = td[1];
  const bool qk_norm = w.q_norm != nullptr && w.k_norm != nullptr;
  bool half = false;
  if (!cache_kind(cache_k, cache_v, &half) || k_out->element_type() != cache_k.element_type() ||
      static_cast<int64_t>(cos.element_count()) != M * (D / 2) ||
      (num_kv_heads - 1) * head_stride + (num_pages - 1) * page_stride + page_size * D >
          static_cast<int64_t>(cache_k.element_count())) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer: inconsistent shapes");
  }
  // The caches are aliased to k_out / v_out (updated in place); should XLA hand over copies, fill them.
  void* ck = k_out->untyped_data();
  void* cv = v_out->untyped_data();
  if (ck != cache_k.untyped_data()) std::memcpy(ck, cache_k.untyped_data(), cache_k.size_bytes());
  if (cv != cache_v.untyped_data()) std::memcpy(cv, cache_v.untyped_data(), cache_v.size_bytes());

  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(M * (H + QD + 2 * KD + QD + 3 * F + H)));
  float* h = scratch.data();   // [M, H] normed input
  float* q = h + M * H;        // [M, QD]
  float* k = q + M * QD;       // [M, KD]
  float* v = k + M * KD;       // [M, KD]
  float* attn = v + M * KD;    // [M, QD]
  float* gate = attn + M * QD;  // [M, F]
  float* up = gate + M * F;     // [M, F]
  float* act = up + M * F;      // [M, F]
  float* tmp = act + M * F;     // [M, H]
  float* out = x_out->typed_data();
  const int32_t* pos = positions.typed_data();
  const int32_t* ok = valid.typed_data();
  const int32_t* table = tables.typed_data();

  rms_norm_rows(x.typed_data(), w.attn_norm, h, M, H, eps);
  Segments qkv = segments(h, M, H, {{w.wq, q, QD}, {w.wk, k, KD}, {w.wv, v, KD}});
  pool().run(segments_chunk, &qkv, qkv.first_chunk[qkv.count]);
  if (lora != nullptr) {  // each row's adapter on the projections, before the norms and RoPE (as PEFT)
    add_lora(lora, lora->q, h, H, q, QD, M);
    add_lora(lora, lora->k, h, H, k, KD, M);
    add_lora(lora, lora->v, h, H, v, KD, M);
  }

  // Every row's key and value go into the cache before any row reads it: a row then attends to
  // cached positions [lo, position] alone, which holds its history and the new keys of its own
  // sequence's earlier tokens in this batch (the reference's two parts).
  thread_local std::vector<int32_t> lo, hi;  // the positions row i attends to; empty for padding
  lo.assign(static_cast<size_t>(M), 0), hi.assign(static_cast<size_t>(M), 0);
  for (int64_t i = 0; i < M; ++i) {
    if (!ok[i]) continue;
    if (qk_norm) {
      rms_norm_rows(q + i * QD, w.q_norm, q + i * QD, num_heads, D, eps);
      rms_norm_rows(k + i * KD, w.k_norm, k + i * KD, num_kv_heads, D, eps);
    }
    rope_heads(q + i * QD, num_heads, D, cos.typed_data() + i * (D / 2), sin.typed_data() + i * (D / 2));
    rope_heads(k + i * KD, num_kv_heads, D, cos.typed_data() + i * (D / 2), sin.typed_data() + i * (D / 2));
    const int64_t p = pos[i];
    lo[i] = static_cast<int32_t>(window > 0 && p - window + 1 > 0 ? p - window + 1 : 0);
    hi[i] = static_cast<int32_t>(p + 1);
    const int64_t slot_page = p / page_size;
    if (p < 0 || slot_page >= pages_per_row) continue;  // past the sequence's room: dropped, as the reference
    const int64_t page = table[i * pages_per_row + slot_page];
    if (page < 0 || page >= num_pages) continue;
    for (int64_t hh = 0; hh < num_kv_heads; ++hh) {
      const int64_t at = hh * head_stride + page * page_stride + (p % page_size) * D;
      store_cached(ck, half, at, k + i * KD + hh * D, D);
      store_cached(cv, half, at, v + i * KD + hh * D, D);
    }
  }
  thread_local std::vector<float> top, total;
  top.resize(M * num_heads), total.resize(M * num_heads);
  const Attention a{q, ck, cv, half, table, lo.data(), hi.data(), attn, top.data(), total.data(),
                    num_kv_heads, G, D, pages_per_row, page_size, head_stride, page_stride, num_pages, scale};
  pool().run(attention_chunk, &a, M * num_kv_heads * G);
  for (int64_t i = 0; i < M * num_heads; ++i) {
    const float inv = 1.f / (total[i] > 1e-30f ? total[i] : 1e-30f);
    for (int64_t d = 0; d < D; ++d) attn[i * D + d] *= inv;
  }

  const ResidualMatmul o = residual_matmul(attn, M, QD, w.wo, tmp, H, x.typed_data(), out);
  pool().run(residual_chunk, &o, chunk_count(H, o.rows_per_chunk));
  if (lora != nullptr) add_lora(lora, lora->o, attn, QD, out, H, M);  // out = x + o(attn): its delta adds there

  rms_norm_rows(out, w.mlp_norm, h, M, H, eps);
  const int64_t rows_f = rows_per_chunk_for(w.w_gate, H, M);
  const GatedMatmul mlp{layer_input(h, M, H, {w.w_gate, w.w_up}), w.w_gate, w.w_up, gate, up, F, rows_f, act};
  pool().run(gated_chunk, &mlp, chunk_count(F, rows_f));
  if (lora != nullptr && (lora->gate.a || lora->up.a)) {  // gate and up changed: their product again
    add_lora(lora, lora->gate, h, H, gate, F, M);
    add_lora(lora, lora->up, h, H, up, F, M);
    for (int64_t i = 0; i < M * F; ++i) act[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }

  const ResidualMatmul down = residual_matmul(act, M, F, w.w_down, tmp, H, out, out);
  pool().run(residual_chunk, &down, chunk_count(H, down.rows_per_chunk));
  if (lora != nullptr) add_lora(lora, lora->down, act, F, out, H, M);
  return ffi::Error::Success();
}


ffi::Error DecoderLayer(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> attn_norm, ffi::Buffer<ffi::F32> wq,
                        ffi::Buffer<ffi::F32> wk, ffi::Buffer<ffi::F32> wv, ffi::Buffer<ffi::F32> wo,
                        ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> mlp_norm,
                        ffi::Buffer<ffi::F32> w_gate, ffi::Buffer<ffi::F32> w_up, ffi::Buffer<ffi::F32> w_down,
                        ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k,
                        ffi::AnyBuffer cache_v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                        ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> x_out,
                        ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float eps, float scale,
                        int64_t num_heads, int64_t num_kv_heads, int64_t window, int64_t page_size,
                        int64_t head_stride, int64_t page_stride, int64_t num_pages, bool qk_norm) {
  const auto xd = x.dimensions();
  const auto gd = w_gate.dimensions();  // [F, H]
  if (xd.size() != 2 || gd.size() != 2 || num_heads < 1 || xd[1] < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer: inconsistent shapes");
  }
  const int64_t H = xd[1], F = gd[0];
  const int64_t D = static_cast<int64_t>(wq.element_count()) / H / num_heads;
  const int64_t QD = num_heads * D, KD = num_kv_heads * D;
  if (gd[1] != H || static_cast<int64_t>(wq.element_count()) != QD * H ||
      static_cast<int64_t>(wk.element_count()) != KD * H || static_cast<int64_t>(wv.element_count()) != KD * H ||
      static_cast<int64_t>(wo.element_count()) != H * QD ||
      static_cast<int64_t>(w_up.element_count()) != F * H || static_cast<int64_t>(w_down.element_count()) != H * F ||
      static_cast<int64_t>(attn_norm.element_count()) != H || static_cast<int64_t>(mlp_norm.element_count()) != H ||
      (qk_norm && (static_cast<int64_t>(q_norm.element_count()) != D ||
                   static_cast<int64_t>(k_norm.element_count()) != D))) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer: inconsistent shapes");
  }
  const auto f32 = [](const ffi::Buffer<ffi::F32>& b) { return Weight{b.typed_data(), kF32}; };
  const LayerWeights w{attn_norm.typed_data(), f32(wq), f32(wk), f32(wv), f32(wo),
                       qk_norm ? q_norm.typed_data() : nullptr, qk_norm ? k_norm.typed_data() : nullptr,
                       mlp_norm.typed_data(), f32(w_gate), f32(w_up), f32(w_down)};
  return decoder_layer(w, F, D, x, cos, sin, cache_k, cache_v, tables, positions, valid, x_out, k_out, v_out, eps,
                       scale, num_heads, num_kv_heads, window, page_size, head_stride, page_stride, num_pages);
}

// The same layer with its weights named by address: row `layer` of `addresses` [layers, 66] holds
// the eleven weights in the order of LayerWeights' fields as (low, high, kind, scale low, scale
// high, group): the address's 32-bit halves (0 for none), kF32, a GGUF block kind or kI8 (norms
// are f32), and for kI8 its scales' address and group. A program whose every
// layer this kernel runs then takes one small table instead of eleven arguments per layer: JAX's
// dispatch pays per argument (cbjax/runtime/cpu/kernels.py, `LayerAddresses`; docs/cpu_kernels.md).
ffi::Error decoder_layer_at(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> addresses, ffi::Buffer<ffi::F32> cos,
                          ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> valid,
                          ffi::ResultBuffer<ffi::F32> x_out, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out, float eps, float scale, int64_t num_heads,
                          int64_t num_kv_heads, int64_t window, int64_t page_size, int64_t head_stride,
                          int64_t page_stride, int64_t num_pages, int64_t layer, int64_t intermediate,
                          int64_t head_dim, const LayerLora* lora) {
  constexpr int64_t kWeights = 11;
  const auto ad = addresses.dimensions();
  constexpr int64_t kFields = 6;
  if (ad.size() != 2 || ad[1] != kFields * kWeights || layer < 0 || layer >= ad[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer_at: bad address table");
  }
  const uint32_t* row = addresses.typed_data() + layer * kFields * kWeights;
  const auto address = [](const uint32_t* halves) {
    return reinterpret_cast<const void*>(static_cast<uintptr_t>(halves[0]) | static_cast<uintptr_t>(halves[1]) << 32);
  };
  Weight p[kWeights];
  for (int64_t i = 0; i < kWeights; ++i) {
    const uint32_t* f = row + kFields * i;
    p[i] = {address(f), static_cast<int64_t>(f[2]), static_cast<const float*>(address(f + 3)),
            static_cast<int64_t>(f[5])};
  }
  const auto norm = [](Weight w) { return w.kind == kF32 ? static_cast<const float*>(w.data) : nullptr; };
  const LayerWeights w{norm(p[0]), p[1], p[2], p[3], p[4], norm(p[5]), norm(p[6]), norm(p[7]), p[8], p[9], p[10]};
  const int64_t H = x.dimensions().back(), QD = num_heads * head_dim;
  bool ok = w.attn_norm && w.mlp_norm && (p[5].data == nullptr || w.q_norm) && (p[6].data == nullptr || w.k_norm);
  for (int i : {1, 2, 3, 4, 8, 9, 10}) {
    const int64_t K = i == 4 ? QD : i == 10 ? intermediate : H;  // wo reads attention, w_down the MLP's act
    ok = ok && p[i].data && p[i].kind >= 0 && p[i].kind <= kI8 && (p[i].kind == kF32 || K % 32 == 0) &&
         (p[i].kind != kI8 || (p[i].scale && int8_group_fits(p[i].group, K)));
  }
  if (!ok) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer_at: a weight has no address or kind");
  if (x.dimensions().front() > kMaxBlockRows) {  // the blocks' scalar path keeps an accumulator per row
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_decoder_layer_at: too many rows");
  }
  return decoder_layer(w, intermediate, head_dim, x, cos, sin, cache_k, cache_v, tables, positions, valid, x_out,
                       k_out, v_out, eps, scale, num_heads, num_kv_heads, window, page_size, head_stride,
                       page_stride, num_pages, lora);
}

ffi::Error DecoderLayerAt(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> addresses, ffi::Buffer<ffi::F32> cos,
                          ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> valid,
                          ffi::ResultBuffer<ffi::F32> x_out, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out, float eps, float scale, int64_t num_heads,
                          int64_t num_kv_heads, int64_t window, int64_t page_size, int64_t head_stride,
                          int64_t page_stride, int64_t num_pages, int64_t layer, int64_t intermediate,
                          int64_t head_dim) {
  return decoder_layer_at(x, addresses, cos, sin, cache_k, cache_v, tables, positions, valid, x_out, k_out, v_out,
                          eps, scale, num_heads, num_kv_heads, window, page_size, head_stride, page_stride, num_pages,
                          layer, intermediate, head_dim, nullptr);
}

}  // namespace
