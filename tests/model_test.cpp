// Whole-model properties: determinism of forward and backward across runs.
#include <gtest/gtest.h>

#include "anvil/core/rng.h"
#include "anvil/model/llama.h"
#include "test_util.h"

using namespace anvil;
using namespace anvil::testing;

// The same inputs must give bit-identical gradients on every run, whatever the
// thread timing: any difference is a race in a kernel.
TEST(Llama, BackwardIsBitwiseReproducible) {
  for (DType dt : {DType::bf16, DType::f32}) {
    const ModelArgs args = model_flavor("llama3", "debugmodel");
    const int64_t B = 4, T = 256;
    Llama model(args, dt, T);
    model.params().init(0);
    Tensor tokens = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "tokens");
    Tensor targets = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "targets");
    const uint64_t key = RngStream{0, "determinism"}.key();
    for (int64_t i = 0; i < B * T; ++i) {
      tokens.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * 258);
      targets.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i + B * T)) * 258);
    }
    std::vector<std::vector<double>> runs;
    for (int run = 0; run < 3; ++run) {
      model.params().zero_grad();
      model.forward_backward(tokens, targets, 1.0f / static_cast<float>(B * T), AcPolicy{});
      std::vector<double> g;
      runs.push_back(to_double(model.params().grad_flat()));
    }
    const auto& specs = model.params().specs();
    for (int run = 1; run < 3; ++run)
      for (const ParamSpec& s : specs) {
        double diff = 0;
        for (int64_t i = s.offset; i < s.offset + s.numel(); ++i)
          diff = std::max(diff, std::abs(runs[run][static_cast<size_t>(i)] - runs[0][static_cast<size_t>(i)]));
        EXPECT_EQ(diff, 0.0) << dtype_name(dt) << " run " << run << ": " << s.name;
      }
  }
}
