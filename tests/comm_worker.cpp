// The multi-rank half of comm_test: a GoogleTest program that starts MPI and
// is run by comm_test under `mpirun -np N` (and once alone, as a singleton).
// Every rank runs every test; each rank's data comes from a formula of its
// rank, so every rank knows the exact expected result locally.
//
// Tests use EXPECT (never ASSERT) around collectives: a failed check must not
// change the sequence of collectives one rank makes, or the others would wait
// for it forever.
//
//   comm_worker [--expect-world-size=N] [gtest flags]   the tests
//   comm_worker --scenario=config-mismatch              rank 2 has another config
//   comm_worker --scenario=abort                        rank 2 calls abort_all
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/tensor.h"
#include "anvil/distributed/comm.h"
#include "anvil/distributed/config_check.h"
#include "anvil/distributed/mesh.h"
#include "mpi_test_util.h"

using namespace anvil;

namespace {

Communicator* g_world = nullptr;
int g_expect_world_size = -1;
int g_thread_level = -1;

Communicator& world() { return *g_world; }

// The value `v` as stored in `dtype` and read back.
float stored(float v, DType dtype) { return dtype == DType::bf16 ? to_f32(from_f32<bf16>(v)) : v; }

Tensor make(Shape shape, DType dtype, const std::function<float(int64_t)>& value, const char* tag = "test") {
  Tensor f = Tensor::empty(shape, DType::f32, MemCategory::workspace, "test_f32");
  for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = value(i);
  Tensor t = Tensor::empty(std::move(shape), dtype, MemCategory::workspace, tag);
  t.copy_from(f);
  return t;
}

// Exact small values: every f32 sum of them over ≤ 8 ranks is exact, so the
// expected result does not depend on MPI's reduction order.
float f32_term(int rank, int64_t j) {
  return static_cast<float>((rank * 37 + j * 11) % 101 - 50) + 0.125f * static_cast<float>(rank);
}

// bf16 terms for 4 ranks, in units of 1/128: in every pattern each value is a
// bf16 number, the sum is exact in fp32, and EVERY order of adding them
// pairwise with a bf16 rounding after each add (what a bf16 MPI_Op would do,
// whatever MPI's reduction tree) misses the once-rounded fp32 sum. Found by an
// exhaustive search over the 18 merge orders; the Bf16PatternsDefeatPairwise
// test re-checks it, so a correct result cannot come from pairwise rounding.
constexpr float kBf16Patterns[8][4] = {
    {4480, 270, 10432, 1784},   {15744, 7168, 28416, 2080}, {18816, 9088, 11648, 1544},
    {14592, 2000, 7072, 18176}, {510, 5760, 29824, 23680},  {6240, 648, 428, 510},
    {17280, 760, 1752, 3168},   {16000, 1012, 24320, 482},
};

// The term of group rank r (of n) at element j: the patterns above for n = 4
// (rotated with j so each rank holds every position), otherwise bf16 numbers
// of mixed exponents (1 + k/128)·2^e, still exact when summed in fp32.
float bf16_term(int r, int64_t j, int n) {
  if (n == 4) return kBf16Patterns[j % 8][(r + j / 8) % 4] / 128.0f;
  return (1.0f + static_cast<float>((r * 7 + j * 3) % 128) / 128.0f) * std::ldexp(1.0f, static_cast<int>((r + j) % 5));
}

float term(DType dtype, int r, int64_t j, int n) { return dtype == DType::bf16 ? bf16_term(r, j, n) : f32_term(r, j); }

// The exact sum over ranks, then (bf16) one rounding: what fp32 accumulation gives.
float expected_sum(DType dtype, int64_t j, int n, bool avg) {
  double s = 0;
  for (int r = 0; r < n; ++r) s += term(dtype, r, j, n);
  float f = static_cast<float>(s);
  EXPECT_EQ(static_cast<double>(f), s) << "test values must sum exactly in fp32";
  if (avg) f /= static_cast<float>(n);
  return stored(f, dtype);
}

// Every result of adding `vals` pairwise in any order, rounding to bf16 after each add.
void pairwise_bf16_results(std::vector<float> vals, std::set<float>& out) {
  if (vals.size() == 1) {
    out.insert(vals[0]);
    return;
  }
  for (size_t a = 0; a < vals.size(); ++a)
    for (size_t b = a + 1; b < vals.size(); ++b) {
      std::vector<float> rest;
      for (size_t k = 0; k < vals.size(); ++k)
        if (k != a && k != b) rest.push_back(vals[k]);
      rest.push_back(stored(vals[a] + vals[b], DType::bf16));
      pairwise_bf16_results(rest, out);
    }
}

const DType kDtypes[] = {DType::f32, DType::bf16};

}  // namespace

