// run_workers (cpu/pool.hpp): a process-wide pool of helper threads, started on first use
// and never stopped (they sleep in a futex wait between calls; the pool is leaked so that
// no destructor races the helpers at exit).
//
// Protocol (all on seq_cst atomics): the caller publishes the job (queue, body, limit),
// sets `active`, bumps `gen` and wakes the helpers, then runs body itself. A woken helper
// increments `busy` first and only then reads `active`: the caller clears `active` after
// its own body returned (every task claimed) and then waits for `busy` to reach 0. So a
// helper either entered body before the caller's wait (and is waited for) or sees `active`
// false and leaves without touching the job (Dekker's argument on seq_cst operations).
#include "cpu/pool.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace flashattn::detail::cpu {
namespace {

void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

struct Pool {
  explicit Pool(pid_t owner) : pid(owner) {}
  const pid_t pid;        // the process whose helpers these are
  std::mutex call_mutex;  // one job at a time
  std::atomic<std::uint32_t> gen{0};
  std::atomic<bool> active{false};
  std::atomic<int> busy{0};
  // The job, written by the caller while no helper can read it (before `active` is set).
  TaskQueue* queue = nullptr;
  const WorkerBody* body = nullptr;
  int limit = 0;  // helpers 0 .. limit - 1 may join
  std::atomic<int> started{0};
};

// The pool of this process. A child made by fork() has none of the parent's helpers (and
// may have copied a job in flight: `busy` above 0, call_mutex held): its first call makes
// its own pool. Pools are leaked on purpose (see the file comment).
Pool& pool() {
  static std::atomic<Pool*> current{nullptr};
  Pool* p = current.load();
  const pid_t pid = getpid();
  while (p == nullptr || p->pid != pid) {
    Pool* fresh = new Pool(pid);
    if (current.compare_exchange_strong(p, fresh)) return *fresh;
    delete fresh;  // another thread installed one (no helper has seen ours): check that one
  }
  return *p;
}

thread_local bool t_in_body = false;

// How long a helper keeps polling for the next job before it sleeps, following the OpenMP
// runtime's OMP_WAIT_POLICY (read once): passive 0 (sleep at once: the setting for a
// machine shared with other work), active 20 ms, unset 200 us (libgomp's default also
// spins a while, so back-to-back calls find their threads awake).
std::chrono::nanoseconds helper_spin() {
  static const std::chrono::nanoseconds spin = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const std::string v = policy ? policy : "";
    if (v == "passive" || v == "PASSIVE" || v == "Passive") return std::chrono::nanoseconds(0);
    if (v == "active" || v == "ACTIVE" || v == "Active")
      return std::chrono::nanoseconds(std::chrono::milliseconds(20));
    return std::chrono::nanoseconds(std::chrono::microseconds(200));
  }();
  return spin;
}

void helper_main(Pool* p, int index, std::uint32_t seen) {
  const std::chrono::nanoseconds spin = helper_spin();
  for (;;) {
    if (spin.count() > 0 && p->gen.load(std::memory_order_relaxed) == seen) {
      const auto end = std::chrono::steady_clock::now() + spin;
      for (int i = 1; p->gen.load(std::memory_order_relaxed) == seen; ++i) {
        cpu_relax();
        if (i % 64 == 0 && std::chrono::steady_clock::now() >= end) break;
      }
    }
    p->gen.wait(seen);
    seen = p->gen.load();
    p->busy.fetch_add(1);
    if (p->active.load() && index < p->limit && !p->queue->drained()) {
      t_in_body = true;
      (*p->body)(*p->queue);
      t_in_body = false;
    }
    if (p->busy.fetch_sub(1) == 1) p->busy.notify_all();
  }
}

// Starts helpers until `want` exist (fewer if the system refuses threads). Called with
// call_mutex held and no job active.
int ensure_helpers(Pool& p, int want) {
  int have = p.started.load();
  while (have < want) {
    try {
      std::thread(helper_main, &p, have, p.gen.load()).detach();
    } catch (const std::system_error&) {
      break;
    }
    p.started.store(++have);
  }
  return have;
}

}  // namespace

void run_workers(TaskQueue& queue, int threads, WorkerBody body) {
  if (threads <= 1 || queue.size() <= 1 || t_in_body) {
    body(queue);
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.call_mutex, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread's call holds the pool
    body(queue);
    return;
  }
  const std::int64_t most = std::min<std::int64_t>(threads - 1, queue.size() - 1);
  const int helpers = ensure_helpers(p, static_cast<int>(most));
  if (helpers == 0) {
    body(queue);
    return;
  }
  p.queue = &queue;
  p.body = &body;
  p.limit = helpers;
  p.active.store(true);
  p.gen.fetch_add(1);
  p.gen.notify_all();
  t_in_body = true;
  body(queue);
  t_in_body = false;
  p.active.store(false);
  // Every task is claimed; wait for the helpers inside body (at most one task each):
  // spin, then yield, then sleep.
  for (int spin = 0; p.busy.load() != 0; ++spin) {
    if (spin < 2048) {
      cpu_relax();
    } else if (spin < 2048 + 4096) {
      std::this_thread::yield();
    } else {
      const int b = p.busy.load();
      if (b != 0) p.busy.wait(b);
    }
  }
}

int pool_helpers() noexcept { return pool().started.load(); }

}  // namespace flashattn::detail::cpu
