#include "anvil/core/crc32c.h"

#include <array>
#include <cstring>

#ifdef __SSE4_2__
#include <nmmintrin.h>
#endif

namespace anvil {

namespace {

// table[b] is the CRC register after shifting byte b through it from zero: one
// lookup replaces eight bit steps.
constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1u) ? (r >> 1) ^ 0x82F63B78u : r >> 1;
    table[b] = r;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

}  // namespace

namespace detail {

uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  // The register starts (and ends) inverted, so leading zero bytes still count.
  uint32_t r = ~crc;
  for (size_t i = 0; i < size; ++i) r = kTable[(r ^ p[i]) & 0xFFu] ^ (r >> 8);
  return ~r;
}

}  // namespace detail

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
#ifdef __SSE4_2__
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t r = ~crc;
  // Eight bytes per instruction; memcpy because the buffer need not be aligned.
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    r = _mm_crc32_u64(r, word);
  }
  auto r32 = static_cast<uint32_t>(r);
  for (; size > 0; --size, ++p) r32 = _mm_crc32_u8(r32, *p);
  return ~r32;
#else
  return detail::crc32c_portable(data, size, crc);
#endif
}

}  // namespace anvil
