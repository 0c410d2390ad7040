// The first module: token ids → the residual stream. Its saved record is the
// tokens themselves (the caller keeps them); its backward has no input
// gradient, only the table's.
#pragma once
#include "anvil/core/tensor.h"
#include "anvil/model/parallel_style.h"
#include "anvil/model/params.h"

namespace anvil {

class TokenEmbedding {
 public:
  TokenEmbedding(ParamStore& params, int weight_index, const ParallelStyle& style)
      : params_(params), weight_(weight_index), style_(style) {}
  // tokens (B, T) i32 → h (residual_rows(B·T), D) in the compute dtype.
  Tensor forward(const Tensor& tokens) const;
  // dh: the gradient of h; adds into the table's gradient.
  void backward(const Tensor& tokens, const Tensor& dh);

 private:
  ParamStore& params_;
  int weight_;
  const ParallelStyle& style_;
};

}  // namespace anvil
