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

}  // namespace
