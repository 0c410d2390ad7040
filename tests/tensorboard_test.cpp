// TensorBoard event files written by TensorBoardWriter, read back by a decoder
// of this file's own: a bit-at-a-time CRC-32C (the library's is table-driven or
// the SSE4.2 instruction), unmasking instead of masking, and a general protobuf
// field parser. A mistake shared by the writer's encoder and this decoder would
// have to be made twice, in two different ways.
#include "anvil/obs/tensorboard.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "anvil/core/crc32c.h"
#include "anvil/core/error.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

// --- The test's own decoder ----------------------------------------------------

// Straight from the definition: shift one bit at a time, xor-ing in the
// reflected Castagnoli polynomial whenever a one falls off the end.
uint32_t bitwise_crc32c(std::string_view bytes) {
  uint32_t r = 0xFFFFFFFFu;
  for (const char c : bytes) {
    r ^= static_cast<unsigned char>(c);
    for (int k = 0; k < 8; ++k) r = (r >> 1) ^ (0x82F63B78u & (0u - (r & 1u)));
  }
  return r ^ 0xFFFFFFFFu;
}

// The inverse of TFRecord's mask ((crc >> 15 | crc << 17) + 0xa282ead8), so the
// decoder compares raw CRCs rather than repeating the writer's masking.
uint32_t unmask(uint32_t masked) {
  const uint32_t rotated = masked - 0xa282ead8u;
  return (rotated << 15) | (rotated >> 17);
}

struct DecodeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

uint64_t little_endian(std::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = bytes.size(); i-- > 0;) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
  return v;
}

std::string at(size_t offset) { return " at byte " + std::to_string(offset); }

// The data of every record of a TFRecord stream, each one's two CRCs verified.
std::vector<std::string> read_tfrecords(std::string_view file) {
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < file.size()) {
    if (file.size() - pos < 12) throw DecodeError("truncated record header" + at(pos));
    const std::string_view length_bytes = file.substr(pos, 8);
    if (unmask(static_cast<uint32_t>(little_endian(file.substr(pos + 8, 4)))) != bitwise_crc32c(length_bytes))
      throw DecodeError("length CRC mismatch" + at(pos));
    const uint64_t length = little_endian(length_bytes);
    pos += 12;
    if (file.size() - pos < 4 || length > file.size() - pos - 4) throw DecodeError("truncated record data" + at(pos));
    const std::string_view data = file.substr(pos, length);
    if (unmask(static_cast<uint32_t>(little_endian(file.substr(pos + length, 4)))) != bitwise_crc32c(data))
      throw DecodeError("data CRC mismatch" + at(pos));
    records.emplace_back(data);
    pos += length + 4;
  }
  return records;
}

// One protobuf field: its number, wire type, and either an integer payload
// (varint, fixed32, fixed64) or bytes (length-delimited).
struct Field {
  uint32_t number;
  uint32_t wire;
  uint64_t integer = 0;
  std::string_view bytes;
};

std::vector<Field> parse_message(std::string_view msg) {
  size_t pos = 0;
  const auto varint = [&]() -> uint64_t {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= msg.size()) throw DecodeError("varint runs past the end of the message");
      const auto b = static_cast<unsigned char>(msg[pos++]);
      v |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80u) == 0) return v;
    }
    throw DecodeError("varint longer than ten bytes");
  };
  const auto fixed = [&](size_t n) -> uint64_t {
    if (msg.size() - pos < n) throw DecodeError("fixed-width field runs past the end of the message");
    const uint64_t v = little_endian(msg.substr(pos, n));
    pos += n;
    return v;
  };
  std::vector<Field> fields;
  while (pos < msg.size()) {
    const uint64_t key = varint();
    Field f{static_cast<uint32_t>(key >> 3), static_cast<uint32_t>(key & 7), 0, {}};
    switch (f.wire) {
      case 0:
        f.integer = varint();
        break;
      case 1:
        f.integer = fixed(8);
        break;
      case 5:
        f.integer = fixed(4);
        break;
      case 2: {
        const uint64_t n = varint();
        if (n > msg.size() - pos) throw DecodeError("length-delimited field runs past the end of the message");
        f.bytes = msg.substr(pos, n);
        pos += n;
        break;
      }
      default:
        throw DecodeError("unknown wire type " + std::to_string(f.wire));
    }
    fields.push_back(f);
  }
  return fields;
}

