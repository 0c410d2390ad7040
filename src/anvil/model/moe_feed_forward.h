// A mixture-of-experts feed-forward layer (Qwen3-MoE's sparse block), forward
// and backward written out, from the ops:
//
//   logits = x·Wgᵀ (f32)  →  router: scores, top k, weights   (ops/moe_router.h)
//   routes sorted by expert; xe = dispatch(x)                  (ops/moe_dispatch.h)
//   g = xe·W1[e]ᵀ, u = xe·W3[e]ᵀ, s = silu(g)·u, ye = s·W2[e]ᵀ  (ops/moe_experts.h, ops/swiglu.h)
//   y = Σ_j weights[t, j] · ye[row of (t, j)]                  (combine)
//
// Dropless (no capacity: every token reaches its k experts) and with no
// shared expert, as in Qwen3-MoE. The load-balancing auxiliary loss (Hugging
// Face's, ops/moe_router.h) is taken per sequence — each sequence's own token
// counts and mean probabilities — and the forward returns its sum over the
// sequences; the backward adds aux_coef times that sum's gradient to the
// router's. Per sequence, so a step's loss is the same however its sequences
// are split over micro-batches and ranks; under context parallelism a
// sequence's counts and shares are summed over the ranks holding its chunks. The choice of experts is constant
// to the backward, as in every MoE implementation. Under expert parallelism
// the rows between the dispatch and the combine travel to the ranks holding
// their experts and back (ExpertExchange, below).
#pragma once
#include <algorithm>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/parallel_style.h"
#include "anvil/ops/moe_dispatch.h"
#include "anvil/ops/moe_router.h"

namespace anvil {

// The layer's weights in the compute dtype, or (as gradients) f32:
//   router (E, D); w1 gate and w3 up (El, F, D); w2 down (El, D, F), with El
//   the experts this rank holds (E without expert parallelism).
struct MoeWeights {
  Tensor router, w1, w3, w2;
};

// Expert parallelism: the E experts split over a group of n ranks, rank r
// holding experts [r·E/n, (r+1)·E/n). Every rank routes its own tokens over
// all E (the router is whole on every rank), sends each routed row to the rank
// holding its expert and gets the expert's output back; the backward sends the
// output gradients and returns the input gradients the same way. The model
// layer states what it needs; distributed/expert_parallel.h carries it over
// MPI (all-to-all-v, counts first).
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // counts (n·El): how many rows this rank sends each rank's local expert j
  // (at r·El + j); returns how many each rank sends this one's (at s·El + j).
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) = 0;
  // send_rows[r] rows of send (in rank order) to rank r; recv_rows[s] rows
  // from rank s into recv, in rank order.
  virtual void exchange_rows(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                             const std::vector<int64_t>& recv_rows) = 0;
};

// Tensor parallelism over the experts' width: every rank holds each expert's
// F/n slice (the gate and up projections' rows, the down projection's
// columns) and runs the router whole on every row, so its combine is a
// partial sum of the layer's output and its dispatch backward a partial input
// gradient, both reduced over the ranks by the block (as a row-parallel
// product's). The backward sums the combine weights' gradients over the ranks
// here, and adds the router's share of the input gradient on the first rank
// only, so the reduction counts it once.
class ExpertWidthSplit {
 public:
  virtual ~ExpertWidthSplit() = default;
  virtual bool first_rank() const = 0;
  virtual void sum_over_ranks(const Tensor& t) const = 0;  // f32, in place
};

// Under expert parallelism, where the routed rows went and came from.
struct ExpertTraffic {
  std::vector<int64_t> send_rows, recv_rows;  // per rank
  std::vector<int64_t> local_offsets;         // El + 1: the local experts' rows, expert-major
  Tensor order;  // (received rows) i32: the received row at each expert-major position
};

// What the forward keeps for the backward.
struct MoeSaved {
  Tensor probs, experts, weights;  // (M, E) f32, (M, k) i32, (M, k) f32
  ExpertRoutes routes;
  // The experts' inputs and activations: the dispatched rows (M·k, D), or
  // under expert parallelism the rows this rank's experts received (Rl, D),
  // expert-major; g, u, s (those rows, F); ye (M·k, D) the outputs of this
  // rank's routes, in route order.
  Tensor xe, g, u, s, ye;
  ExpertTraffic traffic;  // expert parallelism only
  // The sequences the rows hold (parts of): each one's token runs, and its
  // load-balancing sums over all of its tokens (every rank's part).
  std::vector<std::vector<SequenceLayout::TokenRun>> runs;
  std::vector<RouterAuxSums> aux_sums;
  int64_t sequences = 1;  // runs.size()
  double aux_loss = 0;    // Σ over the sequences of their load-balancing losses (before the coefficient)
};

// What a model's mixture-of-experts layers did over a step, for the metrics
// line, and the scale of their auxiliary loss's gradient. The model owns one;
// its blocks add to it in their training forwards (not in recomputation).
struct MoeStepState {
  // coef / (n_layers · the step's sequences over every rank): the router
  // gradients are then those of coef × the mean of the aux losses over the
  // model's layers and the step's sequences.
  float aux_grad_coef = -1;  // negative until the model's set_step_sequences
  int64_t num_experts = 0;
  // The auxiliary-loss-free balance (DeepSeek-V3): (n_layers, E) biases the
  // routers add to their scores to choose experts, moved after each step
  // (Llama::update_expert_bias); all zero, and left so, without it. The same
  // on every rank: each moves them by the step's routes over every rank.
  std::vector<float> expert_bias;
  std::vector<int64_t> routes;  // (n_layers, E) routes per expert this step (0 for layers not held)
  double aux_sum = 0;           // Σ of the aux losses over the layers held and the sequences
  int64_t aux_terms = 0;        // how many were summed
  bool record_experts = false;  // keep every training forward's choice of experts (tests)
  std::vector<Tensor> experts;  // (M, k) i32 copies, in forward order
  // The most rows one layer's experts on this rank received in a training
  // forward this step, and that as a share of the rows the dry run has them
  // receive at model.moe_estimate_load 1 (the rows the forward routed, M·k):
  // under expert parallelism a learned routing's load, which sets this rank's
  // memory; 1 without it.
  int64_t received_rows = 0;
  double received_share = 0;
  void begin_step() {
    std::fill(routes.begin(), routes.end(), 0);
    aux_sum = 0, aux_terms = 0;
    experts.clear();
    received_rows = 0, received_share = 0;
  }
};

// x (M, D), `rows` rows of M / rows tokens → y (M, D), x's dtype; with a
// residual (M, D), y = residual + the layer's output. `exchange`: the
// expert-parallel group (w then holds this rank's experts). `layout`: where
// the rows sit in their sequences (context parallelism's chunks; the aux
// loss's sums then add up over its group, and forced balance routes by the
// tokens' positions); null: each row is a whole sequence.
Tensor moe_forward(const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, MoeSaved& saved, int64_t rows = 1,
                   const Tensor& residual = {}, ExpertExchange* exchange = nullptr,
                   const SequenceLayout* layout = nullptr);

// dy (M, D) → dx (M, D) (overwritten); the weights' gradients are added to
// `grads` (f32, or the compute dtype); the router's includes aux_coef times the
// gradient of saved.aux_loss. saved is consumed. `split`: the experts' width
// is split over tensor-parallel ranks (dx is then this rank's partial sum).
void moe_backward(const Tensor& dy, const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, float aux_coef,
                  MoeSaved& saved, Tensor& dx, const MoeWeights& grads, ExpertExchange* exchange = nullptr,
                  const ExpertWidthSplit* split = nullptr);

}  // namespace anvil
