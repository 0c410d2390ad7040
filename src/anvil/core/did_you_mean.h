// "Did you mean": the known word nearest a mistyped one, by edit distance
// (Levenshtein: insertions, deletions and substitutions each cost 1). The
// configuration's unknown keys and the command line's unknown commands both
// answer with it.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace anvil {

// The fewest single-character edits that turn `a` into `b`.
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate nearest `wanted` (the first of equals), or "" when even that
// one is more than `max_distance` edits away: a suggestion that far off would
// mislead more than help. Pass SIZE_MAX to always get the nearest.
std::string nearest_word(const std::vector<std::string>& candidates, const std::string& wanted, size_t max_distance);

}  // namespace anvil