struct Scalar {
  std::string tag;
  float value;
};

// The parts of tensorflow.Event the writer uses; any other field is an error,
// since the writer has no business emitting one.
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::optional<std::string> file_version;
  std::vector<Scalar> scalars;
};

Scalar decode_value(std::string_view msg) {
  std::optional<std::string> tag;
  std::optional<float> value;
  for (const Field& f : parse_message(msg)) {
    if (f.number == 1 && f.wire == 2)
      tag = std::string(f.bytes);
    else if (f.number == 2 && f.wire == 5)
      value = std::bit_cast<float>(static_cast<uint32_t>(f.integer));
    else
      throw DecodeError("unexpected Summary.Value field " + std::to_string(f.number));
  }
  if (!tag || !value) throw DecodeError("Summary.Value without tag or simple_value");
  return {*tag, *value};
}

Event decode_event(std::string_view msg) {
  Event e;
  for (const Field& f : parse_message(msg)) {
    if (f.number == 1 && f.wire == 1) {
      e.wall_time = std::bit_cast<double>(f.integer);
    } else if (f.number == 2 && f.wire == 0) {
      e.step = static_cast<int64_t>(f.integer);
    } else if (f.number == 3 && f.wire == 2) {
      e.file_version = std::string(f.bytes);
    } else if (f.number == 5 && f.wire == 2) {
      for (const Field& v : parse_message(f.bytes)) {
        if (v.number != 1 || v.wire != 2) throw DecodeError("unexpected Summary field " + std::to_string(v.number));
        e.scalars.push_back(decode_value(v.bytes));
      }
    } else {
      throw DecodeError("unexpected Event field " + std::to_string(f.number));
    }
  }
  return e;
}

std::vector<Event> decode_events(std::string_view file) {
  std::vector<Event> events;
  for (const std::string& r : read_tfrecords(file)) events.push_back(decode_event(r));
  return events;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A fresh, empty folder for one test.
fs::path test_dir(const std::string& name) {
  const fs::path dir = anvil::testing::scratch_root() / "tensorboard" / name;
  fs::remove_all(dir);
  return dir;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// --- CRC-32C ---------------------------------------------------------------------

TEST(Crc32c, KnownVectors) {
  // "123456789" is the standard check input; the 32-byte ones are RFC 3720's (iSCSI) test patterns.
  std::string incrementing(32, '\0'), decrementing(32, '\0');
  for (int i = 0; i < 32; ++i) {
    incrementing[static_cast<size_t>(i)] = static_cast<char>(i);
    decrementing[static_cast<size_t>(i)] = static_cast<char>(31 - i);
  }
  const std::vector<std::pair<std::string, uint32_t>> vectors = {
      {"123456789", 0xE3069283u},  {std::string(32, '\0'), 0x8A9136AAu}, {std::string(32, '\xFF'), 0x62A8AB43u},
      {incrementing, 0x46DD794Eu}, {decrementing, 0x113FDB5Cu},          {"", 0x00000000u},
  };
  for (const auto& [input, want] : vectors) {
    EXPECT_EQ(anvil::crc32c(input), want) << "input of " << input.size() << " bytes";
    EXPECT_EQ(anvil::detail::crc32c_portable(input.data(), input.size()), want) << input.size() << " bytes";
    EXPECT_EQ(bitwise_crc32c(input), want) << "test's own CRC, input of " << input.size() << " bytes";
  }
}

TEST(Crc32c, AgreesWithBitwiseAtEveryLengthAlignmentAndSplit) {
  // The hardware path takes 8 bytes at a time then single bytes: lengths 0..80
  // at every start offset within a word cover every head/tail combination.
  std::string buf(100, '\0');
  uint32_t x = 12345;
  for (char& c : buf) {
    x = x * 1103515245u + 12345u;
    c = static_cast<char>(x >> 24);
  }
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n <= 80; ++n) {
      const std::string_view s(buf.data() + offset, n);
      const uint32_t want = bitwise_crc32c(s);
      ASSERT_EQ(anvil::crc32c(s), want) << "offset " << offset << ", length " << n;
      ASSERT_EQ(anvil::detail::crc32c_portable(s.data(), s.size()), want) << "offset " << offset << ", length " << n;
      // Continuing a CRC over a split buffer gives the CRC of the whole.
      for (size_t split = 0; split <= n; split += 7) {
        EXPECT_EQ(anvil::crc32c(s.substr(split), anvil::crc32c(s.substr(0, split))), want) << "split " << split;
        EXPECT_EQ(anvil::detail::crc32c_portable(s.data() + split, n - split,
                                                 anvil::detail::crc32c_portable(s.data(), split)),
                  want)
            << "split " << split;
      }
    }
  }
}

