#include "anvil/distributed/comm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

#include "anvil/core/parallel_for.h"
#include "anvil/distributed/clock_sync.h"
#include "anvil/distributed/deadline.h"

namespace anvil {

namespace {

// The world rank, kept outside MPI so abort_all can name it without an MPI
// call (it may run while MPI is in a bad state).
std::atomic<int> g_world_rank{0};

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

// Under MPI_THREAD_FUNNELED only the thread that initialised MPI may call it;
// a call from elsewhere is a bug in Anvil, not something a user can cause.
void require_main_thread(const char* what) {
  int is_main = 0;
  MPI_Is_thread_main(&is_main);
  ANVIL_ASSERT(is_main, what, " called from a thread other than the one that initialised MPI, which "
               "MPI_THREAD_FUNNELED forbids");
}

MPI_Datatype wire_type(DType d) {
  switch (d) {
    case DType::f32: return MPI_FLOAT;
    case DType::bf16: return MPI_UINT16_T;  // moved as raw bits, never reduced as such
    case DType::i32: return MPI_INT32_T;
  }
  return MPI_DATATYPE_NULL;
}

int mpi_count(int64_t n, const char* op) {
  ANVIL_CHECK(n <= INT_MAX, op, ": ", n, " elements exceed MPI's count limit of ", INT_MAX,
              " per call; split the tensor into buckets");
  return static_cast<int>(n);
}

void check_reduction(const Tensor& t, ReduceOp op, const char* name) {
  ANVIL_CHECK(op != ReduceOp::avg || t.dtype() != DType::i32, name, ": avg needs f32 or bf16, not i32");
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

// x /= n elementwise: avg is the fp32 sum divided once, so a bf16 result is
// still rounded only once.
void divide_(float* x, int64_t count, int n) {
  const float d = static_cast<float>(n);
  parallel_for(0, count, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) x[i] /= d;
  });
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const char* a0 = static_cast<const char*>(a.raw());
  const char* b0 = static_cast<const char*>(b.raw());
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// full must be `parts` copies of shard's shape stacked along dim 0.
void check_stacked(const Tensor& shard, const Tensor& full, int parts, const char* op) {
  ANVIL_CHECK(shard.defined() && full.defined(), op, ": undefined tensor");
  ANVIL_CHECK(shard.dtype() == full.dtype(), op, ": shard is ", dtype_name(shard.dtype()), " but full is ",
              dtype_name(full.dtype()));
  bool ok = shard.ndim() >= 1 && shard.ndim() == full.ndim() && full.size(0) == shard.size(0) * parts;
  for (int d = 1; ok && d < shard.ndim(); ++d) ok = shard.size(d) == full.size(d);
  ANVIL_CHECK(ok, op, ": full ", shape_str(full.shape()), " must be ", parts, " shards of ", shape_str(shard.shape()),
              " stacked along dim 0");
}

}  // namespace

// ---------------------------------------------------------------------------
// MpiRuntime

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown MPI thread level";
  }
}

void check_thread_level(int provided, int required) {
  // The standard orders the levels: SINGLE < FUNNELED < SERIALIZED < MULTIPLE.
  ANVIL_CHECK(provided >= required, "MPI provides thread level ", thread_level_name(provided), " but Anvil needs ",
              thread_level_name(required),
              " (its data-prefetch and checkpoint threads run while the main thread calls MPI); use an MPI "
              "library built with thread support");
}

MpiRuntime::MpiRuntime(int& argc, char**& argv) { init(&argc, &argv); }
MpiRuntime::MpiRuntime() { init(nullptr, nullptr); }

