// Pinning the calling thread's OpenMP team, one thread per CPU (backend/thread_binding.py says
// when and why). GNU OpenMP keeps a team per thread that starts parallel regions, and torch's
// at::parallel_for and these kernels all start theirs from the engine's thread, so binding that
// team once binds every parallel region of every step.
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "ops.h"

namespace {

std::vector<int64_t> cpus_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  TORCH_CHECK(sched_getaffinity(0, sizeof(set), &set) == 0, "sched_getaffinity failed");
  std::vector<int64_t> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

}  // namespace

std::vector<std::vector<int64_t>> openmp_team_cpus() {
  const int threads = at::get_num_threads();
  std::vector<std::vector<int64_t>> out(threads);
#pragma omp parallel num_threads(threads)
  out[omp_get_thread_num()] = cpus_of_this_thread();
  return out;
}

std::vector<int64_t> bind_openmp_team(std::vector<int64_t> cpus) {
  const int threads = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) == threads, "binding ", threads, " OpenMP threads needs ", threads,
              " CPUs, got ", cpus.size());
  std::vector<int> failed(threads, 0);
  std::vector<int64_t> tids(threads, 0);
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    tids[me] = gettid();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[me], &set);
    failed[me] = sched_setaffinity(0, sizeof(set), &set) != 0;  // 0: this thread, not the process
  }
  for (int i = 0; i < threads; ++i) {
    TORCH_CHECK(!failed[i], "could not bind OpenMP thread ", i, " to CPU ", cpus[i]);
  }
  return tids;
}
