#include "anvil/train/optimizer.h"

namespace anvil {

void RankOptimizer::create_state() {
  exp_avg_ = Tensor::zeros({master_.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg");
  exp_avg_sq_ = Tensor::zeros({master_.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg_sq");
}

void RankOptimizer::step(const AdamWConfig& adamw, int64_t step, const Tensor& grads, float clip) {
  if (!has_state()) create_state();
  adamw_step(adamw, step, master_, grads, exp_avg_, exp_avg_sq_, compute_copy_, clip);
}

}  // namespace anvil
