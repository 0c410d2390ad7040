// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A value is
// a pure function of (seed, tensor name, element index), so any shard of a tensor
// initialises to exactly the elements it would hold in the unsharded tensor,
// whatever the parallel layout.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

#include "anvil/core/tensor.h"

namespace anvil {

// 64-bit FNV-1a of a name: the stream key.
uint64_t name_key(std::string_view name);

// Four 32-bit random words for (key, counter).
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_lo, uint64_t counter_hi = 0);

// Uniform in [0, 1) and standard normal for element `index` of stream `key`.
float uniform01(uint64_t key, uint64_t index);
float standard_normal(uint64_t key, uint64_t index);

struct RngStream {
  uint64_t seed;
  std::string_view name;
  uint64_t key() const;
};

// Fill t with values of the logical tensor `name`, elements [offset, offset+numel).
void fill_uniform(Tensor& t, RngStream s, float lo, float hi, int64_t offset = 0);
void fill_normal(Tensor& t, RngStream s, float mean, float std, int64_t offset = 0);
// Normal truncated to [mean + a*std, mean + b*std], by redrawing from further counters.
void fill_trunc_normal(Tensor& t, RngStream s, float mean, float std, float a, float b, int64_t offset = 0);

}  // namespace anvil
