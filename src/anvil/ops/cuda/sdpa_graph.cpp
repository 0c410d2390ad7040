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

// A [n, 1, 1, 1] array of the documents' pack (i32 lengths, i64 offsets).
Tensor pack_array(fe::graph::Graph& g, const char* name, SdpaUid uid, int64_t n, fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(static_cast<int64_t>(uid))
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(type));
}

// The documents' tensors of a ragged graph; null where the layout is causal.
struct Ragged {
  Tensor seq_len_q, seq_len_kv, q_offset, kv_offset, stats_offset;
};

Ragged ragged_of(fe::graph::Graph& g, const SdpaLayout& l) {
  if (!l.ragged) return {};
  return {pack_array(g, "seq_len_q", SdpaUid::seq_len_q, l.b, fe::DataType_t::INT32),
          pack_array(g, "seq_len_kv", SdpaUid::seq_len_kv, l.b, fe::DataType_t::INT32),
          pack_array(g, "q_offset", SdpaUid::q_offset, l.b + 1, fe::DataType_t::INT64),
          pack_array(g, "kv_offset", SdpaUid::kv_offset, l.b + 1, fe::DataType_t::INT64),
          pack_array(g, "stats_offset", SdpaUid::stats_offset, l.b + 1, fe::DataType_t::INT64)};
}

// The padding mask over the entries' lengths, for a ragged layout.
template <class Attributes>
void set_padding(Attributes& a, const Ragged& r) {
  if (r.seq_len_q) a.set_padding_mask(true).set_seq_len_q(r.seq_len_q).set_seq_len_kv(r.seq_len_kv);
}

void set_offset(const Tensor& t, const Tensor& offset) {
  if (offset) t->set_ragged_offset(offset);
}

}  // namespace

std::shared_ptr<fe::graph::Graph> sdpa_forward_graph(const SdpaLayout& l) {
  auto g = new_graph("anvil_sdpa_forward");
  const Tensor q = input(*g, "q", SdpaUid::q, l.q);
  const Tensor k = input(*g, "k", SdpaUid::k, l.k);
  const Tensor v = input(*g, "v", SdpaUid::v, l.v);
  const Ragged r = ragged_of(*g, l);
  for (const Tensor& t : {q, k, v}) set_offset(t, t == q ? r.q_offset : r.kv_offset);
  auto attributes = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(l.attn_scale);
  set_mask(attributes, l);
  set_padding(attributes, r);
  auto [o, stats] = g->sdpa(q, k, v, attributes);
  output(o, "o", SdpaUid::o, l.o);
  output(stats, "stats", SdpaUid::stats, l.stats, fe::DataType_t::FLOAT);
  set_offset(o, r.q_offset);
  set_offset(stats, r.stats_offset);
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
  const Ragged r = ragged_of(*g, l);
  for (const Tensor& t : {q, o, d_o}) set_offset(t, r.q_offset);
  for (const Tensor& t : {k, v}) set_offset(t, r.kv_offset);
  set_offset(stats, r.stats_offset);
  auto attributes = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(l.attn_scale);
  set_mask(attributes, l);
  set_padding(attributes, r);
  if (l.ragged) attributes.set_max_total_seq_len_q(l.max_total_seq).set_max_total_seq_len_kv(l.max_total_seq);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, attributes);
  output(dq, "dQ", SdpaUid::dq, l.q);
  output(dk, "dK", SdpaUid::dk, l.k);
  output(dv, "dV", SdpaUid::dv, l.v);
  set_offset(dq, r.q_offset);
  set_offset(dk, r.kv_offset);
  set_offset(dv, r.kv_offset);
  return g;
}

}  // namespace anvil