TEST(World, SizeRankAndThreadLevel) {
  if (g_expect_world_size > 0) {
    EXPECT_EQ(world().size(), g_expect_world_size);
  }
  EXPECT_GE(world().rank(), 0);
  EXPECT_LT(world().rank(), world().size());
  EXPECT_GE(g_thread_level, MPI_THREAD_FUNNELED);
}

TEST(AllReduce, SumAndAvgBlockingAndNonBlocking) {
  const int n = world().size(), r = world().rank();
  for (DType dt : kDtypes)
    for (bool avg : {false, true})
      for (bool async : {false, true}) {
        Tensor t = make({6, 11}, dt, [&](int64_t j) { return term(dt, r, j, n); });
        const ReduceOp op = avg ? ReduceOp::avg : ReduceOp::sum;
        if (async) {
          Work w = world().iall_reduce(t, op);
          EXPECT_TRUE(w.pending());
          w.wait();
          EXPECT_FALSE(w.pending());
        } else {
          world().all_reduce(t, op);
        }
        int wrong = 0;
        for (int64_t j = 0; j < t.numel(); ++j) wrong += t.item_f32(j) != expected_sum(dt, j, n, avg);
        EXPECT_EQ(wrong, 0) << dtype_name(dt) << (avg ? " avg" : " sum") << (async ? " non-blocking" : " blocking")
                            << ", e.g. element 0: " << t.item_f32(0) << " vs " << expected_sum(dt, 0, n, avg);
      }
}

// The test data must be able to catch a bf16 reduction that rounds partial
// sums: for 4 ranks, no pairwise-rounding order reproduces any expected value.
TEST(AllReduce, Bf16PatternsDefeatPairwise) {
  const int n = world().size();
  if (n != 4) GTEST_SKIP() << "the patterns are for 4 ranks";
  for (int64_t j = 0; j < 64; ++j) {
    std::vector<float> vals;
    for (int r = 0; r < n; ++r) {
      vals.push_back(bf16_term(r, j, n));
      EXPECT_EQ(stored(vals.back(), DType::bf16), vals.back()) << "terms must be bf16 numbers";
    }
    std::set<float> pairwise;
    pairwise_bf16_results(vals, pairwise);
    EXPECT_EQ(pairwise.count(expected_sum(DType::bf16, j, n, false)), 0u) << "element " << j;
  }
}

TEST(AllReduce, I32Sum) {
  const int n = world().size(), r = world().rank();
  Tensor t = Tensor::empty({5}, DType::i32, MemCategory::workspace, "i32");
  for (int j = 0; j < 5; ++j) t.data<int32_t>()[j] = r * 1000 + j;
  world().all_reduce(t);
  for (int j = 0; j < 5; ++j) EXPECT_EQ(t.data<int32_t>()[j], 1000 * n * (n - 1) / 2 + n * j);
  EXPECT_THROW(world().all_reduce(t, ReduceOp::avg), Error);
}

TEST(AllReduce, Bf16StagingIsTrackedAsCommunication) {
  auto& alloc = TrackingAllocator::instance();
  const size_t before = alloc.live_bytes(MemCategory::communication);
  Tensor t = make({1000}, DType::bf16, [&](int64_t j) { return bf16_term(world().rank(), j, world().size()); });
  Work w = world().iall_reduce(t);
  // The fp32 accumulator lives while the reduction is in flight, then goes.
  EXPECT_EQ(alloc.live_bytes(MemCategory::communication), before + 4000);
  w.wait();
  EXPECT_EQ(alloc.live_bytes(MemCategory::communication), before);
}

