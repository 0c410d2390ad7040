#include "anvil/train/optimizer.h"

#include <fnmatch.h>

#include <sstream>

#include "anvil/core/error.h"
#include "anvil/train/config.h"

namespace anvil {

namespace {

std::vector<std::string> split_patterns(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string p; std::getline(in, p, ',');) {
    const size_t a = p.find_first_not_of(" \t"), b = p.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(p.substr(a, b - a + 1));
  }
  return out;
}

// '*' matches any run of characters, dots included (no FNM_PATHNAME).
bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const std::string& p : patterns)
    if (fnmatch(p.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

}  // namespace

OptimizerConfig optimizer_config(const JobConfig& cfg) {
  const auto& o = cfg.optimizer;
  OptimizerConfig out;
  out.kind = o.name == "Muon" ? OptimizerKind::muon : OptimizerKind::adamw;
  out.adamw = {static_cast<float>(o.lr), static_cast<float>(o.beta1), static_cast<float>(o.beta2),
               static_cast<float>(o.eps), static_cast<float>(o.weight_decay)};
  out.adamw_lr = o.lr;
  check_adamw_config(out.adamw);
  if (out.kind == OptimizerKind::adamw) return out;
  out.muon.lr = o.muon_lr;
  out.muon.weight_decay = o.muon_weight_decay;
  out.muon.momentum = o.muon_momentum;
  out.muon.nesterov = o.muon_nesterov;
  out.muon.ns_steps = o.muon_ns_steps;
  out.muon.eps = o.muon_eps;
  out.muon.adjust_lr = o.muon_adjust_lr_fn == "match_rms_adamw" ? MuonLrAdjust::match_rms_adamw : MuonLrAdjust::original;
  out.muon.ns_dtype = o.muon_ns_dtype == "float32" ? DType::f32 : DType::bf16;
  check_muon_config(out.muon);
  out.muon_params = split_patterns(o.muon_params);
  out.adamw_params = split_patterns(o.adamw_params);
  return out;
}

std::vector<bool> muon_matrices(const OptimizerConfig& cfg, const std::vector<ParamSpec>& specs) {
  std::vector<bool> muon(specs.size(), false);
  if (cfg.kind != OptimizerKind::muon) return muon;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    const bool m = matches_any(cfg.muon_params, s.name), a = matches_any(cfg.adamw_params, s.name);
    ANVIL_CHECK(m || a, "optimizer.name = \"Muon\": parameter ", s.name,
                " matches neither optimizer.muon_params nor optimizer.adamw_params, so no optimizer would update it; "
                "add a pattern that names it to one of the two");
    ANVIL_CHECK(!(m && a), "optimizer.name = \"Muon\": parameter ", s.name,
                " matches both optimizer.muon_params and optimizer.adamw_params; name it in one of them only");
    ANVIL_CHECK(!m || s.global_shape().size() == 2, "optimizer.name = \"Muon\": parameter ", s.name, " has ",
                s.global_shape().size(),
                " dimensions, and Muon orthogonalises matrices only; leave it out of optimizer.muon_params "
                "(optimizer.adamw_params takes it)");
    muon[i] = m;
  }
  return muon;
}

CheckpointOptimizer checkpoint_optimizer(const OptimizerConfig& cfg) {
  CheckpointOptimizer out;
  out.name = cfg.name();
  if (cfg.kind == OptimizerKind::muon)
    out.momentum_only = [patterns = cfg.muon_params](const std::string& name) { return matches_any(patterns, name); };
  return out;
}

RankOptimizer::RankOptimizer(const OptimizerConfig& cfg, const std::vector<ParamSpec>& specs, Tensor& master,
                             Tensor* compute_copy)
    : cfg_(cfg), master_(master), compute_copy_(compute_copy) {
  if (cfg_.kind != OptimizerKind::muon) return;
  const std::vector<bool> muon = muon_matrices(cfg_, specs);
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    ANVIL_CHECK(s.offset + s.numel() <= master.numel(), "Muon: parameter ", s.name, " lies outside the master weights");
    if (muon[i]) {
      muon_.push_back({s.offset, s.numel(), muon_numel_, s.shape[0], s.shape[1]});
      muon_numel_ += s.numel();
    } else {
      adamw_.push_back({s.offset, s.numel(), adamw_numel_});
      adamw_numel_ += s.numel();
    }
  }
}

