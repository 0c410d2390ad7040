#include "anvil/model/moe_feed_forward.h"

#include "anvil/core/error.h"
#include "anvil/model/parallel_style.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/moe_experts.h"
#include "anvil/ops/swiglu.h"

namespace anvil {

namespace {
// Σ over the sequences of their auxiliary losses; with dlogits, adds coef
// times its gradient there. A sequence's rows are a contiguous slice.
double sequence_aux_losses(const MoeSaved& saved, float coef, Tensor* dlogits) {
  const int64_t M = saved.probs.size(0), S = saved.sequences, T = M / S;
  double sum = 0;
  for (int64_t s = 0; s < S; ++s) {
    Tensor d = dlogits ? dlogits->slice(s * T, T) : Tensor();
    sum += router_aux_loss(saved.probs.slice(s * T, T), saved.experts.slice(s * T, T), coef, dlogits ? &d : nullptr);
  }
  return sum;
}
}  // namespace

Tensor moe_forward(const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, MoeSaved& saved,
                   int64_t sequences, const Tensor& residual) {
  const int64_t M = x.size(0), D = x.size(1), E = w.router.size(0), F = w.w1.size(1), k = cfg.top_k;
  const DType dt = x.dtype();
  ANVIL_ASSERT(w.router.size(1) == D && w.w1.shape() == Shape({E, F, D}) && w.w3.shape() == w.w1.shape() &&
                   w.w2.shape() == Shape({E, D, F}) && k >= 1 && k <= E,
               "moe: x ", shape_str(x.shape()), " router ", shape_str(w.router.shape()), " w1 ",
               shape_str(w.w1.shape()), " w2 ", shape_str(w.w2.shape()), " top_k ", k);
  ANVIL_ASSERT(sequences >= 1 && M % sequences == 0, "moe: ", M, " rows are not ", sequences, " sequences");
  saved = MoeSaved{};
  saved.sequences = sequences;
  // The router in f32, as Hugging Face's softmax runs in float32.
  Tensor logits = new_activation({M, E}, DType::f32, "moe.router_logits");
  gemm({.M = M, .N = E, .K = D, .trans_b = true, .ab = dt, .c = DType::f32}, x.raw(), w.router.raw(), logits.raw());
  saved.probs = new_activation({M, E}, DType::f32, "moe.router_probs");
  saved.experts = new_activation({M, k}, DType::i32, "moe.experts");
  saved.weights = new_activation({M, k}, DType::f32, "moe.weights");
  router_forward(logits, cfg, saved.probs, saved.experts, saved.weights);
  logits = Tensor();
  saved.aux_loss = sequence_aux_losses(saved, 0.0f, nullptr);
  saved.routes = sort_routes(saved.experts, E);
  const std::vector<int64_t>& offsets = saved.routes.offsets;
  const int64_t R = M * k;
  saved.xe = new_activation({R, D}, dt, "moe.xe");
  dispatch_forward(x, saved.routes, saved.xe);
  saved.g = new_activation({R, F}, dt, "moe.g");
  saved.u = new_activation({R, F}, dt, "moe.u");
  grouped_linear_forward(saved.xe, w.w1, offsets, saved.g);
  grouped_linear_forward(saved.xe, w.w3, offsets, saved.u);
  saved.s = new_activation({R, F}, dt, "moe.s");
  swiglu_forward(saved.g, saved.u, saved.s);
  saved.ye = new_activation({R, D}, dt, "moe.ye");
  grouped_linear_forward(saved.s, w.w2, offsets, saved.ye);
  Tensor y = new_activation({M, D}, dt, "moe.y");
  combine_forward(saved.ye, saved.weights, saved.routes, y, residual);
  return y;
}

void moe_backward(const Tensor& dy, const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, float aux_coef,
                  MoeSaved& saved, Tensor& dx, const MoeWeights& grads) {
  const int64_t M = x.size(0), D = x.size(1), E = w.router.size(0), F = w.w1.size(1), R = saved.xe.size(0);
  const DType dt = x.dtype();
  const std::vector<int64_t>& offsets = saved.routes.offsets;
  // The combine: each row's weighted gradient, and each weight's.
  Tensor dye = new_activation({R, D}, dt, "moe.dye");
  Tensor dweights = new_activation({M, cfg.top_k}, DType::f32, "moe.dweights");
  combine_backward(dy, saved.ye, saved.weights, saved.routes, dye, dweights);
  saved.ye = Tensor();
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
  dispatch_backward(dxe, saved.routes, dx);
  dxe = Tensor();
  // The router: through the top-k weights and the softmax, plus the auxiliary loss's gradient.
  Tensor dlogits = new_activation({M, E}, DType::f32, "moe.dlogits");
  router_backward(saved.probs, saved.experts, dweights, cfg, dlogits);
  if (aux_coef != 0.0f) sequence_aux_losses(saved, aux_coef, &dlogits);
  Tensor dlogits_dt = dt == DType::f32 ? dlogits : dlogits.to(dt, MemCategory::activations, "moe.dlogits_compute");
  linear_backward_input(dlogits_dt, w.router, dx, /*accumulate_dx=*/true);
  Tensor grouter = grads.router;
  linear_backward_weight(dlogits_dt, x, grouter);
  saved = MoeSaved{};
}

}  // namespace anvil
