// Every rank must train with the same configuration: a rank started with a
// different file or override would silently disagree on shapes, learning rate
// or data order, and typically hang in the first collective instead of failing.
// Each rank hashes its configuration text; the hashes are all-gathered, and a
// difference stops every rank with the same message, naming the odd ranks.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "anvil/distributed/comm.h"

namespace anvil {

// 64-bit FNV-1a: simple, and the same on every platform and build, unlike
// std::hash.
uint64_t config_hash(std::string_view text);

// nullopt when every rank's hash is the same; otherwise the message naming the
// ranks that differ from the most common hash (on a tie, rank 0's). A pure
// function of the gathered hashes, so every rank words it identically.
std::optional<std::string> config_mismatch(const std::vector<uint64_t>& hash_per_rank);

// Collective over `world`: throws anvil::Error with config_mismatch's message
// on every rank when the ranks' texts differ.
void check_same_config(Communicator& world, std::string_view config_text);

}  // namespace anvil
