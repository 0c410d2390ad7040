#include "anvil/distributed/context_parallel.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/profiler.h"
#include "anvil/ops/attention.h"

namespace anvil {

CpLoadBalancer cp_load_balancer(const std::string& name) {
  if (name == "headtail") return CpLoadBalancer::headtail;
  if (name == "none") return CpLoadBalancer::none;
  throw Error(detail::concat("parallelism.context_parallel_load_balancer is \"", name,
                             "\"; it must be \"headtail\" (each rank a head and a tail chunk of every sequence, equal "
                             "attention work) or \"none\" (each rank one contiguous piece)"));
}

const char* cp_load_balancer_name(CpLoadBalancer b) { return b == CpLoadBalancer::headtail ? "headtail" : "none"; }

CpRotateMethod cp_rotate_method(const std::string& name) {
  if (name == "allgather") return CpRotateMethod::allgather;
  if (name == "ring") return CpRotateMethod::ring;
  throw Error(detail::concat("parallelism.context_parallel_rotate_method is \"", name,
                             "\"; it must be \"allgather\" (every rank gathers the group's keys and values for each "
                             "layer) or \"ring\" (they pass from rank to rank, each transfer overlapping the attention "
                             "of the block before)"));
}

const char* cp_rotate_method_name(CpRotateMethod m) { return m == CpRotateMethod::ring ? "ring" : "allgather"; }

int64_t cp_chunk(CpLoadBalancer balancer, int degree, int rank, int j) {
  ANVIL_ASSERT(rank >= 0 && rank < degree && (j == 0 || j == 1), "cp rank ", rank, " of ", degree, ", chunk ", j);
  if (balancer == CpLoadBalancer::headtail) return j == 0 ? rank : 2 * degree - 1 - rank;
  return 2 * rank + j;
}

ContextParallel::ContextParallel(Communicator& group, CpLoadBalancer balancer, CpRotateMethod rotate)
    : group_(group), balancer_(balancer), rotate_(rotate) {}

void cp_local_rows(CpLoadBalancer balancer, int degree, int rank, const int32_t* sequences, int64_t B, int64_t T,
                   int32_t* local) {
  const int64_t c = T / (2 * degree);
  ANVIL_ASSERT(c * 2 * degree == T, "context parallelism: ", T, " tokens do not split into ", 2 * degree, " chunks");
  for (int j = 0; j < 2; ++j)
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(local + (j * B + b) * c, sequences + b * T + cp_chunk(balancer, degree, rank, j) * c,
                  static_cast<size_t>(c) * sizeof(int32_t));
}

void ContextParallel::local_tokens(const int32_t* sequences, int64_t B, int64_t T, int32_t* local) const {
  cp_local_rows(balancer_, degree(), rank(), sequences, B, T, local);
}

namespace {

// Calls f(gathered, whole) with the element offsets of every chunk's rows —
// rank r's local chunk j of sequence b, `chunk_elems` elements — in a buffer
// laid out rank by rank as an all-gather of the local rows leaves it (each
// rank's 2B rows of c tokens), and in the whole sequences (B, T, ...).
template <class F>
void for_each_chunk(CpLoadBalancer balancer, int n, int64_t B, int64_t c, int64_t chunk_elems, F f) {
  const int64_t T = 2 * n * c, token_elems = chunk_elems / c;
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < 2; ++j)
      for (int64_t b = 0; b < B; ++b)
        f((r * 2 * B + j * B + b) * chunk_elems, (b * T + cp_chunk(balancer, n, r, j) * c) * token_elems);
}

// Rows [j·B, (j+1)·B) of a local (2B, ...) tensor: local chunk j of every sequence.
Tensor chunk_rows(const Tensor& x, int j) {
  const int64_t B = x.size(0) / 2;
  return x.slice(j * B, B);
}

// One rank's keys and values (2B, c, Hkv, D), or their gradients: what a
// ring step passes on.
struct KvBlock {
  Tensor k, v;
};

KvBlock kv_block(const Tensor& like, const char* k_tag, const char* v_tag) {
  return {Tensor::empty(like.shape(), like.dtype(), MemCategory::communication, k_tag),
          Tensor::empty(like.shape(), like.dtype(), MemCategory::communication, v_tag)};
}

// A block going to the next rank and another coming from the previous one.
struct KvTransfer {
  Work send_k, send_v, recv_k, recv_v;
  // MPI moves a message only inside MPI calls: called between kernels.
  void progress() {
    for (Work* w : {&recv_k, &recv_v, &send_k, &send_v})
      if (w->pending()) (void)w->test();
  }
  void wait() {
    for (Work* w : {&recv_k, &recv_v, &send_k, &send_v})
      if (w->pending()) w->wait();
  }
};

// Tags 0 and 1 carry keys and values, 2 and 3 their gradients (both travel at once in the backward).
KvTransfer pass_on(Communicator& group, const KvBlock& out, int to, const KvBlock& in, int from, int tag) {
  KvTransfer t;
  t.recv_k = group.irecv(in.k, from, tag);
  t.recv_v = group.irecv(in.v, from, tag + 1);
  t.send_k = group.isend(out.k, to, tag);
  t.send_v = group.isend(out.v, to, tag + 1);
  return t;
}

// The ring's keys and values: at step s a rank holds rank (r − s)'s block
// while it travels on to the next rank and the next block arrives (into one
// of two spare blocks, made when first needed).
struct KvRing {
  KvRing(Communicator& g, int ranks, int to, int from, KvBlock own)
      : group(g), n(ranks), next(to), prev(from), held(std::move(own)) {}
  Communicator& group;
  int n, next, prev;
  KvBlock held, spare[2], incoming;
  KvTransfer transfer;
  void begin_step(int s) {
    if (s + 1 >= n) return;
    if (!spare[s % 2].k.defined()) spare[s % 2] = kv_block(held.k, "cp.ring_keys", "cp.ring_values");
    incoming = spare[s % 2];
    transfer = pass_on(group, held, next, incoming, prev, 0);
  }
  void end_step(int s) {
    transfer.wait();
    if (s + 1 < n) held = incoming;
  }
};

// into += from, elementwise (f32, or bf16 summed in f32 and rounded once).
void add_into(const Tensor& from, const Tensor& into) {
  ANVIL_ASSERT(from.shape() == into.shape() && from.dtype() == into.dtype(), "add_into: ", shape_str(from.shape()),
               " into ", shape_str(into.shape()));
  auto add = [&](auto* dst, const auto* src) {
    parallel_for(0, from.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(dst)>>;
      for (int64_t i = lo; i < hi; ++i) dst[i] = from_f32<T>(to_f32(dst[i]) + to_f32(src[i]));
    });
  };
  if (from.dtype() == DType::f32)
    add(into.data<float>(), from.data<float>());
  else
    add(into.data<bf16>(), from.data<bf16>());
}

}  // namespace

