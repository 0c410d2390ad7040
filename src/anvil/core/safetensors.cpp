#include "anvil/core/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "anvil/core/device.h"

namespace anvil {

namespace {
const char* st_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
  }
  return "?";
}
}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata, const WriteProgress& progress,
                      const Tensor& staging) {
  for (const auto& [name, t] : tensors)
    ANVIL_CHECK(t.device().is_cpu() || (staging.defined() && staging.device().is_cpu() && staging.nbytes() > 0),
                "save_safetensors: ", name, " is on ", t.device().str(), " and no host staging buffer was given");
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", st_dtype(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  ANVIL_CHECK(f != nullptr, "cannot write '", tmp, "': ", std::strerror(errno));
  errno = 0;
  const uint64_t n = text.size();
  bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  // In pieces, so a long write can report progress.
  constexpr size_t kPiece = size_t{64} << 20;
  size_t written = 0;
  for (const auto& [name, t] : tensors) {
    const char* p = static_cast<const char*>(t.raw());
    const bool on_gpu = !t.device().is_cpu();
    const size_t piece = on_gpu ? std::min(kPiece, staging.nbytes()) : kPiece;
    for (size_t at = 0; ok && at < t.nbytes(); at += piece) {
      const size_t len = std::min(piece, t.nbytes() - at);
      const char* bytes = p + at;
      if (on_gpu) {  // returns with the bytes on the host
        device_runtime(t.device()).copy(staging.raw(), Device::cpu(), bytes, t.device(), len);
        bytes = static_cast<const char*>(staging.raw());
      }
      ok = std::fwrite(bytes, 1, len, f) == len;
      written += len;
      if (ok && progress) progress(written, offset);
    }
  }
  ok = (std::fflush(f) == 0) && ok;
  const int write_errno = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    const std::string reason = std::strerror(write_errno != 0 ? write_errno : errno);
    std::remove(tmp.c_str());  // a partial file only takes space a retry would need
    throw Error(detail::concat("writing '", tmp, "' failed: ", reason));
  }
  ANVIL_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
              "': ", std::strerror(errno));
}

namespace {
// Bytes per element of the format's dtypes; 0 for a name it does not define.
uint64_t st_element_size(const std::string& dt) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  auto it = sizes.find(dt);
  return it == sizes.end() ? 0 : it->second;
}
}  // namespace

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)), in_(path_, std::ios::binary) {
  ANVIL_CHECK(in_.good(), "cannot read '", path_, "': ", std::strerror(errno));
  in_.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in_.tellg());
  in_.seekg(0);
  uint64_t header_len = 0;
  in_.read(reinterpret_cast<char*>(&header_len), 8);
  ANVIL_CHECK(in_.good() && file_size >= 8 && header_len <= file_size - 8, "'", path_,
              "' is not a safetensors file (bad header length); is it truncated?");
  std::string text(header_len, '\0');
  in_.read(text.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", path_, "': the safetensors header is not valid JSON: ", e.what()));
  }
  const uint64_t data_start = 8 + header_len;
  try {
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        for (const auto& [k, v] : entry.items()) metadata_[k] = v.get<std::string>();
        continue;
      }
      SafetensorsEntry e;
      e.dtype = entry.at("dtype").get<std::string>();
      e.shape = entry.at("shape").get<Shape>();
      const auto range = entry.at("data_offsets").get<std::vector<uint64_t>>();
      const uint64_t elem = st_element_size(e.dtype);
      const bool fits = range.size() == 2 && range[0] <= range[1] && range[1] <= file_size - data_start &&
                        (elem == 0 || range[1] - range[0] == static_cast<uint64_t>(shape_numel(e.shape)) * elem);
      ANVIL_CHECK(fits, "'", path_, "': tensor '", name, "' has a byte range that does not match its shape ",
                  shape_str(e.shape), " or the file size; the file is corrupt or truncated");
      e.begin = data_start + range[0];
      e.end = data_start + range[1];
      entries_.emplace(name, std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", path_, "': malformed safetensors header: ", e.what()));
  }
}

void SafetensorsReader::read(const std::string& name, void* dst) {
  auto it = entries_.find(name);
  ANVIL_CHECK(it != entries_.end(), "'", path_, "' has no tensor '", name, "'");
  in_.clear();
  in_.seekg(static_cast<std::streamoff>(it->second.begin));
  in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(it->second.nbytes()));
  ANVIL_CHECK(in_.good(), "'", path_, "': reading tensor '", name, "' failed");
}

SafetensorsFile load_safetensors(const std::string& path, MemCategory category) {
  SafetensorsReader reader(path);
  SafetensorsFile out;
  out.metadata = reader.metadata();
  for (const auto& [name, entry] : reader.entries()) {
    DType dtype;
    if (entry.dtype == "F32") dtype = DType::f32;
    else if (entry.dtype == "BF16") dtype = DType::bf16;
    else if (entry.dtype == "I32") dtype = DType::i32;
    else throw Error(detail::concat("'", path, "': tensor '", name, "' has dtype ", entry.dtype, "; Anvil reads F32, BF16, I32"));
    Tensor t = Tensor::empty(entry.shape, dtype, category, name);
    reader.read(name, t.raw());
    out.tensors.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace anvil
