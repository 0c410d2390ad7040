#include "anvil/data/text_source.h"

#include <glob.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "anvil/core/error.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// Reports a missing input: throws, or counts it when skipping.
void missing(const std::string& message, const SourceOptions& opts, SourceStats& stats) {
  ANVIL_CHECK(opts.skip_bad, message, "; ", opts.bad_input_hint);
  ++stats.missing_files;
}

// nlohmann's message without its "[json.exception.parse_error.101] " prefix.
std::string parse_message(const std::string& what) {
  const size_t close = what.find("] ");
  return close == std::string::npos ? what : what.substr(close + 2);
}

}  // namespace

bool is_json_lines_path(const std::string& path) {
  for (const char* ext : {".json", ".jsonl", ".json.gz", ".jsonl.gz"})
    if (ends_with(path, ext)) return true;
  return false;
}

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs, const SourceOptions& opts,
                                       SourceStats& stats) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  auto add = [&](std::vector<std::string> files) {
    std::sort(files.begin(), files.end());
    for (auto& f : files)
      if (seen.insert(f).second) out.push_back(std::move(f));
  };
  for (const std::string& input : inputs) {
    std::error_code ec;
    if (fs::is_directory(input, ec)) {
      std::vector<std::string> files;
      for (const auto& e : fs::recursive_directory_iterator(input, fs::directory_options::follow_directory_symlink))
        if (e.is_regular_file()) files.push_back(e.path().string());
      if (files.empty()) missing("the directory " + input + " holds no files", opts, stats);
      add(std::move(files));
    } else if (fs::exists(input, ec)) {
      add({input});
    } else if (has_glob_chars(input)) {
      glob_t g{};
      const int rc = glob(input.c_str(), GLOB_NOSORT, nullptr, &g);
      std::vector<std::string> files;
      if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i)
          if (fs::is_regular_file(g.gl_pathv[i], ec)) files.emplace_back(g.gl_pathv[i]);
      globfree(&g);
      if (files.empty()) missing("no file matches the pattern " + input, opts, stats);
      add(std::move(files));
    } else {
      missing(input + ": no such file or directory", opts, stats);
    }
  }
  return out;
}

FileDocuments::FileDocuments(std::string path, const SourceOptions& opts, SourceStats& stats)
    : path_(std::move(path)), opts_(opts), stats_(stats), json_lines_(is_json_lines_path(path_)) {
  gz_ = gzopen(path_.c_str(), "rb");
  if (gz_ == nullptr) {
    missing(path_ + ": cannot open (" + std::strerror(errno) + ")", opts_, stats_);
    done_ = true;
    return;
  }
  gzbuffer(gz_, 1 << 17);
  ++stats_.files;
}

FileDocuments::~FileDocuments() {
  if (gz_ != nullptr) gzclose(gz_);
}

int64_t FileDocuments::file_offset() const {
  return gz_ == nullptr ? 0 : static_cast<int64_t>(gzoffset(gz_));
}

void FileDocuments::bad(int64_t& counter, const std::string& message) {
  ANVIL_CHECK(opts_.skip_bad, message, "; ", opts_.bad_input_hint);
  ++counter;
}

bool FileDocuments::fill() {
  if (eof_) return false;
  constexpr size_t kChunk = 1 << 20;
  if (pos_ > 0) {  // keep only the unread tail
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  const size_t old = buf_.size();
  buf_.resize(old + kChunk);
  const int n = gzread(gz_, buf_.data() + old, static_cast<unsigned>(kChunk));
  if (n < 0) {
    int code = 0;
    const std::string msg = gzerror(gz_, &code);
    buf_.resize(old);
    eof_ = true;
    done_ = true;
    bad(stats_.unreadable_files, path_ + ": cannot read after " + std::to_string(bytes_) +
                                     " decompressed bytes (" + msg + "; the file is corrupt or truncated)");
    return false;
  }
  buf_.resize(old + static_cast<size_t>(n));
  bytes_ += n;
  if (static_cast<size_t>(n) < kChunk) {
    // At the end of the input zlib reports Z_BUF_ERROR when it stopped inside a gzip stream.
    int code = Z_OK;
    const std::string msg = gzerror(gz_, &code);
    if (code == Z_BUF_ERROR) {
      eof_ = true;
      done_ = true;
      bad(stats_.unreadable_files, path_ + ": cannot read after " + std::to_string(bytes_) +
                                       " decompressed bytes (the gzip data ends early: " + msg + "; the file is truncated)");
      return false;
    }
  }
  if (n == 0) eof_ = true;
  return n > 0;
}

bool FileDocuments::read_line(std::string& line) {
  for (;;) {
    const size_t nl = buf_.find('\n', pos_);
    if (nl != std::string::npos) {
      line.assign(buf_, pos_, nl - pos_);
      pos_ = nl + 1;
      break;
    }
    if (!fill()) {
      if (done_ || pos_ >= buf_.size()) return false;
      line.assign(buf_, pos_, std::string::npos);  // the last line has no newline
      pos_ = buf_.size();
      break;
    }
  }
  if (!line.empty() && line.back() == '\r') line.pop_back();
  ++line_;
  return true;
}

bool FileDocuments::next(std::string& text) {
  if (done_) return false;
  if (!json_lines_) {  // the whole file is one document
    while (fill()) {
    }
    const bool failed = done_;  // fill() marks a read error (skipped) as done
    done_ = true;
    if (failed) return false;
    if (buf_.empty()) {
      bad(stats_.empty_files, path_ + ": the file is empty");
      return false;
    }
    text.assign(buf_, pos_, std::string::npos);
    buf_.clear();
    pos_ = 0;
    line_ = 1;
    ++stats_.documents;
    return true;
  }
  std::string line;
  while (read_line(line)) {
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines separate nothing
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      bad(stats_.invalid_json_lines,
          path_ + ":" + std::to_string(line_) + ": invalid JSON (" + parse_message(e.what()) + ")");
      continue;
    }
    const auto field = doc.is_object() ? doc.find(opts_.text_field) : doc.end();
    if (!doc.is_object() || field == doc.end() || !field->is_string()) {
      bad(stats_.missing_field_lines, path_ + ":" + std::to_string(line_) + ": no string field \"" +
                                          opts_.text_field + "\" (" + opts_.text_field_hint + ")");
      continue;
    }
    text = field->get<std::string>();
    ++stats_.documents;
    return true;
  }
  if (!done_ && bytes_ == 0) bad(stats_.empty_files, path_ + ": the file is empty");
  done_ = true;
  return false;
}

DocumentSource::DocumentSource(const std::vector<std::string>& inputs, SourceOptions opts) : opts_(std::move(opts)) {
  files_ = expand_inputs(inputs, opts_, stats_);
  for (const auto& f : files_) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    sizes_.push_back(ec ? 0 : static_cast<int64_t>(size));
    total_bytes_ += sizes_.back();
  }
}

DocumentSource::~DocumentSource() = default;

bool DocumentSource::next(std::string& text) {
  for (;;) {
    if (current_ != nullptr) {
      if (current_->next(text)) return true;
      finished_bytes_ += sizes_[next_file_ - 1];
      current_.reset();
    }
    if (next_file_ >= files_.size()) return false;
    current_ = std::make_unique<FileDocuments>(files_[next_file_++], opts_, stats_);
  }
}

int64_t DocumentSource::bytes_done() const {
  return finished_bytes_ + (current_ != nullptr ? current_->file_offset() : 0);
}

std::string DocumentSource::where() const {
  return current_ == nullptr ? std::string() : current_->path() + ":" + std::to_string(current_->line());
}

}  // namespace anvil