int64_t ContextParallel::sequences(int64_t B) const {
  ANVIL_ASSERT(B % 2 == 0, "context parallelism: ", B, " rows are not two chunks of each sequence");
  return B / 2;
}

std::vector<SequenceLayout::TokenRun> ContextParallel::sequence_runs(int64_t b, int64_t B, int64_t T) const {
  const int64_t sequences_held = sequences(B);
  ANVIL_ASSERT(b >= 0 && b < sequences_held, "context parallelism: sequence ", b, " of ", sequences_held);
  return {{b * T, T}, {(sequences_held + b) * T, T}};
}

std::vector<int64_t> ContextParallel::token_positions(int64_t B, int64_t T) const {
  const int64_t sequences_held = sequences(B);
  std::vector<int64_t> positions(static_cast<size_t>(B * T));
  for (int64_t r = 0; r < B; ++r)
    for (int64_t i = 0; i < T; ++i)
      positions[static_cast<size_t>(r * T + i)] = chunk(static_cast<int>(r / sequences_held)) * T + i;
  return positions;
}

void ContextParallel::sum_over_parts(std::vector<double>& values) const {
  // Each value as an f32 and its f32 remainder (about 2^-48 of it), gathered
  // from the group and summed in f64 in rank order: every rank gets the same sum.
  const auto n = static_cast<int64_t>(values.size());
  Tensor mine = Tensor::empty({2 * n}, DType::f32, MemCategory::communication, "cp.sequence_parts");
  Tensor all = Tensor::empty({degree() * 2 * n}, DType::f32, MemCategory::communication, "cp.sequence_parts");
  if (!dry_run()) {
    float* f = mine.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const double v = values[static_cast<size_t>(i)];
      f[2 * i] = static_cast<float>(v);
      f[2 * i + 1] = static_cast<float>(v - static_cast<double>(f[2 * i]));
    }
  }
  group_.all_gather(mine, all);
  if (dry_run()) return;
  const float* f = all.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int r = 0; r < degree(); ++r)
      sum += static_cast<double>(f[(r * n + i) * 2]) + static_cast<double>(f[(r * n + i) * 2 + 1]);
    values[static_cast<size_t>(i)] = sum;
  }
}

