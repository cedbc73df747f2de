// A second core for a few-row product's column blocks, where the process has one to spare (skinny_gemm.cpp's `mm`).
//
// At one to four rows a product is bound by reading W: one core of the project's 2-core AVX2 VM reads ~10 GB/s, two
// read ~18. An AW serving one stream computes while its EWs wait for it, so a CPU idles then, and its lm_head (16 MiB
// on the bench model) and projections could read twice as fast. torch's intra-op pool is no way to it: its threads
// split a product in fixed halves and the caller waits for both, so where no CPU is free the caller waits out another
// process's turn (an AW with two threads served 16 and 64 streams at 0.63x-0.82x the tokens a second).
//
// Here the caller and one helper thread claim the blocks one at a time, under a mutex, until none is left. A helper
// that finds no CPU free claims none, and the caller does them all, as it would alone: a busy machine pays the
// helper's wake-up (a futex call) and never a wait for it, beyond the one block it may be computing. The caller
// waits for that block only. After `kMisses` products in a row in which the helper took no block, it is not woken
// for the next `kRest`: a machine whose CPUs are all busy stops paying even the wake-up. Each output element is
// still computed whole by one thread, so the floats are the same whichever thread computed which block.
//
// Off until `start()` (an AW that has two CPUs or more to run on turns it on). The thread lives as long as the
// process; the object is never destroyed, so that exit does not destroy a mutex the thread waits on.
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace second_core {

class Helper {
 public:
  using Fn = void (*)(const void* ctx, int64_t block);

  static Helper& get() {
    static Helper* one = new Helper();  // never destroyed (above)
    return *one;
  }

  // Starts the helper thread (once); whether it runs.
  bool start() {
    std::lock_guard<std::mutex> lk(mu_);
    if (!started_.load()) {
      std::thread([this] { loop(); }).detach();
      started_.store(true);
    }
    return true;
  }

  bool on() const { return started_.load(std::memory_order_relaxed); }

  // Products shared with the helper so far, and the blocks it computed of them.
  int64_t products() const { return products_.load(std::memory_order_relaxed); }
  int64_t helped() const { return helped_.load(std::memory_order_relaxed); }

  // fn(ctx, b) for every b in [0, total), on this thread and the helper's; returns the blocks the helper computed.
  // A second caller while one runs (the GIL is released in `mm`) computes alone.
  int64_t run(int64_t total, Fn fn, const void* ctx) {
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (!caller.owns_lock() || rest_ > 0) {  // another caller's, or the helper found no CPU lately: alone
      if (caller.owns_lock()) --rest_;
      for (int64_t b = 0; b < total; ++b) fn(ctx, b);
      return 0;
    }
    int64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = ++gen_;
      fn_ = fn;
      ctx_ = ctx;
      next_ = 0;
      total_ = total;
      done_.store(0, std::memory_order_relaxed);
    }
    cv_.notify_one();
    int64_t b = 0, mine = 0;
    while (claim(gen, &b)) {
      fn(ctx, b);
      ++mine;
      done_.fetch_add(1, std::memory_order_release);
    }
    // The helper's last block: its time to compute one (a block is ~10-30 µs here), or longer where it lost its CPU.
    for (int spins = 0; done_.load(std::memory_order_acquire) < total; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
    const int64_t helped = total - mine;
    products_.fetch_add(1, std::memory_order_relaxed);
    helped_.fetch_add(helped, std::memory_order_relaxed);
    misses_ = helped ? 0 : misses_ + 1;
    if (misses_ >= kMisses) {
      misses_ = 0;
      rest_ = kRest;
    }
    return helped;
  }

 private:
  static constexpr int kMisses = 8;
  static constexpr int kRest = 16;

  Helper() = default;

  bool claim(int64_t gen, int64_t* b) {
    std::lock_guard<std::mutex> lk(mu_);
    if (gen_ != gen || next_ >= total_) return false;
    *b = next_++;
    return true;
  }

  void loop() {
    pthread_setname_np(pthread_self(), "second-core");  // (as top -H and /proc show it)
    int64_t seen = 0;
    for (;;) {
      int64_t gen;
      Fn fn;
      const void* ctx;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen = gen_;
        fn = fn_;
        ctx = ctx_;
      }
      // A claim succeeds only while the product `gen` is running: its caller waits for the block claimed.
      int64_t b = 0;
      while (claim(gen, &b)) {
        fn(ctx, b);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  std::mutex caller_;  // held by the caller running
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> started_{false};
  // The product running (under mu_): its number, its function and context, the next block to claim, its blocks.
  int64_t gen_ = 0;
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t next_ = 0;
  int64_t total_ = 0;
  std::atomic<int64_t> done_{0};  // blocks computed, by either thread
  std::atomic<int64_t> products_{0}, helped_{0};
  // The caller's (under caller_).
  int misses_ = 0;
  int rest_ = 0;
};

}  // namespace second_core
