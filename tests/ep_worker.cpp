// The multi-rank half of expert_parallel_test: a GoogleTest program with its
// own main (it starts MPI), run under mpirun with 2 and 4 ranks, all of them
// one expert-parallel group. Every rank builds the whole mixture-of-experts
// layer (8 experts, 2 per token) from one seed and every rank's tokens from
// theirs, so it can compute the single-process reference of every rank
// alone; then it runs the layer with its own share of the experts, its own
// tokens and the exchange over MPI, and compares: its output and input
// gradient with the reference of its tokens, its router gradient with that of
// its tokens, and its experts' weight gradients with the reference's summed
// over every rank's tokens (each expert's rows now come from all ranks).
//
// Tolerance (fp32): the experts multiply the same rows by the same weights,
// but in row blocks of other heights (rows from several ranks), which oneDNN
// may sum in another order: 1e-6 relative for outputs and input gradients,
// 1e-5 for the weight gradients (sums over every rank's rows). A row sent to
// the wrong rank or expert, or returned to the wrong route, is off by O(1).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/expert_parallel.h"
#include "anvil/model/moe_feed_forward.h"
#include "mpi_test_util.h"
#include "test_util.h"

using namespace anvil;
using namespace anvil::testing;

namespace {

Communicator* g_world = nullptr;

constexpr int64_t kSeqs = 2, kSeq = 6, M = kSeqs * kSeq, D = 16, F = 8, E = 8;
constexpr float kAuxCoef = 0.1f;

MoeWeights whole_weights(float router_scale) {
  return {random_tensor({E, D}, DType::f32, "ep.router", router_scale), random_tensor({E, F, D}, DType::f32, "ep.w1"),
          random_tensor({E, F, D}, DType::f32, "ep.w3"), random_tensor({E, D, F}, DType::f32, "ep.w2")};
}
MoeWeights zero_grads(int64_t experts) {
  return {Tensor::zeros({E, D}, DType::f32, MemCategory::workspace, "g.router"),
          Tensor::zeros({experts, F, D}, DType::f32, MemCategory::workspace, "g.w1"),
          Tensor::zeros({experts, F, D}, DType::f32, MemCategory::workspace, "g.w3"),
          Tensor::zeros({experts, D, F}, DType::f32, MemCategory::workspace, "g.w2")};
}
Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::workspace, "copy");
  c.copy_from(t);
  return c;
}
MoeWeights local_slice(const MoeWeights& w, int64_t first, int64_t count) {
  return {w.router, copy_of(w.w1.slice(first, count)), copy_of(w.w3.slice(first, count)),
          copy_of(w.w2.slice(first, count))};
}

struct Result {
  Tensor y, dx;
  MoeWeights grads;
  double aux = 0;
};

// One forward and backward of rank `rank`'s tokens through `w`.
Result run(const MoeWeights& w, int rank, const RouterConfig& cfg, ExpertExchange* exchange) {
  const Tensor x = random_tensor({M, D}, DType::f32, "ep.x." + std::to_string(rank));
  const Tensor dy = random_tensor({M, D}, DType::f32, "ep.dy." + std::to_string(rank));
  Result r;
  MoeSaved saved;
  r.y = copy_of(moe_forward(x, w, cfg, saved, kSeqs, {}, exchange));
  r.aux = saved.aux_loss;
  r.dx = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx");
  r.grads = zero_grads(w.w1.size(0));
  moe_backward(dy, x, w, cfg, kAuxCoef, saved, r.dx, r.grads, exchange);
  return r;
}

void check_layer(float router_scale, const RouterConfig& cfg, const char* label) {
  Communicator& world = *g_world;
  const int n = world.size(), me = world.rank();
  const int64_t El = E / n;
  const MoeWeights whole = whole_weights(router_scale);
  // The reference: every rank's tokens through the whole layer, one process.
  Result mine;
  MoeWeights summed = zero_grads(E);
  for (int r = 0; r < n; ++r) {
    Result ref = run(whole, r, cfg, nullptr);
    for (auto [sum, g] : {std::pair{summed.w1, ref.grads.w1}, std::pair{summed.w2, ref.grads.w2},
                          std::pair{summed.w3, ref.grads.w3}})
      for (int64_t i = 0; i < sum.numel(); ++i) sum.data<float>()[i] += g.data<float>()[i];
    if (r == me) mine = ref;
  }
  MpiExpertExchange exchange(world);
  world.reset_counters();
  const Result ep = run(local_slice(whole, me * El, El), me, cfg, &exchange);
  SCOPED_TRACE(std::string(label) + ", rank " + std::to_string(me) + " of " + std::to_string(n));
  EXPECT_LT(rel_error(ep.y, to_double(mine.y)), 1e-6);
  EXPECT_LT(rel_error(ep.dx, to_double(mine.dx)), 1e-6);
  EXPECT_LT(rel_error(ep.grads.router, to_double(mine.grads.router)), 1e-6);
  EXPECT_DOUBLE_EQ(ep.aux, mine.aux);
  for (auto [got, want, what] : {std::tuple{ep.grads.w1, summed.w1, "w1"}, std::tuple{ep.grads.w3, summed.w3, "w3"},
                                 std::tuple{ep.grads.w2, summed.w2, "w2"}})
    EXPECT_LT(rel_error(got, to_double(want.slice(me * El, El))), 1e-5) << what;
  // One exchange of counts and four of rows (the forward's there and back,
  // the backward's there and back, which reuses the forward's counts).
  EXPECT_EQ(world.counters().calls_of(CommOp::all_to_all), 5u);
}

}  // namespace

TEST(ExpertParallel, TopTwoMatchesTheSingleProcess) { check_layer(1.0f, RouterConfig{2, true}, "top 2"); }
TEST(ExpertParallel, TopOneUnnormalisedMatchesTheSingleProcess) {
  check_layer(1.0f, RouterConfig{1, false}, "top 1");
}
// Zero router weights: every token of every rank ties and goes to experts 0
// and 1, all on rank 0, which receives every rank's rows and the other ranks'
// experts none; dropless, the result is the single process's.
TEST(ExpertParallel, EveryTokenOnTheFirstRanksExperts) {
  check_layer(0.0f, RouterConfig{2, true}, "every token on experts 0 and 1");
}
TEST(ExpertParallel, ForcedBalancedRouting) { check_layer(1.0f, RouterConfig{2, true, true}, "balanced"); }

int main(int argc, char** argv) {
  MpiRuntime mpi(argc, argv);
  Communicator w = Communicator::world();
  g_world = &w;
  ::testing::InitGoogleTest(&argc, argv);
  anvil::testing::report_only_failures_unless_rank_0(w.rank());
  return RUN_ALL_TESTS();
}
