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
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <chrono>
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
// the CPU back; yielding hands it over at once. First inter-token latency after a prefill in the
// in-process serving loop, SmolLM2, 2-core EPYC, medians of 8 runs each: 15.9 ms against 17.4
// (mean ITL within the VM's noise either way).
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

// One input row: each weight row is read start to end, so a thread's part of the matrix is one
// sequential stream (with the pool's contiguous regions, 211 SmolLM2 matvecs: 7.9 ms against 10.1
// for the 4-row tile, whose four interleaved row streams the prefetchers follow worse).
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

// A job's chunks are split into one contiguous region per thread, each with its own claim
// counter. A thread claims the chunks of its own region in order, then helps with the others':
// while both threads run, each streams one contiguous part of the weights (one sequential stream
// per core is what the prefetchers like: SmolLM2's 211 matvecs took 7.5 ms in two halves against
// 11.1 ms with 64 KB chunks dealt out alternately, 2-core AMD EPYC), and a worker that the OS has
// not scheduled yet costs nothing but its region's chunks going to the caller: the caller never
// waits for a thread to wake (on 2 cores, XLA's own spinning threads can keep ours off the CPU
// for a whole time slice), only for chunks already claimed. Workers spin for 100 us after each
// job before they sleep: a decode step calls its kernels back to back.
class Pool {
 public:
  using ChunkFn = void (*)(const void* context, int64_t chunk);
  static constexpr int kMaxThreads = 64;

  explicit Pool(int size) : size_(size < kMaxThreads ? size : kMaxThreads) {
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
    const int regions = chunks < size_ ? static_cast<int>(chunks) : size_;
    job_ = Job{fn, context, chunks, regions};
    done_.store(0, std::memory_order_relaxed);
    joined_.store(1, std::memory_order_relaxed);  // the caller is participant 0
    const uint64_t id = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    for (int r = 0; r < regions; ++r)
      region_[r].next.store((id << 32) | static_cast<uint64_t>(region_start(r)), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ticket_.store(id << 32, std::memory_order_release);  // publishes job_, done_ and the regions
    }
    cv_.notify_all();
    run_regions(id, 0);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks;) wait_a_little(spins);
    // Close job `id` before the next call rewrites job_: a worker that loaded a region counter
    // of this job (every chunk claimed) and then read the next job's larger bounds would
    // otherwise win its compare-exchange, run a chunk of the next job under this id and bump
    // done_ past that job's count, so its caller spun forever (seen once: a hang after 600
    // decode calls). No compare-exchange on a counter of `id` can succeed after these stores,
    // since ids only grow.
    for (int r = 0; r < regions; ++r) region_[r].next.store((id << 32) | 0xffffffffu, std::memory_order_release);
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct Job {
    ChunkFn fn;
    const void* context;
    int64_t chunks;
    int regions;
  };

  int64_t region_start(int r) const { return job_.chunks * r / job_.regions; }

