// Muon (ops/muon.h) against torch.optim.Muon itself (scripts/torch_muon.py,
// in the oracles' environment: torch 2.9), and its Newton–Schulz against a
// double-precision one written here.
#include "anvil/ops/muon.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/safetensors.h"
#include "oracles.h"
#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;
namespace fs = std::filesystem;

// NS_k in double: X = u (transposed when tall) / ‖u‖_F, k times X ← a·X + (b·G + c·G²)·X, G = X·Xᵀ.
std::vector<double> newton_schulz_double(const MuonConfig& cfg, const std::vector<double>& u, int64_t rows,
                                         int64_t cols) {
  const bool tall = rows > cols;
  const int64_t r = tall ? cols : rows, c = tall ? rows : cols;
  std::vector<double> x(static_cast<size_t>(r * c));
  double norm = 0;
  for (double v : u) norm += v * v;
  norm = std::max(std::sqrt(norm), cfg.eps);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j)
      x[static_cast<size_t>(i * c + j)] = u[static_cast<size_t>(tall ? j * cols + i : i * cols + j)] / norm;
  std::vector<double> g(static_cast<size_t>(r * r)), h(g.size()), next(x.size());
  for (int64_t step = 0; step < cfg.ns_steps; ++step) {
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double s = 0;
        for (int64_t k = 0; k < c; ++k) s += x[static_cast<size_t>(i * c + k)] * x[static_cast<size_t>(j * c + k)];
        g[static_cast<size_t>(i * r + j)] = s;
      }
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double s = 0;
        for (int64_t k = 0; k < r; ++k) s += g[static_cast<size_t>(i * r + k)] * g[static_cast<size_t>(k * r + j)];
        h[static_cast<size_t>(i * r + j)] = cfg.ns_b * g[static_cast<size_t>(i * r + j)] + cfg.ns_c * s;
      }
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        double s = 0;
        for (int64_t k = 0; k < r; ++k) s += h[static_cast<size_t>(i * r + k)] * x[static_cast<size_t>(k * c + j)];
        next[static_cast<size_t>(i * c + j)] = cfg.ns_a * x[static_cast<size_t>(i * c + j)] + s;
      }
    std::swap(x, next);
  }
  std::vector<double> o(u.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j)
      o[static_cast<size_t>(tall ? j * cols + i : i * cols + j)] = x[static_cast<size_t>(i * c + j)];
  return o;
}

// torch.optim.Muon's steps in double from p and zero momentum: the weights after them.
std::vector<double> muon_double(const MuonConfig& cfg, std::vector<double> p, const std::vector<Tensor>& grads,
                                int64_t rows, int64_t cols) {
  std::vector<double> m(p.size(), 0.0), u(p.size());
  const double lr = muon_adjusted_lr(cfg, rows, cols);
  for (const Tensor& grad : grads) {
    const std::vector<double> g = to_double(grad);
    for (size_t i = 0; i < p.size(); ++i) {
      m[i] += (1 - cfg.momentum) * (g[i] - m[i]);
      u[i] = cfg.nesterov ? g[i] + cfg.momentum * (m[i] - g[i]) : m[i];
    }
    const std::vector<double> o = newton_schulz_double(cfg, u, rows, cols);
    for (size_t i = 0; i < p.size(); ++i) p[i] = p[i] * (1 - cfg.lr * cfg.weight_decay) - lr * o[i];
  }
  return p;
}

std::vector<double> minus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::workspace, "copy");
  c.copy_from(t);
  return c;
}

std::vector<double> difference(const Tensor& a, const Tensor& b) {
  std::vector<double> d = to_double(a);
  const std::vector<double> bd = to_double(b);
  for (size_t i = 0; i < d.size(); ++i) d[i] -= bd[i];
  return d;
}

struct Case {
  std::string name;
  int64_t rows, cols;
  MuonConfig cfg;
};

constexpr int kSteps = 3;

// The cases: square, tall and wide, each adjust_lr_fn, Newton–Schulz in f32
// and bf16, and one without Nesterov. lr 0.02 (Muon's usual) on weights of
// scale 0.02, so that the 3 steps' change is as large as the weights and
// its f32 rounding is far below the bounds.
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {96, 48}, {48, 96}})
    for (const MuonLrAdjust adjust : {MuonLrAdjust::original, MuonLrAdjust::match_rms_adamw})
      for (const DType dt : {DType::f32, DType::bf16}) {
        Case c{std::to_string(rows) + "x" + std::to_string(cols) + "_" + muon_lr_adjust_name(adjust) + "_" +
                   dtype_name(dt),
               rows, cols, MuonConfig{}};
        c.cfg.lr = 0.02;
        c.cfg.adjust_lr = adjust;
        c.cfg.ns_dtype = dt;
        out.push_back(c);
      }
  Case plain{"64x64_no_nesterov_f32", 64, 64, MuonConfig{}};
  plain.cfg.lr = 0.02;
  plain.cfg.nesterov = false;
  plain.cfg.ns_dtype = DType::f32;
  out.push_back(plain);
  return out;
}