// --- Event files -------------------------------------------------------------------

struct Logged {
  std::string tag;
  int64_t step;
  double value;
};

TEST(TensorBoardWriter, ScalarsRoundTripThroughIndependentDecoder) {
  const fs::path dir = test_dir("round_trip") / "run1";  // parents are created too
  const std::vector<std::string> tags = {
      "loss", "lr", "grad_norm", "tokens_per_s", "memory/peak_gib", "memory/activations_gib"};
  // Values a training run really produces at its edges: exact zero, negative
  // zero, negatives, tiny (including float subnormal), huge, beyond float
  // (becomes inf), inf and NaN (a diverged loss).
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> awkward = {0.0, -0.0, -3.5, 1e-30, 1e-40, 1e30, -2.5e38, 1e300, -1e300, inf, -inf, nan};
  std::vector<Logged> logged;
  const double t_before = now_seconds();
  anvil::TensorBoardWriter writer(dir.string());
  for (int64_t i = 0; i < 60; ++i) {
    const int64_t step = i * 25 + (i > 50 ? int64_t{1} << 33 : 0);  // late steps need 5-byte varints
    for (size_t t = 0; t < tags.size(); ++t) {
      const size_t k = static_cast<size_t>(i) * tags.size() + t;
      const double value = k % 7 == 3 ? awkward[(k / 7) % awkward.size()]
                                      : std::exp(-0.05 * static_cast<double>(i)) * static_cast<double>(t + 1) + 0.1 / 3;
      writer.add_scalar(tags[t], value, step);
      logged.push_back({tags[t], step, value});
    }
  }
  writer.flush();  // the writer stays open: flush alone must make the data readable
  const double t_after = now_seconds();

  ASSERT_EQ(fs::path(writer.path()).parent_path(), dir);
  const std::vector<Event> events = decode_events(read_file(writer.path()));
  ASSERT_EQ(events.size(), logged.size() + 1);

  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].scalars.empty());

  double previous_wall_time = 0;
  size_t inf_seen = 0, nan_seen = 0;
  for (size_t i = 0; i < logged.size(); ++i) {
    const Event& e = events[i + 1];
    const Logged& want = logged[i];
    ASSERT_EQ(e.scalars.size(), 1u) << "event " << i + 1;
    EXPECT_FALSE(e.file_version.has_value()) << "event " << i + 1;
    EXPECT_EQ(e.scalars[0].tag, want.tag) << "event " << i + 1;
    EXPECT_EQ(e.step, want.step) << "event " << i + 1;
    // Bit-exact, so -0.0 and NaN are checked too.
    EXPECT_EQ(bits(e.scalars[0].value), bits(static_cast<float>(want.value)))
        << "event " << i + 1 << ": " << want.tag << " = " << want.value;
    EXPECT_GE(e.wall_time, t_before) << "event " << i + 1;
    EXPECT_LE(e.wall_time, t_after) << "event " << i + 1;
    EXPECT_GE(e.wall_time, previous_wall_time) << "event " << i + 1;
    previous_wall_time = e.wall_time;
    if (std::abs(want.value) > 1e39) {
      EXPECT_TRUE(std::isinf(e.scalars[0].value)) << want.value << " is beyond float and shows as ±inf";
      EXPECT_EQ(std::signbit(e.scalars[0].value), std::signbit(want.value));
      ++inf_seen;
    }
    if (std::isnan(want.value)) {
      EXPECT_TRUE(std::isnan(e.scalars[0].value));
      ++nan_seen;
    }
  }
  // The awkward values really were among those logged.
  EXPECT_GT(inf_seen, 0u);
  EXPECT_GT(nan_seen, 0u);
  EXPECT_GE(events[0].wall_time, t_before);
  EXPECT_LE(events[0].wall_time, t_after);
}

