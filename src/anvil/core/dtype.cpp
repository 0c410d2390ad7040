#include "anvil/core/dtype.h"

#include "anvil/core/parallel_for.h"

namespace anvil {

void convert_f32_to_bf16(const float* src, bf16* dst, int64_t n) {
  parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i].bits = bf16::from_float(src[i]);
  });
}

void convert_bf16_to_f32(const bf16* src, float* dst, int64_t n) {
  parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = bf16::to_float(src[i].bits);
  });
}

void convert_f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = f16_to_f32(src[i]);
  });
}

}  // namespace anvil