void ContextParallel::rope_forward(const Tensor& x, const RopeTable& table, Tensor& y) const {
  const int64_t c = x.size(1);
  for (int j = 0; j < 2; ++j) {
    Tensor yj = chunk_rows(y, j);
    anvil::rope_forward(chunk_rows(x, j), table, chunk(j) * c, yj);
  }
}

void ContextParallel::rope_backward(const Tensor& dy, const RopeTable& table, Tensor& dx) const {
  const int64_t c = dy.size(1);
  for (int j = 0; j < 2; ++j) {
    Tensor dxj = chunk_rows(dx, j);
    anvil::rope_backward(chunk_rows(dy, j), table, chunk(j) * c, dxj);
  }
}

Tensor ContextParallel::gather_sequences(const Tensor& local, const char* tag) const {
  const int64_t B = local.size(0) / 2, c = local.size(1), H = local.size(2), D = local.size(3);
  const int n = degree();
  const int64_t T = 2 * n * c, row = c * H * D;  // elements of one chunk of one sequence
  Tensor gathered = Tensor::empty({n * 2 * B, c, H, D}, local.dtype(), MemCategory::communication, "cp.gathered");
  group_.all_gather(local, gathered);
  Tensor whole = Tensor::empty({B, T, H, D}, local.dtype(), MemCategory::communication, tag);
  if (dry_run()) return whole;
  const size_t es = dtype_size(local.dtype());
  const auto* src = static_cast<const char*>(gathered.raw());
  auto* dst = static_cast<char*>(whole.raw());
  for_each_chunk(balancer_, n, B, c, row, [&](int64_t rank_major, int64_t sequence) {
    std::memcpy(dst + static_cast<size_t>(sequence) * es, src + static_cast<size_t>(rank_major) * es,
                static_cast<size_t>(row) * es);
  });
  return whole;
}

void ContextParallel::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                        const Tensor& documents) const {
  if (rotate_ == CpRotateMethod::ring) return ring_forward(q, k, v, out, lse, documents);
  const int64_t c = q.size(1);
  const Tensor K = gather_sequences(k, "cp.keys"), V = gather_sequences(v, "cp.values");
  // The kernels alone, apart from the gather: each rank's attention work, whose
  // balance over the group the load balancer decides (bench/context_parallel.py).
  const ScopedPhase phase(SpanCategory::forward, "cp.attention");
  for (int j = 0; j < 2; ++j) {
    Tensor out_j = chunk_rows(out, j), lse_j = chunk_rows(lse, j);
    anvil::attention_forward(chunk_rows(q, j), K, V, out_j, lse_j, 0.0f, {},
                             AttentionWindow{chunk(j) * c, 0, documents});
  }
}