TEST(Counters, BytesFollowTheFormulas) {
  const int n = world().size();
  world().reset_counters();
  Tensor f = Tensor::zeros({1000}, DType::f32, MemCategory::workspace, "f");
  Tensor b = Tensor::zeros({1000}, DType::bf16, MemCategory::workspace, "b");
  world().all_reduce(f);
  world().iall_reduce(b).wait();  // bf16 travels as fp32: 4000 bytes again
  Tensor shard = Tensor::zeros({10}, DType::f32, MemCategory::workspace, "shard");
  Tensor full = Tensor::zeros({10 * n}, DType::f32, MemCategory::workspace, "full");
  world().all_gather(shard, full);
  world().reduce_scatter(full, shard);
  world().broadcast(f, 0);
  const auto& c = world().counters();
  const auto un = static_cast<uint64_t>(n);
  EXPECT_EQ(c.calls_of(CommOp::all_reduce), 2u);
  EXPECT_EQ(c.bytes_of(CommOp::all_reduce), 2 * (2 * (un - 1) * 4000 / un));
  EXPECT_EQ(c.bytes_of(CommOp::all_gather), (un - 1) * 40 * un / un);
  EXPECT_EQ(c.bytes_of(CommOp::reduce_scatter), (un - 1) * 40 * un / un);
  EXPECT_EQ(c.bytes_of(CommOp::broadcast), n > 1 ? 4000u : 0u);
  EXPECT_EQ(c.total_bytes(), c.bytes_of(CommOp::all_reduce) + c.bytes_of(CommOp::all_gather) +
                                 c.bytes_of(CommOp::reduce_scatter) + c.bytes_of(CommOp::broadcast));
}

// Shard and full-tensor collectives over a group whose members have group
// ranks 0…n−1; values depend only on the group rank, so the expected results
// are known locally. Shared by the world tests and the mesh's sub-groups.
void check_gather_and_scatter(Communicator& comm, const std::string& where) {
  const int n = comm.size(), r = comm.rank();
  const int64_t k = 3, m = 8;  // shard rows, row length
  for (DType dt : kDtypes)
    for (bool async : {false, true}) {
      const std::string what = where + " " + dtype_name(dt) + (async ? " non-blocking" : " blocking");
      // all_gather: shard (k, m) of rank q holds term(q, ·); full is them in rank order.
      Tensor shard = make({k, m}, dt, [&](int64_t j) { return stored(term(dt, r, j, n), dt); });
      Tensor full = Tensor::zeros({n * k, m}, dt, MemCategory::workspace, "full");
      if (async)
        comm.iall_gather(shard, full).wait();
      else
        comm.all_gather(shard, full);
      int wrong = 0;
      for (int q = 0; q < n; ++q)
        for (int64_t j = 0; j < k * m; ++j) wrong += full.item_f32(q * k * m + j) != stored(term(dt, q, j, n), dt);
      EXPECT_EQ(wrong, 0) << "all_gather " << what;

      // In place: the shard is this rank's own slice of full.
      Tensor full2 = Tensor::zeros({n * k, m}, dt, MemCategory::workspace, "full2");
      full2.slice(r * k, k).copy_from(shard);
      if (async)
        comm.iall_gather(full2.slice(r * k, k), full2).wait();
      else
        comm.all_gather(full2.slice(r * k, k), full2);
      wrong = 0;
      for (int64_t j = 0; j < full.numel(); ++j) wrong += full2.item_f32(j) != full.item_f32(j);
      EXPECT_EQ(wrong, 0) << "in-place all_gather " << what;

      // reduce_scatter: full (n·k, m) on rank q holds term(q, j) at element j;
      // rank r's shard is the sum over q of rows [r·k, (r+1)·k).
      for (bool avg : {false, true}) {
        Tensor in = make({n * k, m}, dt, [&](int64_t j) { return term(dt, r, j, n); });
        Tensor out = Tensor::zeros({k, m}, dt, MemCategory::workspace, "out");
        const ReduceOp op = avg ? ReduceOp::avg : ReduceOp::sum;
        if (async)
          comm.ireduce_scatter(in, out, op).wait();
        else
          comm.reduce_scatter(in, out, op);
        wrong = 0;
        for (int64_t j = 0; j < k * m; ++j) wrong += out.item_f32(j) != expected_sum(dt, r * k * m + j, n, avg);
        EXPECT_EQ(wrong, 0) << "reduce_scatter " << (avg ? "avg " : "sum ") << what << ", element 0: "
                            << out.item_f32(0) << " vs " << expected_sum(dt, r * k * m, n, avg);
      }
    }
}

