#include "anvil/model/params.h"

#include "anvil/core/dry_run.h"
#include "anvil/core/rng.h"

namespace anvil {

namespace {
// Keep every parameter 64-byte aligned in every buffer (16 f32 / 32 bf16).
int64_t padded(int64_t n) { return (n + 31) / 32 * 32; }
}  // namespace

Shape ParamSpec::global_shape() const {
  Shape g = shape;
  if (!slice.replicated()) g[static_cast<size_t>(slice.dim)] = slice.global_extent;
  return g;
}

int64_t padded_numel(const std::vector<ParamSpec>& specs) {
  int64_t n = 0;
  for (const ParamSpec& s : specs) n += padded(s.numel());
  return n;
}

ParamStore::ParamStore(std::vector<ParamSpec> specs, DType compute_dtype, bool allocate, ComputeCopy copy)
    : specs_(std::move(specs)), compute_dtype_(compute_dtype), allocate_(allocate), copy_(copy) {
  ANVIL_ASSERT(compute_dtype == DType::f32 || compute_dtype == DType::bf16);
  for (size_t i = 0; i < specs_.size(); ++i) {
    ParamSpec& s = specs_[i];
    s.offset = numel_;
    numel_ += padded(s.numel());
    ANVIL_ASSERT(s.group >= 0 && (groups_.empty() || s.group == static_cast<int>(groups_.size()) - 1 ||
                                  s.group == static_cast<int>(groups_.size())),
                 "parameter groups must be consecutive: ", s.name);
    if (s.group == static_cast<int>(groups_.size()))
      groups_.push_back({static_cast<int>(i), 0, s.offset, 0, s.module, s.layer, {}});
    ParamGroup& g = groups_.back();
    g.end = static_cast<int>(i) + 1;
    g.numel = numel_ - g.offset;
    if (!s.expert) {
      auto& runs = g.data_parallel_runs;
      if (!runs.empty() && runs.back().first + runs.back().second == s.offset) runs.back().second += padded(s.numel());
      else runs.emplace_back(s.offset, padded(s.numel()));
    }
  }
  bound_compute_.resize(groups_.size());
  bound_grads_.resize(groups_.size());
  for (const ParamSpec& s : specs_) bound_offset_.push_back(s.offset - groups_[static_cast<size_t>(s.group)].offset);
  for (const ParamGroup& g : groups_) bound_numel_.push_back(g.numel);
  if (!allocate) return;
  master_ = Tensor::empty({numel_}, DType::f32, MemCategory::parameters, "params.master_f32");
  compute_ = compute_dtype == DType::f32 || copy == ComputeCopy::per_group
                 ? master_
                 : Tensor::empty({numel_}, DType::bf16, MemCategory::parameters, "params.compute_bf16");
  grads_ = Tensor::zeros({numel_}, DType::f32, MemCategory::gradients, "params.grads_f32");
}

Tensor ParamStore::compute(int i) const {
  const Tensor& b = bound_compute_[static_cast<size_t>(specs_[static_cast<size_t>(i)].group)];
  return b.defined() ? group_view(b, i) : view(compute_, i);
}

Tensor ParamStore::grad(int i) const {
  const Tensor& b = bound_grads_[static_cast<size_t>(specs_[static_cast<size_t>(i)].group)];
  return b.defined() ? group_view(b, i) : view(grads_, i);
}

Tensor ParamStore::compute_stack(int first, int count) const { return stack(bound_compute_, compute_, first, count); }
Tensor ParamStore::grad_stack(int first, int count) const { return stack(bound_grads_, grads_, first, count); }

Tensor ParamStore::stack(const std::vector<Tensor>& bound, const Tensor& flat, int first, int count) const {
  const ParamSpec& s = specs_.at(static_cast<size_t>(first));
  const int64_t bound_first = bound_offset_[static_cast<size_t>(first)];
  for (int j = 1; j < count; ++j) {
    const ParamSpec& n = specs_.at(static_cast<size_t>(first + j));
    ANVIL_ASSERT(n.shape == s.shape && n.group == s.group && n.offset == s.offset + j * s.numel() &&
                     bound_offset_[static_cast<size_t>(first + j)] == bound_first + j * s.numel(),
                 "parameters ", s.name, " .. ", n.name,
                 " are not one shape back to back (each must be a multiple of 32 elements)");
  }
  Shape shape{count};
  shape.insert(shape.end(), s.shape.begin(), s.shape.end());
  const Tensor& b = bound[static_cast<size_t>(s.group)];
  const int64_t offset = b.defined() ? bound_first : s.offset;
  return (b.defined() ? b : flat).slice(offset, count * s.numel()).view(shape);
}

void ParamStore::bind_group(int g, Tensor compute, Tensor grad) {
  const int64_t need = bound_numel_[static_cast<size_t>(g)];
  ANVIL_ASSERT(!compute.defined() || (compute.numel() >= need && compute.dtype() == compute_dtype_), "group ", g);
  ANVIL_ASSERT(!grad.defined() || (grad.numel() >= need && grad.dtype() == DType::f32), "group ", g);
  bound_compute_[static_cast<size_t>(g)] = std::move(compute);
  bound_grads_[static_cast<size_t>(g)] = std::move(grad);
}

void ParamStore::set_bound_layout(int g, const std::vector<int64_t>& offsets, int64_t numel) {
  const ParamGroup& pg = groups_.at(static_cast<size_t>(g));
  ANVIL_ASSERT(static_cast<int>(offsets.size()) == pg.end - pg.first, "group ", g, ": ", offsets.size(),
               " offsets for ", pg.end - pg.first, " parameters");
  for (int i = pg.first; i < pg.end; ++i) {
    const int64_t at = offsets[static_cast<size_t>(i - pg.first)];
    ANVIL_ASSERT(at >= 0 && at + specs_[static_cast<size_t>(i)].numel() <= numel, "parameter ",
                 specs_[static_cast<size_t>(i)].name, " outside its group's bound buffers");
    bound_offset_[static_cast<size_t>(i)] = at;
  }
  bound_numel_[static_cast<size_t>(g)] = numel;
}

void ParamStore::unbind_group(int g) {
  bound_compute_.at(static_cast<size_t>(g)) = Tensor();
  bound_grads_.at(static_cast<size_t>(g)) = Tensor();
}

Tensor ParamStore::group_view(const Tensor& group_buffer, int i) const {
  const ParamSpec& s = specs_.at(static_cast<size_t>(i));
  return group_buffer.slice(bound_offset_[static_cast<size_t>(i)], s.numel()).view(s.shape);
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
  if (dry_run()) return;
  if (!master_.device().is_cpu()) {
    // Drawn on the host (the values a CPU run draws), then copied over once.
    Tensor on_device = master_;
    master_ = Tensor::empty(on_device.shape(), DType::f32, MemCategory::workspace, "params.init_on_host", Device::cpu());
    const DType compute = compute_dtype_;
    compute_dtype_ = DType::f32;  // no compute copy to refresh on the host
    init(seed);
    compute_dtype_ = compute;
    on_device.copy_from(master_);
    master_ = std::move(on_device);
    sync_compute_copy();
    return;
  }
  master_.zero_();  // the alignment padding stays zero
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    // Element j of the global tensor draws counter j, so a tensor-parallel
    // slice gets exactly the values it has in the whole tensor.
    for_each_global_run(s, master(static_cast<int>(i)), [&](Tensor p, int64_t global_offset) {
      switch (s.init) {
        case ParamInit::ones: {
          float* d = p.data<float>();
          for (int64_t j = 0; j < p.numel(); ++j) d[j] = 1.0f;
          break;
        }
        case ParamInit::normal: fill_normal(p, {seed, s.name}, 0.0f, s.std, global_offset); break;
        case ParamInit::trunc_normal:
          fill_trunc_normal(p, {seed, s.name}, 0.0f, s.std, -3.0f, 3.0f, global_offset);
          break;
      }
    });
  }
  sync_compute_copy();
}

void ParamStore::sync_compute_copy() {
  if (compute_dtype_ == DType::bf16 && copy_ == ComputeCopy::whole) compute_.copy_from(master_);
}

void ParamStore::zero_grad() {
  if (grads_.defined()) grads_.zero_();
  else ensure_grads();
}

void ParamStore::ensure_grads() {
  if (allocate_ && !grads_.defined()) grads_ = Tensor::zeros({numel_}, DType::f32, MemCategory::gradients, "params.grads_f32");
}

}  // namespace anvil