struct Inputs {
  Tensor param, u;
  std::vector<Tensor> grads;
};
Inputs inputs_of(const Case& c) {
  // The same matrices for the f32 and bf16 cases of a shape.
  const std::string key = std::to_string(c.rows) + "x" + std::to_string(c.cols);
  Inputs in{random_tensor({c.rows, c.cols}, DType::f32, "muon.param." + key, 0.02f),
            random_tensor({c.rows, c.cols}, DType::f32, "muon.u." + key, 1.0f), {}};
  for (int s = 0; s < kSteps; ++s)
    in.grads.push_back(random_tensor({c.rows, c.cols}, DType::f32, "muon.grad" + std::to_string(s) + "." + key, 0.1f));
  return in;
}

// Every case through torch.optim.Muon in one run of scripts/torch_muon.py.
std::map<std::string, Tensor> run_torch(const std::string& python, const std::vector<Case>& all, const fs::path& dir) {
  nlohmann::json cfg = {{"cases", nlohmann::json::array()}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const Case& c : all) {
    cfg["cases"].push_back({{"name", c.name},
                            {"rows", c.rows},
                            {"cols", c.cols},
                            {"steps", kSteps},
                            {"lr", c.cfg.lr},
                            {"weight_decay", c.cfg.weight_decay},
                            {"momentum", c.cfg.momentum},
                            {"nesterov", c.cfg.nesterov},
                            {"ns_steps", c.cfg.ns_steps},
                            {"eps", c.cfg.eps},
                            {"adjust_lr_fn", muon_lr_adjust_name(c.cfg.adjust_lr)},
                            {"ns_dtype", dtype_name(c.cfg.ns_dtype)}});
    const Inputs in = inputs_of(c);
    tensors.emplace_back(c.name + ".param", in.param);
    tensors.emplace_back(c.name + ".u", in.u);
    for (int s = 0; s < kSteps; ++s) tensors.emplace_back(c.name + ".grad" + std::to_string(s), in.grads[s]);
  }
  std::ofstream(dir / "config.json") << cfg.dump(2);
  save_safetensors((dir / "inputs.safetensors").string(), tensors);
  std::string cmd = python;  // built in steps: GCC 12 warns falsely (-Wrestrict) on s + "..." + s
  cmd += " ";
  cmd += ANVIL_SOURCE_DIR;
  cmd += "/scripts/torch_muon.py " + dir.string() + " --threads 2";
  std::string out;
  shell_output(cmd + " 2>&1", out);
  EXPECT_TRUE(fs::exists(dir / "torch.safetensors")) << cmd << ":\n" << out;
  if (!fs::exists(dir / "torch.safetensors")) return {};
  return load_safetensors((dir / "torch.safetensors").string()).tensors;
}

