#include <gtest/gtest.h>

#include "anvil/ops/matmul.h"

TEST(Matmul, Bf16RunsOnAmx) {
  const std::string impl = anvil::matmul_impl_name(anvil::DType::bf16);
  std::printf("bf16 matmul impl: %s\n", impl.c_str());
  EXPECT_NE(impl.find("amx"), std::string::npos) << impl;
}
