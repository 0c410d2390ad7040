#include "anvil/obs/tensorboard.h"

#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "anvil/core/crc32c.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {

// --- Protobuf wire format, just the parts event.proto needs -----------------
// A field is a key varint (field_number << 3 | wire_type) followed by its value.
enum class Wire : uint32_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  // Seven bits per byte, least significant first; the high bit says "more follows".
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_fixed32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_fixed64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_key(std::string& out, uint32_t field, Wire wire) {
  put_varint(out, (uint64_t{field} << 3) | static_cast<uint32_t>(wire));
}

void put_double(std::string& out, uint32_t field, double v) {
  put_key(out, field, Wire::fixed64);
  put_fixed64(out, std::bit_cast<uint64_t>(v));
}

void put_float(std::string& out, uint32_t field, float v) {
  put_key(out, field, Wire::fixed32);
  put_fixed32(out, std::bit_cast<uint32_t>(v));
}

// int64 fields encode negative values as their 64-bit two's complement (ten bytes).
void put_int64(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, Wire::varint);
  put_varint(out, static_cast<uint64_t>(v));
}

// Strings and embedded messages alike: a length, then the bytes.
void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, Wire::length_delimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Field numbers from tensorflow/core/util/event.proto and framework/summary.proto.
namespace event_field {
constexpr uint32_t wall_time = 1, step = 2, file_version = 3, summary = 5;
}
namespace summary_field {
constexpr uint32_t value = 1;
}
namespace value_field {
constexpr uint32_t tag = 1, simple_value = 2;
}

std::string file_version_event(double wall_time) {
  std::string event;
  put_double(event, event_field::wall_time, wall_time);
  put_bytes(event, event_field::file_version, "brain.Event:2");
  return event;
}

std::string scalar_event(std::string_view tag, float value, int64_t step, double wall_time) {
  std::string summary_value;
  put_bytes(summary_value, value_field::tag, tag);
  put_float(summary_value, value_field::simple_value, value);
  std::string summary;
  put_bytes(summary, summary_field::value, summary_value);
  std::string event;
  put_double(event, event_field::wall_time, wall_time);
  put_int64(event, event_field::step, step);
  put_bytes(event, event_field::summary, summary);
  return event;
}

// --- TFRecord framing ---------------------------------------------------------
// TFRecord stores a rotated, offset CRC: the CRC of data that itself contains
// CRCs is otherwise prone to degenerate values (format's own rationale).
uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  put_fixed64(record, data.size());
  put_fixed32(record, masked_crc32c(record));  // covers the 8 length bytes
  record.append(data);
  put_fixed32(record, masked_crc32c(data));
  return record;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  ANVIL_CHECK(!log_dir.empty(), "the TensorBoard log folder is an empty path");
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  ANVIL_CHECK(!ec, "cannot create the TensorBoard log folder '", log_dir, "': ", ec.message());

  const double wall_time = now_seconds();
  const std::string base = (std::filesystem::path(log_dir) / "events.out.tfevents.").string() +
                           std::to_string(static_cast<int64_t>(wall_time)) + "." + host_name() + "." +
                           std::to_string(::getpid()) + ".anvil";
  // "x": fail rather than truncate when the name is taken (same process, same second).
  for (int n = 0; file_ == nullptr; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    file_ = std::fopen(path_.c_str(), "wbx");
    ANVIL_CHECK(file_ != nullptr || errno == EEXIST, "cannot create the TensorBoard event file '", path_,
                "': ", std::strerror(errno));
  }
  try {
    write_record(file_version_event(wall_time));
    flush();  // an empty run shows up in TensorBoard at once
  } catch (...) {
    std::fclose(file_);  // no destructor runs for a constructor that throws
    throw;
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (std::fclose(file_) != 0 && !failed_)
    std::fprintf(stderr,
                 "anvil: warning: closing the TensorBoard event file '%s' failed, its last scalars may be lost: %s\n",
                 path_.c_str(), std::strerror(errno));
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  add_scalar(tag, value, step, now_seconds());
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  // IEEE 754 rounding: out-of-range magnitudes become ±inf, which is what the curve should show.
  write_record(scalar_event(tag, static_cast<float>(value), step, wall_time));
}

void TensorBoardWriter::flush() {
  ANVIL_CHECK(!failed_, "the TensorBoard event file '", path_, "' had a failed write earlier; not writing more");
  const bool ok = std::fflush(file_) == 0;
  failed_ = !ok;
  ANVIL_CHECK(ok, "writing the TensorBoard event file '", path_, "' failed (disk full?): ", std::strerror(errno));
}

void TensorBoardWriter::write_record(std::string_view data) {
  ANVIL_CHECK(!failed_, "the TensorBoard event file '", path_, "' had a failed write earlier; not writing more");
  const std::string record = tfrecord(data);
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_) == record.size();
  failed_ = !ok;
  ANVIL_CHECK(ok, "writing the TensorBoard event file '", path_, "' failed (disk full?): ", std::strerror(errno));
}

}  // namespace anvil