// One update, and three, against torch.optim.Muon, for every case; the
// momentum, f32 elementwise on both sides (PyTorch's lerp formed alike), to
// the bit.
//
// f32 (PyTorch's Newton–Schulz patched to skip its bf16 cast): the iteration
// itself amplifies f32 rounding (its polynomial's slope is 3.4 near 0), so an
// f32 Newton–Schulz is about 1.1e-6 from the same iteration in double
// (measured here on every shape, PyTorch's and Anvil's alike), and two f32
// implementations summing in other orders differ by about √2 times that
// (1.5e-6 measured). The bound is derived from PyTorch's own error against
// double in the same run: Newton–Schulz and the weights' change over 3 steps
// each within 2 times it, of PyTorch's and of double.
//
// bf16 (as PyTorch ships it): Anvil rounds where PyTorch rounds (the cast,
// the norm, each quotient, each product and each addmm once), so the two
// differ only where a sum before a rounding, added in another order, rounds
// the other way by one bf16 step. Measured 0 to 0.16 times PyTorch's own
// bf16-vs-f32 gap on the same inputs (that gap is 1.1e-2 to 1.5e-2); one
// rounding more or less would move it by about the gap. Bound: half the gap.
TEST(Muon, UpdatesAreTorchOptimMuonsInF32AndBf16) {
  ANVIL_NEED_ORACLES(python);
  const std::vector<Case> all = cases();
  const fs::path dir = scratch_root() / "muon_torch";
  fs::create_directories(dir);
  const std::map<std::string, Tensor> torch = run_torch(python, all, dir);
  ASSERT_FALSE(torch.empty());
  std::printf("%-27s %-36s %-36s %s\n", "case", "Newton-Schulz: Anvil-PyTorch", "weights' change: Anvil-PyTorch",
              "momentum");
  for (const Case& c : all) {
    SCOPED_TRACE(c.name);
    const Inputs in = inputs_of(c);
    Tensor o = Tensor::empty({c.rows, c.cols}, DType::f32, MemCategory::workspace, "o");
    newton_schulz(c.cfg, in.u, o);
    Tensor p = copy_of(in.param);
    Tensor m = Tensor::zeros({c.rows, c.cols}, DType::f32, MemCategory::optimizer_state, "m");
    for (int s = 0; s < kSteps; ++s) muon_step(c.cfg, p, in.grads[s], m);

    const Tensor& torch_p = torch.at(c.name + ".param");
    const double ns_error = rel_error(o, to_double(torch.at(c.name + ".ns")));
    const double change_error = rel_error(difference(p, in.param), difference(torch_p, in.param));
    EXPECT_TRUE(same_bytes(m, torch.at(c.name + ".momentum")));
    const double momentum_error = rel_error(m, to_double(torch.at(c.name + ".momentum")));
    if (c.cfg.ns_dtype == DType::f32) {
      const std::vector<double> p0 = to_double(in.param);
      const std::vector<double> exact_ns = newton_schulz_double(c.cfg, to_double(in.u), c.rows, c.cols);
      const std::vector<double> exact_change = minus(muon_double(c.cfg, p0, in.grads, c.rows, c.cols), p0);
      const double torch_ns = rel_error(torch.at(c.name + ".ns"), exact_ns);
      const double torch_change = rel_error(difference(torch_p, in.param), exact_change);
      const double anvil_ns = rel_error(o, exact_ns), anvil_change = rel_error(difference(p, in.param), exact_change);
      std::printf("%-27s %.2e (double: %.2e, PyTorch %.2e) %.2e (double: %.2e, PyTorch %.2e) %.1e\n", c.name.c_str(),
                  ns_error, anvil_ns, torch_ns, change_error, anvil_change, torch_change, momentum_error);
      EXPECT_LT(torch_ns, 3e-6) << "PyTorch's own f32 Newton-Schulz is this far from double";
      EXPECT_LT(ns_error, 2 * torch_ns);
      EXPECT_LT(anvil_ns, 2 * torch_ns);
      EXPECT_LT(change_error, 2 * torch_change);
      EXPECT_LT(anvil_change, 2 * torch_change);
      continue;
    }
    // PyTorch's own gap: its bf16 case against its f32 case of the same matrices.
    std::string f32_name = c.name;
    f32_name.replace(f32_name.rfind("bf16"), 4, "f32");
    const double ns_gap = rel_error(torch.at(c.name + ".ns"), to_double(torch.at(f32_name + ".ns")));
    const double change_gap = rel_error(difference(torch_p, in.param), difference(torch.at(f32_name + ".param"), in.param));
    std::printf("%-27s %.2e (PyTorch's bf16 gap %.2e)        %.2e (PyTorch's bf16 gap %.2e)        %.1e\n",
                c.name.c_str(), ns_error, ns_gap, change_error, change_gap, momentum_error);
    EXPECT_LT(ns_error, 0.5 * ns_gap);
    EXPECT_LT(change_error, 0.5 * change_gap);
  }
}

