// The optimizer over this rank's master weights — the model's own, or its FSDP
// shard — as every layout runs it: AdamW for every parameter, or Muon
// (ops/muon.h) for the hidden matrices and AdamW for the rest, as Moonlight and
// torchtitan train with it. Its state is created at the first step (as in
// PyTorch, so the first forward and backward run without it) or by a resume,
// and the bf16 compute copy is written in the same pass as the update.
//
// State, per parameter: AdamW's two fp32 moments (8 bytes); Muon's one fp32
// momentum (4 bytes). Under Muon each kind is one buffer packed over the
// parameters that have it, so the state is exactly those bytes.
//
// Under FSDP (and HSDP, and context parallelism, whose shards span dp_shard ×
// cp) a rank holds one run of each parameter's elements, or none. Everything
// in Muon but Newton-Schulz is elementwise and runs on the run; Newton-Schulz
// needs the matrix whole, so each matrix has one owner among the ranks of its
// shard group (round-robin over the matrices, in the model's order), and per
// FSDP group and shard group the ranks trade in one all-to-all: every rank
// sends its runs of u (the momentum's update) to their owners, each owner
// orthogonalises its matrices whole, and a second all-to-all sends each rank
// its runs of o back. Per step a shard group sends 8·Σ(numel − the owner's run)
// bytes over all its matrices, 8·P·(n − 1)/n for P Muon parameters evenly
// sharded over n ranks (docs/muon.md); the state stays sharded. Under tensor
// parallelism the tensor a rank's runs make whole is its tp slice: the ranks
// holding a matrix's slices whole trade them over the tp group in the same
// way, to the matrix's tp owner, which orthogonalises the global matrix.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/distributed/comm_tracker.h"
#include "anvil/model/params.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/muon.h"
#include "anvil/train/checkpoint.h"

namespace anvil {

class Communicator;
class FsdpParams;
struct JobConfig;

enum class OptimizerKind : uint8_t { adamw, muon };

// The [optimizer] keys, checked: AdamW's settings (every parameter's, or under
// Muon those of adamw_params) and Muon's, at the schedule's peak.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adamw;
  AdamWConfig adamw;
  double adamw_lr = 0;  // adamw.lr before its rounding to f32: the schedule scales this one
  MuonConfig muon;
  std::vector<std::string> muon_params, adamw_params;  // glob patterns over parameter names (Muon)
  const char* name() const { return kind == OptimizerKind::muon ? "Muon" : "AdamW"; }
};
OptimizerConfig optimizer_config(const JobConfig& cfg);

// Which parameters take Muon: under Muon, those muon_params names, after
// checking that every parameter in `specs` is named by exactly one of the two
// lists and that Muon's are matrices (anvil::Error naming the parameter and
// the fix otherwise). Under AdamW, none. By name, so the answer is the same for
// a rank's slices and for the global tensors a checkpoint holds.
std::vector<bool> muon_matrices(const OptimizerConfig& cfg, const std::vector<ParamSpec>& specs);
// The kinds of state a checkpoint holds for `cfg`'s parameters (checkpoint.h).
CheckpointOptimizer checkpoint_optimizer(const OptimizerConfig& cfg);

class RankOptimizer {
 public:
  // `master`: the fp32 weights this rank updates: laid out as `specs` (each
  // parameter whole: one process, DDP, a pipeline's stages), or under FSDP
  // (`fsdp`, the shards of the model whose parameters `specs` are) its shard.
  // `compute_copy`: their bf16 copy in mixed precision, or null. All outlive
  // the optimizer.
  // `tp`: the tp group when `specs` are this rank's tensor-parallel slices.
  RankOptimizer(const OptimizerConfig& cfg, const std::vector<ParamSpec>& specs, Tensor& master,
                Tensor* compute_copy, const FsdpParams* fsdp = nullptr, Communicator* tp = nullptr);