void MpiRuntime::init(int* argc, char*** argv) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  ANVIL_CHECK(!finalized, "MPI was already finalised in this process and cannot be started again");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided_);
  } else {
    // MPI's start exchanges every rank's address: a wait for all of them.
    static const GroupInfo starting{"world", {}};
    const CommWait wait("MPI start-up (MPI_Init_thread)", starting);
    const int rc = MPI_Init_thread(argc, argv, kRequiredThreadLevel, &provided_);
    ANVIL_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed (error code ", rc, ")");
    owns_ = true;
  }
  // Errors come back as codes and become anvil::Error with the operation's name,
  // instead of MPI's default of killing the job with a generic message.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  g_world_rank = rank;
  try {
    check_thread_level(provided_, kRequiredThreadLevel);
  } catch (...) {
    if (owns_) MPI_Finalize();
    owns_ = false;
    throw;
  }
  // Which host each rank runs on, for the banner and for every message that names a rank.
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<char> all(static_cast<size_t>(size) * MPI_MAX_PROCESSOR_NAME);
  static GroupInfo world;  // named before Communicator::world() exists, for the deadline's message
  world.name = "world";
  world.world_ranks.resize(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) world.world_ranks[static_cast<size_t>(r)] = r;
  {
    const CommWait wait("the exchange of host names (MPI_Allgather)", world);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD);
  }
  std::vector<std::string> hosts;
  for (int r = 0; r < size; ++r) hosts.emplace_back(all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME);
  set_world_hosts(std::move(hosts), rank);
  // Traces of every host on rank 0's clock.
  const CommWait wait("the clock offsets' ping-pongs (MPI_Send, MPI_Recv)", world);
  synchronize_clocks();
}

MpiRuntime::~MpiRuntime() {
  if (owns_ && active()) MPI_Finalize();
}

bool MpiRuntime::active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

void abort_all(const std::string& why) {
  rank_log_line(rank_and_host(g_world_rank.load()) + ": " + why);
  if (MpiRuntime::active()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// ---------------------------------------------------------------------------
// Byte counting

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::all_reduce: return "all_reduce";
    case CommOp::all_gather: return "all_gather";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::broadcast: return "broadcast";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::all_to_all: return "all_to_all";
  }
  return "?";
}

uint64_t comm_bytes(CommOp op, uint64_t payload_bytes, int group_size) {
  ANVIL_ASSERT(group_size >= 1, "group size ", group_size);
  const uint64_t n = static_cast<uint64_t>(group_size);
  switch (op) {
    case CommOp::all_reduce: return 2 * (n - 1) * payload_bytes / n;
    case CommOp::all_gather:
    case CommOp::reduce_scatter: return (n - 1) * payload_bytes / n;
    case CommOp::broadcast: return n > 1 ? payload_bytes : 0;
    case CommOp::send:
    case CommOp::recv:
    case CommOp::all_to_all: return payload_bytes;
  }
  return 0;
}

uint64_t CommCounters::total_bytes() const {
  uint64_t s = 0;
  for (uint64_t b : bytes) s += b;
  return s;
}

// ---------------------------------------------------------------------------
// Work

struct Work::Pending {
  MPI_Request request = MPI_REQUEST_NULL;
  std::string what;                 // "all_reduce (MPI_Iallreduce) on rank 1 of a group of 4"
  std::vector<Tensor> keep_alive;   // every buffer MPI reads or writes until completion
  std::function<void()> finish;     // after completion: fp32 → bf16, avg's division
  int64_t expect_count = -1;        // recv: the element count that must arrive
  MPI_Datatype type = MPI_DATATYPE_NULL;
  bool dry = false;                 // a dry run's: completes without MPI and computes nothing
  std::shared_ptr<const GroupInfo> group;  // for a deadline's message
};

Work::Work(std::unique_ptr<Pending> p) : pending_(std::move(p)) {}

Work::Work(Work&& other) noexcept : pending_(std::move(other.pending_)) {}

Work::Work() = default;

Work::~Work() {
  if (!pending_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    abort_all(e.what());
  }
}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (pending_) {
      try {
        wait();
      } catch (const std::exception& e) {
        abort_all(e.what());
      }
    }
    pending_ = std::move(other.pending_);
  }
  return *this;
}

