#include "anvil/model/tensor_parallel.h"

#include "anvil/core/error.h"

namespace anvil {

int64_t padded_vocab_size(int64_t vocab_size, int tp) {
  ANVIL_ASSERT(tp >= 1 && vocab_size >= 1);
  return (vocab_size + tp - 1) / tp * tp;
}

void copy_global_to_local(const ParamSpec& spec, const Tensor& global, const Tensor& local) {
  ANVIL_ASSERT(global.shape() == spec.global_shape() && local.shape() == spec.shape, spec.name, ": global ",
               shape_str(global.shape()), " local ", shape_str(local.shape()));
  Tensor flat = global.view({global.numel()});
  Tensor whole = local;
  if (!spec.tp.replicated()) whole.zero_();  // the vocabulary padding
  for_each_global_run(spec, local, [&](Tensor run, int64_t offset) { run.copy_from(flat.slice(offset, run.numel())); });
}

void assemble_global(const ParamSpec& spec, int tp, const Tensor& stacked, const Tensor& global) {
  ANVIL_ASSERT(global.shape() == spec.global_shape() && stacked.numel() == tp * spec.numel(), spec.name, ": global ",
               shape_str(global.shape()), " from ", shape_str(stacked.shape()));
  Tensor flat = global.view({global.numel()});
  if (spec.tp.replicated()) {  // the same on every rank: rank 0's
    flat.copy_from(stacked.view({stacked.numel()}).slice(0, spec.numel()));
    return;
  }
  const int64_t extent = spec.shape[static_cast<size_t>(spec.tp.dim)];
  for (int t = 0; t < tp; ++t) {
    ParamSpec of_rank = spec;
    of_rank.tp.begin = t * extent;
    const Tensor local = stacked.view({stacked.numel()}).slice(t * spec.numel(), spec.numel()).view(spec.shape);
    for_each_global_run(of_rank, local, [&](Tensor run, int64_t offset) {
      Tensor dst = flat.slice(offset, run.numel());
      dst.copy_from(run);
    });
  }
}

void global_flat_to_local(const std::vector<ParamSpec>& global_specs, const Tensor& global_flat,
                          const std::vector<ParamSpec>& local_specs, const Tensor& local_flat) {
  ANVIL_ASSERT(global_specs.size() == local_specs.size());
  for (size_t i = 0; i < local_specs.size(); ++i) {
    const ParamSpec& g = global_specs[i];
    const ParamSpec& l = local_specs[i];
    ANVIL_ASSERT(g.name == l.name && g.shape == l.global_shape(), g.name, " vs ", l.name);
    copy_global_to_local(l, global_flat.slice(g.offset, g.numel()).view(g.shape),
                         local_flat.slice(l.offset, l.numel()).view(l.shape));
  }
}

}  // namespace anvil
