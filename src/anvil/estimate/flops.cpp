#include "anvil/estimate/flops.h"

#include <algorithm>

namespace anvil {

double block_causal_share(int64_t seq_len, double mean_document_tokens) {
  if (mean_document_tokens <= 0 || seq_len <= 0) return 1.0;
  // Query p sees min(p, u) + 1 keys, u its offset in its document, uniform on
  // [0, L): E[min(p, u)] = p − p(p + 1) / (2L) for p < L, (L − 1) / 2 beyond.
  const double L = std::max(1.0, mean_document_tokens);
  double kept = 0, causal = 0;
  for (int64_t i = 0; i < seq_len; ++i) {
    const double p = static_cast<double>(i);
    kept += (p < L ? p - p * (p + 1) / (2 * L) : (L - 1) / 2) + 1;
    causal += p + 1;
  }
  return kept / causal;
}

double flops_per_token(const ModelArgs& a, int64_t seq_len) {
  // A tied head is the embedding's matrix, but its product is done all the same.
  const int64_t head = a.tie_embeddings ? a.vocab_size * a.dim : 0;
  // A mixture of experts counts the experts a token runs (torchtitan's MoE count).
  const double dense = 6.0 * static_cast<double>(a.active_params() - a.num_embedding_params() + head);
  const double attention = 6.0 * static_cast<double>(a.n_layers * a.n_heads * 2 * a.head_dim() * seq_len);
  return dense + attention;
}

}  // namespace anvil