void Work::complete(int rc, const MPI_Status& status) {
  // Whatever happens, this Work is no longer pending (and its buffers go).
  const std::unique_ptr<Pending> p = std::move(pending_);
  if (p->dry) return;
  ANVIL_CHECK(rc == MPI_SUCCESS, p->what, " failed: ", mpi_error_text(rc));
  if (p->expect_count >= 0) {
    int got = 0;
    MPI_Get_count(&status, p->type, &got);
    ANVIL_CHECK(got == p->expect_count, p->what, ": received ", got, " elements from rank ", status.MPI_SOURCE,
                " but the tensor holds ", p->expect_count);
  }
  if (p->finish) p->finish();
}

void Work::wait() {
  if (!pending_) return;
  if (pending_->dry) return complete(MPI_SUCCESS, MPI_Status{});
  require_main_thread("Work::wait");
  MPI_Status status{};
  int rc = MPI_SUCCESS;
  {
    const CommWait deadline(pending_->what.c_str(), *pending_->group);
    rc = MPI_Wait(&pending_->request, &status);
  }
  complete(rc, status);
}

bool Work::test() {
  if (!pending_) return true;
  if (pending_->dry) {
    complete(MPI_SUCCESS, MPI_Status{});
    return true;
  }
  require_main_thread("Work::test");
  MPI_Status status{};
  int done = 0;
  const int rc = MPI_Test(&pending_->request, &done, &status);
  if (rc == MPI_SUCCESS && !done) return false;
  complete(rc, status);
  return true;
}

// ---------------------------------------------------------------------------
// Communicator

struct Communicator::Call {
  Call(CommOp o, const char* blocking, const char* nonblocking)
      : op(o), blocking_name(blocking), nonblocking_name(nonblocking) {}
  CommOp op;
  const char* blocking_name;     // "MPI_Allreduce"
  const char* nonblocking_name;  // "MPI_Iallreduce"
  uint64_t wire_bytes = 0;       // S of comm_bytes
  // Issues the MPI call: non-blocking into *request when request is non-null,
  // blocking otherwise (status for a blocking receive).
  std::function<int(MPI_Request* request, MPI_Status* status)> issue;
  std::function<void()> finish;
  std::vector<Tensor> keep_alive;
  int64_t expect_count = -1;
  MPI_Datatype type = MPI_DATATYPE_NULL;
};

Communicator::Communicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  if (comm_ == MPI_COMM_NULL) return;
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  // The members' world ranks, for messages that name them.
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm_, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> mine(static_cast<size_t>(size_));
  for (int i = 0; i < size_; ++i) mine[static_cast<size_t>(i)] = i;
  auto info = std::make_shared<GroupInfo>();
  info->world_ranks.resize(static_cast<size_t>(size_));
  MPI_Group_translate_ranks(group, size_, mine.data(), world, info->world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  if (comm_ == MPI_COMM_WORLD) info->name = "world";
  info_ = std::move(info);
}

void Communicator::set_name(std::string name) {
  auto info = std::make_shared<GroupInfo>(*info_);
  info->name = std::move(name);
  info_ = std::move(info);
}

Communicator::~Communicator() { free_comm(); }

Communicator::Communicator(Communicator&& other) noexcept
    : comm_(other.comm_),
      owned_(other.owned_),
      dry_(other.dry_),
      rank_(other.rank_),
      size_(other.size_),
      info_(std::move(other.info_)),
      counters_(other.counters_) {
  other.comm_ = MPI_COMM_NULL;
  other.owned_ = false;
}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    free_comm();
    comm_ = other.comm_;
    owned_ = other.owned_;
    dry_ = other.dry_;
    rank_ = other.rank_;
    size_ = other.size_;
    info_ = std::move(other.info_);
    counters_ = other.counters_;
    other.comm_ = MPI_COMM_NULL;
    other.owned_ = false;
  }
  return *this;
}

void Communicator::free_comm() {
  // After MPI_Finalize every communicator is gone already; freeing would be an error.
  if (owned_ && comm_ != MPI_COMM_NULL && MpiRuntime::active()) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
  owned_ = false;
}

