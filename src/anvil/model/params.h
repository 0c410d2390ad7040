// Parameter storage: every parameter is a named view into a few flat buffers —
// f32 master weights, an optional bf16 compute copy, f32 gradients — so the
// optimizer, the gradient norm and (later) FSDP's collectives run over one
// contiguous range instead of hundreds of small tensors.
#pragma once
#include <algorithm>
#include <string>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

enum class ParamInit { ones, normal, trunc_normal };

// How a rank's parameter maps to the global tensor of the same name (what
// checkpoints hold): the whole tensor (replicated), or the slice [begin, begin
// + shape[dim]) of the global tensor along dim 0 (rows) or 1 (columns), as a
// parallel style shards it (tensor parallelism: distributed/tensor_parallel.h).
// Indices at or past global_extent are padding (a vocabulary padded to a
// multiple of the shard count): zero, never trained, not stored. Without a
// sharding style every slice is the whole tensor.
struct GlobalSlice {
  int dim = -1;               // -1: replicated
  int64_t begin = 0;          // the slice's first global index along dim
  int64_t global_extent = 0;  // the global tensor's size along dim
  bool replicated() const { return dim < 0; }
};

// Which module of the model a parameter belongs to (llama.h's list). Data
// parallelism reads it from the groups instead of assuming a numbering, so a
// pipeline stage's renumbered groups need nothing else.
enum class ModuleKind { embedding, block, head };

struct ParamSpec {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Shape shape;
  ParamInit init = ParamInit::trunc_normal;
  float std = 0.02f;
  int group = 0;       // the parameter group (a model's unit of FSDP sharding and DDP bucketing)
  int64_t offset = 0;  // in elements, into the flat buffers
  GlobalSlice slice = {};  // where this (local) tensor sits in the global one
  ModuleKind module = ModuleKind::block;
  int layer = -1;  // a block's layer in the whole model; -1 for the other modules
  // An expert's weight under expert parallelism: only the ranks holding the
  // expert have it, and its gradient there holds every token of their ep group
  // routed to it, so DDP leaves it alone and FSDP reduces it over the ranks
  // holding the same expert only (FsdpParams).
  bool expert = false;
  int64_t numel() const { return shape_numel(shape); }
  Shape global_shape() const;
};

// Calls fn(run, global_offset) for each contiguous run of `local` (parameter
// s's tensor, in s.shape) that holds elements of the global tensor, with the
// row-major index of the run's first element in the global tensor. Padding is
// skipped. A row split is one run; a column split is one run per row.
template <class F>
void for_each_global_run(const ParamSpec& s, const Tensor& local, F&& fn) {
  if (s.slice.replicated()) return fn(local, int64_t{0});
  const int64_t rows = local.size(0), inner = local.numel() / std::max<int64_t>(1, rows);
  if (s.slice.dim == 0) {
    const int64_t valid = std::clamp<int64_t>(s.slice.global_extent - s.slice.begin, 0, rows);
    if (valid > 0) fn(local.slice(0, valid), s.slice.begin * inner);
    return;
  }
  // dim 1 of a matrix: row r's columns [begin, begin + cols) of a global row of global_extent.
  for (int64_t r = 0; r < rows; ++r) fn(local.slice(r, 1), r * s.slice.global_extent + s.slice.begin);
}

// Elements of a flat buffer holding `specs`, each parameter padded to a
// 64-byte boundary (what ParamStore allocates per buffer).
int64_t padded_numel(const std::vector<ParamSpec>& specs);

// Consecutive parameters sharded, gathered and reduced together: Llama's are
// the embedding, each transformer block, and the head (final norm and output).
struct ParamGroup {
  int first = 0, end = 0;  // parameters [first, end)
  int64_t offset = 0;      // the group's start in the flat buffers, in elements
  int64_t numel = 0;       // its padded length
  ModuleKind module = ModuleKind::block;  // its parameters' module
  int layer = -1;                         // and layer (blocks only)
  // The runs {offset, numel} of the flat buffers that data parallelism
  // reduces over all its ranks: the whole group, less a mixture of experts'
  // expert weights (ParamSpec::expert), which expert parallelism keeps apart.
  std::vector<std::pair<int64_t, int64_t>> data_parallel_runs;
};

// Where a bf16 store's compute weights live. `whole`: a bf16 copy of every
// parameter, kept and rewritten by each optimizer step (18 bytes per
// parameter with the fp32 master, gradients and AdamW's moments). `per_group`:
// none kept; each group's bf16 weights are cast from the master while the
// group runs and bound to it (model/cast_on_use.h), as FSDP2 does on one
// device: 16 bytes per parameter, plus the groups in use.
enum class ComputeCopy { whole, per_group };

