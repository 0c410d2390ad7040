#include "anvil/distributed/deadline.h"

#include <fcntl.h>
#include <mpi.h>
#include <spawn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
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
  // A stop signal (SIGTERM, SIGINT) this process caught, and when.
  std::atomic<int> stop_signal{0};
  std::atomic<int64_t> stop_signal_ns{0};
  // This rank's log of how it ended ("" for none); set before any wait.
  std::string rank_log;
  // The launcher process that started this rank on this host (Open MPI's
  // mpirun or orted), recorded when MPI starts: its pid and its start time
  // (field 22 of /proc/pid/stat, which tells it from a later process given
  // the same pid); 0 when the parent is no launcher Anvil knows (srun's
  // slurmstepd, a shell).
  pid_t launcher_pid = 0;
  std::string launcher_start, launcher_name;
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

// Seconds a rank gives MPI_Abort to end it, and then its host's launcher
// to exit, before ending them itself.
constexpr int kAbortGraceSeconds = 5;
constexpr int kLauncherGraceSeconds = 10;

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Field 22 of /proc/<pid>/stat, the process's start time in clock ticks.
std::string process_start_time(pid_t pid) {
  const std::string stat = read_first_line("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');  // the name may hold spaces; the fields after it do not
  if (paren == std::string::npos) return "";
  size_t pos = paren + 2;  // field 3
  for (int field = 3; field < 22; ++field) {
    const size_t space = stat.find(' ', pos);
    if (space == std::string::npos) return "";
    pos = space + 1;
  }
  return stat.substr(pos, stat.find(' ', pos) - pos);
}

void remember_launcher() {
  DeadlineState& s = state();
  const pid_t parent = ::getppid();
  const std::string name = read_first_line("/proc/" + std::to_string(parent) + "/comm");
  for (const char* launcher : {"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"})
    if (name == launcher) {
      s.launcher_pid = parent;
      s.launcher_name = name;
      s.launcher_start = process_start_time(parent);
      return;
    }
}

// Open MPI's launcher, asked to end the job, waits for the daemons of every
// host to confirm; across a cut link that never comes (its TCP keepalive gives
// up after 8 minutes by default), and an orted cut off from mpirun stays too.
// So the rank whose deadline fired leaves a process of its own, in a session
// of its own (the launcher kills the rank's process group), which ends this
// host's launcher if it is still there kLauncherGraceSeconds later, with
// SIGKILL (mpirun 4.1 answers SIGTERM in that state by crashing in its own
// clean-up). Where the job ends normally the launcher is gone by then and it
// does nothing.
void end_launcher_later(const std::string& cause) {
  const DeadlineState& s = state();
  if (s.launcher_pid <= 0 || s.launcher_start.empty()) return;
  const std::string pid = std::to_string(s.launcher_pid);
  const std::string note = rank_and_host(s.world_rank) + ": ended this host's launcher (" + s.launcher_name + ", pid " +
                           pid + "), still running " + std::to_string(kLauncherGraceSeconds) + " s after " + cause;
  const std::string script =
      "alive() { [ \"$(sed 's/.*) //' /proc/$1/stat 2>/dev/null | cut -d' ' -f20)\" = \"$2\" ]; }\n"
      "sleep " +
      std::to_string(kLauncherGraceSeconds) +
      "\n"
      "alive \"$1\" \"$2\" || exit 0\n"
      "[ -n \"$3\" ] && echo \"anvil: $4\" >> \"$3\"\n"
      "kill -KILL \"$1\"\n";
  std::vector<std::string> args = {"sh", "-c", script, "anvil-end-launcher", pid, s.launcher_start, s.rank_log, note};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  for (int fd = 0; fd < 3; ++fd) posix_spawn_file_actions_addopen(&files, fd, "/dev/null", fd ? O_WRONLY : O_RDONLY, 0);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
  pid_t child = 0;
  posix_spawn(&child, "/bin/sh", &files, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&files);
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
  const int64_t step = s.step.load();
  const std::string when = step > 0 ? "step " + std::to_string(step) : std::string("start-up");
  char waited_text[32];
  std::snprintf(waited_text, sizeof waited_text, "%.0f", waited);
  rank_log_line(rank_and_host(me) + ": error: in " + when + ", " + (what ? what : "a collective") + " over the " +
                (group ? group->name : std::string("?")) + " group (world ranks " + join_ranks(members) +
                ") did not complete within " + waited_text + " s (" + s.key.load() + "): no word from " +
                (n_others == 1 ? "" : "one of ") + (others.empty() ? std::string("the group") : others) +
                " — a rank has stopped or the network between them is down" + (context.empty() ? "" : "; ") + context +
                "; ending the job");
  end_launcher_later("this rank's deadline (" + when + ", " + (what ? what : "a collective") + " over the " +
                     (group ? group->name : std::string("?")) + " group, no word from " +
                     (n_others == 1 ? "" : "one of ") + (others.empty() ? std::string("the group") : others) + ")");
  // MPI_Abort reaches the launcher, which ends every rank; across a cut link
  // it may never return, so this process ends itself a few seconds later.
  std::thread([] { MPI_Abort(MPI_COMM_WORLD, 1); }).detach();
  std::this_thread::sleep_for(std::chrono::seconds(kAbortGraceSeconds));
  rank_log_line(rank_and_host(me) + ": MPI could not end the job; this rank ends itself");
  std::_Exit(1);
}

// A stop signal that lands while this rank waits for others cannot be acted
// on at the next micro-batch boundary until the wait ends; when the launcher
// sent it because another rank died, the wait never ends and the launcher
// kills this rank a second later. So a signal still unanswered after 0.2 s of
// waiting is reported here, once, with what the rank was waiting for.
void report_stop_signal_in_wait() {
  DeadlineState& s = state();
  const int sig = s.stop_signal.load();
  if (sig == 0) return;
  const int64_t start = s.start_ns.load(std::memory_order_acquire);
  if (start == 0) return;
  const int64_t since = std::max(start, s.stop_signal_ns.load());
  if (static_cast<double>(now_ns() - since) * 1e-9 < 0.2) return;
  const char* what = s.what.load();
  const GroupInfo* group = s.group.load();
  if (s.start_ns.load(std::memory_order_acquire) != start) return;
  s.stop_signal = 0;  // once per signal
  std::string others;
  for (int r : group ? group->world_ranks : std::vector<int>{})
    if (r != s.world_rank) others += (others.empty() ? "" : ", ") + rank_and_host(r);
  const int64_t step = s.step.load();
  rank_log_line(rank_and_host(s.world_rank) + ": " + strsignal(sig) + " (signal " + std::to_string(sig) +
                ") arrived while waiting in " + (step > 0 ? "step " + std::to_string(step) : "start-up") + " for " +
                (what ? what : "a collective") + " over the " + (group ? group->name : std::string("?")) +
                " group, whose other ranks are " + (others.empty() ? std::string("none") : others) +
                "; the launcher sends it when another rank has ended, or when the job is cancelled");
}

void watchdog() {
  DeadlineState& s = state();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    report_stop_signal_in_wait();
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

void note_stop_signal(int sig) {
  DeadlineState& s = state();
  s.stop_signal_ns = now_ns();
  s.stop_signal = sig;
}

void set_rank_log(const std::string& path) { state().rank_log = path; }

void rank_log_line(const std::string& line) {
  std::fflush(stdout);
  std::fprintf(stderr, "anvil: %s\n", line.c_str());
  std::fflush(stderr);
  const std::string& path = state().rank_log;
  if (path.empty()) return;
  std::ofstream(path, std::ios::app) << "anvil: " << line << "\n";
}

void set_comm_deadline_context(std::function<std::string()> context) {
  DeadlineState& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.context = std::move(context);
}

void set_world_hosts(std::vector<std::string> hosts, int world_rank) {
  DeadlineState& s = state();
  s.hosts = std::move(hosts);
  s.world_rank = world_rank;
  remember_launcher();
}

const std::vector<std::string>& world_hosts() { return state().hosts; }

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