Communicator Communicator::world() {
  ANVIL_CHECK(MpiRuntime::active(), "MPI is not running: create an anvil::MpiRuntime at the start of main");
  return Communicator(MPI_COMM_WORLD, false);
}

Communicator Communicator::self() {
  ANVIL_CHECK(MpiRuntime::active(), "MPI is not running: create an anvil::MpiRuntime at the start of main");
  return Communicator(MPI_COMM_SELF, false);
}

Communicator Communicator::dry(int rank, int size) {
  ANVIL_ASSERT(size >= 1 && rank >= 0 && rank < size, "dry communicator: rank ", rank, " of ", size);
  Communicator c;
  c.dry_ = true;
  c.rank_ = rank;
  c.size_ = size;
  return c;
}

Communicator Communicator::split(int color, int key) const {
  ANVIL_CHECK(valid(), "split on an empty communicator");
  ANVIL_ASSERT(!dry_, "split of a dry communicator: build the dry run's groups with Communicator::dry");
  require_main_thread("split");
  MPI_Comm out = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
  {
    const CommWait deadline("split (MPI_Comm_split)", *info_);
    rc = MPI_Comm_split(comm_, color, key, &out);
  }
  ANVIL_CHECK(rc == MPI_SUCCESS, "split: MPI_Comm_split failed on rank ", rank_, " of a group of ", size_, ": ",
              mpi_error_text(rc));
  return Communicator(out, true);
}

void Communicator::barrier() {
  ANVIL_CHECK(valid(), "barrier on an empty communicator");
  if (dry_) return;
  require_main_thread("barrier");
  const CommWait deadline("barrier (MPI_Barrier)", *info_);
  const int rc = MPI_Barrier(comm_);
  ANVIL_CHECK(rc == MPI_SUCCESS, "barrier: MPI_Barrier failed on rank ", rank_, " of a group of ", size_, ": ",
              mpi_error_text(rc));
}

Work Communicator::run(Call c, bool async) {
  const char* name = comm_op_name(c.op);
  ANVIL_CHECK(valid(), name, " on an empty communicator");
  if (!dry_) require_main_thread(name);
  const auto op = static_cast<size_t>(c.op);
  counters_.calls[op] += 1;
  counters_.bytes[op] += comm_bytes(c.op, c.wire_bytes, size_);

  auto p = std::make_unique<Work::Pending>();
  p->what = detail::concat(name, " (", async ? c.nonblocking_name : c.blocking_name, ") on rank ", rank_,
                           " of a group of ", size_);
  p->keep_alive = std::move(c.keep_alive);
  p->finish = std::move(c.finish);
  p->expect_count = c.expect_count;
  p->type = c.type;
  p->dry = dry_;
  p->group = info_;
  if (dry_) return async ? Work(std::move(p)) : Work();  // the buffers go now, or at the caller's wait
  if (async) {
    const int rc = c.issue(&p->request, nullptr);
    ANVIL_CHECK(rc == MPI_SUCCESS, p->what, " failed: ", mpi_error_text(rc));
    return Work(std::move(p));
  }
  MPI_Status status{};
  int rc = MPI_SUCCESS;
  {
    const CommWait deadline(p->what.c_str(), *info_);
    rc = c.issue(nullptr, &status);
  }
  Work(std::move(p)).complete(rc, status);
  return Work();
}

void Communicator::all_reduce(const Tensor& t, ReduceOp op) { all_reduce_impl(t, op, false); }
Work Communicator::iall_reduce(const Tensor& t, ReduceOp op) { return all_reduce_impl(t, op, true); }