class ParamStore {
 public:
  // compute_dtype bf16 adds a bf16 copy of the master weights for the matrix
  // products, whole or per group (ComputeCopy). Groups come from the specs'
  // `group` fields, which must be non-decreasing. allocate = false makes a
  // store without flat buffers, whose groups are all bound to buffers someone
  // else owns (FSDP's gathered groups).
  ParamStore(std::vector<ParamSpec> specs, DType compute_dtype, bool allocate = true,
             ComputeCopy copy = ComputeCopy::whole);

  // Initialise from the counter-based RNG, keyed by (seed, parameter name).
  void init(uint64_t seed);
  // Refresh the compute copy from the master weights (after loading or init).
  void sync_compute_copy();

  const std::vector<ParamSpec>& specs() const { return specs_; }
  int64_t numel() const { return numel_; }
  DType compute_dtype() const { return compute_dtype_; }
  ComputeCopy compute_copy() const { return copy_; }
  int index_of(const std::string& name) const;  // throws anvil::Error when unknown

  const std::vector<ParamGroup>& groups() const { return groups_; }

  Tensor master(int i) const { return view(master_, i); }
  // The compute copy and gradient of parameter i: views into the group's bound
  // buffers when it has them, else into the flat buffers. A per_group store's
  // unbound group reads the fp32 master (the embedding gathers its rows from
  // it, converting only those; a product would refuse the f32 weight).
  Tensor compute(int i) const;
  Tensor grad(int i) const;
  // Parameters [first, first + count) of one shape, back to back in their
  // group (each a multiple of the 64-byte padding: a MoE layer's experts), as
  // one (count, shape...) tensor: the compute copies, or the gradients.
  Tensor compute_stack(int first, int count) const;
  Tensor grad_stack(int first, int count) const;

  // Binds group g's compute weights and gradients to full-group buffers of
  // bound_numel(g) elements laid out as in the flat buffers, or as
  // set_bound_layout says (either may be an undefined Tensor: not needed now).
  // unbind_group goes back to the flat ones.
  void bind_group(int g, Tensor compute, Tensor grad);
  // Where group g's parameters sit in its bound buffers, in elements from
  // their start (one per parameter of the group), and those buffers' length:
  // FSDP's gathered groups whose expert weights are sharded apart from the rest.
  void set_bound_layout(int g, const std::vector<int64_t>& offsets, int64_t numel);
  int64_t bound_numel(int g) const { return bound_numel_[static_cast<size_t>(g)]; }
  void unbind_group(int g);

  Tensor& master_flat() { return master_; }
  // The master buffer itself in pure f32 or a per_group store.
  Tensor& compute_flat() { return compute_; }
  Tensor& grad_flat() { return grads_; }
  void zero_grad();
  // The trainer frees the gradients after each optimizer step, as PyTorch's
  // zero_grad(set_to_none=True) does, and the backward creates them again
  // (zeroed) when it first needs them: between steps, and during the forward,
  // they take no memory.
  void release_grads() {
    if (allocate_) grads_ = Tensor();
  }
  // Zeroes the gradients if they exist, keeping their pages: freeing and
  // re-creating them each step cost a page fault per 4 KiB (0.7 s a step for
  // 125M's 475 MiB, 6% of it), zeroing resident pages a memset.
  void zero_kept_grads() {
    if (grads_.defined()) grads_.zero_();
  }
  void ensure_grads();
  bool has_grads() const { return grads_.defined(); }

 private:
  Tensor view(const Tensor& flat, int i) const;
  Tensor group_view(const Tensor& group_buffer, int i) const;
  Tensor stack(const std::vector<Tensor>& bound, const Tensor& flat, int first, int count) const;
  std::vector<ParamSpec> specs_;
  DType compute_dtype_;
  bool allocate_;
  ComputeCopy copy_;
  int64_t numel_ = 0;
  std::vector<ParamGroup> groups_;
  std::vector<Tensor> bound_compute_, bound_grads_;  // per group; undefined: use the flat buffers
  std::vector<int64_t> bound_offset_;                // per parameter: its offset in its group's bound buffers
  std::vector<int64_t> bound_numel_;                 // per group: the bound buffers' length
  Tensor master_, compute_, grads_;
};

// The seam where data parallelism acts, never inside kernels: the model calls
// these around each module's use, numbering the modules it holds from 0 (each
// module's parameters are one group; see Llama::group_of_module). FSDP gathers
// a group's weights before and reshards them and reduce-scatters its gradients
// after; DDP starts a bucket's all-reduce when its backward is done. The head's
// forward and backward are one fused pass: it sees before_forward,
// before_backward, after_backward.
class ParamGroupHooks {
 public:
  virtual ~ParamGroupHooks() = default;
  virtual void before_forward(int group) {}
  virtual void after_forward(int group) {}
  virtual void before_backward(int group) {}
  virtual void after_backward(int group) {}
};

}  // namespace anvil
