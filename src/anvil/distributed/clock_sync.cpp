#include "anvil/distributed/clock_sync.h"

#include <mpi.h>

#include <cstdio>
#include <vector>

#include "anvil/core/profiler.h"
#include "anvil/distributed/deadline.h"

namespace anvil {

namespace {

// Round trips per rank: the shortest of them sets the bound, and a few dozen
// find one that no scheduling hiccup stretched.
constexpr int kRoundTrips = 24;

// Per world rank: its clock minus rank 0's, and the bound on that, µs.
std::vector<double> g_offset_us, g_uncertainty_us;
int g_world_rank = 0;

}  // namespace

void synchronize_clocks() {
  const std::vector<std::string>& hosts = world_hosts();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  g_world_rank = rank;
  g_offset_us.assign(static_cast<size_t>(size), 0.0);
  g_uncertainty_us.assign(static_cast<size_t>(size), 0.0);
  if (hosts.size() != static_cast<size_t>(size)) return;
  // Its own communicator, so no message of the run can match these.
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  for (int r = 1; r < size; ++r) {
    if (hosts[static_cast<size_t>(r)] == hosts[0]) continue;
    if (rank == 0) {
      double best_rtt = 1e300;
      for (int i = 0; i < kRoundTrips; ++i) {
        double stamp = 0;
        const double t0 = steady_now_us();
        MPI_Send(&t0, 1, MPI_DOUBLE, r, 0, comm);
        MPI_Recv(&stamp, 1, MPI_DOUBLE, r, 0, comm, MPI_STATUS_IGNORE);
        const double t2 = steady_now_us();
        if (t2 - t0 < best_rtt) {
          best_rtt = t2 - t0;
          g_offset_us[static_cast<size_t>(r)] = stamp - 0.5 * (t0 + t2);
          g_uncertainty_us[static_cast<size_t>(r)] = 0.5 * (t2 - t0);
        }
      }
    } else if (rank == r) {
      for (int i = 0; i < kRoundTrips; ++i) {
        double t0 = 0;
        MPI_Recv(&t0, 1, MPI_DOUBLE, 0, 0, comm, MPI_STATUS_IGNORE);
        const double stamp = steady_now_us();
        MPI_Send(&stamp, 1, MPI_DOUBLE, 0, 0, comm);
      }
    }
  }
  MPI_Bcast(g_offset_us.data(), size, MPI_DOUBLE, 0, comm);
  MPI_Bcast(g_uncertainty_us.data(), size, MPI_DOUBLE, 0, comm);
  MPI_Comm_free(&comm);
}

double clock_offset_us() {
  return static_cast<size_t>(g_world_rank) < g_offset_us.size() ? g_offset_us[static_cast<size_t>(g_world_rank)] : 0;
}

double clock_offset_uncertainty_us() {
  return static_cast<size_t>(g_world_rank) < g_uncertainty_us.size()
             ? g_uncertainty_us[static_cast<size_t>(g_world_rank)]
             : 0;
}

std::string clock_offsets_summary() {
  const std::vector<std::string>& hosts = world_hosts();
  std::string out;
  std::vector<std::string> seen = {hosts.empty() ? std::string() : hosts[0]};
  for (size_t r = 1; r < hosts.size() && r < g_offset_us.size(); ++r) {
    bool known = false;
    for (const std::string& h : seen) known = known || h == hosts[r];
    if (known) continue;
    seen.push_back(hosts[r]);
    char text[160];
    std::snprintf(text, sizeof text, "%s %+.3f ms ± %.3f ms", hosts[r].c_str(), g_offset_us[r] * 1e-3,
                  g_uncertainty_us[r] * 1e-3);
    if (!out.empty()) out += "; ";
    out += text;
  }
  return out;
}

}  // namespace anvil