Work Communicator::all_reduce_impl(const Tensor& t, ReduceOp op, bool async) {
  ANVIL_CHECK(t.defined(), "all_reduce: undefined tensor");
  check_reduction(t, op, "all_reduce");
  const int count = mpi_count(t.numel(), "all_reduce");
  const MPI_Comm comm = comm_;
  const int n = size_;
  // bf16 is reduced in an fp32 copy, so MPI adds fp32 and the result is rounded once.
  const Tensor acc = t.dtype() == DType::bf16 ? Tensor::empty({t.numel()}, DType::f32, MemCategory::communication,
                                                              "all_reduce.fp32_accumulator")
                                              : t;
  if (t.dtype() == DType::bf16 && !dry_) convert_bf16_to_f32(t.data<bf16>(), acc.data<float>(), t.numel());
  const MPI_Datatype type = wire_type(acc.dtype());

  Call c(CommOp::all_reduce, "MPI_Allreduce", "MPI_Iallreduce");
  c.wire_bytes = acc.nbytes();
  c.keep_alive = {t, acc};
  const MPI_Op mop = mpi_op(op);
  c.issue = [acc, count, type, comm, mop](MPI_Request* req, MPI_Status*) {
    return req ? MPI_Iallreduce(MPI_IN_PLACE, acc.raw(), count, type, mop, comm, req)
               : MPI_Allreduce(MPI_IN_PLACE, acc.raw(), count, type, mop, comm);
  };
  if (t.dtype() == DType::bf16 || op == ReduceOp::avg) {
    c.finish = [t, acc, op, n] {
      if (op == ReduceOp::avg) divide_(acc.data<float>(), acc.numel(), n);
      if (t.dtype() == DType::bf16) convert_f32_to_bf16(acc.data<float>(), t.data<bf16>(), t.numel());
    };
  }
  return run(std::move(c), async);
}

void Communicator::all_gather(const Tensor& shard, const Tensor& full) { all_gather_impl(shard, full, false); }
Work Communicator::iall_gather(const Tensor& shard, const Tensor& full) { return all_gather_impl(shard, full, true); }

Work Communicator::all_gather_impl(const Tensor& shard, const Tensor& full, bool async) {
  check_stacked(shard, full, size_, "all_gather");
  const int count = mpi_count(shard.numel(), "all_gather");
  // The shard may already sit in its place inside full (FSDP's flat buffers):
  // that is MPI's in-place all-gather. Any other overlap would be corrupted.
  const bool in_place =
      static_cast<const char*>(shard.raw()) == static_cast<const char*>(full.raw()) + rank_ * shard.nbytes();
  ANVIL_CHECK(in_place || !overlaps(shard, full), "all_gather: the shard overlaps the output without being its slice ",
              "for rank ", rank_, "; pass full.slice(rank*k, k) or a separate tensor");
  const MPI_Datatype type = wire_type(shard.dtype());
  const MPI_Comm comm = comm_;

  Call c(CommOp::all_gather, "MPI_Allgather", "MPI_Iallgather");
  c.wire_bytes = full.nbytes();
  c.keep_alive = {shard, full};
  c.issue = [shard, full, count, type, comm, in_place](MPI_Request* req, MPI_Status*) {
    const void* send = in_place ? MPI_IN_PLACE : shard.raw();
    return req ? MPI_Iallgather(send, count, type, full.raw(), count, type, comm, req)
               : MPI_Allgather(send, count, type, full.raw(), count, type, comm);
  };
  return run(std::move(c), async);
}

namespace {

// out ← the n pieces (n × out.numel(), one per rank, in rank order) combined by
// op: summed (divided by n for avg, f32 only) or their elementwise largest.
template <class T>
void combine_pieces(const T* in, int n, ReduceOp op, T* dst, int64_t k) {
  parallel_for(0, k, 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T acc = in[i];
      for (int r = 1; r < n; ++r) {
        const T v = in[static_cast<int64_t>(r) * k + i];
        acc = op == ReduceOp::max ? std::max(acc, v) : acc + v;
      }
      dst[i] = op == ReduceOp::avg ? acc / static_cast<T>(n) : acc;
    }
  });
}

void sum_pieces(const Tensor& pieces, int n, ReduceOp op, const Tensor& out) {
  if (out.dtype() == DType::i32)
    combine_pieces(pieces.data<int32_t>(), n, op, out.data<int32_t>(), out.numel());
  else
    combine_pieces(pieces.data<float>(), n, op, out.data<float>(), out.numel());
}

}  // namespace