  // Claims and runs chunks of job `id`, its own region first, then the others' in turn; a stale
  // id claims nothing.
  void run_regions(uint64_t id, int first) {
    if ((ticket_.load(std::memory_order_acquire) >> 32) != id) return;
    const int regions = job_.regions;
    for (int i = 0; i < regions; ++i) {
      const int r = (first + i) % regions;
      const int64_t end = region_start(r + 1);
      for (;;) {
        uint64_t t = region_[r].next.load(std::memory_order_acquire);
        if ((t >> 32) != id) return;
        const int64_t c = static_cast<int64_t>(t & 0xffffffffu);
        if (c >= end) break;
        if (!region_[r].next.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
        // Job `id` cannot end (nor job_ change) before this claimed chunk is done.
        job_.fn(job_.context, c);
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  void work() {
    pthread_setname_np(pthread_self(), "cbjax-kernels");  // told apart from XLA's in profiles and top
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      int idle_spins = 0;
      for (int spins = 1; (ticket_.load(std::memory_order_acquire) >> 32) == seen; ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(100)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
          break;
        }
        wait_a_little(idle_spins);
      }
      seen = ticket_.load(std::memory_order_acquire) >> 32;
      const int me = joined_.fetch_add(1, std::memory_order_acq_rel);
      run_regions(seen, me % size_);
    }
  }

  const int size_;
  std::atomic<uint64_t> ticket_{0};  // (job id << 32): the job now published
  // Each region's counter on its own cache line, and done_ on another: one line shared by the
  // threads' claims bounced between the cores on every chunk.
  struct alignas(64) Region {
    std::atomic<uint64_t> next;  // (job id << 32) | next unclaimed chunk of region r
  };
  Region region_[kMaxThreads];
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<int> joined_{0};
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
// lines). Bit-exact: the table holds `_cvtsh_ss` of each pattern. SmolLM2 Q4_1's 211 block
// matmuls at one row, alternating runs: 5.63-6.05 -> 5.44-5.56 ms.
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

// Several input rows: kTileRows weight rows widened once (`widen(row, b, v)`: the 32 floats of
// the row's b-th 32-weight block) into a thread-local buffer (L1), then
// every pair of input rows multiplied against all of them in one pass over k, a kTileRows x 2
// register tile (12 accumulators): each x vector loaded serves kTileRows weight rows and each
// widened vector two inputs, so x streams from L2 once per kTileRows weight rows. Two rows a
// pass, before, left SmolLM2's Q4_1 at 0.9x llama.cpp at 8 and 32 sequences; 6 x 2 took the
// layers' matmuls at 32 rows from 185 to 101 ms (4 x 2: 127). `next_tile`: the next tile's
// `tile_bytes`, asked for while this one computes.
template <typename Widen>
void tile_rows(const float* x, Widen widen, const uint8_t* next_tile, int64_t tile_bytes, float* y, int64_t M,
               int64_t N, int64_t K, int64_t n, int rows_here) {
  const int64_t blocks = K / 32;
  thread_local std::vector<float> widened;
  widened.resize(kTileRows * K);
  // Read once: GCC otherwise fetched the thread-local's address (a __tls_get_addr call) at
  // every block of the int8 widening (SmolLM2's int8 matrices at 8 rows 27 -> 21 ms).
  float* const buffer = widened.data();
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t row = n + std::min(r, rows_here - 1);  // a short tile repeats its last row
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 v[4];
      widen(row, b, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(buffer + r * K + b * 32 + 8 * i, v[i]);
    }
  }
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
      // memory is not idle until the next tile's widening (SmolLM2 Q8_0, 211 matmuls at 8 rows
      // 21.3-21.8 -> 19.6-20.4 ms, 32 rows 2% less, alternating runs).
      if (m == 0 && k * 8 < tile_bytes) prefetch(next_tile + k * 8);
      const __m256 x0 = _mm256_loadu_ps(x0p + k), x1 = _mm256_loadu_ps(x1p + k);
      for (int r = 0; r < kTileRows; ++r) {
        __m256 v = _mm256_loadu_ps(wr[r] + k);
        // Held in a register for both FMAs: GCC otherwise folds the load into each (14 loads a
        // step for 12 FMAs, load-bound); SmolLM2's matmuls at 32 rows 61-69 against 82-93 ms.
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

// A block row's stream asks for the bytes 1 KB ahead of the block it reads. The hardware
// prefetchers alone left the one-row loop short of memory: SmolLM2's 211 matmuls at one row,
// alternating runs, Q8_0 7.4-8.7 -> 6.9-7.5 ms, Q4_1 7.6-8.8 -> 7.3-7.6 ms; 512 and 2048 bytes
// ahead measured slower than 1024. (The f32 rows of single_input_rows measured slower with it.)
// A prefetch past the end of the matrix is harmless: it never faults.
constexpr int64_t kPrefetchAhead = 1024;

// One input row (a sequence's decode): per block d * sum(x q) (+ m * sum(x) for Q4_1, - 8 d * sum(x)
// for Q4_0), two weight rows at a time (Q4). Each block's sum(x) / 8, broadcast to 8 lanes, carries
// the m (or -8) term through the same accumulator. The bytes go to 32-bit lanes by byte-to-int32
// loads (`vpmovzxbd` / `vpmovsxbd`, 8 bytes each): a Q4 byte j holds weights j and j + 16, so
// bytes 0-7 masked are weights 0-7, shifted 16-23, and x is read in its own order. That is 10
// vector ops a Q4 block against 13 for the earlier shifts and masks of one broadcast load (which
// needed x permuted): the Q4 loop is bound by its f32 products, and the engine's one-sequence
// Q4_1 step went 10.5 -> 9.5 ms (means of 12 step blocks, alternating runs, 2-core EPYC).
// SmolLM2's Q4_1 matrices, one row, 57 MB of blocks: 13.4 GB/s (shifts) against 8.2-9.9 for
// widening each block to d * q + m floats first; the sums differ from the widened ones in the
// last bits (3e-7 of the largest output).
template <int64_t Kind>
void block_rows_one_input(const float* x, const float* eighth_sums, const uint8_t* w, float* y, int64_t K,
                          int64_t row_bytes, int64_t n0, int64_t n1) {
  constexpr int64_t size = kBlockBytes[Kind];
  const int64_t blocks = K / 32;
  // Q8_0 one weight row at a time: two (sharing x's loads) ran at 11-12 GB/s against 18-19 for
  // one in a standalone bench of 147 MB of blocks on the 2-core EPYC. Q4 rows, bound by their
  // products rather than the stream, run faster by two: 14.7-15.2 against 13.5 GB/s (24 MB Q4_1).
  constexpr int64_t step = Kind == kQ8_0 ? 1 : 2;
  for (int64_t n = n0; n < n1; n += step) {
    const bool pair = step == 2 && n + 1 < n1;
    const uint8_t* r0 = w + n * row_bytes;
    const uint8_t* r1 = pair ? r0 + row_bytes : r0;
    __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
    int64_t b = 0;
    if (step == 1) {
      // Two accumulators over alternate blocks: with one, each block's d * t waited on the last
      // (a 4-cycle chain a block); Q8_0, 40 MB synthetic matrix, 2 threads: 25-27 against 23-25
      // GB/s; one-sequence decode 8.4 -> 8.1 ms (means of 12 step blocks, alternating runs).
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

// Weight rows [n0, n1) against M input rows: one (block_rows_one_input), or tiles of kTileRows
// weight rows (block_tile_rows).
template <int64_t Kind>
void block_rows_avx2(const float* x, const float* eighth_sums, const uint8_t* w, float* y, int64_t M, int64_t N,
                     int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  if (M == 1) return block_rows_one_input<Kind>(x, eighth_sums, w, y, K, row_bytes, n0, n1);
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
};

// Weight rows [n0, n1) of blocks `w` of `kind` against the input: y [M, N].
void block_rows(const BlockInput& in, const uint8_t* w, int64_t kind, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t row_bytes = in.K / 32 * kBlockBytes[kind];
#if defined(__AVX2__) && defined(__F16C__)
  const float *x = in.x, *sums = in.eighth_sums;
  if (kind == kQ8_0) return block_rows_avx2<kQ8_0>(x, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
  if (kind == kQ4_0) return block_rows_avx2<kQ4_0>(x, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
  return block_rows_avx2<kQ4_1>(x, sums, w, y, in.M, N, in.K, row_bytes, n0, n1);
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
BlockInput block_input(const float* x, int64_t M, int64_t K, bool q4) {
#if defined(__AVX2__) && defined(__F16C__)
  if (M == 1 && q4) {
    thread_local std::vector<float> eighth_sums;
    eighth_sums.resize(K / 32);
    block_sums(x, K, eighth_sums.data());
    return {x, eighth_sums.data(), M, K};
  }
#endif
  return {x, nullptr, M, K};
}

// ---------------------------------------------------------------- int8 rows

// quantization='int8' weights (cbjax/models/quant.py, QuantizedWeight): int8 values [N, K] and an
// f32 scale per `group` inputs of a row ([N, K / group]), group 32 times a power of two. Q8_0's
// loops with each 32 weights' scale read from their group's: one input row, scale * sum(x q) a
// block into two accumulators; several, kTileRows rows widened to scale * q floats (the
// reference's own products) for tile_rows. XLA widened every matrix to f32 in memory each
// call instead: SmolLM2 int8 decoded at 160 ms a step against 19 for its f32 weights, and
// its process held ~1 GB more than the f32 one.
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

// About 16 KB of blocks a chunk, in whole tiles of kTileRows weight rows.
int64_t block_rows_per_chunk(int64_t row_bytes) {
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
  const int64_t rows = block_rows_per_chunk(wd[1]);
  const BlockMatmul m{block_input(x.typed_data(), M, K, kind != kQ8_0), w.typed_data(), y->typed_data(), N, kind, rows};
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
  const int64_t rows = block_rows_per_chunk(K);
  const Int8Matmul m{block_input(x.typed_data(), M, K, false), {q.typed_data(), scale.typed_data(), K / sd[1]},
                     y->typed_data(), N, rows};
  pool().run(int8_matmul_chunk, &m, chunk_count(N, rows));
  return ffi::Error::Success();
}

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


// ---------------------------------------------------------------- one decoder layer

// A whole pre-norm decoder layer (RMSNorm, RoPE, gated SiLU MLP: the Llama / Mistral / Qwen3
// shape) for rows of one token each, in one call. The per-op version ran 7 matmul calls, one
// attention call and ~26 small XLA fusions per layer, each a thunk of XLA's executor on its
// own threads beside ours; here the layer is five jobs of this file's pool and a few loops on
// the caller.

// A layer's matrix: f32 rows, rows of GGUF blocks of a kind (a file's layer may mix kinds), or
// int8 rows with their groups' scales.
constexpr int64_t kF32 = 3;  // after the block kinds
constexpr int64_t kI8 = 4;
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
  for (int64_t i = 0; i < count; ++i) q4 |= readers[i].kind == kQ4_0 || readers[i].kind == kQ4_1;
  return block_input(x, M, K, q4);
}

BlockInput layer_input(const float* x, int64_t M, int64_t K, std::initializer_list<Weight> readers) {
  return layer_input(x, M, K, readers.begin(), static_cast<int64_t>(readers.size()));
}

void any_rows(const BlockInput& in, Weight w, float* y, int64_t N, int64_t n0, int64_t n1) {
  if (w.kind == kF32) return weight_rows(in.x, static_cast<const float*>(w.data), y, in.M, N, in.K, n0, n1);
  if (w.kind == kI8) return int8_rows(in, {static_cast<const int8_t*>(w.data), w.scale, w.group}, y, N, n0, n1);
  block_rows(in, static_cast<const uint8_t*>(w.data), w.kind, y, N, n0, n1);
}

int64_t rows_per_chunk_for(Weight w, int64_t K) {
  if (w.kind == kF32) return rows_per_chunk_for(K);
  return block_rows_per_chunk(w.kind == kI8 ? K : K / 32 * kBlockBytes[w.kind]);
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
  s.rows_per_chunk = rows_per_chunk_for(std::get<0>(*parts.begin()), K);
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
  return {layer_input(x, M, K, {w}), w, y, N, rows_per_chunk_for(w, K), residual, out};
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
                         int64_t head_stride, int64_t page_stride, int64_t num_pages) {
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

  rms_norm_rows(out, w.mlp_norm, h, M, H, eps);
  const int64_t rows_f = rows_per_chunk_for(w.w_gate, H);
  const GatedMatmul mlp{layer_input(h, M, H, {w.w_gate, w.w_up}), w.w_gate, w.w_up, gate, up, F, rows_f, act};
  pool().run(gated_chunk, &mlp, chunk_count(F, rows_f));

  const ResidualMatmul down = residual_matmul(act, M, F, w.w_down, tmp, H, out, out);
  pool().run(residual_chunk, &down, chunk_count(H, down.rows_per_chunk));
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
// dispatch costs ~2.5 us per argument, ~0.5 ms of a SmolLM2 decode step over its 272 weight
// arrays (cbjax/runtime/cpu_kernels.py, `LayerAddresses`).
ffi::Error DecoderLayerAt(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> addresses, ffi::Buffer<ffi::F32> cos,
                          ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> valid,
                          ffi::ResultBuffer<ffi::F32> x_out, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out, float eps, float scale, int64_t num_heads,
                          int64_t num_kv_heads, int64_t window, int64_t page_size, int64_t head_stride,
                          int64_t page_stride, int64_t num_pages, int64_t layer, int64_t intermediate,
                          int64_t head_dim) {
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
                       page_stride, num_pages);
}

// ---------------------------------------------------------------- greedy sampling

// `jnp.argmax` over each row's last axis, as int32: the first maximum, or the first NaN where the
// row has one. XLA:CPU's version over SmolLM2's 49,152 logits (YNNPACK's reduce_max, a select of
// the hits and a min over them: `Ops.argmax`) took ~220 us of a 6.6 ms one-sequence step on
// the 2-core EPYC, with a hand-off between pool threads inside; this reads the row twice while it
// is in cache, the second pass stopping at the hit.
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_blocks, MatmulBlocks,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_matmul_int8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_history_attention, HistoryAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
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

// What both layer kernels take after their weights, in their handlers' order.
template <typename Binding>
auto with_rows_and_cache(Binding&& binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::F32>>()  // cos
      .template Arg<ffi::Buffer<ffi::F32>>()             // sin
      .template Arg<ffi::AnyBuffer>()                    // cache_k (f32 or f16)
      .template Arg<ffi::AnyBuffer>()                    // cache_v
      .template Arg<ffi::Buffer<ffi::S32>>()             // tables
      .template Arg<ffi::Buffer<ffi::S32>>()             // positions
      .template Arg<ffi::Buffer<ffi::S32>>()             // valid
      .template Ret<ffi::Buffer<ffi::F32>>()             // x_out
      .template Ret<ffi::AnyBuffer>()                    // cache_k (aliased)
      .template Ret<ffi::AnyBuffer>()                    // cache_v (aliased)
      .template Attr<float>("eps")
      .template Attr<float>("scale")
      .template Attr<int64_t>("num_heads")
      .template Attr<int64_t>("num_kv_heads")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("page_size")
      .template Attr<int64_t>("head_stride")
      .template Attr<int64_t>("page_stride")
      .template Attr<int64_t>("num_pages");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_decoder_layer, DecoderLayer,
                              with_rows_and_cache(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // x
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // attn_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wq
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wk
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wv
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // wo
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // q_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // k_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_gate
                                                      .Arg<ffi::Buffer<ffi::F32>>()  // w_up
                                                      .Arg<ffi::Buffer<ffi::F32>>())  // w_down
                                  .Attr<bool>("qk_norm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_decoder_layer_at, DecoderLayerAt,
                              with_rows_and_cache(ffi::Ffi::Bind()
                                                      .Arg<ffi::Buffer<ffi::F32>>()   // x
                                                      .Arg<ffi::Buffer<ffi::U32>>())  // addresses
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("intermediate")
                                  .Attr<int64_t>("head_dim"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cbjax_argmax, ArgmaxRows,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
