#include "anvil/ops/muon.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"

namespace anvil {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per chunk at least

void check_f32(const Tensor& t, int64_t n, const char* op, const char* name) {
  ANVIL_ASSERT(t.dtype() == DType::f32, op, ": ", name, " must be f32, got ", dtype_name(t.dtype()));
  ANVIL_ASSERT(t.numel() == n, op, ": ", name, " has ", t.numel(), " elements, expected ", n);
  ANVIL_CHECK(t.device().is_cpu(), "Muon runs on the CPU: ", name, " is on ", t.device().str(),
              ". Train with [job] device = \"cpu\", or with optimizer AdamW on a GPU.");
}

// torch.lerp's f32 kernel (its vectorized lerp_vec): with d = end − start,
// start + w·d for |w| < 0.5, else end + (w − 1)·d, as one fused multiply-add;
// w − 1 is formed in f32, as PyTorch forms it.
inline float lerp(float start, float end, float w) {
  const float d = end - start;
  return std::abs(w) < 0.5f ? std::fma(w, d, start) : std::fma(w - 1.0f, d, end);
}

// A value rounded to the Newton–Schulz dtype (f32: itself).
inline float round_to(DType dt, float x) { return dt == DType::bf16 ? to_f32(from_f32<bf16>(x)) : x; }

// Element (i, j) of a (rows, cols) matrix of dtype dt, and its store.
inline float load(const Tensor& t, int64_t i) {
  return t.dtype() == DType::bf16 ? to_f32(t.data<bf16>()[i]) : t.data<float>()[i];
}
inline void store(Tensor& t, int64_t i, float x) {
  if (t.dtype() == DType::bf16)
    t.data<bf16>()[i] = from_f32<bf16>(x);
  else
    t.data<float>()[i] = x;
}

}  // namespace

const char* muon_lr_adjust_name(MuonLrAdjust a) {
  return a == MuonLrAdjust::original ? "original" : "match_rms_adamw";
}

void check_muon_config(const MuonConfig& c) {
  auto bad = [](const char* name, double value, const char* rule) {
    return detail::concat("Muon: ", name, " = ", value, " is invalid; it must be ", rule,
                          ". Fix the optimizer settings.");
  };
  ANVIL_CHECK(std::isfinite(c.lr) && c.lr >= 0, bad("lr", c.lr, "a finite number >= 0"));
  ANVIL_CHECK(std::isfinite(c.weight_decay) && c.weight_decay >= 0,
              bad("weight_decay", c.weight_decay, "a finite number >= 0"));
  ANVIL_CHECK(std::isfinite(c.momentum) && c.momentum >= 0 && c.momentum < 1,
              bad("momentum", c.momentum, "in [0, 1)"));
  ANVIL_CHECK(std::isfinite(c.eps) && c.eps > 0, bad("eps", c.eps, "a finite number > 0"));
  ANVIL_CHECK(std::isfinite(c.ns_a) && std::isfinite(c.ns_b) && std::isfinite(c.ns_c),
              "Muon: the Newton-Schulz coefficients (", c.ns_a, ", ", c.ns_b, ", ", c.ns_c,
              ") must be finite. Fix the optimizer settings.");
  ANVIL_CHECK(c.ns_steps >= 1 && c.ns_steps < 100, "Muon: ns_steps = ", c.ns_steps,
              " is invalid; it must be at least 1 and below 100 (PyTorch's limit; 5 is the default).",
              " Fix the optimizer settings.");
  ANVIL_CHECK(c.ns_dtype == DType::f32 || c.ns_dtype == DType::bf16, "Muon: Newton-Schulz runs in f32 or bf16, not ",
              dtype_name(c.ns_dtype), ". Fix the optimizer settings.");
}

