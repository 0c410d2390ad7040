#include "anvil/train/optimizer.h"

#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <sstream>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/distributed/comm.h"
#include "anvil/distributed/fsdp.h"
#include "anvil/distributed/tensor_parallel.h"
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
                             Tensor* compute_copy, const FsdpParams* fsdp, Communicator* tp)
    : cfg_(cfg), master_(master), compute_copy_(compute_copy) {
  if (cfg_.kind != OptimizerKind::muon) return;
  const std::vector<bool> muon = muon_matrices(cfg_, specs);
  // {FSDP group, shard group, tp group} → exchanges_
  std::map<std::tuple<int, Communicator*, Communicator*>, size_t> exchange_of;
  std::map<Communicator*, int64_t> matrices_of;  // per shard group (or tp group, without FSDP): its matrices so far
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    Matrix m;
    Run run{s.offset, s.numel(), 0, 0};
    if (fsdp) {  // this rank's run of the parameter, and every rank's
      const FsdpParams::ParamShards sh = fsdp->param_shards(static_cast<int>(i));
      for (int q = 0; q < sh.comm->size(); ++q) {
        const int64_t lo = std::clamp<int64_t>(q * sh.shard - sh.at, 0, s.numel());
        const int64_t hi = std::clamp<int64_t>((q + 1) * sh.shard - sh.at, 0, s.numel());
        m.runs.emplace_back(lo, hi - lo);
      }
      const int me = sh.comm->rank();
      const auto [lo, len] = m.runs[static_cast<size_t>(me)];
      run = {len > 0 ? sh.slice_offset + (sh.at + lo - me * sh.shard) : 0, len, 0, lo};  // none: an empty run
      if (sh.comm->size() > 1) m.comm = sh.comm;  // else held whole here, as without FSDP
    }
    ANVIL_CHECK(run.offset + run.numel <= master.numel(), "Muon: parameter ", s.name,
                " lies outside the master weights");
    if (!muon[i]) {
      run.state_offset = adamw_numel_;
      adamw_numel_ += run.numel;
      adamw_.push_back(run);
      continue;
    }
    run.state_offset = muon_numel_;
    muon_numel_ += run.numel;
    m.spec = s;
    m.mine = run;
    if (tp && tp->size() > 1 && !s.slice.replicated()) {
      const int64_t extent = s.shape[static_cast<size_t>(s.slice.dim)];
      ANVIL_ASSERT(s.slice.begin == tp->rank() * extent, "Muon: ", s.name, "'s tp slice begins at ", s.slice.begin,
                   ", not at its rank's share");
      m.tp = tp;
    }
    const Shape global = s.global_shape();
    bool owned = true;
    if (m.comm || m.tp) {
      // Round-robin over the shard group, then over the tp group: matrix c's
      // tensor is assembled on shard rank c mod n, and the global matrix on tp
      // rank (c / n) mod tp (every tp rank counts the same matrices alike).
      const int n = m.comm ? m.comm->size() : 1, nt = m.tp ? m.tp->size() : 1;
      const int64_t c = matrices_of[m.comm ? m.comm : m.tp]++;
      m.owner = static_cast<int>(c % n);
      m.tp_owner = static_cast<int>(c / n % nt);
      bool holds = true;  // this rank holds its tensor whole after the shard group's gather
      if (m.comm) {
        const int me = m.comm->rank();
        holds = m.owner == me;
        // What this rank sends over the shard group: its run of u to the owner, or o's runs to the other ranks.
        const int64_t elements = holds ? s.numel() - m.runs[static_cast<size_t>(me)].second : run.numel;
        exchange_bytes_ += static_cast<uint64_t>(elements) * sizeof(float);
      }
      owned = holds;
      if (m.tp && holds) {  // its slice to the tp owner, or the other ranks' slices of o back
        const bool tp_owned = m.tp_owner == m.tp->rank();
        exchange_bytes_ += static_cast<uint64_t>(tp_owned ? (nt - 1) * s.numel() : s.numel()) * sizeof(float);
        owned = tp_owned;
      }
      const auto key = std::tuple{s.group, m.comm, m.tp};
      if (!exchange_of.contains(key)) {
        exchange_of[key] = exchanges_.size();
        exchanges_.push_back({m.comm, m.tp, {}});
      }
      exchanges_[exchange_of[key]].matrices.push_back(muon_.size());
    }
    if (owned) ns_flops_ += newton_schulz_flops(cfg_.muon, global[0], global[1]);
    muon_.push_back(std::move(m));
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

Tensor RankOptimizer::compute_copy_of(const Run& r) const {
  return compute_copy_ ? compute_copy_->slice(r.offset, r.numel) : Tensor();
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
  for (const Matrix& x : muon_) {
    if (x.comm || x.tp) continue;  // traded below
    const Run& r = x.mine;
    Tensor p = master_.slice(r.offset, r.numel).view(x.spec.shape);
    Tensor m = momentum_.slice(r.state_offset, r.numel).view(x.spec.shape);
    Tensor copy = compute_copy_of(r);
    muon_step(muon, p, grads.slice(r.offset, r.numel).view(x.spec.shape), m, copy.defined() ? &copy : nullptr, clip);
  }
  for (const Exchange& e : exchanges_) exchange_step(muon, e, grads, clip);
  for (const Run& r : adamw_) {
    if (r.numel == 0) continue;
    Tensor p = master_.slice(r.offset, r.numel);
    Tensor m = first_.slice(r.state_offset, r.numel), v = second_.slice(r.state_offset, r.numel);
    Tensor copy = compute_copy_of(r);
    adamw_step(adamw, step, p, grads.slice(r.offset, r.numel), m, v, copy.defined() ? &copy : nullptr, clip);
  }
}

void RankOptimizer::trade(Communicator& comm, const Tensor& out, const std::vector<int64_t>& out_rows,
                          const Tensor& in, const std::vector<int64_t>& in_rows, const char* label) {
  uint64_t bytes = 0;
  for (size_t q = 0; q < out_rows.size(); ++q)
    if (static_cast<int>(q) != comm.rank()) bytes += static_cast<uint64_t>(out_rows[q]) * sizeof(float);
  const ScopedPhase phase(SpanCategory::communication, label, -1);
  const int id = tracker_.start(label, -1, CommOp::all_to_all, bytes, comm.size());
  {
    const CommTracker::Blocked blocked(tracker_);
    comm.all_to_all_v(out, out_rows, in, in_rows);
  }
  tracker_.done(id);
}

namespace {
// Start offsets of consecutive blocks of `rows` (one per rank), and their total.
std::vector<int64_t> block_starts(const std::vector<int64_t>& rows, int64_t& total) {
  std::vector<int64_t> at(rows.size(), 0);
  total = 0;
  for (size_t q = 0; q < rows.size(); ++q) {
    at[q] = total;
    total += rows[q];
  }
  return at;
}
}  // namespace

void RankOptimizer::exchange_step(const MuonConfig& muon, const Exchange& e, const Tensor& grads, float clip) {
  std::vector<Tensor> held(e.matrices.size());  // matrix j's tensor (u, then o), where this rank holds it whole
  if (!e.comm) {  // each tensor whole here: its momentum, then the tp group's Newton-Schulz, then its update
    for (size_t j = 0; j < e.matrices.size(); ++j) {
      const Matrix& x = muon_[e.matrices[j]];
      held[j] = Tensor::empty(x.spec.shape, DType::f32, MemCategory::workspace, "muon.update");
      Tensor m = momentum_.slice(x.mine.state_offset, x.mine.numel);
      Tensor u = held[j].view({x.mine.numel});
      muon_momentum(muon, grads.slice(x.mine.offset, x.mine.numel), clip, m, u);
    }
    orthogonalise_over_tp(muon, e, held);
    for (size_t j = 0; j < e.matrices.size(); ++j) {
      const Matrix& x = muon_[e.matrices[j]];
      Tensor p = master_.slice(x.mine.offset, x.mine.numel);
      Tensor copy = compute_copy_of(x.mine);
      const Shape global = x.spec.global_shape();
      muon_apply(muon, muon_adjusted_lr(muon, global[0], global[1]), held[j].view({x.mine.numel}), p,
                 copy.defined() ? &copy : nullptr);
    }
    return;
  }
  Communicator& comm = *e.comm;
  const auto n = static_cast<size_t>(comm.size());
  const int me = comm.rank();
  // The send buffer: this rank's runs, grouped by owner in rank order; the
  // receive buffer: every rank's runs of the tensors this rank owns, grouped
  // by sender. Each matrix in the model's order within its block.
  std::vector<int64_t> send_rows(n, 0), recv_rows(n, 0);
  for (const size_t k : e.matrices) {
    const Matrix& x = muon_[k];
    send_rows[static_cast<size_t>(x.owner)] += x.mine.numel;
    if (x.owner == me)
      for (size_t q = 0; q < n; ++q) recv_rows[q] += x.runs[q].second;
  }
  int64_t send_total = 0, recv_total = 0;
  std::vector<int64_t> send_at = block_starts(send_rows, send_total), recv_at = block_starts(recv_rows, recv_total);
  Tensor send = Tensor::empty({send_total}, DType::f32, MemCategory::communication, "muon.exchange.send");
  Tensor recv = Tensor::empty({recv_total}, DType::f32, MemCategory::communication, "muon.exchange.recv");
  // u over this rank's runs, each where its owner's block of `send` puts it.
  std::vector<int64_t> send_pos(e.matrices.size());
  for (size_t j = 0; j < e.matrices.size(); ++j) {
    const Matrix& x = muon_[e.matrices[j]];
    const size_t owner = static_cast<size_t>(x.owner);
    send_pos[j] = send_at[owner];
    send_at[owner] += x.mine.numel;
    if (x.mine.numel == 0) continue;
    Tensor m = momentum_.slice(x.mine.state_offset, x.mine.numel);
    Tensor u = send.slice(send_pos[j], x.mine.numel);
    muon_momentum(muon, grads.slice(x.mine.offset, x.mine.numel), clip, m, u);
  }
  trade(comm, send, send_rows, recv, recv_rows, "muon.gather");
  // Where each owned tensor's runs lie in `recv`, by sender.
  std::vector<std::vector<int64_t>> recv_pos(e.matrices.size());
  for (size_t j = 0; j < e.matrices.size(); ++j) {
    const Matrix& x = muon_[e.matrices[j]];
    if (x.owner != me) continue;
    for (size_t q = 0; q < n; ++q) {
      recv_pos[j].push_back(recv_at[q]);
      recv_at[q] += x.runs[q].second;
    }
  }
  // o's runs of tensor j, written back where u's came from.
  auto send_back = [&](size_t j, const Tensor& o) {
    const Matrix& x = muon_[e.matrices[j]];
    const Tensor o_flat = o.view({o.numel()});
    for (size_t q = 0; q < n; ++q) {
      const auto [begin, len] = x.runs[q];
      if (len > 0) recv.slice(recv_pos[j][q], len).copy_from(o_flat.slice(begin, len));
    }
  };
  // Each tensor this rank owns, assembled whole from its runs. Without tensor
  // parallelism it is the matrix: orthogonalised and sent back one at a time.
  for (size_t j = 0; j < e.matrices.size(); ++j) {
    const Matrix& x = muon_[e.matrices[j]];
    if (x.owner != me) continue;
    Tensor u = Tensor::empty(x.spec.shape, DType::f32, MemCategory::workspace, "muon.update");
    const Tensor u_flat = u.view({u.numel()});
    for (size_t q = 0; q < n; ++q) {
      const auto [begin, len] = x.runs[q];
      if (len > 0) u_flat.slice(begin, len).copy_from(recv.slice(recv_pos[j][q], len));
    }
    if (e.tp) {
      held[j] = u;
      continue;
    }
    Tensor o = Tensor::empty(x.spec.shape, DType::f32, MemCategory::workspace, "muon.orthogonal");
    newton_schulz(muon, u, o);
    send_back(j, o);
  }
  if (e.tp) {
    orthogonalise_over_tp(muon, e, held);
    for (size_t j = 0; j < e.matrices.size(); ++j)
      if (held[j].defined()) send_back(j, held[j]);
    held.clear();
  }
  // o's runs come back where u's went.
  trade(comm, recv, recv_rows, send, send_rows, "muon.scatter");
  for (size_t j = 0; j < e.matrices.size(); ++j) {
    const Matrix& x = muon_[e.matrices[j]];
    if (x.mine.numel == 0) continue;
    Tensor p = master_.slice(x.mine.offset, x.mine.numel);
    Tensor copy = compute_copy_of(x.mine);
    const Shape global = x.spec.global_shape();
    muon_apply(muon, muon_adjusted_lr(muon, global[0], global[1]), send.slice(send_pos[j], x.mine.numel), p,
               copy.defined() ? &copy : nullptr);
  }
}

void RankOptimizer::orthogonalise_over_tp(const MuonConfig& muon, const Exchange& e, std::vector<Tensor>& held) {
  if (!e.tp) {  // each held tensor is its matrix
    for (size_t j = 0; j < held.size(); ++j) {
      if (!held[j].defined()) continue;
      Tensor o = Tensor::empty(held[j].shape(), DType::f32, MemCategory::workspace, "muon.orthogonal");
      newton_schulz(muon, held[j], o);
      held[j] = o;
    }
    return;
  }
  Communicator& tp = *e.tp;
  const auto nt = static_cast<size_t>(tp.size());
  const int me = tp.rank();
  // Every rank of the tp group holds the same matrices' slices (their shard
  // groups count the matrices alike), each slice the same size: this rank's
  // go to their owners, and the owner gets one from each rank.
  std::vector<int64_t> send_rows(nt, 0), recv_rows(nt, 0);
  for (size_t j = 0; j < held.size(); ++j) {
    if (!held[j].defined()) continue;
    const Matrix& x = muon_[e.matrices[j]];
    send_rows[static_cast<size_t>(x.tp_owner)] += x.spec.numel();
    if (x.tp_owner == me)
      for (size_t t = 0; t < nt; ++t) recv_rows[t] += x.spec.numel();
  }
  int64_t send_total = 0, recv_total = 0;
  std::vector<int64_t> send_at = block_starts(send_rows, send_total), recv_at = block_starts(recv_rows, recv_total);
  Tensor send = Tensor::empty({send_total}, DType::f32, MemCategory::communication, "muon.exchange.tp_send");
  Tensor recv = Tensor::empty({recv_total}, DType::f32, MemCategory::communication, "muon.exchange.tp_recv");
  std::vector<int64_t> send_pos(held.size(), 0);
  std::vector<bool> has(held.size(), false);
  for (size_t j = 0; j < held.size(); ++j) {
    if (!held[j].defined()) continue;
    const Matrix& x = muon_[e.matrices[j]];
    const size_t owner = static_cast<size_t>(x.tp_owner);
    has[j] = true;
    send_pos[j] = send_at[owner];
    send_at[owner] += x.spec.numel();
    Tensor dst = send.slice(send_pos[j], x.spec.numel());
    dst.copy_from(held[j].view({x.spec.numel()}));
    held[j] = Tensor();
  }
  trade(tp, send, send_rows, recv, recv_rows, "muon.gather.tp");
  // Each matrix this rank owns: the global matrix from every rank's slice,
  // orthogonalised, and cut back into slices where they came from (the
  // padding of a slice past the matrix's end zero).
  for (size_t j = 0; j < held.size(); ++j) {
    const Matrix& x = muon_[e.matrices[j]];
    if (!has[j] || x.tp_owner != me) continue;
    const int64_t numel = x.spec.numel(), extent = x.spec.shape[static_cast<size_t>(x.spec.slice.dim)];
    auto slice_of = [&](size_t t) {
      ParamSpec of_rank = x.spec;
      of_rank.slice.begin = static_cast<int64_t>(t) * extent;
      return of_rank;
    };
    Tensor u = Tensor::empty(x.spec.global_shape(), DType::f32, MemCategory::workspace, "muon.update");
    const Tensor u_flat = u.view({u.numel()});
    for (size_t t = 0; t < nt; ++t)
      for_each_global_run(slice_of(t), recv.slice(recv_at[t], numel).view(x.spec.shape), [&](Tensor run, int64_t at) {
        Tensor dst = u_flat.slice(at, run.numel());
        dst.copy_from(run);
      });
    Tensor o = Tensor::empty(x.spec.global_shape(), DType::f32, MemCategory::workspace, "muon.orthogonal");
    newton_schulz(muon, u, o);
    u = Tensor();
    for (size_t t = 0; t < nt; ++t) {
      copy_global_to_local(slice_of(t), o, recv.slice(recv_at[t], numel).view(x.spec.shape));
      recv_at[t] += numel;
    }
  }
  trade(tp, recv, recv_rows, send, send_rows, "muon.scatter.tp");
  for (size_t j = 0; j < held.size(); ++j)
    if (has[j]) {
      const Matrix& x = muon_[e.matrices[j]];
      held[j] = send.slice(send_pos[j], x.spec.numel()).view(x.spec.shape);
    }
}

void RankOptimizer::copy_state(const Tensor& first, const Tensor& second, bool into_packed) {
  auto copy = [&](const Tensor& packed, const Tensor& laid_out, const Run& r) {
    Tensor p = packed.slice(r.state_offset, r.numel), l = laid_out.slice(r.offset, r.numel);
    if (into_packed)
      p.copy_from(l);
    else
      l.copy_from(p);
  };
  for (const Matrix& x : muon_) copy(momentum_, first, x.mine);
  for (const Run& r : adamw_) {
    copy(first_, first, r);
    copy(second_, second, r);
  }
}

std::pair<Tensor, Tensor> RankOptimizer::state_in_master_layout() {
  if (!has_state()) create_state();
  if (cfg_.kind == OptimizerKind::adamw) return {first_, second_};
  const int64_t n = master_.numel();
  Tensor first = Tensor::zeros({n}, DType::f32, MemCategory::workspace, "optimizer.state_in_master_layout");
  Tensor second = Tensor::zeros({n}, DType::f32, MemCategory::workspace, "optimizer.state_in_master_layout");
  copy_state(first, second, /*into_packed=*/false);
  return {first, second};
}

void RankOptimizer::set_state_from_master_layout(const Tensor& first, const Tensor& second) {
  if (!has_state()) create_state();
  if (cfg_.kind == OptimizerKind::adamw) {
    if (first.raw() != first_.raw()) first_.copy_from(first);
    if (second.raw() != second_.raw()) second_.copy_from(second);
    return;
  }
  copy_state(first, second, /*into_packed=*/true);
}

}  // namespace anvil