void Communicator::reduce_scatter(const Tensor& full, const Tensor& shard, ReduceOp op) {
  reduce_scatter_impl(full, shard, op, false, Tensor());
}
Work Communicator::ireduce_scatter(const Tensor& full, const Tensor& shard, ReduceOp op, const Tensor& pieces) {
  return reduce_scatter_impl(full, shard, op, true, pieces);
}

Work Communicator::reduce_scatter_impl(const Tensor& full, const Tensor& shard, ReduceOp op, bool async,
                                       Tensor pieces) {
  check_stacked(shard, full, size_, "reduce_scatter");
  check_reduction(full, op, "reduce_scatter");
  ANVIL_CHECK(!overlaps(shard, full), "reduce_scatter: the shard must not overlap the full input");
  const int count = mpi_count(shard.numel(), "reduce_scatter");
  mpi_count(full.numel(), "reduce_scatter");
  const MPI_Comm comm = comm_;
  const int n = size_;
  const bool widen = full.dtype() == DType::bf16;
  const Tensor in = widen ? Tensor::empty({full.numel()}, DType::f32, MemCategory::communication,
                                          "reduce_scatter.fp32_input")
                          : full;
  const Tensor out = widen ? Tensor::empty({shard.numel()}, DType::f32, MemCategory::communication,
                                           "reduce_scatter.fp32_accumulator")
                           : shard;
  if (widen && !dry_) convert_bf16_to_f32(full.data<bf16>(), in.data<float>(), full.numel());
  const MPI_Datatype type = wire_type(in.dtype());

  Call c(CommOp::reduce_scatter, "MPI_Reduce_scatter_block", "MPI_Ialltoall");
  c.wire_bytes = in.nbytes();
  const MPI_Op mop = mpi_op(op);
  if (!async) {
    c.keep_alive = {full, shard, in, out};
    c.issue = [in, out, count, type, comm, mop](MPI_Request*, MPI_Status*) {
      return MPI_Reduce_scatter_block(in.raw(), out.raw(), count, type, mop, comm);
    };
    if (widen || op == ReduceOp::avg) {
      c.finish = [shard, out, op, n, widen] {
        if (op == ReduceOp::avg) divide_(out.data<float>(), out.numel(), n);
        if (widen) convert_f32_to_bf16(out.data<float>(), shard.data<bf16>(), shard.numel());
      };
    }
    return run(std::move(c), async);
  }
  // Non-blocking: every rank sends rank r its rows of `in` (an all-to-all, the
  // same (n−1)/n · S on the wire as any reduce-scatter) and sums the n pieces
  // it receives, in rank order, when the exchange completes. Open MPI's
  // MPI_Ireduce_scatter_block (libnbc) instead reduces everything into rank 0
  // through a hidden buffer of twice the full input, then scatters: rank 0 did
  // all the arithmetic and held memory nothing could account for.
  if (pieces.defined())
    ANVIL_ASSERT(pieces.numel() == full.numel() && pieces.dtype() == in.dtype(), "ireduce_scatter: pieces ",
                 shape_str(pieces.shape()), " ", dtype_name(pieces.dtype()), " for a full input of ", full.numel());
  else
    pieces = Tensor::empty({full.numel()}, in.dtype(), MemCategory::communication, "reduce_scatter.pieces");
  c.keep_alive = {full, shard, in, out, pieces};
  c.issue = [in, pieces, count, type, comm](MPI_Request* req, MPI_Status*) {
    return MPI_Ialltoall(in.raw(), count, type, pieces.raw(), count, type, comm, req);
  };
  c.finish = [shard, out, pieces, op, n, widen] {
    sum_pieces(pieces, n, op, out);
    if (widen) convert_f32_to_bf16(out.data<float>(), shard.data<bf16>(), shard.numel());
  };
  return run(std::move(c), async);
}

void Communicator::broadcast(const Tensor& t, int root) { broadcast_impl(t, root, false); }
Work Communicator::ibroadcast(const Tensor& t, int root) { return broadcast_impl(t, root, true); }