  const OptimizerConfig& config() const { return cfg_; }
  // One step on `grads` (shaped as the master weights), scaled by `clip`, at
  // the schedule's `lr_factor` times each learning rate.
  void step(double lr_factor, int64_t step, const Tensor& grads, float clip);
  // The state, zero (a resume fills it).
  void create_state();
  bool has_state() const { return first_.defined(); }

  // The state laid out as the master weights, for checkpoints: the first
  // buffer holds AdamW's exp_avg, or Muon's momentum on its matrices; the
  // second exp_avg_sq (zero on Muon's matrices). Under AdamW they are the
  // state itself; under Muon copies, which set_state_from_master_layout takes
  // back after a load. Creates the state if there is none.
  std::pair<Tensor, Tensor> state_in_master_layout();
  void set_state_from_master_layout(const Tensor& first, const Tensor& second);

  // Per step, on this rank: Newton-Schulz's FLOPs (its owned matrices), and
  // the bytes its two all-to-alls send to the other ranks (zero unless
  // sharded). Both are known at construction.
  double newton_schulz_flops_per_step() const { return ns_flops_; }
  uint64_t exchange_bytes_per_step() const { return exchange_bytes_; }
  // The all-to-alls' bytes and times since the last take.
  CommStats take_comm_stats() { return tracker_.take(); }

 private:
  // This rank's run of a parameter: where it lies in the master weights, its
  // length, where in its kind's state buffer, and its first element in the
  // parameter (0 when held whole).
  struct Run {
    int64_t offset = 0, numel = 0, state_offset = 0, begin = 0;
  };
  struct Matrix {
    ParamSpec spec;  // this rank's tensor of it: its tp slice (spec.slice), or the whole matrix
    Run mine;        // this rank's run of that tensor
    Communicator* comm = nullptr;  // its FSDP shard group; null when this rank holds its tensor whole
    int owner = 0;                 // the rank of comm that assembles the tensor whole
    std::vector<std::pair<int64_t, int64_t>> runs;  // per rank of comm: {begin, numel}
    Communicator* tp = nullptr;    // the tp group when the matrix is a tp slice; null when whole
    int tp_owner = 0;              // the rank of tp that orthogonalises the global matrix
  };
  // Matrices traded together: one FSDP group's, over one shard group and tp group.
  struct Exchange {
    Communicator* comm = nullptr;
    Communicator* tp = nullptr;
    std::vector<size_t> matrices;  // into muon_, in the model's order
  };
  void exchange_step(const MuonConfig& muon, const Exchange& x, const Tensor& grads, float clip);
  // Over the tp group: each held[j] (the tensor of matrix j this rank holds
  // whole, or undefined) goes to the matrix's tp owner, which orthogonalises
  // the global matrix; held[j] becomes this rank's slice of the result.
  void orthogonalise_over_tp(const MuonConfig& muon, const Exchange& x, std::vector<Tensor>& held);
  // One all-to-all of `comm`, tracked (its bytes, its time blocked) under `label`.
  void trade(Communicator& comm, const Tensor& out, const std::vector<int64_t>& out_rows, const Tensor& in,
             const std::vector<int64_t>& in_rows, const char* label);
  Tensor compute_copy_of(const Run& r) const;
  // Muon's packed state to (into_packed false) or from buffers laid out as the master weights.
  void copy_state(const Tensor& first, const Tensor& second, bool into_packed);

  OptimizerConfig cfg_;
  Tensor& master_;
  Tensor* compute_copy_;
  std::vector<Matrix> muon_;
  std::vector<Run> adamw_;
  std::vector<Exchange> exchanges_;  // the sharded matrices' (each held whole is stepped alone)
  int64_t muon_numel_ = 0, adamw_numel_ = 0;
  double ns_flops_ = 0;
  uint64_t exchange_bytes_ = 0;
  CommTracker tracker_;
  // AdamW: exp_avg and exp_avg_sq over the master weights. Muon: the
  // momentum packed over its matrices, and AdamW's moments packed over the rest.
  Tensor first_, second_, momentum_;
};

}  // namespace anvil
