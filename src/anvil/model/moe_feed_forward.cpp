#include "anvil/model/moe_feed_forward.h"

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/model/parallel_style.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/moe_experts.h"
#include "anvil/ops/swiglu.h"

namespace anvil {

namespace {
// The token runs of each sequence this rank holds (part of) among the M = B·T
// rows: B whole sequences, or where the sequence layout puts them.
std::vector<std::vector<SequenceLayout::TokenRun>> sequence_runs(int64_t B, int64_t T, const SequenceLayout* layout) {
  std::vector<std::vector<SequenceLayout::TokenRun>> runs;
  const int64_t S = layout ? layout->sequences(B) : B;
  for (int64_t s = 0; s < S; ++s)
    runs.push_back(layout ? layout->sequence_runs(s, B, T) : std::vector<SequenceLayout::TokenRun>{{s * T, T}});
  return runs;
}

// Each sequence's load-balancing sums over all of its tokens (summed over
// the ranks holding its other parts), and Σ over the sequences of their losses.
double sequence_aux_losses(MoeSaved& saved, int64_t E, bool sigmoid, const SequenceLayout* layout) {
  saved.aux_sums.assign(saved.runs.size(), RouterAuxSums{});
  for (size_t s = 0; s < saved.runs.size(); ++s)
    for (const SequenceLayout::TokenRun& r : saved.runs[s])
      router_aux_sums(saved.probs.slice(r.first, r.tokens), saved.experts.slice(r.first, r.tokens), sigmoid,
                      saved.aux_sums[s]);
  if (layout) {  // the parts of every sequence, in one exchange: per sequence E counts, E shares, its tokens
    const auto Es = static_cast<size_t>(E), per = 2 * Es + 1;
    std::vector<double> v(saved.runs.size() * per);
    for (size_t s = 0; s < saved.runs.size(); ++s) {
      const RouterAuxSums& a = saved.aux_sums[s];
      std::copy(a.chose.begin(), a.chose.end(), v.begin() + static_cast<std::ptrdiff_t>(s * per));
      std::copy(a.share.begin(), a.share.end(), v.begin() + static_cast<std::ptrdiff_t>(s * per + Es));
      v[s * per + 2 * Es] = a.tokens;
    }
    layout->sum_over_parts(v);
    for (size_t s = 0; s < saved.runs.size(); ++s) {
      RouterAuxSums& a = saved.aux_sums[s];
      const auto at = v.begin() + static_cast<std::ptrdiff_t>(s * per);
      a.chose.assign(at, at + static_cast<std::ptrdiff_t>(Es));
      a.share.assign(at + static_cast<std::ptrdiff_t>(Es), at + static_cast<std::ptrdiff_t>(2 * Es));
      a.tokens = v[s * per + 2 * Es];
    }
  }
  double sum = 0;
  for (const RouterAuxSums& a : saved.aux_sums) sum += router_aux_loss(a);
  return sum;
}

// Adds coef times the gradient of Σ of the sequences' losses to this rank's rows of dlogits.
void sequence_aux_backward(const MoeSaved& saved, bool sigmoid, float coef, Tensor& dlogits) {
  for (size_t s = 0; s < saved.runs.size(); ++s)
    for (const SequenceLayout::TokenRun& r : saved.runs[s]) {
      Tensor d = dlogits.slice(r.first, r.tokens);
      router_aux_backward(saved.probs.slice(r.first, r.tokens), saved.aux_sums[s], coef, d, sigmoid);
    }
}

// Where this rank's routed rows go and where the rows its experts get come
// from: the counts per (rank, local expert) both ways, and the expert-major
// order of the received rows (which arrive source rank by source rank, each
// source's rows by local expert).
ExpertTraffic plan_traffic(const ExpertRoutes& routes, int64_t local_experts, ExpertExchange& exchange) {
  const int64_t n = exchange.size(), El = local_experts;
  std::vector<int64_t> sent(static_cast<size_t>(n * El));
  for (int64_t e = 0; e < n * El; ++e) sent[static_cast<size_t>(e)] = routes.rows(e);  // global e = r·El + j
  const std::vector<int64_t> got = exchange.exchange_counts(sent);
  ExpertTraffic t;
  t.send_rows.assign(static_cast<size_t>(n), 0);
  t.recv_rows.assign(static_cast<size_t>(n), 0);
  t.local_offsets.assign(static_cast<size_t>(El + 1), 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < El; ++j) {
      t.send_rows[static_cast<size_t>(r)] += sent[static_cast<size_t>(r * El + j)];
      t.recv_rows[static_cast<size_t>(r)] += got[static_cast<size_t>(r * El + j)];
      t.local_offsets[static_cast<size_t>(j + 1)] += got[static_cast<size_t>(r * El + j)];
    }
  for (int64_t j = 0; j < El; ++j) t.local_offsets[static_cast<size_t>(j + 1)] += t.local_offsets[static_cast<size_t>(j)];
  const int64_t received = t.local_offsets.back();
  t.order = Tensor::empty({received}, DType::i32, MemCategory::activations, "moe.received_order");
  if (dry_run()) return t;
  // Expert-major position p of local expert j's rows from source s: after the
  // earlier experts' rows and the earlier sources' rows of j.
  std::vector<int64_t> next(t.local_offsets.begin(), t.local_offsets.end() - 1);
  int32_t* order = t.order.data<int32_t>();
  int64_t at = 0;  // the received row, source-major
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < El; ++j)
      for (int64_t c = 0; c < got[static_cast<size_t>(s * El + j)]; ++c) order[next[static_cast<size_t>(j)]++] = static_cast<int32_t>(at++);
  return t;
}

// The experts' SwiGLU on their rows xe (R, D) by `offsets`: fills g, u, s and
// returns their outputs (R, D).
Tensor run_experts(const Tensor& xe, const MoeWeights& w, const std::vector<int64_t>& offsets, MoeSaved& saved) {
  const int64_t R = xe.size(0), D = xe.size(1), F = w.w1.size(1);
  const DType dt = xe.dtype();
  saved.g = new_activation({R, F}, dt, "moe.g");
  saved.u = new_activation({R, F}, dt, "moe.u");
  grouped_linear_forward(xe, w.w1, offsets, saved.g);
  grouped_linear_forward(xe, w.w3, offsets, saved.u);
  saved.s = new_activation({R, F}, dt, "moe.s");
  swiglu_forward(saved.g, saved.u, saved.s);
  Tensor ye = new_activation({R, D}, dt, "moe.ye");
  grouped_linear_forward(saved.s, w.w2, offsets, ye);
  return ye;
}

// Their backward from dye (R, D): the weights' gradients added to grads,
// returns the gradient of their rows; consumes g, u, s and xe.
Tensor experts_backward(Tensor dye, const MoeWeights& w, const std::vector<int64_t>& offsets, MoeSaved& saved,
                        const MoeWeights& grads) {
  const int64_t R = dye.size(0), D = dye.size(1), F = w.w1.size(1);
  const DType dt = dye.dtype();
  // Down projection, then SwiGLU (dg, du into g, u), then gate and up.
  Tensor ds = new_activation({R, F}, dt, "moe.ds");
  grouped_linear_backward_input(dye, w.w2, offsets, ds);
  Tensor gw2 = grads.w2;
  grouped_linear_backward_weight(dye, saved.s, offsets, gw2);
  dye = saved.s = Tensor();
  swiglu_backward(ds, saved.g, saved.u, saved.g, saved.u);
  ds = Tensor();
  Tensor dxe = new_activation({R, D}, dt, "moe.dxe");
  grouped_linear_backward_input(saved.g, w.w1, offsets, dxe);
  grouped_linear_backward_input(saved.u, w.w3, offsets, dxe, /*accumulate=*/true);
  Tensor gw1 = grads.w1, gw3 = grads.w3;
  grouped_linear_backward_weight(saved.g, saved.xe, offsets, gw1);
  grouped_linear_backward_weight(saved.u, saved.xe, offsets, gw3);
  saved.g = saved.u = saved.xe = Tensor();
  return dxe;
}

// Rows (this rank's routes, route order) to the experts' ranks, returned
// there in expert-major order; and back.
Tensor to_experts(const Tensor& rows, const ExpertTraffic& t, ExpertExchange& exchange, const char* tag) {
  const int64_t received = t.local_offsets.back(), D = rows.size(1);
  Tensor arrived = new_activation({received, D}, rows.dtype(), "moe.arrived");
  exchange.exchange_rows(rows, t.send_rows, arrived, t.recv_rows);
  Tensor out = new_activation({received, D}, rows.dtype(), tag);
  gather_rows(arrived, t.order, out);
  return out;
}
Tensor from_experts(const Tensor& rows, const ExpertTraffic& t, ExpertExchange& exchange, int64_t routes,
                    const char* tag) {
  const int64_t D = rows.size(1);
  Tensor leaving = new_activation(rows.shape(), rows.dtype(), "moe.leaving");
  scatter_rows(rows, t.order, leaving);
  Tensor out = new_activation({routes, D}, rows.dtype(), tag);
  exchange.exchange_rows(leaving, t.recv_rows, out, t.send_rows);
  return out;
}
}  // namespace