// Newton–Schulz in f32 against the same iteration in double, and what it
// does: u's singular values are mapped to between about 0.7 and 1.2 (the
// rows of a wide o then have squared lengths near 1), the small ones too.
TEST(Muon, NewtonSchulzInF32IsTheDoubleIteration) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {96, 48}, {48, 96}}) {
    MuonConfig cfg;
    cfg.ns_dtype = DType::f32;
    const Tensor u = random_tensor({rows, cols}, DType::f32, "muon.ns_double." + std::to_string(rows), 1.0f);
    Tensor o = Tensor::empty({rows, cols}, DType::f32, MemCategory::workspace, "o");
    newton_schulz(cfg, u, o);
    const std::vector<double> want = newton_schulz_double(cfg, to_double(u), rows, cols);
    const double error = rel_error(o, want);
    // What it does: o's rows (a wide o's, else its columns) are near-orthogonal of length near 1.
    const int64_t r = std::min(rows, cols), len = std::max(rows, cols);
    double lo = 1e9, hi = 0, cross = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double dot = 0;
        for (int64_t k = 0; k < len; ++k)
          dot += static_cast<double>(o.data<float>()[rows <= cols ? i * cols + k : k * cols + i]) *
                 o.data<float>()[rows <= cols ? j * cols + k : k * cols + j];
        if (i == j) lo = std::min(lo, dot), hi = std::max(hi, dot);
        else cross = std::max(cross, std::abs(dot));
      }
    std::printf("%lld x %lld: f32 Newton-Schulz within %.2e of double; squared lengths %.3f to %.3f, "
                "largest cross product %.3f\n", static_cast<long long>(rows), static_cast<long long>(cols), error,
                lo, hi, cross);
    EXPECT_LT(error, 3e-6);  // f32's own error through the iteration: 1.1e-6 measured (see above)
    EXPECT_GT(lo, 0.1);
    EXPECT_LT(hi, 2.0);
  }
}

// The clip coefficient is applied to the gradient as it is read: the same
// bits as a pre-scaled gradient.
TEST(Muon, GradScaleIsAScaledGradient) {
  MuonConfig cfg;
  const Tensor p0 = random_tensor({32, 48}, DType::f32, "muon.scale.p", 0.02f);
  const Tensor g = random_tensor({32, 48}, DType::f32, "muon.scale.g", 0.1f);
  Tensor scaled = copy_of(g);
  for (int64_t i = 0; i < scaled.numel(); ++i) scaled.data<float>()[i] *= 0.25f;
  Tensor p1 = copy_of(p0), p2 = copy_of(p0);
  Tensor m1 = Tensor::zeros({32, 48}, DType::f32, MemCategory::optimizer_state, "m1");
  Tensor m2 = Tensor::zeros({32, 48}, DType::f32, MemCategory::optimizer_state, "m2");
  Tensor b1 = Tensor::empty({32, 48}, DType::bf16, MemCategory::parameters, "b1");
  muon_step(cfg, p1, g, m1, &b1, 0.25f);
  muon_step(cfg, p2, scaled, m2);
  EXPECT_TRUE(same_bytes(p1, p2));
  EXPECT_TRUE(same_bytes(m1, m2));
  EXPECT_GT(rel_error(difference(p1, p0), std::vector<double>(static_cast<size_t>(p0.numel()), 0.0)), 0.0);
  Tensor want = p1.to(DType::bf16, MemCategory::workspace, "want");
  EXPECT_TRUE(same_bytes(b1, want)) << "the compute copy is bf16(p)";
}

// Each setting outside its range is refused with one line naming it.
TEST(Muon, BadSettingsAreRefusedByName) {
  const auto refused = [](MuonConfig cfg, const std::string& what) {
    try {
      check_muon_config(cfg);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  MuonConfig c;
  c.ns_steps = 0;
  refused(c, "ns_steps = 0 is invalid; it must be at least 1 and below 100");
  c.ns_steps = 100;
  refused(c, "ns_steps = 100 is invalid");
  c = MuonConfig{};
  c.momentum = 1;
  refused(c, "momentum = 1 is invalid; it must be in [0, 1)");
  c = MuonConfig{};
  c.lr = -1e-3;
  refused(c, "lr = -0.001 is invalid");
  c = MuonConfig{};
  c.weight_decay = -0.1;
  refused(c, "weight_decay = -0.1 is invalid");
  c = MuonConfig{};
  c.eps = 0;
  refused(c, "eps = 0 is invalid");
  c = MuonConfig{};
  c.ns_dtype = DType::i32;
  refused(c, "Newton-Schulz runs in f32 or bf16");
}

TEST(Muon, AdjustedLearningRatesArePyTorchs) {
  MuonConfig c;
  c.lr = 0.02;
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(c, 96, 48), 0.02 * std::sqrt(2.0));  // tall: √(A/B)
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(c, 48, 96), 0.02);                   // wide: √max(1, A/B) = 1
  c.adjust_lr = MuonLrAdjust::match_rms_adamw;
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(c, 48, 96), 0.02 * 0.2 * std::sqrt(96.0));
  EXPECT_DOUBLE_EQ(muon_adjusted_lr(c, 96, 48), 0.02 * 0.2 * std::sqrt(96.0));
  // 5 steps on 48 x 96: per step 4·48²·96 + 2·48³.
  EXPECT_DOUBLE_EQ(newton_schulz_flops(c, 96, 48), 5 * (4.0 * 48 * 48 * 96 + 2.0 * 48 * 48 * 48));
}

}  // namespace
