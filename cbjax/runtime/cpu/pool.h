// The worker pool the kernels share their chunks out over.
#pragma once

#include "simd.h"

namespace {

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
// per core is what the prefetchers like: docs/experiments.md, "The CPU kernels' threads"), and a
// helper that has not started yet costs nothing but its region's chunks going to the caller: the
// caller never waits for a thread to wake, only for chunks already claimed.
//
// The helpers are tasks on XLA's own intra-op thread pool (the FFI `ThreadPool` of the calling
// handler), not threads of our own: measured as fast (SmolLM2 decode steps on 2 cores, within
// noise at 1 and 8 sequences, against the hand-written spinning workers this replaced), and
// XLA's threads and ours no longer take the same cores from each other.
thread_local ffi::ThreadPool* xla_threads = nullptr;  // the calling handler's, set by `Pooled`

class Pool {
 public:
  using ChunkFn = void (*)(const void* context, int64_t chunk);
  static constexpr int kMaxThreads = 64;

  explicit Pool(int size) : size_(size < kMaxThreads ? size : kMaxThreads) {}

  // Runs fn(context, c) for c in [0, chunks). A call that finds the pool busy (XLA ran two
  // kernels concurrently) or has no XLA pool runs every chunk itself.
  void run(ChunkFn fn, const void* context, int64_t chunks) {
    bool idle = false;
    if (xla_threads == nullptr || size_ == 1 || chunks < 2 || !busy_.compare_exchange_strong(idle, true)) {
      for (int64_t c = 0; c < chunks; ++c) fn(context, c);
      return;
    }
    const int regions = chunks < size_ ? static_cast<int>(chunks) : size_;
    job_ = Job{fn, context, chunks, regions};
    done_.store(0, std::memory_order_relaxed);
    const uint64_t id = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    for (int r = 0; r < regions; ++r)
      region_[r].next.store((id << 32) | static_cast<uint64_t>(region_start(r)), std::memory_order_relaxed);
    ticket_.store(id << 32, std::memory_order_release);  // publishes job_, done_ and the regions
    for (int r = 1; r < regions; ++r) xla_threads->Schedule([this, id, r] { run_regions(id, r); });
    run_regions(id, 0);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks;) wait_a_little(spins);
    // Close job `id` before the next call rewrites job_: a helper that loaded a region counter
    // of this job (every chunk claimed) and then read the next job's larger bounds would
    // otherwise win its compare-exchange, run a chunk of the next job under this id and bump
    // done_ past that job's count, so its caller spun forever. No compare-exchange on a
    // counter of `id` can succeed after these stores, since ids only grow; a helper that starts
    // after its job ended claims nothing.
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

  const int size_;
  std::atomic<uint64_t> ticket_{0};  // (job id << 32): the job now published
  // Each region's counter on its own cache line, and done_ on another: one line shared by the
  // threads' claims bounced between the cores on every chunk.
  struct alignas(64) Region {
    std::atomic<uint64_t> next;  // (job id << 32) | next unclaimed chunk of region r
  };
  Region region_[kMaxThreads];
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<bool> busy_{false};
  Job job_{};
};

Pool& pool() {
  static Pool* p = new Pool(usable_cpus());  // never destroyed: a late helper task may still look at it
  return *p;
}

// A handler run with its XLA thread pool as the one `Pool` schedules on.
template <auto Handler>
struct Pooled;
template <typename... Args, ffi::Error (*Handler)(Args...)>
struct Pooled<Handler> {
  static ffi::Error call(ffi::ThreadPool threads, Args... args) {
    xla_threads = &threads;
    ffi::Error result = Handler(std::move(args)...);
    xla_threads = nullptr;
    return result;
  }
};

}  // namespace
