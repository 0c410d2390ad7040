// Helpers shared by the op tests: random inputs, double-precision copies,
// error measures and central finite differences.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/rng.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/tensor.h"

namespace anvil::testing {

// The anvil program run with `args` (and an optional command prefix, such as
// `timeout`): its exit code and everything it printed, stdout and stderr.
struct CommandOutput {
  int exit_code;
  std::string text;
};
inline CommandOutput run_anvil(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + std::string(ANVIL_BINARY) + " " + args + " 2>&1";
  CommandOutput out{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.text.append(buf, n);
  const int status = pclose(p);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// `cmd` run by the shell: its exit code, and what it printed on stdout in
// `out` (its stderr goes to the test's).
inline int shell_output(const std::string& cmd, std::string& out) {
  out.clear();
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A folder of this process's own under the system temp dir, so that test runs
// going on at the same time (two builds, ctest -j) never share files.
// It is removed when the test program ends (checkpoints make a full run
// several GB), unless ANVIL_KEEP_TEST_FILES is set, to look at after a failure.
// The message of the anvil::Error `f` throws; empty when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The ops' thread count set for a scope (a dry run must use the ranks' own:
// attention's scratch is per thread).
struct ScopedThreads {
  explicit ScopedThreads(int n) : before(num_threads()) { set_num_threads(n); }
  ~ScopedThreads() { set_num_threads(before); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;
  int before;
};

// A run's training losses by step from its metrics.jsonl, as printed (so
// comparisons are exact), the last line of a step winning: a resumed run logs
// the steps after its checkpoint again.
inline std::map<int64_t, std::string> losses_by_step(const std::filesystem::path& metrics) {
  std::map<int64_t, std::string> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].dump();
  }
  return out;
}

inline std::filesystem::path scratch_root() {
  struct Root {
    std::filesystem::path path;
    pid_t owner = ::getpid();  // a forked child (a death test) exiting must not remove it
    Root() : path(std::filesystem::temp_directory_path() / ("anvil-tests-" + std::to_string(::getpid()))) {
      std::filesystem::create_directories(path);
    }
    ~Root() {
      if (::getpid() != owner || std::getenv("ANVIL_KEEP_TEST_FILES") != nullptr) return;
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Root root;
  return root.path;
}

// Uniform in [-scale, scale), keyed by name so each input is reproducible.
// Values of exactly zero are nudged away: a zero input hides bugs.
inline Tensor random_tensor(Shape shape, DType dtype, std::string_view name, float scale = 1.0f,
                            MemCategory cat = MemCategory::workspace) {
  Tensor t = Tensor::empty(std::move(shape), dtype, cat, name);
  Tensor f = Tensor::empty(t.shape(), DType::f32, MemCategory::workspace, "random_f32");
  fill_uniform(f, {1234, name}, -scale, scale);
  float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i)
    if (p[i] == 0.0f) p[i] = scale * 0.5f;
  t.copy_from(f);
  return t;
}

// Random token ids and targets (B, T) in [0, V), a few targets ignored.
inline void make_batch(int64_t B, int64_t T, int64_t V, Tensor& tokens, Tensor& targets) {
  tokens = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "tokens");
  targets = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "targets");
  const uint64_t key = RngStream{1, "stage-batch"}.key();
  for (int64_t i = 0; i < B * T; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * static_cast<double>(V));
    targets.data<int32_t>()[i] =
        i % 7 == 3 ? -100 : static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i + B * T)) * static_cast<double>(V));
  }
}

inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

inline std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.item_f32(i);
  return v;
}

inline void from_double(Tensor& t, const std::vector<double>& v) {
  Tensor f = Tensor::empty(t.shape(), DType::f32, MemCategory::workspace, "from_double");
  for (int64_t i = 0; i < t.numel(); ++i) f.data<float>()[i] = static_cast<float>(v[static_cast<size_t>(i)]);
  t.copy_from(f);
}

// ‖got − want‖₂ / ‖want‖₂: the error relative to the size of the answer.
inline double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}
inline double rel_error(const Tensor& got, const std::vector<double>& want) { return rel_error(to_double(got), want); }

inline double max_abs_error(const std::vector<double>& got, const std::vector<double>& want) {
  double m = 0;
  for (size_t i = 0; i < want.size(); ++i) m = std::max(m, std::abs(got[i] - want[i]));
  return m;
}

// d f / d x[i] for every i by central differences, all in double.
inline std::vector<double> numerical_grad(const std::function<double(const std::vector<double>&)>& f,
                                          std::vector<double> x, double eps = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    x[i] = xi + eps;
    const double fp = f(x);
    x[i] = xi - eps;
    const double fm = f(x);
    x[i] = xi;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

// Σ out[i]·w[i]: turns a tensor-valued op into a scalar whose gradient with
// respect to `out` is w, so one finite-difference check covers the whole output.
inline double weighted_sum(const std::vector<double>& out, const std::vector<double>& w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * w[i];
  return s;
}

}  // namespace anvil::testing