Tensor moe_forward(const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, MoeSaved& saved, int64_t rows,
                   const Tensor& residual, ExpertExchange* exchange, const SequenceLayout* layout) {
  const int64_t M = x.size(0), D = x.size(1), E = w.router.size(0), El = w.w1.size(0), F = w.w1.size(1),
                k = cfg.top_k, n = exchange ? exchange->size() : 1;
  const DType dt = x.dtype();
  ANVIL_ASSERT(w.router.size(1) == D && El * n == E && w.w1.shape() == Shape({El, F, D}) &&
                   w.w3.shape() == w.w1.shape() && w.w2.shape() == Shape({El, D, F}) && k >= 1 && k <= E,
               "moe: x ", shape_str(x.shape()), " router ", shape_str(w.router.shape()), " w1 ",
               shape_str(w.w1.shape()), " w2 ", shape_str(w.w2.shape()), " top_k ", k, " over ", n, " rank(s)");
  ANVIL_ASSERT(rows >= 1 && M % rows == 0, "moe: ", M, " token rows are not ", rows, " rows of tokens");
  const int64_t T = M / rows;
  saved = MoeSaved{};
  saved.runs = sequence_runs(rows, T, layout);
  saved.sequences = static_cast<int64_t>(saved.runs.size());
  // The router in f32, as Hugging Face's softmax runs in float32 (and torchtitan's sigmoid scores).
  Tensor logits = new_activation({M, E}, DType::f32, "moe.router_logits");
  gemm({.M = M, .N = E, .K = D, .trans_b = true, .ab = dt, .c = DType::f32}, x.raw(), w.router.raw(), logits.raw());
  saved.probs = new_activation({M, E}, DType::f32, "moe.router_probs");
  saved.experts = new_activation({M, k}, DType::i32, "moe.experts");
  saved.weights = new_activation({M, k}, DType::f32, "moe.weights");
  RouterConfig routing = cfg;
  routing.sequence_length = T;
  std::vector<int64_t> positions;  // where the rows are not whole sequences from position 0
  if (cfg.balanced && layout) {
    positions = layout->token_positions(rows, T);
    routing.positions = positions.data();
  }
  router_forward(logits, routing, saved.probs, saved.experts, saved.weights);
  logits = Tensor();
  saved.aux_loss = sequence_aux_losses(saved, E, cfg.sigmoid, layout);
  saved.routes = sort_routes(saved.experts, E, cfg.balanced ? balanced_route_offsets(M, E, routing) : std::vector<int64_t>{});
  const int64_t R = M * k;
  Tensor xe = new_activation({R, D}, dt, "moe.xe");
  dispatch_forward(x, saved.routes, xe);
  if (exchange) {
    saved.traffic = plan_traffic(saved.routes, El, *exchange);
    saved.xe = to_experts(xe, saved.traffic, *exchange, "moe.expert_rows");
    xe = Tensor();
    const Tensor ye = run_experts(saved.xe, w, saved.traffic.local_offsets, saved);
    saved.ye = from_experts(ye, saved.traffic, *exchange, R, "moe.ye_returned");
  } else {
    saved.xe = xe;
    saved.ye = run_experts(saved.xe, w, saved.routes.offsets, saved);
  }
  Tensor y = new_activation({M, D}, dt, "moe.y");
  combine_forward(saved.ye, saved.weights, saved.routes, y, residual);
  return y;
}

