// CPU kernels of cbjax's decode steps, as XLA FFI custom calls (cbjax/models/cpu_kernels.py
// builds and registers them; the pure-JAX code they replace stays the reference and the tests
// compare the two).
//
// Why they exist: a decode step at batch 1-16 is a chain of ~200 small dependent matmuls and
// ~60 small attention reads. XLA:CPU runs each matmul through YNNPACK, paying ~40 us of
// thread-pool hand-off each and streaming the weights at 7-12 GB/s at 8 rows, and runs decode
// attention as single-threaded multiply-reduce loops over the whole attended-length bucket.
// Here every weight row is read once for all input rows (4 x 4 register tiles), attention
// reads each row's keys and values once up to its own length, and the caller and a small pool
// of briefly spinning workers share the work in chunks.
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <chrono>

#ifdef __AVX512F__
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
// 8 floats) that tile, each 16-float vector split in two, spilled on every step: a SmolLM2
// decode step of 8 rows took 185 ms against 43 ms for 1 row (2-core AMD EPYC). With 8-float
// vectors and 2 weight rows x 4 input rows (8 + 2 + 1 registers): 48 ms for 8 rows, 75 ms for
// 16 (4 x 4 of 8-float vectors: 50 / 78 ms; 4 x 2: 65 / 97 ms).
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
    // stream never stalls on compute (8 rows, 30-layer matmul chain: 34.4 -> 29.5 ms; an
    // 8-wide tile in one pass instead was slower, 42 ms: eight input loads per step).
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

void weight_rows(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
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

int usable_cpus() {
  if (const char* env = std::getenv("CBJAX_CPU_KERNEL_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// The caller and the pool's workers claim chunks of a job from one counter until none is left.
// A worker that the OS has not scheduled yet simply finds nothing to do: the caller never waits
// for a thread to wake (on 2 cores, XLA's own spinning threads can keep ours off the CPU for a
// whole time slice), only for chunks already claimed. Workers spin for 100 us after each job
// before they sleep: a decode step calls its kernels back to back.
class Pool {
 public:
  using ChunkFn = void (*)(const void* context, int64_t chunk);

  explicit Pool(int size) : size_(size) {
    for (int i = 1; i < size_; ++i) std::thread([this] { work(); }).detach();
  }

  // Runs fn(context, c) for c in [0, chunks). A call that finds the pool busy (XLA ran two
  // kernels concurrently) runs every chunk itself.
  void run(ChunkFn fn, const void* context, int64_t chunks) {
    bool idle = false;
    if (size_ == 1 || chunks < 2 || !busy_.compare_exchange_strong(idle, true)) {
      for (int64_t c = 0; c < chunks; ++c) fn(context, c);
      return;
    }
    job_ = Job{fn, context, chunks};
    done_.store(0, std::memory_order_relaxed);
    const uint64_t id = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ticket_.store(id << 32, std::memory_order_release);  // publishes job_ and done_
    }
    cv_.notify_all();
    run_chunks(id);
    while (done_.load(std::memory_order_acquire) < chunks) cpu_relax();
    // Close job `id` before the next call rewrites job_: a worker that loaded this job's
    // ticket (every chunk claimed) and then read the next job's larger chunk count would
    // otherwise win its compare-exchange, run a chunk of the next job under this id and
    // bump done_ past that job's count, so its caller spun forever (seen once: a hang in
    // MatmulNT after 600 decode calls). No compare-exchange on a ticket of `id` can succeed
    // after this store, since ids only grow.
    ticket_.store((id << 32) | 0xffffffffu, std::memory_order_release);
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct Job {
    ChunkFn fn;
    const void* context;
    int64_t chunks;
  };

  // Claims and runs chunks of job `id` until none is left; a stale id claims nothing.
  void run_chunks(uint64_t id) {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != id) return;
      const int64_t c = static_cast<int64_t>(t & 0xffffffffu);
      if (c >= job_.chunks) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      // Job `id` cannot end (nor job_ change) before this claimed chunk is done.
      job_.fn(job_.context, c);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; (ticket_.load(std::memory_order_acquire) >> 32) == seen; ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(100)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
          break;
        }
        cpu_relax();
      }
      seen = ticket_.load(std::memory_order_acquire) >> 32;
      run_chunks(seen);
    }
  }

  const int size_;
  std::atomic<uint64_t> ticket_{0};  // (job id << 32) | next unclaimed chunk
  std::atomic<int64_t> done_{0};
  std::atomic<bool> busy_{false};
  Job job_{};
  std::mutex mu_;
  std::condition_variable cv_;
};

Pool& pool() {
  static Pool* p = new Pool(usable_cpus());  // never destroyed: its threads live as long as the process
  return *p;
}

// ---------------------------------------------------------------- matmul

struct Matmul {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K, rows_per_chunk;
};