void ContextParallel::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                                         const Tensor& documents) const {
  if (rotate_ == CpRotateMethod::ring) return ring_backward(dout, q, k, v, out, lse, dq, dk, dv, documents);
  const int64_t B = q.size(0) / 2, c = q.size(1), Hkv = k.size(2), D = k.size(3);
  const int n = degree();
  const int64_t row = c * Hkv * D;  // elements of one chunk of one sequence
  const Tensor K = gather_sequences(k, "cp.keys"), V = gather_sequences(v, "cp.values");
  // The keys' gradients of both local chunks' queries, over whole sequences.
  Tensor dK = Tensor::zeros(K.shape(), K.dtype(), MemCategory::communication, "cp.dkeys");
  Tensor dV = Tensor::zeros(V.shape(), V.dtype(), MemCategory::communication, "cp.dvalues");
  std::optional<ScopedPhase> phase(std::in_place, SpanCategory::backward, "cp.attention_backward");
  for (int j = 0; j < 2; ++j) {
    Tensor dq_j = chunk_rows(dq, j);
    anvil::attention_backward(chunk_rows(dout, j), chunk_rows(q, j), K, V, chunk_rows(out, j), chunk_rows(lse, j), dq_j,
                              dK, dV, 0.0f, {}, AttentionWindow{chunk(j) * c, 0, documents},
                              {.dq = false, .dkv = true});
  }
  phase.reset();
  // Every rank's keys' gradients summed into the ranks that hold those keys:
  // laid out rank by rank as the gather came, then reduce-scattered.
  for (auto [whole, local] : {std::pair<const Tensor*, Tensor*>{&dK, &dk}, {&dV, &dv}}) {
    Tensor by_rank =
        Tensor::empty({n * 2 * B, c, Hkv, D}, whole->dtype(), MemCategory::communication, "cp.dkv_by_rank");
    if (!dry_run()) {
      const size_t es = dtype_size(whole->dtype());
      const auto* src = static_cast<const char*>(whole->raw());
      auto* dst = static_cast<char*>(by_rank.raw());
      for_each_chunk(balancer_, n, B, c, row, [&](int64_t rank_major, int64_t sequence) {
        std::memcpy(dst + static_cast<size_t>(rank_major) * es, src + static_cast<size_t>(sequence) * es,
                    static_cast<size_t>(row) * es);
      });
    }
    group_.reduce_scatter(by_rank, *local);
  }
}

void ContextParallel::ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                   const Tensor& documents) const {
  const int n = degree(), next = (rank() + 1) % n, prev = (rank() + n - 1) % n;
  const int64_t B = q.size(0) / 2, c = q.size(1), Hq = q.size(2), D = q.size(3);
  // The merged attention so far, in f32 (out itself when it is f32), and its lse.
  const bool f32 = out.dtype() == DType::f32;
  Tensor acc = f32 ? out : Tensor::empty(out.shape(), DType::f32, MemCategory::communication, "cp.ring_out");
  if (!dry_run()) std::fill_n(lse.data<float>(), lse.numel(), -std::numeric_limits<float>::infinity());
  Tensor part = Tensor::empty({B, c, Hq, D}, q.dtype(), MemCategory::communication, "cp.ring_part");
  Tensor part_lse = Tensor::empty({B, Hq, c}, DType::f32, MemCategory::communication, "cp.ring_part_lse");
  KvRing ring(group_, n, next, prev, {k, v});
  for (int s = 0; s < n; ++s) {
    const int src = (rank() - s + n) % n;  // whose keys this step holds
    const KvBlock& held = ring.held;
    ring.begin_step(s);
    {
      const ScopedPhase phase(SpanCategory::forward, "cp.attention");
      for (int j = 0; j < 2; ++j)
        for (int j2 = 0; j2 < 2; ++j2) {
          const int64_t qc = chunk(j), kc = cp_chunk(balancer_, n, src, j2);
          if (kc > qc) continue;  // keys after every query of the chunk
          anvil::attention_forward(chunk_rows(q, j), chunk_rows(held.k, j2), chunk_rows(held.v, j2), part, part_lse,
                                   0.0f, {}, AttentionWindow{qc * c, kc * c, documents});
          Tensor acc_j = chunk_rows(acc, j), lse_j = chunk_rows(lse, j);
          attention_merge(part, part_lse, acc_j, lse_j);
          ring.transfer.progress();
        }
    }
    ring.end_step(s);
  }
  if (!f32) out.copy_from(acc);
}