double muon_adjusted_lr(const MuonConfig& cfg, int64_t rows, int64_t cols) {
  const double A = static_cast<double>(rows), B = static_cast<double>(cols);
  return cfg.adjust_lr == MuonLrAdjust::original ? cfg.lr * std::sqrt(std::max(1.0, A / B))
                                                 : cfg.lr * 0.2 * std::sqrt(std::max(A, B));
}

double newton_schulz_flops(const MuonConfig& cfg, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(std::min(rows, cols)), c = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(cfg.ns_steps) * (4.0 * r * r * c + 2.0 * r * r * r);
}

void muon_momentum(const MuonConfig& cfg, const Tensor& g, float grad_scale, Tensor& m, Tensor& u) {
  const ScopedOpTime op("muon_momentum");
  check_muon_config(cfg);
  ANVIL_CHECK(std::isfinite(grad_scale), "Muon: grad_scale = ", grad_scale,
              " is not finite (a NaN/Inf gradient norm?). Stop or skip the step instead of updating the weights.");
  const int64_t n = g.numel();
  check_f32(g, n, "muon_momentum", "g");
  check_f32(m, n, "muon_momentum", "m");
  check_f32(u, n, "muon_momentum", "u");
  if (dry_run()) return;
  // PyTorch's scalars: the Python float 1 − μ rounded to f32 (buf.lerp_), and μ
  // rounded to f32 (grad.lerp); lerp forms w − 1 from each in f32.
  const float keep = static_cast<float>(1.0 - cfg.momentum), mu = static_cast<float>(cfg.momentum);
  const bool nesterov = cfg.nesterov;
  const float* gp = g.data<float>();
  float* mp = m.data<float>();
  float* up = u.data<float>();
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = gp[i] * grad_scale;
      const float mi = lerp(mp[i], gi, keep);
      mp[i] = mi;
      up[i] = nesterov ? lerp(gi, mi, mu) : mi;
    }
  });
}

void newton_schulz(const MuonConfig& cfg, const Tensor& u, Tensor& o) {
  const ScopedOpTime op("newton_schulz");
  check_muon_config(cfg);
  ANVIL_ASSERT(u.ndim() == 2, "newton_schulz: u must be a matrix, got ", u.ndim(), " dimensions");
  const int64_t rows = u.size(0), cols = u.size(1);
  check_f32(u, rows * cols, "newton_schulz", "u");
  check_f32(o, rows * cols, "newton_schulz", "o");
  const bool tall = rows > cols;
  const int64_t r = tall ? cols : rows, c = tall ? rows : cols;  // X is r × c, r ≤ c
  const DType dt = cfg.ns_dtype;
  Tensor x = Tensor::empty({r, c}, dt, MemCategory::workspace, "muon.ns.x");
  Tensor next = Tensor::empty({r, c}, dt, MemCategory::workspace, "muon.ns.x_next");
  Tensor gram = Tensor::empty({r, r}, dt, MemCategory::workspace, "muon.ns.gram");
  Tensor update = Tensor::empty({r, r}, dt, MemCategory::workspace, "muon.ns.gram_update");
  // Each product in f32 before its one rounding to dt, with the a·X or b·G it is added to.
  Tensor product = Tensor::empty({r, c}, DType::f32, MemCategory::workspace, "muon.ns.product");
  if (rows * cols == 0) return;
  // A dry run goes on: its products take the scratch a real one takes (the
  // widened operands of bf16 products, ops/matmul.h), and skip their
  // arithmetic, as parallel_for does; only the norm's serial sum is skipped.

  // X = u (rounded to dt first, as PyTorch casts before it transposes), over
  // its Frobenius norm rounded to dt, each quotient rounded to dt.
  const float* up = u.data<float>();
  double sum = 0;
  for (int64_t i = 0; i < rows * cols && !dry_run(); ++i) {
    const double v = round_to(dt, up[i]);
    sum += v * v;
  }
  const float norm = round_to(dt, std::max(static_cast<float>(std::sqrt(sum)), round_to(dt, static_cast<float>(cfg.eps))));
  parallel_for(0, r, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t j = 0; j < c; ++j) store(x, i * c + j, round_to(dt, up[tall ? j * cols + i : i * cols + j]) / norm);
  });

  const float a = static_cast<float>(cfg.ns_a), b = static_cast<float>(cfg.ns_b);
  float* pp = product.data<float>();
  // The iterate and its successor trade places by pointer, so the two
  // buffers are freed in the same order whatever the step count (the dry run
  // frees them as the real run does).
  Tensor* cur = &x;
  Tensor* nxt = &next;
  for (int64_t step = 0; step < cfg.ns_steps; ++step) {
    // G = X·Xᵀ, rounded once.
    gemm({.M = r, .N = r, .K = c, .trans_b = true, .ab = dt, .c = dt}, cur->raw(), cur->raw(), gram.raw());
    // H = b·G + c·G·G: the product scaled by c in f32, b·G added, rounded once (PyTorch's addmm).
    gemm({.M = r, .N = r, .K = r, .ab = dt, .c = DType::f32, .alpha = static_cast<float>(cfg.ns_c)}, gram.raw(),
         gram.raw(), pp);
    parallel_for(0, r * r, kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) store(update, i, pp[i] + b * load(gram, i));
    });
    // X ← a·X + H·X, rounded once.
    gemm({.M = r, .N = c, .K = r, .ab = dt, .c = DType::f32}, update.raw(), cur->raw(), pp);
    parallel_for(0, r * c, kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) store(*nxt, i, pp[i] + a * load(*cur, i));
    });
    std::swap(cur, nxt);
  }
  float* op_ = o.data<float>();
  parallel_for(0, r, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t j = 0; j < c; ++j) op_[tall ? j * cols + i : i * cols + j] = load(*cur, i * c + j);
  });
}

