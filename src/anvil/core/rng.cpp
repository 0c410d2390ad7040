#include "anvil/core/rng.h"

#include <cmath>

#include "anvil/core/parallel_for.h"

namespace anvil {

uint64_t name_key(std::string_view name) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t RngStream::key() const { return name_key(name) ^ (seed * 0x9E3779B97F4A7C15ull); }

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_lo, uint64_t counter_hi) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(M0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(M1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += W0;
    k1 += W1;
  }
  return {c0, c1, c2, c3};
}

namespace {
// 24 random bits -> [0, 1), exactly representable in float.
inline float bits_to_unit(uint32_t w) { return static_cast<float>(w >> 8) * (1.0f / 16777216.0f); }

// Box-Muller on two words of one Philox block; `draw` selects further blocks.
inline float normal_at(uint64_t key, uint64_t index, uint64_t draw) {
  const auto w = philox4x32(key, index, draw);
  const double u1 = (static_cast<double>(w[0] >> 8) + 1.0) / 16777217.0;  // (0, 1): log is finite
  const double u2 = static_cast<double>(w[1] >> 8) / 16777216.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

template <class F>
void fill_with(Tensor& t, int64_t offset, F&& value_at) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::f32) {
    float* p = t.data<float>();
    parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) p[i] = value_at(static_cast<uint64_t>(offset + i));
    });
  } else {
    bf16* p = t.data<bf16>();
    parallel_for(0, n, 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) p[i] = from_f32<bf16>(value_at(static_cast<uint64_t>(offset + i)));
    });
  }
}
}  // namespace

float uniform01(uint64_t key, uint64_t index) { return bits_to_unit(philox4x32(key, index)[0]); }
float standard_normal(uint64_t key, uint64_t index) { return normal_at(key, index, 0); }

void fill_uniform(Tensor& t, RngStream s, float lo, float hi, int64_t offset) {
  const uint64_t key = s.key();
  fill_with(t, offset, [&](uint64_t i) { return lo + (hi - lo) * uniform01(key, i); });
}

void fill_normal(Tensor& t, RngStream s, float mean, float std, int64_t offset) {
  const uint64_t key = s.key();
  fill_with(t, offset, [&](uint64_t i) { return mean + std * normal_at(key, i, 0); });
}

void fill_trunc_normal(Tensor& t, RngStream s, float mean, float std, float a, float b, int64_t offset) {
  ANVIL_CHECK(a < b, "truncated normal needs a < b, got a=", a, " b=", b);
  const uint64_t key = s.key();
  fill_with(t, offset, [&](uint64_t i) {
    for (uint64_t draw = 0;; ++draw) {
      const float z = normal_at(key, i, draw);
      if (z >= a && z <= b) return mean + std * z;
      if (draw > 1000) return mean + std * std::clamp(z, a, b);  // unreachable for sane bounds
    }
  });
}

}  // namespace anvil
