// The communication layer: MPI's lifetime, communicators and the collectives
// the parallel strategies need, on anvil::Tensor. The interface (rank, size,
// split, all-reduce, all-gather, reduce-scatter, broadcast, send/recv, each
// blocking or returning a Work handle) is all a strategy sees, so an NCCL
// backend can implement the same class later; docs/distributed.md says how.
//
// Payloads are f32, bf16 or i32 tensors (always contiguous). bf16 reductions
// accumulate in fp32: the values are widened into an fp32 staging buffer
// (tracked as MemCategory::communication), MPI sums fp32, and the result is
// rounded back to bf16 once, to nearest even. A user-defined MPI_Op on bf16
// pairs would instead round every partial sum, so the result would depend on
// the rank count and on MPI's reduction tree; the staging costs twice the
// bytes on the wire, which the byte counters report honestly.
#pragma once
#include <mpi.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

// ---------------------------------------------------------------------------
// MPI's lifetime.

// Owns MPI_Init_thread / MPI_Finalize for the process; create one at the top of
// main, before any Communicator, so communicators are freed before MPI is.
// Works without mpirun too: MPI then starts as a singleton, a world of size 1.
//
// Thread level: MPI_THREAD_FUNNELED. Anvil's other threads — the data prefetch
// thread, the asynchronous checkpoint writer, OpenMP's kernel workers — never
// call MPI; only the main thread does, and it also progresses non-blocking
// collectives (Work::test/wait between layers). FUNNELED is exactly that
// promise, and it is cheaper than MPI_THREAD_MULTIPLE, which makes MPI lock
// around every call and which some MPI builds do not provide. A design with a
// communication thread progressing collectives in the background would need
// MULTIPLE; Anvil asserts the main-thread rule on every call so such a change
// cannot slip in silently.
class MpiRuntime {
 public:
  static constexpr int kRequiredThreadLevel = MPI_THREAD_FUNNELED;

  // Initialises MPI unless it already is (then it neither re-initialises nor
  // finalises). Throws anvil::Error when MPI cannot start or provides a thread
  // level below kRequiredThreadLevel.
  MpiRuntime(int& argc, char**& argv);
  MpiRuntime();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // The thread level MPI provided (MPI_THREAD_SINGLE … MPI_THREAD_MULTIPLE).
  int thread_level() const { return provided_; }

  // MPI is initialised and not yet finalised.
  static bool active();

 private:
  void init(int* argc, char*** argv);
  bool owns_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

// Throws anvil::Error naming both levels when provided < required. Separate so
// the message can be tested without an MPI that lacks thread support.
void check_thread_level(int provided, int required);
// "MPI_THREAD_FUNNELED", ...
const char* thread_level_name(int level);

// For when one rank fails and the others would wait forever in a collective:
// prints "anvil: rank R: <why>" to stderr and calls MPI_Abort on the world,
// which makes mpirun kill every rank. Without MPI it just exits with status 1.
// Like every MPI call it belongs on the main thread; other threads hand their
// failures to it.
[[noreturn]] void abort_all(const std::string& why);

// ---------------------------------------------------------------------------
// Byte counting.

enum class CommOp : uint8_t { all_reduce, all_gather, reduce_scatter, broadcast, send, recv, all_to_all };
inline constexpr int kNumCommOps = 7;
const char* comm_op_name(CommOp op);

// Bytes one rank sends for one call, by the algorithm-independent formulas
// (those of nccl-tests' bus bandwidth), for a group of n ranks and a payload
// of S bytes on the wire:
//   all_reduce      2(n−1)/n · S    (S: the tensor)
//   all_gather       (n−1)/n · S    (S: the gathered, full tensor)
//   reduce_scatter   (n−1)/n · S    (S: the full input)
//   broadcast        S, 0 when n = 1
//   send / recv      S              (recv counts bytes received)
//   all_to_all       S              (S: the bytes this rank sends to the others)
// bf16 reductions travel as fp32, so their S is 4 bytes per element.
uint64_t comm_bytes(CommOp op, uint64_t payload_bytes, int group_size);

struct CommCounters {
  std::array<uint64_t, kNumCommOps> calls{};
  std::array<uint64_t, kNumCommOps> bytes{};  // by comm_bytes, summed over calls
  uint64_t calls_of(CommOp op) const { return calls[static_cast<size_t>(op)]; }
  uint64_t bytes_of(CommOp op) const { return bytes[static_cast<size_t>(op)]; }
  uint64_t total_bytes() const;
};

// ---------------------------------------------------------------------------
// Collectives.

enum class ReduceOp : uint8_t {
  sum,
  avg,  // the sum divided by the group size, in fp32 (f32 and bf16 only)
  max,  // the elementwise largest (loss parallel's per-row maxima); bf16 through fp32 is exact
};

// A non-blocking operation in flight. wait() completes it (and, for bf16 or
// avg, writes the final values into the caller's tensor); the tensors involved
// stay alive until then, but must not be read or written by the caller before
// wait() returns. Destroying a pending Work waits for it, since MPI may still
// be writing into the buffers; a failure there cannot be thrown from a
// destructor, so it aborts the job through abort_all. Move-only.
class Work {
 public:
  Work();  // nothing pending (defined where Pending is complete)
  ~Work();
  Work(Work&& other) noexcept;
  Work& operator=(Work&& other) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Blocks until done. Throws anvil::Error if MPI reports a failure.
  void wait();
  // Progresses the operation without blocking (MPI advances non-blocking
  // collectives only inside MPI calls, so call this between pieces of compute
  // to overlap); true once done, after which wait() returns at once.
  bool test();
  bool pending() const { return pending_ != nullptr; }

