// Where a data-parallel strategy's communication time goes. Each collective
// is tracked from its start to the moment its completion is seen (an upper
// bound on its real duration), and the time the main thread spends inside MPI
// for it — waiting, and testing to make it progress, since MPI moves data of
// non-blocking collectives only inside MPI calls — is counted apart as
// blocked: the share of communication hidden behind compute is
// 1 − blocked / in flight. While a step is profiled each collective also
// becomes a span with its bytes on a "collectives in flight" track, and each
// blocked interval a span on a "blocked on collectives" track, so the trace
// of a step gives back the hidden share its metrics line prints.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/profiler.h"
#include "anvil/distributed/comm.h"

namespace anvil {

struct CommStats {
  uint64_t bytes = 0;        // sent by this rank (comm_bytes' formulas)
  double in_flight_s = 0;    // Σ over collectives of start → completion seen
  double blocked_s = 0;      // the main thread waiting for collectives
  int64_t collectives = 0;
  double hidden_share() const { return in_flight_s > 0 ? std::max(0.0, 1.0 - blocked_s / in_flight_s) : 0.0; }
};

class CommTracker {
 public:
  // A collective just started; returns its id for done().
  int start(const char* label, int layer, CommOp op, uint64_t payload_bytes, int group_size);
  void done(int id);
  // Measures a blocking wait.
  class Blocked {
   public:
    explicit Blocked(CommTracker& t) : t_(t), begin_us_(steady_now_us()) {}
    ~Blocked();

   private:
    CommTracker& t_;
    double begin_us_;
  };
  const CommStats& stats() const { return stats_; }
  CommStats take();  // the stats so far, then zero

 private:
  struct Op {
    const char* label;
    int layer;
    uint64_t bytes;
    double start_us;
    bool open;
  };
  std::vector<Op> ops_;
  CommStats stats_;
};

}  // namespace anvil
