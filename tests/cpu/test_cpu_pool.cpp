// The CPU forward's workers (src/cpu/pool.hpp): every task runs exactly once whatever the
// thread count, helpers do take tasks, nested and concurrent calls run, and the forward /
// decode results do not depend on the number of threads (bitwise), on each ISA path.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "cpu/isa.hpp"
#include "cpu/pool.hpp"
#include "support/cases.hpp"
#include "support/checks.hpp"
#include "support/random.hpp"

namespace flashattn::test {
namespace {

using detail::cpu::run_workers;
using detail::cpu::TaskQueue;

// Runs n tasks on `threads`; returns how often each ran and on which thread.
std::vector<int> run_counting(std::int64_t n, int threads, std::vector<std::thread::id>* who = nullptr,
                              std::chrono::microseconds task_time = {}) {
  std::vector<std::atomic<int>> count(static_cast<std::size_t>(n));
  if (who) who->assign(static_cast<std::size_t>(n), std::thread::id());
  TaskQueue queue(n);
  auto body = [&](TaskQueue& q) {
    for (std::int64_t t; (t = q.next()) >= 0;) {
      count[static_cast<std::size_t>(t)].fetch_add(1);
      if (who) (*who)[static_cast<std::size_t>(t)] = std::this_thread::get_id();
      if (task_time.count() > 0) {
        const auto end = std::chrono::steady_clock::now() + task_time;
        while (std::chrono::steady_clock::now() < end) {
        }
      }
    }
  };
  run_workers(queue, threads, body);
  std::vector<int> out;
  for (auto& c : count) out.push_back(c.load());
  return out;
}

TEST(CpuPool, EveryTaskRunsOnce) {
  for (int threads : {0, 1, 2, 3, 8}) {
    for (std::int64_t n : {0, 1, 2, 7, 1000}) {
      for (int rep = 0; rep < 20; ++rep) {
        const std::vector<int> count = run_counting(n, threads);
        ASSERT_EQ(std::count(count.begin(), count.end(), 1), n)
            << "threads " << threads << " tasks " << n << " rep " << rep;
      }
    }
  }
}

TEST(CpuPool, HelpersTakeTasks) {
  // 400 tasks of 200 us (80 ms on one thread): a helper wakes long before the end, on
  // any machine that gives it a core within that time.
  std::vector<std::thread::id> who;
  const std::vector<int> count = run_counting(400, 2, &who, std::chrono::microseconds(200));
  ASSERT_EQ(std::count(count.begin(), count.end(), 1), 400);
  const auto me = std::this_thread::get_id();
  EXPECT_GT(std::count_if(who.begin(), who.end(), [&](auto id) { return id != me; }), 0);
  EXPECT_GE(detail::cpu::pool_helpers(), 1);
}

TEST(CpuPool, NestedAndConcurrentCalls) {
  // A call from inside a body runs on that thread; calls from several threads at once
  // (one holds the pool, the others run alone) each run all their tasks.
  std::atomic<int> inner_total{0};
  TaskQueue outer(16);
  auto body = [&](TaskQueue& q) {
    for (std::int64_t t; (t = q.next()) >= 0;) {
      const std::vector<int> c = run_counting(5 + t, 4);
      inner_total += static_cast<int>(std::count(c.begin(), c.end(), 1));
    }
  };
  run_workers(outer, 3, body);
  int expected = 0;
  for (int t = 0; t < 16; ++t) expected += 5 + t;
  EXPECT_EQ(inner_total.load(), expected);

  std::vector<std::thread> callers;
  std::atomic<int> good{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 50; ++rep) {
        const std::vector<int> count = run_counting(37 + c, 2);
        if (std::count(count.begin(), count.end(), 1) == 37 + c) ++good;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(good.load(), 4 * 50);
}

// A child made by fork() while the parent has helpers runs its calls (with its own pool),
// and the parent's pool still works afterwards.
TEST(CpuPool, WorksInAForkedChild) {
  const std::vector<int> before = run_counting(500, 2);  // the parent's helpers exist
  ASSERT_EQ(std::count(before.begin(), before.end(), 1), 500);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    bool ok = true;
    for (int rep = 0; rep < 20 && ok; ++rep) {
      const std::vector<int> count =
          run_counting(300, 2, nullptr, std::chrono::microseconds(rep == 0 ? 100 : 0));
      ok = std::count(count.begin(), count.end(), 1) == 300;
    }
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  const std::vector<int> count = run_counting(300, 2);
  EXPECT_EQ(std::count(count.begin(), count.end(), 1), 300);
}

struct IsaScope {
  explicit IsaScope(detail::cpu::Isa isa) { detail::cpu::set_isa_override(isa); }
  ~IsaScope() { detail::cpu::set_isa_override(std::nullopt); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

class CpuPoolIsa : public ::testing::TestWithParam<detail::cpu::Isa> {
 protected:
  void SetUp() override {
    if (!detail::cpu::isa_supported(GetParam()))
      GTEST_SKIP() << "this CPU has no " << detail::cpu::isa_name(GetParam()) << " path";
  }
};

// Decode (packed GQA rows, paged (block sizes 7, 16) and dense, odd lengths, forced splits and the automatic
// choice) on 1 .. 5 threads: every result matches the fp64 oracle, and with a given split
// count the outputs and lse are the same bits whatever the thread count (each task writes
// its own rows; the split merge sums in split order). The automatic split count depends on
// the team size, so there only the oracle check applies.
TEST_P(CpuPoolIsa, DecodeResultsDoNotDependOnThreads) {
  const IsaScope scope(GetParam());
  FA_SEEDED_RNG(rng);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (int block_size : {0, 7, 16}) {  // 7: pages that split the 64-key blocks unevenly
      for (int splits : {0, 1, 3}) {
        KVCacheConfig cfg;
        cfg.batch = 2;
        cfg.s_q = 1;
        cfg.h_q = 8;
        cfg.h_k = 2;
        cfg.d = 64;
        cfg.dtype = dtype;
        cfg.block_size = block_size;
        cfg.cache_lens = {1 + static_cast<int>(rng() % 900), static_cast<int>(rng() % 3)};
        cfg.max_cache_len = 900;
        std::optional<ForwardResults> first;
        const auto state = rng;  // the same case for every thread count
        for (int threads : {1, 2, 3, 5}) {
          auto case_rng = state;
          KVCacheCase c = KVCacheCase::make(case_rng, cfg);
          c.num_splits = splits;
          c.opts.num_threads = threads;
          SCOPED_TRACE(std::string(dtype == DType::kBFloat16 ? "bf16" : "fp32") + " block_size " +
                       std::to_string(block_size) + " splits " + std::to_string(splits) +
                       " threads " + std::to_string(threads));
          const ForwardResults r = run_and_check_kvcache(c);
          if (splits == 0) continue;  // the automatic split count follows the team size
          if (!first) {
            first = r;
            continue;
          }
          ASSERT_EQ(r.out.size(), first->out.size());
          for (std::size_t i = 0; i < r.out.size(); ++i)
            ASSERT_EQ(r.out[i], first->out[i]) << "out element " << i;
          for (std::size_t i = 0; i < r.lse.size(); ++i)
            ASSERT_EQ(r.lse[i], first->lse[i]) << "lse element " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuPoolIsa,
                         ::testing::Values(detail::cpu::Isa::kAvx2, detail::cpu::Isa::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<detail::cpu::Isa>& i) {
                           return std::string(detail::cpu::isa_name(i.param));
                         });

}  // namespace
}  // namespace flashattn::test
