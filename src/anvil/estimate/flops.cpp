#include "anvil/estimate/flops.h"

namespace anvil {

double flops_per_token(const ModelArgs& a, int64_t seq_len) {
  const double dense = 6.0 * static_cast<double>(a.num_params() - a.num_embedding_params());
  const double attention = 6.0 * static_cast<double>(a.n_layers * a.n_heads * 2 * a.head_dim() * seq_len);
  return dense + attention;
}

}  // namespace anvil
