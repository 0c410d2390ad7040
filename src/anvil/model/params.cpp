#include "anvil/model/params.h"

#include "anvil/core/rng.h"

namespace anvil {

namespace {
// Keep every parameter 64-byte aligned in every buffer (16 f32 / 32 bf16).
int64_t padded(int64_t n) { return (n + 31) / 32 * 32; }
}  // namespace

int64_t padded_numel(const std::vector<ParamSpec>& specs) {
  int64_t n = 0;
  for (const ParamSpec& s : specs) n += padded(s.numel());
  return n;
}

ParamStore::ParamStore(std::vector<ParamSpec> specs, DType compute_dtype)
    : specs_(std::move(specs)), compute_dtype_(compute_dtype) {
  ANVIL_ASSERT(compute_dtype == DType::f32 || compute_dtype == DType::bf16);
  for (ParamSpec& s : specs_) {
    s.offset = numel_;
    numel_ += padded(s.numel());
  }
  master_ = Tensor::empty({numel_}, DType::f32, MemCategory::parameters, "params.master_f32");
  compute_ = compute_dtype == DType::f32
                 ? master_
                 : Tensor::empty({numel_}, DType::bf16, MemCategory::parameters, "params.compute_bf16");
  grads_ = Tensor::zeros({numel_}, DType::f32, MemCategory::gradients, "params.grads_f32");
}

Tensor ParamStore::view(const Tensor& flat, int i) const {
  const ParamSpec& s = specs_.at(static_cast<size_t>(i));
  return flat.slice(s.offset, s.numel()).view(s.shape);
}

int ParamStore::index_of(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int>(i);
  throw Error(detail::concat("no parameter named '", name, "' in this model"));
}

void ParamStore::init(uint64_t seed) {
  master_.zero_();  // the alignment padding stays zero
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    Tensor p = master(static_cast<int>(i));
    switch (s.init) {
      case ParamInit::ones: {
        float* d = p.data<float>();
        for (int64_t j = 0; j < p.numel(); ++j) d[j] = 1.0f;
        break;
      }
      case ParamInit::normal: fill_normal(p, {seed, s.name}, 0.0f, s.std); break;
      case ParamInit::trunc_normal: fill_trunc_normal(p, {seed, s.name}, 0.0f, s.std, -3.0f, 3.0f); break;
    }
  }
  sync_compute_copy();
}

void ParamStore::sync_compute_copy() {
  if (compute_dtype_ == DType::bf16) compute_.copy_from(master_);
}

void ParamStore::zero_grad() {
  if (grads_.defined()) grads_.zero_();
  else ensure_grads();
}

void ParamStore::ensure_grads() {
  if (!grads_.defined()) grads_ = Tensor::zeros({numel_}, DType::f32, MemCategory::gradients, "params.grads_f32");
}

}  // namespace anvil
