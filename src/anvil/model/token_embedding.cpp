#include "anvil/model/token_embedding.h"

namespace anvil {

Tensor TokenEmbedding::forward(const Tensor& tokens) const {
  return style_.embedding_forward(tokens, params_.compute(weight_), params_.compute_dtype());
}

void TokenEmbedding::backward(const Tensor& tokens, const Tensor& dh) {
  style_.embedding_backward(dh, tokens, params_.grad(weight_));
}

}  // namespace anvil