TEST(AllGatherReduceScatter, World) { check_gather_and_scatter(world(), "world"); }

TEST(AllGatherReduceScatter, ShapeErrorsNameTheOperation) {
  Tensor shard = Tensor::zeros({2, 3}, DType::f32, MemCategory::workspace, "s");
  Tensor bad = Tensor::zeros({world().size() * 2 + 1, 3}, DType::f32, MemCategory::workspace, "b");
  try {
    world().all_gather(shard, bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_gather: full ["), std::string::npos) << e.what();
  }
  Tensor wrong_dtype = Tensor::zeros({world().size() * 2, 3}, DType::bf16, MemCategory::workspace, "w");
  EXPECT_THROW(world().reduce_scatter(wrong_dtype, shard), Error);
  // Overlap: the shard inside the full input.
  Tensor full = Tensor::zeros({world().size() * 2, 3}, DType::f32, MemCategory::workspace, "f");
  EXPECT_THROW(world().reduce_scatter(full, full.slice(0, 2)), Error);
}

TEST(Broadcast, FromTheLastRank) {
  const int n = world().size(), r = world().rank(), root = n - 1;
  for (DType dt : {DType::f32, DType::bf16, DType::i32})
    for (bool async : {false, true}) {
      Tensor t = Tensor::empty({4, 5}, dt, MemCategory::workspace, "b");
      for (int64_t j = 0; j < 20; ++j) {
        const float v = r == root ? static_cast<float>(j * 3 + 1) : -7.0f;
        if (dt == DType::i32)
          t.data<int32_t>()[j] = static_cast<int32_t>(v);
        else if (dt == DType::bf16)
          t.data<bf16>()[j] = from_f32<bf16>(v);
        else
          t.data<float>()[j] = v;
      }
      if (async)
        world().ibroadcast(t, root).wait();
      else
        world().broadcast(t, root);
      int wrong = 0;
      for (int64_t j = 0; j < 20; ++j) {
        const float got = dt == DType::i32 ? static_cast<float>(t.data<int32_t>()[j]) : t.item_f32(j);
        wrong += got != static_cast<float>(j * 3 + 1);
      }
      EXPECT_EQ(wrong, 0) << dtype_name(dt) << (async ? " non-blocking" : " blocking");
    }
}

TEST(SendRecv, PairsBlocking) {
  const int n = world().size(), r = world().rank(), partner = r ^ 1;
  if (partner >= n) GTEST_SKIP() << "no partner for rank " << r;
  for (DType dt : kDtypes) {
    Tensor out = make({7}, dt, [&](int64_t j) { return stored(term(dt, r, j, n), dt); });
    Tensor in = Tensor::zeros({7}, dt, MemCategory::workspace, "in");
    // The lower rank sends first, so two blocking calls never wait on each other.
    if (r < partner) {
      world().send(out, partner, 5);
      world().recv(in, partner, 5);
    } else {
      world().recv(in, partner, 5);
      world().send(out, partner, 5);
    }
    for (int64_t j = 0; j < 7; ++j) EXPECT_EQ(in.item_f32(j), stored(term(dt, partner, j, n), dt)) << j;
  }
}

TEST(SendRecv, RingNonBlocking) {
  const int n = world().size(), r = world().rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  world().reset_counters();
  for (DType dt : kDtypes) {
    Tensor out = make({9}, dt, [&](int64_t j) { return stored(term(dt, r, j, n), dt); });
    Tensor in = Tensor::zeros({9}, dt, MemCategory::workspace, "in");
    Work rw = world().irecv(in, prev, 1);
    Work sw = world().isend(out, next, 1);
    sw.wait();
    rw.wait();
    for (int64_t j = 0; j < 9; ++j) EXPECT_EQ(in.item_f32(j), stored(term(dt, prev, j, n), dt)) << j;
  }
  EXPECT_EQ(world().counters().bytes_of(CommOp::send), 9u * 4 + 9u * 2);
  EXPECT_EQ(world().counters().bytes_of(CommOp::recv), 9u * 4 + 9u * 2);
}

// Rank r sends (r + i) % 3 rows to rank i (some none, itself included), each
// row of 5 values naming sender, receiver and position; every rank receives
// the rows addressed to it in rank order, f32 and bf16, blocking and not, and
// counts as bytes only the rows that leave it.
TEST(AllToAllV, RowsReachTheirRanksInRankOrder) {
  const int n = world().size(), r = world().rank();
  const auto rows_from_to = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
  std::vector<int64_t> send_rows(static_cast<size_t>(n)), want_rows(static_cast<size_t>(n));
  int64_t out_total = 0, in_total = 0, leaving = 0;
  for (int i = 0; i < n; ++i) {
    send_rows[static_cast<size_t>(i)] = rows_from_to(r, i);
    want_rows[static_cast<size_t>(i)] = rows_from_to(i, r);
    out_total += send_rows[static_cast<size_t>(i)];
    in_total += want_rows[static_cast<size_t>(i)];
    if (i != r) leaving += send_rows[static_cast<size_t>(i)];
  }
  const std::vector<int64_t> recv_rows = world().all_to_all_counts(send_rows);
  EXPECT_EQ(recv_rows, want_rows);
  const auto value = [](int from, int to, int64_t row, int64_t j) {
    return static_cast<float>(from * 100 + to * 10 + row + j);  // bf16 rounds it as it is sent
  };
  for (DType dt : kDtypes)
    for (bool async : {false, true}) {
      world().reset_counters();
      std::vector<float> values;
      for (int i = 0; i < n; ++i)
        for (int64_t row = 0; row < send_rows[static_cast<size_t>(i)]; ++row)
          for (int64_t j = 0; j < 5; ++j) values.push_back(value(r, i, row, j));
      Tensor out = make({out_total, 5}, dt, [&](int64_t k) { return values[static_cast<size_t>(k)]; });
      int64_t at = 0;
      Tensor in = Tensor::zeros({in_total, 5}, dt, MemCategory::workspace, "in");
      if (async) {
        Work w = world().iall_to_all_v(out, send_rows, in, recv_rows);
        w.wait();
      } else {
        world().all_to_all_v(out, send_rows, in, recv_rows);
      }
      at = 0;
      for (int i = 0; i < n; ++i)
        for (int64_t row = 0; row < recv_rows[static_cast<size_t>(i)]; ++row, ++at)
          for (int64_t j = 0; j < 5; ++j)
            EXPECT_EQ(in.item_f32(at * 5 + j), stored(value(i, r, row, j), dt)) << "from " << i << " row " << row;
      EXPECT_EQ(world().counters().bytes_of(CommOp::all_to_all), static_cast<uint64_t>(leaving * 5) * dtype_size(dt));
    }
  // Counts that do not add up to the tensor's rows are refused, naming the call.
  try {
    world().all_to_all_v(Tensor::zeros({out_total + 1, 5}, DType::f32, MemCategory::workspace, "bad"), send_rows,
                         Tensor::zeros({in_total, 5}, DType::f32, MemCategory::workspace, "in"), recv_rows);
    ADD_FAILURE() << "a mismatched count was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_to_all_v"), std::string::npos) << e.what();
  }
}

