#include "anvil/core/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

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
                      const std::map<std::string, std::string>& metadata, const WriteProgress& progress) {
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
    for (size_t at = 0; ok && at < t.nbytes(); at += kPiece) {
      const size_t len = std::min(kPiece, t.nbytes() - at);
      ok = std::fwrite(p + at, 1, len, f) == len;
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

SafetensorsFile load_safetensors(const std::string& path, MemCategory category) {
  std::ifstream in(path, std::ios::binary);
  ANVIL_CHECK(in.good(), "cannot read '", path, "': ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  ANVIL_CHECK(in.good() && header_len <= file_size - 8, "'", path,
              "' is not a safetensors file (bad header length); is it truncated?");
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", path, "': the safetensors header is not valid JSON: ", e.what()));
  }
  const uint64_t data_start = 8 + header_len;
  SafetensorsFile out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.items()) out.metadata[k] = v.get<std::string>();
      continue;
    }
    const std::string dt = entry.at("dtype").get<std::string>();
    DType dtype;
    if (dt == "F32") dtype = DType::f32;
    else if (dt == "BF16") dtype = DType::bf16;
    else if (dt == "I32") dtype = DType::i32;
    else throw Error(detail::concat("'", path, "': tensor '", name, "' has dtype ", dt, "; Anvil reads F32, BF16, I32"));
    const Shape shape = entry.at("shape").get<Shape>();
    const auto range = entry.at("data_offsets").get<std::vector<uint64_t>>();
    Tensor t = Tensor::empty(shape, dtype, category, name);
    ANVIL_CHECK(range.size() == 2 && range[1] - range[0] == t.nbytes() && data_start + range[1] <= file_size, "'",
                path, "': tensor '", name, "' has a byte range that does not match its shape ", shape_str(shape),
                " or the file size; the file is corrupt or truncated");
    in.seekg(static_cast<std::streamoff>(data_start + range[0]));
    in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
    ANVIL_CHECK(in.good(), "'", path, "': reading tensor '", name, "' failed");
    out.tensors.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace anvil