void muon_apply(const MuonConfig& cfg, double adjusted_lr, const Tensor& o, Tensor& p, Tensor* p_bf16) {
  const ScopedOpTime op("muon_apply");
  check_muon_config(cfg);
  const int64_t n = p.numel();
  check_f32(p, n, "muon_apply", "p");
  check_f32(o, n, "muon_apply", "o");
  if (p_bf16) {
    ANVIL_ASSERT(p_bf16->dtype() == DType::bf16 && p_bf16->numel() == n, "muon_apply: the compute copy must be bf16 with ",
                 n, " elements, got ", dtype_name(p_bf16->dtype()), " with ", p_bf16->numel());
  }
  if (dry_run()) return;
  // PyTorch's two passes: p.mul_(1 − lr·wd), then p.add_(o, alpha=−lr'), whose
  // kernel is one fused multiply-add; the scalars are its Python floats in f32.
  const float decay = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  const float step = static_cast<float>(-adjusted_lr);
  float* pp = p.data<float>();
  const float* op_ = o.data<float>();
  bf16* bp = p_bf16 ? p_bf16->data<bf16>() : nullptr;
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float pi = std::fma(op_[i], step, pp[i] * decay);
      pp[i] = pi;
      if (bp) bp[i] = from_f32<bf16>(pi);
    }
  });
}

void muon_step(const MuonConfig& cfg, Tensor& p, const Tensor& g, Tensor& m, Tensor* p_bf16, float grad_scale) {
  ANVIL_ASSERT(p.ndim() == 2, "muon_step: p must be a matrix, got ", p.ndim(), " dimensions");
  Tensor u = Tensor::empty(p.shape(), DType::f32, MemCategory::workspace, "muon.update");
  muon_momentum(cfg, g, grad_scale, m, u);
  Tensor o = Tensor::empty(p.shape(), DType::f32, MemCategory::workspace, "muon.orthogonal");
  newton_schulz(cfg, u, o);
  muon_apply(cfg, muon_adjusted_lr(cfg, p.size(0), p.size(1)), o, p, p_bf16);
}

}  // namespace anvil
