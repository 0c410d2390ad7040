// What the kernel tests (tests/cuda/cuda_*_kernels_test.cpp and the row tests)
// share: storage helpers, the check of a result against a double reference
// within a derived bound, and the bit-for-bit check of a host run against a
// device run.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/core/tensor.h"
#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::testing {

// float f32, uint16_t bf16 bits, int32_t i32.
template <class T>
constexpr DType dtype_for() {
  return std::is_same_v<T, float> ? DType::f32 : std::is_same_v<T, int32_t> ? DType::i32 : DType::bf16;
}
template <class T>
std::string type_name() {
  return dtype_name(dtype_for<T>());
}

template <class T>
T stored(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return bf16::from_float(v);
}

// Values as stored (f32, or bf16 bits rounded from f32 draws).
template <class T>
std::vector<T> random_storage(int64_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<T> x(static_cast<size_t>(n));
  for (T& v : x) v = stored<T>(dist(rng));
  return x;
}

template <class T>
double value_of(T x) {
  return kernel::load_f32(&x, 0);
}

template <class T>
Tensor tensor_of(const std::vector<T>& x, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), dtype_for<T>(), MemCategory::workspace, "x");
  std::memcpy(t.raw(), x.data(), t.nbytes());
  return t;
}
template <class T>
std::vector<T> values(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.raw(), t.nbytes());
  return v;
}

// Checks |got − ref| ≤ ulps·u·scale (+ bf16's final rounding, 2^-8 relative)
// element-wise, u = 2^-24, and prints the largest error in units of u·scale.
template <class T>
void expect_within(const std::string& what, const std::vector<T>& got, const std::vector<double>& ref,
                   const std::vector<double>& scale, double ulps) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  ASSERT_EQ(scale.size(), ref.size()) << what;
  const double u = std::ldexp(1.0, -24), final_rounding = std::is_same_v<T, float> ? 0.0 : std::ldexp(1.0, -8);
  size_t outside = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(value_of(got[i]) - ref[i]);
    const double allowed = ulps * u * scale[i] * (1 + final_rounding) + final_rounding * std::fabs(ref[i]);
    if (!(err <= allowed) && ++outside <= 3)
      ADD_FAILURE() << what << "[" << i << "]: got " << value_of(got[i]) << ", reference " << ref[i] << ", allowed "
                    << allowed;
    if (scale[i] > 0) worst = std::max(worst, (err - final_rounding * std::fabs(ref[i])) / (u * scale[i]));
  }
  std::printf("%-44s max error %.3g u·scale (bound %g)\n", what.c_str(), std::max(worst, 0.0), ulps);
  EXPECT_EQ(outside, 0u) << what;
}

// Element-wise equality of the bits (a NaN equals a NaN of the same payload).
template <class T>
void expect_same_bits(const std::string& what, const std::vector<T>& a, const std::vector<T>& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && ++differ <= 3)
      ADD_FAILURE() << what << "[" << i << "]: " << value_of(a[i]) << " vs " << value_of(b[i]);
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << a.size() << " differ";
}

}  // namespace anvil::testing
