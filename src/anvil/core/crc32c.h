// CRC-32C (Castagnoli polynomial, bit-reflected form 0x82F63B78): the checksum
// of TFRecord framing (TensorBoard event files), also used by iSCSI and ext4.
// It has its own instruction on x86 since SSE4.2, unlike the zlib CRC-32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace anvil {

// The CRC-32C of `size` bytes. Passing a previous result as `crc` continues it,
// so crc32c(b, nb, crc32c(a, na)) equals the CRC of a followed by b.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
inline uint32_t crc32c(std::string_view bytes, uint32_t crc = 0) { return crc32c(bytes.data(), bytes.size(), crc); }

namespace detail {
// The table-driven version crc32c() falls back to without SSE4.2; exposed so
// tests check it on machines where the hardware path is the one compiled in.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);
}  // namespace detail

}  // namespace anvil
