// The keys and values every block computed for the tokens a sequence has seen
// so far, kept between decoding steps: with them a step computes only the new
// token's row instead of the whole sequence again. One slot per sequence of a
// batch, each up to `capacity` positions; K and V are stored as the block
// makes them (after RoPE for K), with the model's KV heads, so a GQA model's
// cache is Hq / Hkv times smaller than its queries would need.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/args.h"

namespace anvil {

struct KvCache {
  // (slots, capacity, n_kv_heads, head_dim) K and V per block, in `dtype`,
  // category activations, uninitialised: a row is written before any query
  // reads it (a query attends to the rows up to its own position).
  KvCache(const ModelArgs& args, int64_t slots, int64_t capacity, DType dtype);
  int64_t slots = 0, capacity = 0;
  std::vector<Tensor> k, v;  // one per block
  // What the cache holds: 2 · layers · slots · capacity · n_kv_heads · head_dim · dtype size.
  size_t bytes() const;
};

}  // namespace anvil
