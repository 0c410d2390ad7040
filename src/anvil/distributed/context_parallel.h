// Context parallelism (torchtitan's cp dimension): the ranks of a cp group
// share every sequence of their data-parallel rank, each holding a part of its
// tokens, so a sequence's activations are spread over cp ranks.
//
// A sequence of T tokens is cut into 2·cp chunks of c = T / (2·cp). Under the
// head-tail load balancer cp rank i holds chunks i and 2·cp − 1 − i: under the
// causal mask a chunk's attention costs ∝ its position, and the pair costs
// the same on every rank; without a balancer rank i holds chunks 2i and 2i + 1
// (one contiguous piece, the last rank doing the most attention).
//
// Local layout: a micro-batch of B sequences becomes 2·B rows of c tokens, the
// B rows of the rank's first chunk, then the B rows of its second. Everything
// that works token by token (embedding, norms, products, the loss) runs on
// them unchanged; only positions matter to RoPE and attention, which this
// class does. Attention all-gathers K and V over the group (small under GQA),
// lays them out as whole sequences, runs each chunk's queries over the keys
// up to its positions (attention.h's AttentionWindow), and in the backward
// gathers K and V again (they are not kept: memory is what CP is for) and
// reduce-scatters their gradients back to the ranks that own the chunks.
//
// The ring instead passes each rank's K and V around the group, one rank's
// block per step, while the current block's attention runs: rank r holds at
// step s the block of rank r − s, and its queries' partial attentions over
// the blocks are merged by their log-sum-exp (attention_merge). In the
// backward the blocks go round again, and with them the sum of their keys'
// gradients, each rank adding its queries' part before passing it on; one
// last hop brings the whole sum home. A rank holds two blocks at a time
// where the all-gather holds all of them, and each transfer overlaps the
// attention of the block before it.
#pragma once
#include <cstdint>
#include <string>

#include "anvil/core/tensor.h"
#include "anvil/distributed/comm.h"
#include "anvil/model/parallel_style.h"
#include "anvil/ops/rope.h"

namespace anvil {

enum class CpLoadBalancer { headtail, none };
CpLoadBalancer cp_load_balancer(const std::string& name);  // "headtail" | "none"; anvil::Error naming both
const char* cp_load_balancer_name(CpLoadBalancer b);

enum class CpRotateMethod { allgather, ring };
CpRotateMethod cp_rotate_method(const std::string& name);  // "allgather" | "ring"; anvil::Error naming both
const char* cp_rotate_method_name(CpRotateMethod m);

// Which of the 2·degree chunks cp rank `rank` holds as its local chunk j (0 or 1).
int64_t cp_chunk(CpLoadBalancer balancer, int degree, int rank, int j);
// That rank's rows of B sequences of T tokens (B, T) row-major: local (2B,
// T / (2·degree)), its first chunk of every sequence, then its second.
void cp_local_rows(CpLoadBalancer balancer, int degree, int rank, const int32_t* sequences, int64_t B, int64_t T,
                   int32_t* local);

class ContextParallel : public SequenceLayout {
 public:
  // `group`: this rank's cp group (outlives this object).
  ContextParallel(Communicator& group, CpLoadBalancer balancer, CpRotateMethod rotate = CpRotateMethod::ring);

  int degree() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  CpLoadBalancer balancer() const { return balancer_; }
  CpRotateMethod rotate_method() const { return rotate_; }
  // The sequence chunk this rank's local chunk j holds.
  int64_t chunk(int j) const { return cp_chunk(balancer_, degree(), rank(), j); }

  // This rank's tokens of B sequences of T (B, T) row-major: local (2B, T / (2·degree)).
  void local_tokens(const int32_t* sequences, int64_t B, int64_t T, int32_t* local) const;

  // Of local rows (2B, c): B sequences, each two runs of c tokens (its first
  // chunk's row, then its second's), at their chunks' positions; sums over the group.
  int64_t sequences(int64_t B) const override;
  std::vector<TokenRun> sequence_runs(int64_t b, int64_t B, int64_t T) const override;
  std::vector<int64_t> token_positions(int64_t B, int64_t T) const override;
  void sum_over_parts(std::vector<double>& values) const override;

  // RoPE on local q or k (2B, c, H, D): each chunk's rows at their positions.
  void rope_forward(const Tensor& x, const RopeTable& table, Tensor& y) const override;
  void rope_backward(const Tensor& dy, const RopeTable& table, Tensor& dx) const override;

  // Causal attention of local q (2B, c, Hq, D) over the whole sequences' keys:
  // out (2B, c, Hq, D), lse (2B, Hq, c), given local k, v (2B, c, Hkv, D).
  // documents: the whole sequences' bounds (B, 2, T), for block-causal
  // attention (a document may span chunks, and ranks); undefined: causal.
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                         const Tensor& documents) const override;
  // dq, dk, dv of the local rows (overwritten).
  void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& documents) const override;

 private:
  // Whole sequences (B, T, H, D) of local x (2B, c, H, D) from every rank.
  Tensor gather_sequences(const Tensor& local, const char* tag) const;
  void ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                    const Tensor& documents) const;
  void ring_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& documents) const;
  Communicator& group_;
  CpLoadBalancer balancer_;
  CpRotateMethod rotate_;
};

}  // namespace anvil
