// Element types: f32 and bf16 (bf16 storage, f32 arithmetic) for values;
// i32 for token ids and targets.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace anvil {

enum class DType : uint8_t { f32, bf16, i32 };

constexpr size_t dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }
constexpr const char* dtype_name(DType t) {
  return t == DType::f32 ? "f32" : t == DType::bf16 ? "bf16" : "i32";
}

// bfloat16: the top 16 bits of an IEEE float. Conversion from float rounds to
// nearest even, as hardware (AMX, AVX512-BF16) and PyTorch do; NaN stays NaN.
struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bf16) == 2);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::f32; }
template <>
constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <>
constexpr DType dtype_of<int32_t>() { return DType::i32; }

// Load/store helpers so kernels can be written once for float and bf16 storage.
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16::to_float(x.bits); }
template <class T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline bf16 from_f32<bf16>(float x) { bf16 r; r.bits = bf16::from_float(x); return r; }

// IEEE binary16 (sign, 5 exponent bits, 10 mantissa bits), which Anvil only
// reads (Llama 2's Hugging Face checkpoints are stored in it). Every f16 value,
// subnormals, infinities and NaN included, is exactly representable in f32.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
  } else if (exp != 0) {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;  // ±0
  } else {  // subnormal mant·2^-24: shift the leading 1 into the implicit bit
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) mant <<= 1, --exp;
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Bulk conversions, parallel over the cores.
void convert_f32_to_bf16(const float* src, bf16* dst, int64_t n);
void convert_bf16_to_f32(const bf16* src, float* dst, int64_t n);
void convert_f16_to_f32(const uint16_t* src, float* dst, int64_t n);

}  // namespace anvil
