// The memory simulator behind the estimator: a replay, without data, of the
// allocations one rank makes during training, tensor by tensor, in the order
// the model's code makes them and with the same lifetimes. A simulated tensor
// is a reference-counted handle: it is freed when its last holder lets go,
// exactly as anvil::Tensor is, so the replay below reads like the code it
// mirrors (model/transformer_block.cpp, model/output_head.cpp, model/llama.cpp
// and the tensor-parallel seams of dist/tensor_parallel.cpp) and its live and
// peak bytes per category are what the tracking allocator records.
//
// When the model's code changes what it allocates, the replay must change with
// it: tests/memory_test.cpp and the parity tests' per-rank checks hold the two
// together to the byte (activations) or within 1%.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/dtype.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"
#include "anvil/model/llama.h"

namespace anvil {

// Live and peak bytes per category and in total, as TrackingAllocator's MemStats.
class MemSim {
 public:
  using Buf = std::shared_ptr<const void>;  // a simulated tensor; empty: none
  Buf alloc(MemCategory c, size_t bytes);
  Buf act(size_t bytes) { return alloc(MemCategory::activations, bytes); }
  // Live bytes that belong to no handle (what stays allocated through the
  // whole run, such as the RoPE table): added now, never freed.
  void hold(MemCategory c, size_t bytes) { keep_.push_back(alloc(c, bytes)); }
  size_t live(MemCategory c) const { return live_[static_cast<size_t>(c)]; }
  size_t peak(MemCategory c) const { return peak_[static_cast<size_t>(c)]; }
  size_t peak_total() const { return peak_total_; }
  // The tracking allocator's block cache (core/allocator.h), mirrored: what
  // the process holds for tensors, live or cached, and its peak.
  size_t peak_reserved() const { return peak_reserved_; }
  void trim_cache();     // TrackingAllocator::trim_cache
  void release_cache();  // TrackingAllocator::release_cache
  const std::array<size_t, kNumMemCategories>& peaks() const { return peak_; }
  // A transient `bytes` of category c on top of what is live now (an op's
  // scratch, freed before the next allocation the replay follows).
  void touch(MemCategory c, size_t bytes) { (void)alloc(c, bytes); }

 private:
  void free(MemCategory c, size_t bytes);
  std::array<size_t, kNumMemCategories> live_{}, peak_{};
  size_t live_total_ = 0, peak_total_ = 0;
  size_t reserved_ = 0, peak_reserved_ = 0;
  std::map<size_t, size_t> cached_;  // block size → blocks waiting
  std::set<size_t> requested_;       // block sizes asked for since the last trim
  std::vector<Buf> keep_;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // handles outliving the simulator free nothing
};

// The data-parallel seam (ParamGroupHooks) in the replay: what FSDP allocates
// around each module's use.
class GroupHooksSim {
 public:
  virtual ~GroupHooksSim() = default;
  virtual void before_forward(int) {}
  virtual void after_forward(int) {}
  virtual void before_backward(int) {}
  virtual void after_backward(int) {}
};

// One rank's model: its stages' modules, with tensor parallelism over `tp`
// ranks (sequence parallel, loss parallel) as TensorParallelPlan runs them.
struct ModelSimShape {
  ModelArgs args;
  int64_t B = 1, T = 1;  // sequences and tokens per sequence of a micro-batch
  DType dtype = DType::bf16;
  AcPolicy ac;
  int tp = 1;
  bool sequence_parallel = true;  // only with tp > 1
  bool loss_parallel = true;      // only with tp > 1
};

struct SimBlockSaved {
  MemSim::Buf x, h1, rstd1, q, k, v, o, lse, x2, h2, rstd2, g, u, s;
  std::vector<MemSim::Buf> weight_work;  // a split backward's deferred products' inputs
};

struct SimStageSaved {
  std::vector<SimBlockSaved> blocks;
  MemSim::Buf output;       // the head's stage: the last block's output
  MemSim::Buf d_embedding;  // a split backward's embedding gradient
};

class ModelSim {
 public:
  // `grads`: called when the model creates its gradient buffers (the start of
  // a backward: ParamStore::ensure_grads).
  ModelSim(MemSim& sim, const ModelSimShape& shape, std::vector<ModuleRange> stages, GroupHooksSim* hooks,
           std::function<void()> ensure_grads);

  int num_stages() const { return static_cast<int>(stages_.size()); }
  MemSim::Buf forward(int stage, MemSim::Buf input, SimStageSaved& saved);
  // The head's stage: the fused loss and its backward, then the blocks'.
  MemSim::Buf backward_from_loss(int stage, SimStageSaved& saved, bool split);
  MemSim::Buf backward(int stage, SimStageSaved& saved, MemSim::Buf d_output, bool split);
  void backward_weight(int stage, SimStageSaved& saved);
  MemSim::Buf logits(const SimStageSaved& saved);  // the keep-outputs diagnostic's tensor

  // Bytes of one residual-stream tensor (the rows this rank holds) in the compute dtype.
  size_t residual_bytes() const;

  // What this rank has sent over the tensor-parallel group so far, by the
  // formulas of dist/comm.h's comm_bytes (reductions travel as fp32).
  uint64_t tp_bytes = 0;

 private:
  struct Dims {
    size_t M, Ml, D, Dq, Dkv, F, V, e, lse;
  };
  void tp_all_reduce(uint64_t payload);
  void tp_gather_or_scatter(uint64_t payload);
  MemSim::Buf gather_rows(const MemSim::Buf& local, size_t cols, size_t elem);
  MemSim::Buf reduce_partial(const MemSim::Buf& partial);
  MemSim::Buf row_parallel_out();
  MemSim::Buf column_input_grad();
  MemSim::Buf block_forward(MemSim::Buf x, int layer, SimBlockSaved& s);
  void rms_norm(MemSim::Buf& out, MemSim::Buf& rstd);
  void run_forward(SimBlockSaved& s);
  void recompute(SimBlockSaved& s);
  MemSim::Buf block_backward(SimBlockSaved& s, MemSim::Buf dout, bool split);
  MemSim::Buf embedding_forward();
  void embedding_backward(const MemSim::Buf& dh);
  MemSim::Buf head_forward_backward(const MemSim::Buf& h);
  MemSim::Buf backward_blocks(int stage, SimStageSaved& saved, MemSim::Buf dh, bool split);
  int group_of_module(int module) const;

  MemSim& sim_;
  ModelSimShape shape_;
  Dims d_;
  bool tp_;
  std::vector<ModuleRange> stages_;
  std::vector<int> held_modules_;
  GroupHooksSim* hooks_;
  GroupHooksSim no_hooks_;
  std::function<void()> ensure_grads_;
};

}  // namespace anvil
