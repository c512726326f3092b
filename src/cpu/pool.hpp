// The CPU forward's and backward's workers: the calling thread plus helper threads of a
// process-wide pool, with a join that waits for the work, not for the helpers.
//
// An OpenMP parallel region ends in a barrier that waits for every thread of the team to
// arrive, also one that wakes too late to find any work. With OMP_WAIT_POLICY=passive (or
// once the spin time has passed) a sleeping thread takes tens of microseconds to wake on a
// loaded machine (a futex wake-up, then a free core), so a short call (decode at 1k keys:
// ~100 us of work) paid that wake-up in full even when the calling thread could have done
// all of it. run_workers instead lets the caller start at once, and returns when the tasks
// are done and no helper is inside `body`: a helper that wakes after the last task was
// claimed leaves without having been waited for.
//
// Between calls a helper polls for the next job for a while before it sleeps, as the
// OpenMP runtime does, following OMP_WAIT_POLICY: passive not at all, unset 200 us,
// active 20 ms (pool.cpp, helper_spin).
//
// Results must not depend on which thread runs a task (the forward's tasks write disjoint
// rows, each backward task owns its dk / dv or dq rows), so they do not depend on how many
// helpers joined.
#pragma once

#include <atomic>
#include <cstdint>

namespace flashattn::detail::cpu {

// Tasks 0 .. n - 1, claimed one at a time.
class TaskQueue {
 public:
  explicit TaskQueue(std::int64_t n) : n_(n) {}
  // The next unclaimed task, or -1 when none is left.
  std::int64_t next() noexcept {
    const std::int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    return t < n_ ? t : -1;
  }
  bool drained() const noexcept { return next_.load(std::memory_order_relaxed) >= n_; }
  std::int64_t size() const noexcept { return n_; }

 private:
  std::atomic<std::int64_t> next_{0};
  const std::int64_t n_;
};

// A function reference without allocation (the body outlives the call it is passed to).
class WorkerBody {
 public:
  template <class F>
  WorkerBody(F& f) noexcept  // NOLINT(google-explicit-constructor)
      : obj_(&f), call_([](void* o, TaskQueue& q) { (*static_cast<F*>(o))(q); }) {}
  void operator()(TaskQueue& q) const { call_(obj_, q); }

 private:
  void* obj_;
  void (*call_)(void*, TaskQueue&);
};

// Runs body(queue) on the calling thread and on up to threads - 1 helpers, each of which
// calls it at most once per call and only while tasks are left; body claims tasks with
// queue.next() until it returns -1. Returns once every task is done and every helper that
// entered body has left it (their writes are then visible to the caller). body must not
// throw. threads <= 1, a concurrent call from another thread (the pool is busy) or a call
// from inside body run body on the calling thread alone.
void run_workers(TaskQueue& queue, int threads, WorkerBody body);

// Helper threads started so far (tests).
int pool_helpers() noexcept;

}  // namespace flashattn::detail::cpu