void RankOptimizer::create_state() {
  if (cfg_.kind == OptimizerKind::adamw) {
    first_ = Tensor::zeros({master_.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg");
    second_ = Tensor::zeros({master_.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg_sq");
    return;
  }
  momentum_ = Tensor::zeros({muon_numel_}, DType::f32, MemCategory::optimizer_state, "muon.momentum_buffer");
  first_ = Tensor::zeros({adamw_numel_}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg");
  second_ = Tensor::zeros({adamw_numel_}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg_sq");
}

void RankOptimizer::step(double lr_factor, int64_t step, const Tensor& grads, float clip) {
  if (!has_state()) create_state();
  AdamWConfig adamw = cfg_.adamw;
  adamw.lr = static_cast<float>(cfg_.adamw_lr * lr_factor);
  if (cfg_.kind == OptimizerKind::adamw) {
    adamw_step(adamw, step, master_, grads, first_, second_, compute_copy_, clip);
    return;
  }
  MuonConfig muon = cfg_.muon;
  muon.lr *= lr_factor;
  auto bf16_copy = [&](const Entry& e) {
    return compute_copy_ ? compute_copy_->slice(e.offset, e.numel) : Tensor();
  };
  for (const Entry& e : muon_) {
    Tensor p = master_.slice(e.offset, e.numel).view({e.rows, e.cols});
    Tensor m = momentum_.slice(e.state_offset, e.numel).view({e.rows, e.cols});
    Tensor copy = bf16_copy(e);
    muon_step(muon, p, grads.slice(e.offset, e.numel).view({e.rows, e.cols}), m, copy.defined() ? &copy : nullptr,
              clip);
  }
  for (const Entry& e : adamw_) {
    Tensor p = master_.slice(e.offset, e.numel);
    Tensor m = first_.slice(e.state_offset, e.numel), v = second_.slice(e.state_offset, e.numel);
    Tensor copy = bf16_copy(e);
    adamw_step(adamw, step, p, grads.slice(e.offset, e.numel), m, v, copy.defined() ? &copy : nullptr, clip);
  }
}

std::pair<Tensor, Tensor> RankOptimizer::state_in_master_layout() {
  if (!has_state()) create_state();
  if (cfg_.kind == OptimizerKind::adamw) return {first_, second_};
  const int64_t n = master_.numel();
  Tensor first = Tensor::zeros({n}, DType::f32, MemCategory::workspace, "optimizer.state_in_master_layout");
  Tensor second = Tensor::zeros({n}, DType::f32, MemCategory::workspace, "optimizer.state_in_master_layout");
  for (const Entry& e : muon_) first.slice(e.offset, e.numel).copy_from(momentum_.slice(e.state_offset, e.numel));
  for (const Entry& e : adamw_) {
    first.slice(e.offset, e.numel).copy_from(first_.slice(e.state_offset, e.numel));
    second.slice(e.offset, e.numel).copy_from(second_.slice(e.state_offset, e.numel));
  }
  return {first, second};
}

void RankOptimizer::set_state_from_master_layout(const Tensor& first, const Tensor& second) {
  if (!has_state()) create_state();
  if (cfg_.kind == OptimizerKind::adamw) {
    if (first.raw() != first_.raw()) first_.copy_from(first);
    if (second.raw() != second_.raw()) second_.copy_from(second);
    return;
  }
  for (const Entry& e : muon_) momentum_.slice(e.state_offset, e.numel).copy_from(first.slice(e.offset, e.numel));
  for (const Entry& e : adamw_) {
    first_.slice(e.state_offset, e.numel).copy_from(first.slice(e.offset, e.numel));
    second_.slice(e.state_offset, e.numel).copy_from(second.slice(e.offset, e.numel));
  }
}

}  // namespace anvil