Work Communicator::broadcast_impl(const Tensor& t, int root, bool async) {
  ANVIL_CHECK(t.defined(), "broadcast: undefined tensor");
  const int count = mpi_count(t.numel(), "broadcast");
  const MPI_Datatype type = wire_type(t.dtype());
  const MPI_Comm comm = comm_;
  Call c(CommOp::broadcast, "MPI_Bcast", "MPI_Ibcast");
  c.wire_bytes = t.nbytes();
  c.keep_alive = {t};
  c.issue = [t, count, type, root, comm](MPI_Request* req, MPI_Status*) {
    return req ? MPI_Ibcast(t.raw(), count, type, root, comm, req) : MPI_Bcast(t.raw(), count, type, root, comm);
  };
  return run(std::move(c), async);
}

void Communicator::send(const Tensor& t, int dst, int tag) { send_impl(t, dst, tag, false); }
Work Communicator::isend(const Tensor& t, int dst, int tag) { return send_impl(t, dst, tag, true); }

Work Communicator::send_impl(const Tensor& t, int dst, int tag, bool async) {
  ANVIL_CHECK(t.defined(), "send: undefined tensor");
  const int count = mpi_count(t.numel(), "send");
  const MPI_Datatype type = wire_type(t.dtype());
  const MPI_Comm comm = comm_;
  Call c(CommOp::send, "MPI_Send", "MPI_Isend");
  c.wire_bytes = t.nbytes();
  c.keep_alive = {t};
  c.issue = [t, count, type, dst, tag, comm](MPI_Request* req, MPI_Status*) {
    return req ? MPI_Isend(t.raw(), count, type, dst, tag, comm, req) : MPI_Send(t.raw(), count, type, dst, tag, comm);
  };
  return run(std::move(c), async);
}

void Communicator::recv(const Tensor& t, int src, int tag) { recv_impl(t, src, tag, false); }
Work Communicator::irecv(const Tensor& t, int src, int tag) { return recv_impl(t, src, tag, true); }

Work Communicator::recv_impl(const Tensor& t, int src, int tag, bool async) {
  ANVIL_CHECK(t.defined(), "recv: undefined tensor");
  const int count = mpi_count(t.numel(), "recv");
  const MPI_Datatype type = wire_type(t.dtype());
  const MPI_Comm comm = comm_;
  Call c(CommOp::recv, "MPI_Recv", "MPI_Irecv");
  c.wire_bytes = t.nbytes();
  c.keep_alive = {t};
  // A longer message is MPI's truncation error; a shorter one would leave stale
  // values behind silently, so the count that arrived is checked too.
  c.expect_count = count;
  c.type = type;
  c.issue = [t, count, type, src, tag, comm](MPI_Request* req, MPI_Status* status) {
    return req ? MPI_Irecv(t.raw(), count, type, src, tag, comm, req)
               : MPI_Recv(t.raw(), count, type, src, tag, comm, status);
  };
  return run(std::move(c), async);
}

void Communicator::all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                                const std::vector<int64_t>& recv_rows) {
  all_to_all_v_impl(send, send_rows, recv, recv_rows, false);
}
Work Communicator::iall_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                                 const std::vector<int64_t>& recv_rows) {
  return all_to_all_v_impl(send, send_rows, recv, recv_rows, true);
}

