#include "anvil/model/kv_cache.h"

#include <string>

namespace anvil {

KvCache::KvCache(const ModelArgs& args, int64_t slots_, int64_t capacity_, DType dtype)
    : slots(slots_), capacity(capacity_) {
  for (int64_t l = 0; l < args.n_layers; ++l) {
    k.push_back(Tensor::empty({slots, capacity, args.n_kv_heads, args.head_dim()}, dtype, MemCategory::activations,
                              "kv_cache.k"));
    v.push_back(Tensor::empty({slots, capacity, args.n_kv_heads, args.head_dim()}, dtype, MemCategory::activations,
                              "kv_cache.v"));
  }
}

size_t KvCache::bytes() const {
  size_t total = 0;
  for (size_t i = 0; i < k.size(); ++i) total += k[i].nbytes() + v[i].nbytes();
  return total;
}

}  // namespace anvil
