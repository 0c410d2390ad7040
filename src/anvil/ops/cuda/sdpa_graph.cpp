#include "anvil/ops/cuda/sdpa_graph.h"

#include <array>
#include <vector>

namespace anvil {

namespace {

namespace fe = cudnn_frontend;
using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;

std::vector<int64_t> as_vector(const std::array<int64_t, 4>& a) { return {a.begin(), a.end()}; }

// A tensor as the layout declares it. The type is set on each tensor, not
// left to the graph's io type, so the serialised graph states it.
fe::graph::Tensor_attributes& declare(fe::graph::Tensor_attributes& t, const char* name, SdpaUid uid,
                                      const CudnnTensorLayout& l, fe::DataType_t type) {
  return t.set_name(name)
      .set_uid(static_cast<int64_t>(uid))
      .set_dim(as_vector(l.dim))
      .set_stride(as_vector(l.stride))
      .set_data_type(type);
}

Tensor input(fe::graph::Graph& g, const char* name, SdpaUid uid, const CudnnTensorLayout& l,
             fe::DataType_t type = fe::DataType_t::BFLOAT16) {
  fe::graph::Tensor_attributes t;
  return g.tensor(declare(t, name, uid, l, type));
}

void output(const Tensor& t, const char* name, SdpaUid uid, const CudnnTensorLayout& l,
            fe::DataType_t type = fe::DataType_t::BFLOAT16) {
  declare(*t, name, uid, l, type).set_output(true);
}

// bf16 in and out; the softmax, its statistics and the products' sums in f32
// (as Anvil's CPU attention on bf16).
std::shared_ptr<fe::graph::Graph> new_graph(const char* name) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_name(name)
      .set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// Anvil's causal mask, as the layout states it: query row i sees keys
// 0..i + right bound (0), the diagonal aligned top-left.
template <class Attributes>
void set_mask(Attributes& a, const SdpaLayout& l) {
  a.set_diagonal_alignment(l.causal_top_left ? fe::DiagonalAlignment_t::TOP_LEFT
                                             : fe::DiagonalAlignment_t::BOTTOM_RIGHT)
      .set_diagonal_band_right_bound(static_cast<int>(l.diagonal_right_bound));
}

}  // namespace

std::shared_ptr<fe::graph::Graph> sdpa_forward_graph(const SdpaLayout& l) {
  auto g = new_graph("anvil_sdpa_forward");
  const Tensor q = input(*g, "q", SdpaUid::q, l.q);
  const Tensor k = input(*g, "k", SdpaUid::k, l.k);
  const Tensor v = input(*g, "v", SdpaUid::v, l.v);
  auto attributes = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(l.attn_scale);
  set_mask(attributes, l);
  auto [o, stats] = g->sdpa(q, k, v, attributes);
  output(o, "o", SdpaUid::o, l.o);
  output(stats, "stats", SdpaUid::stats, l.stats, fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> sdpa_backward_graph(const SdpaLayout& l) {
  auto g = new_graph("anvil_sdpa_backward");
  const Tensor q = input(*g, "q", SdpaUid::q, l.q);
  const Tensor k = input(*g, "k", SdpaUid::k, l.k);
  const Tensor v = input(*g, "v", SdpaUid::v, l.v);
  const Tensor o = input(*g, "o", SdpaUid::o, l.o);
  const Tensor d_o = input(*g, "dO", SdpaUid::d_o, l.o);
  const Tensor stats = input(*g, "stats", SdpaUid::stats, l.stats, fe::DataType_t::FLOAT);
  auto attributes = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(l.attn_scale);
  set_mask(attributes, l);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, attributes);
  output(dq, "dQ", SdpaUid::dq, l.q);
  output(dk, "dK", SdpaUid::dk, l.k);
  output(dv, "dV", SdpaUid::dv, l.v);
  return g;
}

}  // namespace anvil
