// The threads of a whole pass: one OpenMP parallel region for all of DecoderStack::forward, its other
// threads waiting (spinning) for the parallel loops the first one hands them.
//
// Each kernel's at::parallel_for opened a parallel region of its own, ~150 a pass of SmolLM2-135M, each
// costing more than a small kernel's work. Handing a loop to threads already waiting costs a store and a spin. Outside a pass the kernels'
// loops fall back to at::parallel_for, and a loop's split among threads does not change any result
// (each index's work is the same whichever thread does it).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <exception>
#include <functional>
#include <utility>

namespace speculant {

class Team {
 public:
  // Runs body() on this thread while the other threads of an OpenMP region serve the parallel_for calls
  // it makes; exceptions from either side reach the caller.
  static void run(const std::function<void()>& body) {
    Team team;
    std::exception_ptr error;
#pragma omp parallel num_threads(at::get_num_threads())
    {
      if (omp_get_thread_num() == 0) {
        team.size_ = omp_get_num_threads();
        Team* outer = std::exchange(current(), &team);  // a run inside a run has a team of one
        try {
          body();
        } catch (...) {
          error = std::current_exception();
        }
        current() = outer;
        team.post(nullptr, 0, 0, 0);  // no work: the others leave
      } else {
        team.serve(omp_get_thread_num());
      }
    }
    if (!error) error = team.error_;
    if (error) std::rethrow_exception(error);
  }

  // f(b0, b1) over [begin, end) in contiguous chunks, one per thread, as at::parallel_for splits it.
  template <class F>
  static void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    Team* team = current();
    if (!team) return at::parallel_for(begin, end, grain, f);
    if (end - begin <= grain || team->size_ == 1) return f(begin, end);
    // The loop's body by address, no copy: it lives in this frame until every thread is done with it.
    const Task task{&f, [](const void* body, int64_t b0, int64_t b1) { (*static_cast<const F*>(body))(b0, b1); }};
    const int64_t chunk = (end - begin + team->size_ - 1) / team->size_;
    team->post(&task, begin, end, chunk);
    std::exception_ptr error;
    try {
      f(begin, std::min(end, begin + chunk));
    } catch (...) {
      error = std::current_exception();
    }
    // The others must be done with `task` before this frame goes, error or not.
    while (team->done_.load(std::memory_order_acquire) != team->size_ - 1) _mm_pause();
    if (!error) error = team->error_;
    if (error) std::rethrow_exception(error);
  }

 private:
  struct Task {
    const void* body;
    void (*call)(const void* body, int64_t b0, int64_t b1);
  };

  static Team*& current() {
    static thread_local Team* team = nullptr;
    return team;
  }

  void post(const Task* task, int64_t begin, int64_t end, int64_t chunk) {
    task_ = task, begin_ = begin, end_ = end, chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    round_.fetch_add(1, std::memory_order_release);
  }

  void serve(int thread) {
    for (uint64_t seen = 0;;) {
      uint64_t round;
      while ((round = round_.load(std::memory_order_acquire)) == seen) _mm_pause();
      seen = round;
      if (!task_) return;
      const int64_t b0 = begin_ + thread * chunk_, b1 = std::min(end_, b0 + chunk_);
      try {
        if (b0 < b1) task_->call(task_->body, b0, b1);
      } catch (...) {
        error_ = std::current_exception();  // the loop's caller rethrows it
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  const Task* task_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  int size_ = 1;
  std::atomic<uint64_t> round_{0};
  std::atomic<int> done_{0};
  std::exception_ptr error_;
};

}  // namespace speculant
