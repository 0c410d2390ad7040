#include "anvil/obs/allocation_log.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {
MemCategory category_named(const std::string& name, const std::string& where) {
  for (int c = 0; c < kNumMemCategories; ++c)
    if (name == category_name(static_cast<MemCategory>(c))) return static_cast<MemCategory>(c);
  throw Error(detail::concat(where, ": unknown memory category '", name, "'"));
}
}  // namespace

void write_allocation_log(const std::string& path, const std::vector<MemEvent>& events) {
  std::string text;
  for (const MemEvent& e : events) {
    const nlohmann::json j{{"event", e.is_alloc ? "alloc" : "free"},
                           {"tag", e.tag},
                           {"category", category_name(e.category)},
                           {"bytes", e.bytes}};
    text += j.dump() + "\n";
  }
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  write_file_durably(path, text);
}

std::vector<MemEvent> read_allocation_log(const std::string& path) {
  std::ifstream in(path);
  ANVIL_CHECK(in.good(), "cannot read the allocation log '", path, "'");
  std::vector<MemEvent> events;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = detail::concat(path, ":", n);
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      MemEvent e{};
      e.is_alloc = j.at("event").get<std::string>() == "alloc";
      e.tag = j.at("tag").get<std::string>();
      e.category = category_named(j.at("category").get<std::string>(), where);
      e.bytes = j.at("bytes").get<size_t>();
      events.push_back(std::move(e));
    } catch (const nlohmann::json::exception& ex) {
      throw Error(detail::concat(where, ": not an allocation log line (", ex.what(), ")"));
    }
  }
  return events;
}

}  // namespace anvil
