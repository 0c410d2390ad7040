// Deadlines on every wait for other ranks (torchtitan's
// comm.init_timeout_seconds and comm.train_timeout_seconds; NCCL's watchdog).
// Every blocking MPI call and every wait for a non-blocking one runs inside a
// CommWait. A watchdog thread ends the process when one outlasts the
// deadline: it prints one line — the operation, its group, the ranks and
// hosts it waits for, and what the trainer says of the run (step, last
// complete checkpoint, how to resume) — asks MPI to end the whole job, and if
// that has not ended this process within a few seconds (the other side of a
// cut link cannot be reached), exits with status 1 itself; if this host's
// launcher (mpirun, orted) is still there 10 s after, a process the rank left
// behind ends it. So no process of the job outlives the deadline by more than
// about 10 s, on either side of a cut.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace anvil {

struct GroupInfo;

// The deadline of every wait from now on, in seconds (0, the default: none);
// `key` names the setting in the message ("comm.train_timeout_seconds").
void set_comm_deadline(double seconds, const char* key);
// The training step under way (0: start-up), for the expiry message.
void set_comm_deadline_step(int64_t step);
// What else the expiry message says of the run ("step 5; last complete checkpoint
// …; to resume, run the same command again"); called from the watchdog thread.
void set_comm_deadline_context(std::function<std::string()> context);

// A stop signal caught (called from the signal handler): if it lands while
// this rank waits for others and the wait goes on, the watchdog says what the
// rank was waiting for (the launcher sends SIGTERM when another rank died).
void note_stop_signal(int sig);

// The file where this rank also writes the lines that say how it ended
// (deadline expiry, an abort, a stop signal in a wait), appended to: a rank
// cut off from the launcher has no other way to be heard.
void set_rank_log(const std::string& path);
// "anvil: <line>" to stderr and to the rank's log.
void rank_log_line(const std::string& line);

// The host each world rank runs on (MPI_Get_processor_name), gathered when
// MPI starts (MpiRuntime, which also gives this process's world rank);
// unknown before, or without MPI.
void set_world_hosts(std::vector<std::string> hosts, int world_rank);
// The hosts by world rank (empty before MPI starts, or without it).
const std::vector<std::string>& world_hosts();
// "rank 3 (host b)", or "rank 3" when the host is unknown.
std::string rank_and_host(int world_rank);
// Which ranks run on which host: "a: ranks 0-1; b: ranks 2-3".
std::string hosts_summary();

// While alive, this thread waits for `what` ("all_reduce (MPI_Allreduce)")
// over `group`; both must outlive it. Not nested: one wait at a time per
// process (MPI calls come from the main thread only).
class CommWait {
 public:
  CommWait(const char* what, const GroupInfo& group);
  ~CommWait();
  CommWait(const CommWait&) = delete;
  CommWait& operator=(const CommWait&) = delete;
};

}  // namespace anvil
