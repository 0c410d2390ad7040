#include "anvil/model/cast_on_use.h"

namespace anvil {

CastOnUse::CastOnUse(ParamStore& params, ReshardPolicy reshard, int tied_group)
    : params_(params), reshard_(reshard), tied_group_(tied_group), cast_(params.groups().size()) {
  ANVIL_ASSERT(params.compute_copy() == ComputeCopy::per_group && params.compute_dtype() == DType::bf16,
               "CastOnUse needs a bf16 store without a whole compute copy");
}

bool CastOnUse::is_head(int group) const {
  return params_.groups()[static_cast<size_t>(group)].module == ModuleKind::head;
}

void CastOnUse::cast(int group) {
  const size_t g = static_cast<size_t>(group);
  if (cast_[g].defined()) return;
  const ParamGroup& pg = params_.groups()[g];
  cast_[g] = Tensor::empty({pg.numel}, DType::bf16, MemCategory::parameters, "params.cast_bf16");
  cast_[g].copy_from(params_.master_flat().slice(pg.offset, pg.numel));
  params_.bind_group(group, cast_[g], Tensor());
}

void CastOnUse::free(int group) {
  const size_t g = static_cast<size_t>(group);
  if (!cast_[g].defined()) return;
  params_.unbind_group(group);
  cast_[g] = Tensor();
}

void CastOnUse::make(int group) {
  if (params_.groups()[static_cast<size_t>(group)].module != ModuleKind::embedding) cast(group);
  if (is_head(group) && tied_group_ >= 0) cast(tied_group_);
}

void CastOnUse::before_forward(int group) {
  make(group);
  if (inner_) inner_->before_forward(group);
}

void CastOnUse::after_forward(int group) {
  if (inner_) inner_->after_forward(group);
  if (keep_after_forward(params_.groups(), group, reshard_)) return;
  free(group);
  if (is_head(group) && tied_group_ >= 0) free(tied_group_);
}

void CastOnUse::before_backward(int group) {
  make(group);
  if (inner_) inner_->before_backward(group);
}

void CastOnUse::after_backward(int group) {
  if (inner_) inner_->after_backward(group);
  free(group);
  if (is_head(group) && tied_group_ >= 0) free(tied_group_);
}

void CastOnUse::release() {
  for (size_t g = 0; g < cast_.size(); ++g) free(static_cast<int>(g));
}

}  // namespace anvil