Work Communicator::all_to_all_v_impl(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                                     const std::vector<int64_t>& recv_rows, bool async) {
  ANVIL_CHECK(send.defined() && recv.defined(), "all_to_all_v: undefined tensor");
  // A row: every dimension after the first (either tensor may have no rows).
  const auto row_shape = [](const Tensor& t) { return Shape(t.shape().begin() + 1, t.shape().end()); };
  ANVIL_CHECK(send.dtype() == recv.dtype() && send.ndim() >= 1 && recv.ndim() >= 1 &&
                  row_shape(send) == row_shape(recv),
              "all_to_all_v: send ", shape_str(send.shape()), " ", dtype_name(send.dtype()), " and recv ",
              shape_str(recv.shape()), " ", dtype_name(recv.dtype()), " must share a dtype and a row shape");
  const auto n = static_cast<size_t>(size_);
  ANVIL_CHECK(send_rows.size() == n && recv_rows.size() == n, "all_to_all_v: ", send_rows.size(), " send and ",
              recv_rows.size(), " receive counts for a group of ", size_);
  const int64_t width = shape_numel(row_shape(send));
  // Counts and displacements in elements, in MPI's int range.
  auto layout = [&](const std::vector<int64_t>& rows, int64_t total_rows, const char* what) {
    std::vector<int> counts(n), displs(n);
    int64_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      ANVIL_CHECK(rows[i] >= 0, "all_to_all_v: ", what, " count ", rows[i], " for rank ", i);
      counts[i] = mpi_count(rows[i] * width, "all_to_all_v");
      displs[i] = mpi_count(at * width, "all_to_all_v");
      at += rows[i];
    }
    ANVIL_CHECK(at == total_rows, "all_to_all_v: the ", what, " counts add to ", at, " rows but the tensor has ",
                total_rows);
    return std::pair{counts, displs};
  };
  auto [scounts, sdispls] = layout(send_rows, send.size(0), "send");
  auto [rcounts, rdispls] = layout(recv_rows, recv.size(0), "receive");
  const MPI_Datatype type = wire_type(send.dtype());
  const MPI_Comm comm = comm_;
  Call c(CommOp::all_to_all, "MPI_Alltoallv", "MPI_Ialltoallv");
  const uint64_t row_bytes = static_cast<uint64_t>(width) * dtype_size(send.dtype());
  for (size_t i = 0; i < n; ++i)
    if (static_cast<int>(i) != rank_) c.wire_bytes += static_cast<uint64_t>(send_rows[i]) * row_bytes;
  c.keep_alive = {send, recv};
  // The count vectors live in the call until MPI is done with them.
  auto counts = std::make_shared<std::array<std::vector<int>, 4>>(
      std::array<std::vector<int>, 4>{std::move(scounts), std::move(sdispls), std::move(rcounts), std::move(rdispls)});
  c.issue = [send, recv, counts, type, comm](MPI_Request* req, MPI_Status*) {
    auto& [sc, sd, rc, rd] = *counts;
    return req ? MPI_Ialltoallv(send.raw(), sc.data(), sd.data(), type, recv.raw(), rc.data(), rd.data(), type, comm,
                                req)
               : MPI_Alltoallv(send.raw(), sc.data(), sd.data(), type, recv.raw(), rc.data(), rd.data(), type, comm);
  };
  if (async) c.finish = [counts] {};  // holds the counts until completion
  return run(std::move(c), async);
}

std::vector<int64_t> Communicator::all_to_all_counts(const std::vector<int64_t>& counts) {
  ANVIL_CHECK(counts.size() == static_cast<size_t>(size_), "all_to_all_counts: ", counts.size(),
              " counts for a group of ", size_);
  const Tensor send = Tensor::empty({size_}, DType::i32, MemCategory::communication, "all_to_all.counts_out");
  const Tensor recv = Tensor::empty({size_}, DType::i32, MemCategory::communication, "all_to_all.counts_in");
  for (int i = 0; i < size_; ++i) {
    ANVIL_CHECK(counts[static_cast<size_t>(i)] >= 0 && counts[static_cast<size_t>(i)] <= INT32_MAX,
                "all_to_all_counts: count ", counts[static_cast<size_t>(i)], " for rank ", i);
    if (!dry_) send.data<int32_t>()[i] = static_cast<int32_t>(counts[static_cast<size_t>(i)]);
  }
  all_to_all_v(send, std::vector<int64_t>(counts.size(), 1), recv, std::vector<int64_t>(counts.size(), 1));
  if (dry_) return counts;
  std::vector<int64_t> out(counts.size());
  for (int i = 0; i < size_; ++i) out[static_cast<size_t>(i)] = recv.data<int32_t>()[i];
  return out;
}

}  // namespace anvil
