// Training curves (loss, learning rate, gradient norm, throughput, memory) as
// TensorBoard scalar event files, written without TensorFlow or protobuf.
//
// The file is a TFRecord stream: records of
//   uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data
// (all little-endian), where each record's data is a serialized tensorflow.Event
// message (event.proto / summary.proto). The first record carries only
// file_version "brain.Event:2", which TensorBoard reads to pick its loader;
// every later one holds one scalar.
//
// Not thread-safe; under MPI only one rank should log (each rank's file has its
// own name, so several would not clobber each other, only duplicate curves).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace anvil {

class TensorBoardWriter {
 public:
  // Creates log_dir (and its parents) and in it the file
  // events.out.tfevents.<unix seconds>.<hostname>.<pid>.anvil, then writes the
  // file_version record. A second writer in the same process, second and folder
  // gets ".1", ".2", ... appended instead of truncating the first one's file.
  // Throws anvil::Error naming the path and the system's reason.
  explicit TensorBoardWriter(const std::string& log_dir);
  // Closes the file; a failure can only be reported on stderr here, so call
  // flush() first where a lost tail must be an error.
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One point of the curve `tag` at training step `step`. TensorBoard stores
  // scalars as float32, so `value` is rounded to float (beyond float's range it
  // becomes ±inf; NaN stays NaN). wall_time is in seconds since the Unix epoch;
  // the first overload uses the current time.
  void add_scalar(const std::string& tag, double value, int64_t step);
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time);

  // Hands buffered records to the operating system, so a TensorBoard reading
  // the file sees them; no fsync, since surviving a machine crash is not needed.
  void flush();

  const std::string& path() const { return path_; }

 private:
  void write_record(std::string_view data);

  std::string path_;
  std::FILE* file_ = nullptr;
  // After a failed write the file may end in a torn record; appending more after
  // it would make everything that follows unreadable, so the writer stops.
  bool failed_ = false;
};

}  // namespace anvil