TEST(SendRecv, ShortMessageIsAnError) {
  const int n = world().size(), r = world().rank();
  if (n < 2 || r > 1) GTEST_SKIP();
  if (r == 0) {
    world().send(Tensor::zeros({3}, DType::f32, MemCategory::workspace, "short"), 1, 9);
  } else {
    Tensor in = Tensor::zeros({5}, DType::f32, MemCategory::workspace, "in");
    try {
      world().recv(in, 0, 9);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("recv (MPI_Recv) on rank 1 of a group of"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("received 3 elements from rank 0 but the tensor holds 5"),
                std::string::npos)
          << e.what();
    }
  }
}

// An error MPI itself reports (here: a rank that does not exist) comes back as
// anvil::Error with the operation, the MPI call and MPI's own text.
TEST(Errors, MpiErrorsBecomeAnvilErrors) {
  Tensor t = Tensor::zeros({2}, DType::f32, MemCategory::workspace, "t");
  for (bool async : {false, true}) {
    try {
      if (async)
        world().isend(t, world().size() + 3).wait();
      else
        world().send(t, world().size() + 3);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(async ? "send (MPI_Isend) on rank " : "send (MPI_Send) on rank "), std::string::npos) << msg;
      EXPECT_NE(msg.find("failed: MPI_ERR_RANK: invalid rank"), std::string::npos) << msg;
    }
  }
}

