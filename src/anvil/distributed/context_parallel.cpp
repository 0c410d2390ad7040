#include "anvil/distributed/context_parallel.h"

#include <cstring>
#include <optional>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
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

int64_t cp_chunk(CpLoadBalancer balancer, int degree, int rank, int j) {
  ANVIL_ASSERT(rank >= 0 && rank < degree && (j == 0 || j == 1), "cp rank ", rank, " of ", degree, ", chunk ", j);
  if (balancer == CpLoadBalancer::headtail) return j == 0 ? rank : 2 * degree - 1 - rank;
  return 2 * rank + j;
}

ContextParallel::ContextParallel(Communicator& group, CpLoadBalancer balancer) : group_(group), balancer_(balancer) {}

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

}  // namespace

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

void ContextParallel::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                        Tensor& lse) const {
  const int64_t c = q.size(1);
  const Tensor K = gather_sequences(k, "cp.keys"), V = gather_sequences(v, "cp.values");
  // The kernels alone, apart from the gather: each rank's attention work, whose
  // balance over the group the load balancer decides (bench/context_parallel.py).
  const ScopedPhase phase(SpanCategory::forward, "cp.attention");
  for (int j = 0; j < 2; ++j) {
    Tensor out_j = chunk_rows(out, j), lse_j = chunk_rows(lse, j);
    anvil::attention_forward(chunk_rows(q, j), K, V, out_j, lse_j, 0.0f, {}, AttentionWindow{chunk(j) * c, 0});
  }
}

void ContextParallel::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk,
                                         Tensor& dv) const {
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
                              dK, dV, 0.0f, {}, AttentionWindow{chunk(j) * c, 0}, {.dq = false, .dkv = true});
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

}  // namespace anvil