TEST(TensorBoardWriter, EveryFlippedByteIsDetected) {
  const fs::path dir = test_dir("flipped");
  std::string path;
  {
    anvil::TensorBoardWriter writer(dir.string());
    writer.add_scalar("loss", 2.5, 10, 1.7e9);
    writer.add_scalar("lr", 3e-4, 10, 1.7e9);
    path = writer.path();
  }
  const std::string good = read_file(path);
  ASSERT_EQ(decode_events(good).size(), 3u);
  // Any change confined to one byte is within CRC-32C's guaranteed burst-error
  // detection, wherever it lands: length, its CRC, data, or the data's CRC.
  for (size_t i = 0; i < good.size(); ++i) {
    for (const unsigned char flip : {0x01, 0x80, 0xFF}) {
      std::string bad = good;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ flip);
      EXPECT_THROW(read_tfrecords(bad), DecodeError) << "byte " << i << " xor " << int{flip};
    }
  }
}

TEST(TensorBoardWriter, StepsAndTagsAtVarintBoundariesRoundTrip) {
  const fs::path dir = test_dir("varint");
  // Tags over 127 bytes need two-byte lengths at all three nesting levels.
  const std::string long_tag = "memory/" + std::string(300, 'x');
  const std::vector<int64_t> steps = {0, 127, 128, 16383, 16384, int64_t{1} << 35, std::numeric_limits<int64_t>::max(),
                                      -1};
  anvil::TensorBoardWriter writer(dir.string());
  for (size_t i = 0; i < steps.size(); ++i)
    writer.add_scalar(i % 2 ? long_tag : "loss", static_cast<double>(i) + 0.5, steps[i],
                      1.5e9 + 0.125 * static_cast<double>(i));
  writer.flush();
  const std::vector<Event> events = decode_events(read_file(writer.path()));
  ASSERT_EQ(events.size(), steps.size() + 1);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Event& e = events[i + 1];
    EXPECT_EQ(e.step, steps[i]);
    EXPECT_EQ(e.wall_time, 1.5e9 + 0.125 * static_cast<double>(i));  // exact: a double is stored whole
    ASSERT_EQ(e.scalars.size(), 1u);
    EXPECT_EQ(e.scalars[0].tag, i % 2 ? long_tag : "loss");
    EXPECT_EQ(e.scalars[0].value, static_cast<float>(i) + 0.5f);
  }
}

TEST(TensorBoardWriter, FileNameFormat) {
  const fs::path dir = test_dir("file_name");
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const double t_before = std::floor(now_seconds());
  const anvil::TensorBoardWriter writer(dir.string());
  const double t_after = now_seconds();

  const std::string name = fs::path(writer.path()).filename().string();
  const std::string prefix = "events.out.tfevents.";
  const std::string suffix = std::string(".") + host + "." + std::to_string(::getpid()) + ".anvil";
  ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
  ASSERT_GT(name.size(), prefix.size() + suffix.size()) << name;
  EXPECT_EQ(name.substr(name.size() - suffix.size()), suffix) << name;
  const std::string seconds = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  ASSERT_EQ(seconds.find_first_not_of("0123456789"), std::string::npos) << name;
  EXPECT_GE(std::stod(seconds), t_before);
  EXPECT_LE(std::stod(seconds), t_after);
  EXPECT_EQ(fs::path(writer.path()).parent_path(), dir);
}

