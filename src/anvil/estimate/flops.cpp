#include "anvil/estimate/flops.h"

namespace anvil {

double flops_per_token(const ModelArgs& a, int64_t seq_len) {
  // A tied head is the embedding's matrix, but its product is done all the same.
  const int64_t head = a.tie_embeddings ? a.vocab_size * a.dim : 0;
  const double dense = 6.0 * static_cast<double>(a.num_params() - a.num_embedding_params() + head);
  const double attention = 6.0 * static_cast<double>(a.n_layers * a.n_heads * 2 * a.head_dim() * seq_len);
  return dense + attention;
}

}  // namespace anvil
