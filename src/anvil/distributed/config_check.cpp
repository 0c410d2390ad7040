#include "anvil/distributed/config_check.h"

#include <algorithm>
#include <cstdio>

namespace anvil {

namespace {

std::string hex(uint64_t h) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// "rank 3" or "ranks 0-2, 5": runs of consecutive ranks collapse, so a
// thousand-rank job still gets a one-line message.
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return out;
}

}  // namespace

uint64_t config_hash(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ull;  // FNV-1a 64 prime
  }
  return h;
}

std::optional<std::string> config_mismatch(const std::vector<uint64_t>& hash_per_rank) {
  // The distinct hashes with their ranks, in order of each hash's first rank.
  struct Group {
    uint64_t hash;
    std::vector<int> ranks;
  };
  std::vector<Group> groups;
  for (size_t r = 0; r < hash_per_rank.size(); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.hash == hash_per_rank[r]; });
    if (it == groups.end()) it = groups.insert(groups.end(), Group{hash_per_rank[r], {}});
    it->ranks.push_back(static_cast<int>(r));
  }
  if (groups.size() <= 1) return std::nullopt;

  // The most common hash is taken as the intended one; a strict > keeps the
  // earliest group (rank 0's) on a tie.
  size_t reference = 0;
  for (size_t i = 1; i < groups.size(); ++i)
    if (groups[i].ranks.size() > groups[reference].ranks.size()) reference = i;

  std::string msg = "the ranks did not all start with the same configuration: ";
  bool first = true;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i == reference) continue;
    const auto& g = groups[i];
    msg += detail::concat(first ? "" : "; ", rank_list(g.ranks), g.ranks.size() == 1 ? " has" : " have",
                          " configuration hash ", hex(g.hash));
    first = false;
  }
  const auto& agree = groups[reference];
  msg += detail::concat(", where ", rank_list(agree.ranks), agree.ranks.size() == 1 ? " has " : " have ",
                        hex(agree.hash), "; start every rank with the same config file and --section.key overrides");
  return msg;
}

void check_same_config(Communicator& world, std::string_view config_text) {
  // Two 32-bit halves, so the hash travels as an i32 tensor like any payload.
  const uint64_t h = config_hash(config_text);
  Tensor mine = Tensor::empty({1, 2}, DType::i32, MemCategory::communication, "config_hash");
  mine.data<int32_t>()[0] = static_cast<int32_t>(static_cast<uint32_t>(h));
  mine.data<int32_t>()[1] = static_cast<int32_t>(static_cast<uint32_t>(h >> 32));
  Tensor all = Tensor::empty({world.size(), 2}, DType::i32, MemCategory::communication, "config_hashes");
  world.all_gather(mine, all);
  std::vector<uint64_t> hashes(static_cast<size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) {
    const auto lo = static_cast<uint32_t>(all.data<int32_t>()[2 * r]);
    const auto hi = static_cast<uint32_t>(all.data<int32_t>()[2 * r + 1]);
    hashes[static_cast<size_t>(r)] = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  if (auto msg = config_mismatch(hashes)) throw Error(*msg);
}

}  // namespace anvil