void matmul_chunk(const void* context, int64_t c) {
  const Matmul& m = *static_cast<const Matmul*>(context);
  const int64_t n0 = c * m.rows_per_chunk;
  const int64_t n1 = n0 + m.rows_per_chunk < m.N ? n0 + m.rows_per_chunk : m.N;
  weight_rows(m.x, m.w, m.y, m.M, m.N, m.K, n0, n1);
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
  // About 64 KB of weights a chunk, whole 4-row tiles: small enough to share out evenly.
  int64_t rows = (16384 / K) / 4 * 4;
  rows = rows < 4 ? 4 : rows;
  const Matmul m{x.typed_data(), w.typed_data(), y->typed_data(), M, N, K, rows};
  pool().run(matmul_chunk, &m, (N + rows - 1) / rows);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- decode attention

// One query token per row attends to the cached keys of its sequence at positions [lo, hi).
// The cache is pages: position p of row b is in page tables[b, p / page_size], at element
// head * head_stride + page * page_stride + (p % page_size) * D of the layer's buffer. The slot
// layout [slots, kv_heads, max_len, D] is one page per slot (page_size = max_len).
struct Attention {
  const float* q;       // [B, kv_heads * G, D]
  const float* k;       // the layer's cache
  const float* v;
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

inline float dot(const float* a, const float* b, int64_t D) {
  if (D % 16 == 0) {
    v16 acc = {};
    for (int64_t d = 0; d < D; d += 16) acc += load16(a + d) * load16(b + d);
    return sum16(acc);
  }
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// One (row, kv head): the G query heads of the group read each key and value once.
void attention_chunk(const void* context, int64_t c) {
  const Attention& a = *static_cast<const Attention*>(context);
  const int64_t b = c / a.kv_heads, h = c % a.kv_heads;
  const int64_t G = a.G, D = a.D;
  const float* q = a.q + (b * a.kv_heads + h) * G * D;
  float* out = a.out + (b * a.kv_heads + h) * G * D;
  float* top = a.top + (b * a.kv_heads + h) * G;
  float* total = a.total + (b * a.kv_heads + h) * G;
  const int64_t lo = a.lo[b] > 0 ? a.lo[b] : 0;
  const int64_t hi = a.hi[b] < a.pages_per_row * a.page_size ? a.hi[b] : a.pages_per_row * a.page_size;
  std::memset(out, 0, sizeof(float) * G * D);
  for (int64_t g = 0; g < G; ++g) top[g] = kMasked, total[g] = 0.f;
  if (hi <= lo) return;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(G * (hi - lo)));
  const int32_t* table = a.tables + b * a.pages_per_row;
  auto row = [&](const float* cache, int64_t p) {
    int64_t page = table[p / a.page_size];
    page = page < 0 ? 0 : (page >= a.num_pages ? a.num_pages - 1 : page);  // as the reference's clip
    return cache + h * a.head_stride + page * a.page_stride + (p % a.page_size) * D;
  };
  for (int64_t p = lo; p < hi; ++p) {
    const float* key = row(a.k, p);
    for (int64_t g = 0; g < G; ++g) {
      const float s = dot(q + g * D, key, D) * a.scale;
      scores[g * (hi - lo) + (p - lo)] = s;
      top[g] = s > top[g] ? s : top[g];
    }
  }
  for (int64_t p = lo; p < hi; ++p) {
    const float* value = row(a.v, p);
    for (int64_t g = 0; g < G; ++g) {
      const float e = std::exp(scores[g * (hi - lo) + (p - lo)] - top[g]);
      total[g] += e;
      float* o = out + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += e * value[d];
    }
  }
}

ffi::Error HistoryAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> top,
                            ffi::ResultBuffer<ffi::F32> total, float scale, int64_t page_size, int64_t head_stride,
                            int64_t page_stride, int64_t num_pages) {
  const auto od = out->dimensions();  // [B, kv_heads, G, D]
  const auto td = tables.dimensions();  // [B, pages_per_row]
  if (od.size() != 4 || td.size() != 2 || td[0] != od[0] || q.element_count() != out->element_count() ||
      k.element_count() != v.element_count() || num_pages < 1 || page_size < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_history_attention: inconsistent shapes");
  }
  const int64_t B = od[0];
  const Attention a{q.typed_data(), k.typed_data(), v.typed_data(), tables.typed_data(), lo.typed_data(),
                    hi.typed_data(), out->typed_data(), top->typed_data(), total->typed_data(),
                    od[1], od[2], od[3], td[1], page_size, head_stride, page_stride, num_pages, scale};
  const int64_t last = (num_pages - 1) * page_stride + (od[1] - 1) * head_stride + page_size * od[3];
  if (last > static_cast<int64_t>(k.element_count())) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "cbjax_history_attention: strides exceed the cache");
  }
  pool().run(attention_chunk, &a, B * od[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_history_attention, HistoryAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("head_stride")
                                  .Attr<int64_t>("page_stride")
                                  .Attr<int64_t>("num_pages"));