TEST(Work, DestructorWaitsMoveWaitsAndTestPolls) {
  const int n = world().size(), r = world().rank();
  auto fresh = [&] { return make({32}, DType::f32, [&](int64_t j) { return f32_term(r, j); }); };
  auto all_right = [&](const Tensor& t) {
    for (int64_t j = 0; j < 32; ++j)
      if (t.item_f32(j) != expected_sum(DType::f32, j, n, false)) return false;
    return true;
  };
  Tensor a = fresh(), b = fresh(), c = fresh(), d = fresh();
  { Work w = world().iall_reduce(a); }  // the destructor waits
  EXPECT_TRUE(all_right(a));

  Work w = world().iall_reduce(b);
  w = world().iall_reduce(c);  // assigning over a pending Work waits for it first
  EXPECT_TRUE(all_right(b));
  while (!w.test()) {
  }
  EXPECT_FALSE(w.pending());
  EXPECT_TRUE(all_right(c));
  w.wait();  // already done: returns at once
  Work moved = world().iall_reduce(d);
  Work target(std::move(moved));
  EXPECT_FALSE(moved.pending());
  EXPECT_TRUE(target.pending());
  target.wait();
  EXPECT_TRUE(all_right(d));
}

TEST(Work, SeveralInFlightWaitedInAnyOrder) {
  const int n = world().size(), r = world().rank();
  Tensor x = make({16}, DType::bf16, [&](int64_t j) { return bf16_term(r, j, n); });
  Tensor y = make({16}, DType::f32, [&](int64_t j) { return f32_term(r, j); });
  Tensor shard = make({2, 4}, DType::f32, [&](int64_t j) { return f32_term(r, j); });
  Tensor full = Tensor::zeros({2 * n, 4}, DType::f32, MemCategory::workspace, "full");
  Work wx = world().iall_reduce(x);
  Work wy = world().iall_reduce(y, ReduceOp::avg);
  Work wg = world().iall_gather(shard, full);
  wg.wait();
  wy.wait();
  wx.wait();
  for (int64_t j = 0; j < 16; ++j) {
    EXPECT_EQ(x.item_f32(j), expected_sum(DType::bf16, j, n, false)) << j;
    EXPECT_EQ(y.item_f32(j), expected_sum(DType::f32, j, n, true)) << j;
  }
  for (int q = 0; q < n; ++q)
    for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(full.item_f32(q * 8 + j), f32_term(q, j));
}

TEST(Split, ColorAndKeyOrderTheNewGroup) {
  const int n = world().size(), r = world().rank();
  // Even and odd ranks, each group in reverse rank order.
  Communicator half = world().split(r % 2, -r);
  const int members = (n - r % 2 + 1) / 2;
  EXPECT_EQ(half.size(), members);
  EXPECT_EQ(half.rank(), members - 1 - r / 2);
  Tensor t = Tensor::empty({1}, DType::i32, MemCategory::workspace, "r");
  t.data<int32_t>()[0] = r;
  half.all_reduce(t);
  int want = 0;
  for (int q = r % 2; q < n; q += 2) want += q;
  EXPECT_EQ(t.data<int32_t>()[0], want);
  Communicator moved = std::move(half);
  EXPECT_FALSE(half.valid());
  EXPECT_TRUE(moved.valid());
}

// Every way of laying the world out as pp × dp_replicate × dp_shard × cp × tp,
// and expert parallelism 2 over each even dp_shard.
std::vector<MeshLayout> all_layouts(int n) {
  std::vector<MeshLayout> out;
  for (int pp = 1; pp <= n; ++pp)
    for (int rep = 1; rep <= n; ++rep)
      for (int shard = 1; shard <= n; ++shard)
        for (int cp = 1; cp <= n; ++cp)
          for (int tp = 1; tp <= n; ++tp)
            if (pp * rep * shard * cp * tp == n) {
              out.emplace_back(pp, rep, shard, cp, tp);
              if (shard > 1 && shard % 2 == 0) out.emplace_back(pp, rep, shard, cp, tp, 2);  // expert parallel 2
            }
  return out;
}

