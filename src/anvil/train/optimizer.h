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
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/params.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/muon.h"
#include "anvil/train/checkpoint.h"

namespace anvil {

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
  // `master`: the fp32 weights this rank updates, laid out as `specs` (each
  // parameter whole: one process or DDP); `compute_copy`: their bf16 copy in
  // mixed precision, or null. All outlive the optimizer.
  RankOptimizer(const OptimizerConfig& cfg, const std::vector<ParamSpec>& specs, Tensor& master,
                Tensor* compute_copy);

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

 private:
  // A parameter's place in the master weights and in its kind's state buffer.
  struct Entry {
    int64_t offset = 0, numel = 0, state_offset = 0;
    int64_t rows = 0, cols = 0;  // Muon's matrices
  };
  OptimizerConfig cfg_;
  Tensor& master_;
  Tensor* compute_copy_;
  std::vector<Entry> muon_, adamw_;
  int64_t muon_numel_ = 0, adamw_numel_ = 0;
  // AdamW: exp_avg and exp_avg_sq over the master weights. Muon: the
  // momentum packed over its matrices, and AdamW's moments packed over the rest.
  Tensor first_, second_, momentum_;
};

}  // namespace anvil