 private:
  friend class Communicator;
  struct Pending;
  explicit Work(std::unique_ptr<Pending> p);
  void complete(int rc, const MPI_Status& status);
  std::unique_ptr<Pending> pending_;
};

// An MPI communicator: a group of ranks and the collectives among them. Owns
// the MPI_Comm (freed on destruction unless it is MPI_COMM_WORLD or
// MPI_COMM_SELF); move-only. Errors are returned, not fatal (MPI_ERRORS_RETURN),
// and become anvil::Error naming the operation, the MPI call and MPI's text.
//
// Every call is collective over the group (except send/recv) and must be made
// by every member in the same order, from the main thread. Tensors are handles:
// `const Tensor&` outputs are written. Counts are limited to MPI's int range
// (2³¹ − 1 elements per call); larger tensors must be split by the caller.
// Who a group is, for messages: its name and its members' ranks in
// MPI_COMM_WORLD, in group order (none in a dry run). Shared with the group's
// pending Works, which may outlive it.
struct GroupInfo {
  std::string name = "group";
  std::vector<int> world_ranks;
};

class Communicator {
 public:
  Communicator() = default;  // no group (MPI_COMM_NULL)
  ~Communicator();
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Every process of the job. Throws anvil::Error unless MPI is initialised.
  static Communicator world();
  // This process alone.
  static Communicator self();
  // Rank `rank` of a group of `size` ranks for a dry run (core/dry_run.h):
  // no other process shares it and no MPI is involved. Every call checks its
  // arguments, allocates what it would allocate and counts its bytes as a
  // real one does, then moves nothing: blocking calls return at once, and
  // non-blocking ones hold their buffers until the caller's wait() or test()
  // (which completes them), in the order the real code posts and waits.
  static Communicator dry(int rank, int size);

  bool valid() const { return comm_ != MPI_COMM_NULL || dry_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_; }
  // What messages (a deadline's) call the group: "tp", "dp_shard"; "world"
  // or "group" by default.
  void set_name(std::string name);

  // Ranks passing the same color form a new communicator, ordered by key (ties
  // by rank here). Collective over this communicator.
  Communicator split(int color, int key) const;

  // t (any shape) ← Σ over ranks, in place.
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);
  Work iall_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);

  // full (size·k, ...) ← the shards (k, ...) of ranks 0, 1, … concatenated
  // along dim 0. shard may be full's own slice for this rank (in place).
  void all_gather(const Tensor& shard, const Tensor& full);
  Work iall_gather(const Tensor& shard, const Tensor& full);

  // shard (k, ...) ← Σ over ranks of rows [rank·k, (rank+1)·k) of full
  // (size·k, ...). shard must not overlap full. The non-blocking one is an
  // all-to-all into `pieces` (size·k elements, f32, or i32 for i32), summed in
  // rank order when it completes; the caller may pass that buffer, to free it
  // when it chooses, else the Work keeps its own until completion.
  void reduce_scatter(const Tensor& full, const Tensor& shard, ReduceOp op = ReduceOp::sum);
  Work ireduce_scatter(const Tensor& full, const Tensor& shard, ReduceOp op = ReduceOp::sum,
                       const Tensor& pieces = Tensor());

  // t ← root's t, on every rank.
  void broadcast(const Tensor& t, int root);
  Work ibroadcast(const Tensor& t, int root);

  // Point to point; the receiver's tensor must have the sender's dtype and
  // element count.
  void send(const Tensor& t, int dst, int tag = 0);
  Work isend(const Tensor& t, int dst, int tag = 0);
  void recv(const Tensor& t, int src, int tag = 0);
  Work irecv(const Tensor& t, int src, int tag = 0);

  // All-to-all with counts per rank (MPI_Alltoallv), of rows along dim 0:
  // this rank's send_rows[i] rows of `send`, in rank order, go to rank i, and
  // `recv` gets recv_rows[i] rows from rank i, in rank order. send and recv
  // have one dtype and row width; the counts must agree pairwise, so exchange
  // them first (all_to_all_counts). Mixture-of-experts dispatch and combine.
  void all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                    const std::vector<int64_t>& recv_rows);
  Work iall_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows);
  // counts[i] to rank i; returns what each rank sent this one. In a dry run,
  // where no other rank speaks, the counts come back as they went (the
  // balanced case, where every rank sends as much as it receives).
  std::vector<int64_t> all_to_all_counts(const std::vector<int64_t>& counts);

  // Waits for every rank of the group (no bytes counted).
  void barrier();

  const CommCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 private:
  Communicator(MPI_Comm comm, bool owned);
  // One collective: counts it, then starts it non-blocking (async) or runs it
  // blocking and finishes it at once. `call(request)` issues the MPI call,
  // non-blocking when request is non-null.
  struct Call;
  Work run(Call call, bool async);
  Work all_reduce_impl(const Tensor& t, ReduceOp op, bool async);
  Work all_gather_impl(const Tensor& shard, const Tensor& full, bool async);
  Work reduce_scatter_impl(const Tensor& full, const Tensor& shard, ReduceOp op, bool async, Tensor pieces);
  Work broadcast_impl(const Tensor& t, int root, bool async);
  Work send_impl(const Tensor& t, int dst, int tag, bool async);
  Work recv_impl(const Tensor& t, int src, int tag, bool async);
  Work all_to_all_v_impl(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                         const std::vector<int64_t>& recv_rows, bool async);
  void free_comm();

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  bool dry_ = false;
  int rank_ = 0;
  int size_ = 0;
  std::shared_ptr<const GroupInfo> info_ = std::make_shared<GroupInfo>();
  CommCounters counters_;
};

}  // namespace anvil
