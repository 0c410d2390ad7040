// Document bounds for attention tests: (B, 2, T) i32 on the host, as
// ops/document_mask.h's fill_document_bounds makes them and ops/attention.h
// reads them ([b, 0, p] the start of the document holding position p, [b, 1, p]
// the position after its last), for sequences cut into documents of the given
// lengths (each sequence's lengths must add up to T).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil::testing {

inline Tensor document_bounds(const std::vector<std::vector<int32_t>>& lengths, int64_t T) {
  const auto B = static_cast<int64_t>(lengths.size());
  Tensor d = Tensor::empty({B, 2, T}, DType::i32, MemCategory::workspace, "documents", Device::cpu());
  int32_t* p = d.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (const int32_t n : lengths[static_cast<size_t>(b)]) {
      for (int32_t t = start; t < start + n; ++t) p[(b * 2) * T + t] = start, p[(b * 2 + 1) * T + t] = start + n;
      start += n;
    }
    EXPECT_EQ(start, T) << "sequence " << b << "'s documents";
  }
  return d;
}

}  // namespace anvil::testing