void ContextParallel::ring_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const Tensor& documents) const {
  const int n = degree(), next = (rank() + 1) % n, prev = (rank() + n - 1) % n;
  const int64_t c = q.size(1);
  // `mine`: this rank's queries' part of the held block's keys' gradients;
  // `sums`: the running sum over the ranks the block has passed, one arriving
  // while the other leaves.
  KvRing ring(group_, n, next, prev, {k, v});
  KvBlock mine = kv_block(k, "cp.ring_my_dkeys", "cp.ring_my_dvalues");
  KvBlock sums[2] = {kv_block(k, "cp.ring_dkeys", "cp.ring_dvalues"), kv_block(k, "cp.ring_dkeys", "cp.ring_dvalues")};
  KvTransfer grads;
  bool dq_written[2] = {false, false};
  for (int s = 0; s < n; ++s) {
    const int src = (rank() - s + n) % n;
    const KvBlock& held = ring.held;
    ring.begin_step(s);
    KvBlock& sum = sums[s % 2];
    // The block's own rank starts its sum (its queries see every one of its
    // keys, so every row is written); the others add to the one that came.
    const KvBlock& target = s == 0 ? sum : mine;
    bool wrote[2] = {false, false};
    {
      const ScopedPhase phase(SpanCategory::backward, "cp.attention_backward");
      for (int j = 0; j < 2; ++j)
        for (int j2 = 0; j2 < 2; ++j2) {
          const int64_t qc = chunk(j), kc = cp_chunk(balancer_, n, src, j2);
          if (kc > qc) continue;
          Tensor dq_j = chunk_rows(dq, j), dk_j2 = chunk_rows(target.k, j2), dv_j2 = chunk_rows(target.v, j2);
          anvil::attention_backward(chunk_rows(dout, j), chunk_rows(q, j), chunk_rows(held.k, j2),
                                    chunk_rows(held.v, j2), chunk_rows(out, j), chunk_rows(lse, j), dq_j, dk_j2, dv_j2,
                                    0.0f, {}, AttentionWindow{qc * c, kc * c, documents},
                                    {.dq = dq_written[j], .dkv = wrote[j2]});
          dq_written[j] = wrote[j2] = true;
          ring.transfer.progress();
          grads.progress();
        }
    }
    grads.wait();  // the sum of the ranks before has arrived; the one passed on before has left
    ANVIL_ASSERT(s > 0 || (wrote[0] && wrote[1]), "a rank's own keys are all seen by its own queries");
    for (int j2 = 0; s > 0 && j2 < 2; ++j2)
      if (wrote[j2]) {
        add_into(chunk_rows(mine.k, j2), chunk_rows(sum.k, j2));
        add_into(chunk_rows(mine.v, j2), chunk_rows(sum.v, j2));
      }
    // On to the next rank, which adds its part at the next step; after the
    // last step, to the block's own rank: the whole sum lands in dk, dv.
    const KvBlock into = s + 1 < n ? sums[(s + 1) % 2] : KvBlock{dk, dv};
    grads = pass_on(group_, sum, next, into, prev, 2);
    ring.end_step(s);
  }
  grads.wait();
}

}  // namespace anvil