void moe_backward(const Tensor& dy, const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, float aux_coef,
                  MoeSaved& saved, Tensor& dx, const MoeWeights& grads, ExpertExchange* exchange,
                  const ExpertWidthSplit* split) {
  const int64_t M = x.size(0), D = x.size(1), E = w.router.size(0), R = saved.ye.size(0);
  const DType dt = x.dtype();
  // The combine: each route's weighted gradient, and each weight's.
  Tensor dye = new_activation({R, D}, dt, "moe.dye");
  Tensor dweights = new_activation({M, cfg.top_k}, DType::f32, "moe.dweights");
  combine_backward(dy, saved.ye, saved.weights, saved.routes, dye, dweights);
  saved.ye = Tensor();
  if (split) split->sum_over_ranks(dweights);  // each rank's ye is a partial sum over the experts' width
  Tensor dxe;
  if (exchange) {  // the output gradients to the experts' ranks, the input gradients back
    Tensor dyl = to_experts(dye, saved.traffic, *exchange, "moe.expert_dye");
    dye = Tensor();
    const Tensor dxl = experts_backward(std::move(dyl), w, saved.traffic.local_offsets, saved, grads);
    dxe = from_experts(dxl, saved.traffic, *exchange, R, "moe.dxe_returned");
  } else {
    dxe = experts_backward(std::move(dye), w, saved.routes.offsets, saved, grads);
  }
  dispatch_backward(dxe, saved.routes, dx);
  dxe = Tensor();
  // The router: through the top-k weights and the scores, plus the auxiliary loss's gradient.
  Tensor dlogits = new_activation({M, E}, DType::f32, "moe.dlogits");
  router_backward(saved.probs, saved.experts, dweights, cfg, dlogits);
  if (aux_coef != 0.0f) sequence_aux_backward(saved, cfg.sigmoid, aux_coef, dlogits);
  Tensor dlogits_dt = dt == DType::f32 ? dlogits : dlogits.to(dt, MemCategory::activations, "moe.dlogits_compute");
  if (!split || split->first_rank()) linear_backward_input(dlogits_dt, w.router, dx, /*accumulate_dx=*/true);
  Tensor grouter = grads.router;
  linear_backward_weight(dlogits_dt, x, grouter);
  saved = MoeSaved{};
}

}  // namespace anvil
