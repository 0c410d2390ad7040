// Document sources: the text a tokenizer reads, one document at a time.
//
// Inputs are files, directories (every regular file below, sorted) and POSIX glob
// patterns. A file is JSON Lines in C4's shape ({"text": ...} per line, the field
// name configurable) when its name ends in .json, .jsonl, .json.gz or .jsonl.gz;
// anything else is plain text, one document per file. Every file is opened with
// zlib's gzread, which reads gzip data and passes plain files through unchanged,
// so C4's published .json.gz files need no unpacking.
//
// Bad input (a missing file, an empty file, invalid JSON on a line, a line without
// the text field, corrupt gzip data) throws anvil::Error naming the file and line,
// or, with skip_bad, is skipped and counted in SourceStats.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

struct gzFile_s;  // zlib's handle, kept out of this header

namespace anvil {

struct SourceOptions {
  std::string text_field = "text";  // the JSON Lines field holding a document
  bool skip_bad = false;            // skip and count bad input instead of throwing
  // What an error on bad input tells the user to do (the caller's own keys or flags).
  std::string bad_input_hint = "fix or remove it, or pass --skip-bad to skip and count bad input";
  std::string text_field_hint = "set the field name with --text-field";
};

// What was read, and what was skipped for which reason (only with skip_bad).
struct SourceStats {
  int64_t files = 0;      // files opened
  int64_t documents = 0;  // documents returned
  int64_t missing_files = 0;        // named or matched by no file
  int64_t empty_files = 0;          // no bytes (after decompression)
  int64_t invalid_json_lines = 0;   // lines that are not JSON
  int64_t missing_field_lines = 0;  // JSON without a string text field
  int64_t unreadable_files = 0;     // corrupt gzip data or a read error
  int64_t skipped() const {
    return missing_files + empty_files + invalid_json_lines + missing_field_lines + unreadable_files;
  }
};

// True for names JSON Lines documents are read from (.json, .jsonl, optionally .gz).
bool is_json_lines_path(const std::string& path);

// Files, directories and glob patterns -> the files they name, in order: each input's
// files sorted by name, inputs in the order given, duplicates dropped.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs, const SourceOptions& opts,
                                       SourceStats& stats);

// The documents of one file, in order.
class FileDocuments {
 public:
  FileDocuments(std::string path, const SourceOptions& opts, SourceStats& stats);
  ~FileDocuments();
  FileDocuments(const FileDocuments&) = delete;
  FileDocuments& operator=(const FileDocuments&) = delete;

  // The next document's text; false at the end of the file.
  bool next(std::string& text);
  // 1-based line of the document last returned (JSON Lines), for messages.
  int64_t line() const { return line_; }
  // Bytes of the file on disk consumed so far (compressed bytes for gzip).
  int64_t file_offset() const;
  const std::string& path() const { return path_; }

 private:
  bool read_line(std::string& line);  // false at the end of the file
  bool fill();                        // reads more bytes into buf_; false at the end
  void bad(int64_t& counter, const std::string& message);

  std::string path_;
  SourceOptions opts_;
  SourceStats& stats_;
  gzFile_s* gz_ = nullptr;
  bool json_lines_ = false;
  bool done_ = false;
  bool eof_ = false;
  int64_t line_ = 0;
  int64_t bytes_ = 0;  // decompressed bytes read
  std::string buf_;
  size_t pos_ = 0;
};

// Every document of every input, in order.
class DocumentSource {
 public:
  DocumentSource(const std::vector<std::string>& inputs, SourceOptions opts);
  ~DocumentSource();

  bool next(std::string& text);
  const std::vector<std::string>& files() const { return files_; }
  const SourceStats& stats() const { return stats_; }
  // On-disk sizes, for progress: all inputs, and what has been consumed.
  int64_t total_bytes() const { return total_bytes_; }
  int64_t bytes_done() const;
  // "path:line" of the document last returned.
  std::string where() const;

 private:
  SourceOptions opts_;
  SourceStats stats_;
  std::vector<std::string> files_;
  std::vector<int64_t> sizes_;
  int64_t total_bytes_ = 0;
  int64_t finished_bytes_ = 0;
  size_t next_file_ = 0;
  std::unique_ptr<FileDocuments> current_;
};

}  // namespace anvil
