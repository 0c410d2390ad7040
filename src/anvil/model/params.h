// Parameter storage: every parameter is a named view into a few flat buffers —
// f32 master weights, an optional bf16 compute copy, f32 gradients — so the
// optimizer, the gradient norm and (later) FSDP's collectives run over one
// contiguous range instead of hundreds of small tensors.
#pragma once
#include <string>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

enum class ParamInit { ones, normal, trunc_normal };

struct ParamSpec {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Shape shape;
  ParamInit init = ParamInit::trunc_normal;
  float std = 0.02f;
  int64_t offset = 0;  // in elements, into the flat buffers
  int64_t numel() const { return shape_numel(shape); }
};

// Elements of a flat buffer holding `specs`, each parameter padded to a
// 64-byte boundary (what ParamStore allocates per buffer).
int64_t padded_numel(const std::vector<ParamSpec>& specs);

class ParamStore {
 public:
  // compute_dtype bf16 adds a bf16 copy of the master weights for the matrix products.
  ParamStore(std::vector<ParamSpec> specs, DType compute_dtype);

  // Initialise from the counter-based RNG, keyed by (seed, parameter name).
  void init(uint64_t seed);
  // Refresh the compute copy from the master weights (after loading or init).
  void sync_compute_copy();

  const std::vector<ParamSpec>& specs() const { return specs_; }
  int64_t numel() const { return numel_; }
  DType compute_dtype() const { return compute_dtype_; }
  int index_of(const std::string& name) const;  // throws anvil::Error when unknown

  Tensor master(int i) const { return view(master_, i); }
  Tensor compute(int i) const { return view(compute_, i); }
  Tensor grad(int i) const { return view(grads_, i); }

  Tensor& master_flat() { return master_; }
  Tensor& compute_flat() { return compute_; }  // the master buffer itself in pure f32
  Tensor& grad_flat() { return grads_; }
  void zero_grad();
  // The trainer frees the gradients after each optimizer step, as PyTorch's
  // zero_grad(set_to_none=True) does, and the backward creates them again
  // (zeroed) when it first needs them: between steps, and during the forward,
  // they take no memory.
  void release_grads() { grads_ = Tensor(); }
  void ensure_grads();
  bool has_grads() const { return grads_.defined(); }

 private:
  Tensor view(const Tensor& flat, int i) const;
  std::vector<ParamSpec> specs_;
  DType compute_dtype_;
  int64_t numel_ = 0;
  Tensor master_, compute_, grads_;
};

}  // namespace anvil
