#include "anvil/distributed/deadline.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "anvil/core/error.h"
#include "anvil/distributed/comm.h"

namespace anvil {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Never destroyed: the watchdog thread is detached and reads it until the
// process ends.
struct DeadlineState {
  std::atomic<double> seconds{0};
  std::atomic<const char*> key{""};
  std::mutex mu;  // guards context
  std::function<std::string()> context;
  // Written once when MPI starts, before any wait: read without the lock.
  std::vector<std::string> hosts;
  int world_rank = 0;
  // The wait in progress: its start (0: none), what and group.
  std::atomic<int64_t> start_ns{0};
  std::atomic<const char*> what{nullptr};
  std::atomic<const GroupInfo*> group{nullptr};
  std::atomic<int64_t> step{0};
  std::once_flag watchdog_started;
};

DeadlineState& state() {
  static DeadlineState* s = new DeadlineState;
  return *s;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(ranks[i]));
  }
  return out;
}

// Prints the expiry, asks MPI to end the job, and ends this process if MPI
// has not within a few seconds.
[[noreturn]] void expire(const char* what, const GroupInfo* group, double waited) {
  DeadlineState& s = state();
  std::vector<int> members = group ? group->world_ranks : std::vector<int>{};
  const int me = s.world_rank;  // MPI is the main thread's (MPI_THREAD_FUNNELED)
  std::string others;
  int n_others = 0;
  for (int r : members) {
    if (r == me) continue;
    if (n_others++) others.append(", ");
    others.append(rank_and_host(r));
  }
  std::string context;
  {
    const std::lock_guard<std::mutex> lock(s.mu);
    if (s.context) context = s.context();
  }
  std::fflush(stdout);
  const int64_t step = s.step.load();
  const std::string when = step > 0 ? "step " + std::to_string(step) : std::string("start-up");
  std::fprintf(
      stderr,
      "anvil: %s: error: in %s, %s over the %s group (world ranks %s) did not complete within %.0f s (%s): no word "
      "from %s%s — a rank has stopped or the network between them is down%s%s; ending the job\n",
      rank_and_host(me).c_str(), when.c_str(), what ? what : "a collective", group ? group->name.c_str() : "?",
      join_ranks(members).c_str(), waited, s.key.load(), n_others == 1 ? "" : "one of ",
      others.empty() ? "the group" : others.c_str(), context.empty() ? "" : "; ", context.c_str());
  std::fflush(stderr);
  // MPI_Abort reaches the launcher, which ends every rank; across a cut link
  // it may never return, so this process ends itself a few seconds later.
  std::thread([] { MPI_Abort(MPI_COMM_WORLD, 1); }).detach();
  std::this_thread::sleep_for(std::chrono::seconds(5));
  std::fprintf(stderr, "anvil: %s: MPI could not end the job; this rank ends itself\n", rank_and_host(me).c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void watchdog() {
  DeadlineState& s = state();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const double limit = s.seconds.load();
    const int64_t start = s.start_ns.load(std::memory_order_acquire);
    if (limit <= 0 || start == 0) continue;
    const double waited = static_cast<double>(now_ns() - start) * 1e-9;
    if (waited < limit) continue;
    const char* what = s.what.load();
    const GroupInfo* group = s.group.load();
    if (s.start_ns.load(std::memory_order_acquire) != start) continue;  // that wait ended meanwhile
    expire(what, group, waited);
  }
}

}  // namespace

void set_comm_deadline(double seconds, const char* key) {
  ANVIL_CHECK(seconds >= 0, key, " is ", seconds, "; it must not be negative");
  DeadlineState& s = state();
  s.key = key;
  s.seconds = seconds;
  if (seconds > 0) std::call_once(s.watchdog_started, [] { std::thread(watchdog).detach(); });
}

void set_comm_deadline_step(int64_t step) { state().step = step; }

void set_comm_deadline_context(std::function<std::string()> context) {
  DeadlineState& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.context = std::move(context);
}

void set_world_hosts(std::vector<std::string> hosts, int world_rank) {
  DeadlineState& s = state();
  s.hosts = std::move(hosts);
  s.world_rank = world_rank;
}

std::string rank_and_host(int world_rank) {
  const std::vector<std::string>& hosts = state().hosts;
  const std::string r = "rank " + std::to_string(world_rank);
  if (world_rank < 0 || static_cast<size_t>(world_rank) >= hosts.size()) return r;
  return r + " (host " + hosts[static_cast<size_t>(world_rank)] + ")";
}

std::string hosts_summary() {
  const std::vector<std::string>& hosts = state().hosts;
  std::vector<std::pair<std::string, std::vector<int>>> by_host;  // in order of first rank
  for (size_t r = 0; r < hosts.size(); ++r) {
    auto it = std::find_if(by_host.begin(), by_host.end(), [&](const auto& h) { return h.first == hosts[r]; });
    if (it == by_host.end()) it = by_host.insert(by_host.end(), {hosts[r], {}});
    it->second.push_back(static_cast<int>(r));
  }
  std::string out;
  for (const auto& [host, ranks] : by_host) {
    if (!out.empty()) out.append("; ");
    out.append(host).append(ranks.size() > 1 ? ": ranks " : ": rank ");
    // Runs of consecutive ranks as a-b.
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      if (i) out.append(", ");
      out.append(std::to_string(ranks[i]));
      if (j > i) out.append("-").append(std::to_string(ranks[j]));
      i = j + 1;
    }
  }
  return out;
}

CommWait::CommWait(const char* what, const GroupInfo& group) {
  DeadlineState& s = state();
  s.what.store(what);
  s.group.store(&group);
  s.start_ns.store(now_ns(), std::memory_order_release);
}

CommWait::~CommWait() { state().start_ns.store(0, std::memory_order_release); }

}  // namespace anvil