constexpr MeshGroup kGroups[] = {MeshGroup::pp, MeshGroup::dp_replicate, MeshGroup::dp_shard,    MeshGroup::cp,
                                 MeshGroup::tp, MeshGroup::dp,           MeshGroup::dp_shard_cp, MeshGroup::dp_cp,
                                 MeshGroup::ep, MeshGroup::expert_shard};

// For every layout, every group's communicator holds exactly the ranks the
// layout maths says, in that order (an all-gather of world ranks shows it).
TEST(Mesh, SubCommunicatorsMatchTheLayout) {
  const int n = world().size(), r = world().rank();
  for (const MeshLayout& layout : all_layouts(n)) {
    DeviceMesh mesh(world(), layout);
    EXPECT_EQ(mesh.coord(), layout.coord_of(r));
    for (MeshGroup g : kGroups) {
      Communicator& c = mesh.group(g);
      const std::vector<int> want = layout.group_ranks(r, g);
      EXPECT_EQ(c.size(), static_cast<int>(want.size())) << layout.str() << " " << mesh_group_name(g);
      Tensor mine = Tensor::empty({1}, DType::i32, MemCategory::workspace, "rank");
      mine.data<int32_t>()[0] = r;
      Tensor all = Tensor::empty({c.size()}, DType::i32, MemCategory::workspace, "ranks");
      c.all_gather(mine, all);
      std::vector<int> got(all.data<int32_t>(), all.data<int32_t>() + c.size());
      EXPECT_EQ(got, want) << layout.str() << " " << mesh_group_name(g);
    }
  }
}

// Collectives on the mesh's sub-groups: for 4 ranks that includes groups of 2
// (tp and dp_shard of a 2 × 2 mesh) and of 4 (dp of dp_replicate 2 × dp_shard 2).
TEST(Mesh, CollectivesOnSubGroups) {
  for (const MeshLayout& layout : all_layouts(world().size())) {
    DeviceMesh mesh(world(), layout);
    for (MeshGroup g : kGroups)
      if (layout.group_size(g) > 1) check_gather_and_scatter(mesh.group(g), layout.str() + " " + mesh_group_name(g));
  }
}

namespace {

int config_mismatch_scenario() {
  // Rank 2 (the last rank in smaller worlds) runs with another step count.
  const int odd = std::min(2, world().size() - 1);
  const std::string text = world().rank() == odd ? "[training]\nsteps = 11\n" : "[training]\nsteps = 10\n";
  try {
    check_same_config(world(), text);
  } catch (const Error& e) {
    std::fprintf(stderr, "anvil: rank %d: %s\n", world().rank(), e.what());
    return 1;
  }
  std::printf("rank %d: configurations agree\n", world().rank());
  return 0;
}

int abort_scenario() {
  const int failing = std::min(2, world().size() - 1);
  world().barrier();  // every rank is up
  if (world().rank() == failing) abort_all("simulated failure (comm_worker --scenario=abort)");
  // The others wait in a collective the failing rank never joins: without
  // abort_all they would hang here for ever.
  Tensor t = Tensor::zeros({4}, DType::f32, MemCategory::workspace, "t");
  world().all_reduce(t);
  std::printf("rank %d: the all-reduce completed, which it must not\n", world().rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(argc, argv);
  g_thread_level = mpi.thread_level();
  Communicator w = Communicator::world();
  g_world = &w;

  std::string scenario;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--scenario=", 11) == 0) scenario = argv[i] + 11;
    if (std::strncmp(argv[i], "--expect-world-size=", 20) == 0) g_expect_world_size = std::atoi(argv[i] + 20);
  }
  if (scenario == "config-mismatch") return config_mismatch_scenario();
  if (scenario == "abort") return abort_scenario();
  if (!scenario.empty()) {
    std::fprintf(stderr, "comm_worker: unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }

  ::testing::InitGoogleTest(&argc, argv);
  anvil::testing::report_only_failures_unless_rank_0(w.rank());
  return RUN_ALL_TESTS();
}