TEST(TensorBoardWriter, NeverTruncatesAnExistingFileOfTheSameName) {
  const fs::path dir = test_dir("name_taken");
  fs::create_directories(dir);
  // Take the names a writer would pick for this and the next few seconds, as an
  // earlier writer of this process would have, so the collision is certain.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const auto now = static_cast<int64_t>(now_seconds());
  std::vector<fs::path> taken;
  for (int64_t s = now; s < now + 5; ++s) {
    taken.push_back(
        dir / ("events.out.tfevents." + std::to_string(s) + "." + host + "." + std::to_string(::getpid()) + ".anvil"));
    std::ofstream(taken.back()) << "an earlier run's events";
  }
  std::string path;
  {
    anvil::TensorBoardWriter writer(dir.string());
    writer.add_scalar("loss", 2.0, 1);
    path = writer.path();
  }  // closing (no flush) must write everything too
  EXPECT_EQ(path.substr(path.size() - 8), ".anvil.1") << path;
  for (const fs::path& p : taken) EXPECT_EQ(read_file(p.string()), "an earlier run's events") << p;

  const std::vector<Event> events = decode_events(read_file(path));
  ASSERT_EQ(events.size(), 2u) << path;
  EXPECT_EQ(events[0].file_version, "brain.Event:2") << path;
  ASSERT_EQ(events[1].scalars.size(), 1u) << path;
  EXPECT_EQ(events[1].scalars[0].value, 2.0f) << path;

  // And a second writer open at the same time as the first gets a name of its own.
  const anvil::TensorBoardWriter first(dir.string()), second(dir.string());
  EXPECT_NE(first.path(), second.path());
}

TEST(TensorBoardWriter, ImpossibleFolderThrowsNamingThePath) {
  const fs::path dir = test_dir("impossible");
  fs::create_directories(dir);
  const fs::path regular_file = dir / "not_a_folder";
  std::ofstream(regular_file) << "x";
  // A folder under a regular file, and a regular file where the folder should be.
  for (const fs::path& log_dir : {regular_file / "logs", regular_file}) {
    try {
      anvil::TensorBoardWriter writer(log_dir.string());
      ADD_FAILURE() << "no error for " << log_dir;
    } catch (const anvil::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + log_dir.string() + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::strerror(ENOTDIR)), std::string::npos) << msg;
    }
  }
}

TEST(TensorBoardWriter, WriteFailureThrowsNamingThePath) {
  // A file-size limit makes writes fail with EFBIG like a full disk fails with
  // ENOSPC; it is set in a child process so nothing else in this one is limited.
  const fs::path dir = test_dir("write_failure");
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::signal(SIGXFSZ, SIG_IGN);  // fail the write with EFBIG instead of killing the process
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = 4096;
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::string report;
    int code = 3;  // nothing thrown
    std::optional<anvil::TensorBoardWriter> writer;
    try {
      writer.emplace(dir.string());
      for (int64_t step = 0; step < 100000; ++step) {
        writer->add_scalar("loss", 1.0, step);
        if (step % 10 == 0) writer->flush();
      }
    } catch (const anvil::Error& e) {
      report = e.what();
      code = writer ? 0 : 6;
    } catch (...) {
      code = 4;
    }
    // After a failure the file may end in a torn record: the writer must refuse
    // to append after it even once space is available again.
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_FSIZE, &limit);
    if (code == 0) {
      try {
        writer->add_scalar("loss", 1.0, 0);
        code = 7;
      } catch (const anvil::Error& e) {
        report += "\n" + std::string(e.what());
      }
    }
    const ssize_t written = ::write(fds[1], report.data(), report.size());
    ::_exit(written == static_cast<ssize_t>(report.size()) ? code : 5);
  }
  ::close(fds[1]);
  std::string report;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) report.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << report
                                    << "\n3: no error thrown, 4: not an anvil::Error, 5: pipe write failed, "
                                       "6: the constructor failed, 7: wrote on after a failure";
  EXPECT_NE(report.find((dir / "events.out.tfevents.").string()), std::string::npos) << report;
  EXPECT_NE(report.find(std::strerror(EFBIG)), std::string::npos) << report;
  EXPECT_NE(report.find("failed write earlier"), std::string::npos) << report;
}

}  // namespace
