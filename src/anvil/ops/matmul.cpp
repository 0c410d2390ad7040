#include "anvil/ops/matmul.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>

#include "anvil/core/cpu_peak.h"
#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/gpu_kernels.h"

namespace anvil {

namespace {

dnnl::memory::data_type dnnl_type(DType t) {
  ANVIL_ASSERT(t != DType::i32, "matrix products take f32 or bf16");
  return t == DType::f32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
}

// A primitive is made for the threads the process runs (oneDNN sizes its
// scratchpad by them), so a change of thread count makes new ones.
// A dimension left to each call is no part of the key.
GemmShape key_shape(GemmShape s) {
  if (s.runtime == RuntimeDim::m) s.M = 0;
  if (s.runtime == RuntimeDim::k) s.K = 0;
  return s;
}

struct GemmKey {
  explicit GemmKey(const GemmShape& shape) : s(key_shape(shape)) {}
  GemmShape s;
  int threads = num_threads();
  bool operator==(const GemmKey& o) const {
    const GemmShape& a = s;
    const GemmShape& b = o.s;
    return threads == o.threads && a.M == b.M && a.N == b.N && a.K == b.K && a.trans_a == b.trans_a &&
           a.trans_b == b.trans_b && a.lda == b.lda && a.ldb == b.ldb && a.ldc == b.ldc && a.ab == b.ab && a.c == b.c &&
           a.alpha == b.alpha && a.accumulate == b.accumulate && a.runtime == b.runtime;
  }
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    const GemmShape& s = k.s;
    size_t h = 1469598103934665603ull;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(s.M), mix(s.N), mix(s.K), mix(s.lda), mix(s.ldb), mix(s.ldc);
    uint32_t alpha_bits;
    std::memcpy(&alpha_bits, &s.alpha, 4);
    mix(alpha_bits);
    mix((s.trans_a ? 1 : 0) | (s.trans_b ? 2 : 0) | (s.accumulate ? 4 : 0) | (static_cast<int>(s.ab) << 3) |
        (static_cast<int>(s.c) << 5) | (static_cast<int>(s.runtime) << 7));
    mix(static_cast<uint64_t>(k.threads));
    return h;
  }
};

struct GemmPrimitive {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c;
  dnnl::memory::desc scratch;  // supplied by the calling thread (user scratchpad mode)
  std::string impl;  // oneDNN's name for the kernel it picked
};

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::unordered_map<GemmKey, GemmPrimitive, GemmKeyHash> cache;
};

Context& context() {
  static Context ctx;
  return ctx;
}

// Row-major [rows, cols] with row stride ld, or its transpose viewed as [cols, rows].
dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, bool trans, int64_t ld, DType t) {
  // Logical shape is (rows, cols) of op(X); storage is X.
  if (!trans) return dnnl::memory::desc({rows, cols}, dnnl_type(t), dnnl::memory::dims{ld, 1});
  return dnnl::memory::desc({rows, cols}, dnnl_type(t), dnnl::memory::dims{1, ld});
}

GemmShape normalised(GemmShape s) {
  ANVIL_ASSERT(!(s.runtime == RuntimeDim::m && s.trans_a && s.lda == 0) &&
                   !(s.runtime == RuntimeDim::k && !s.trans_a && s.lda == 0) &&
                   !(s.runtime == RuntimeDim::k && s.trans_b && s.ldb == 0),
               "a product with a dimension left to each call needs strides that do not depend on it");
  if (s.lda == 0) s.lda = s.trans_a ? s.M : s.K;
  if (s.ldb == 0) s.ldb = s.trans_b ? s.K : s.N;
  if (s.ldc == 0) s.ldc = s.N;
  return s;
}

const GemmPrimitive& primitive_for(const GemmShape& s) {
  Context& ctx = context();
  std::lock_guard lock(ctx.mutex);
  auto it = ctx.cache.find(GemmKey{s});
  if (it != ctx.cache.end()) return it->second;
  GemmPrimitive g;
  const int64_t M = s.runtime == RuntimeDim::m ? DNNL_RUNTIME_DIM_VAL : s.M;
  const int64_t K = s.runtime == RuntimeDim::k ? DNNL_RUNTIME_DIM_VAL : s.K;
  g.a = matrix_desc(M, K, s.trans_a, s.lda, s.ab);
  g.b = matrix_desc(K, s.N, s.trans_b, s.ldb, s.ab);
  g.c = dnnl::memory::desc({M, s.N}, dnnl_type(s.c), dnnl::memory::dims{s.ldc, 1});
  dnnl::primitive_attr attr;
  // oneDNN's library-managed scratchpad is shared by every execution of a
  // primitive, so two threads running one cached primitive at once (gemm inside
  // parallel_for) would overwrite each other's packing buffers. Each calling
  // thread passes its own scratchpad instead.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
  if (s.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(g.a, g.b, g.c), attr, ctx.engine);
    g.prim = dnnl::matmul(pd);
    g.impl = pd.impl_info_str();
    g.scratch = pd.scratchpad_desc();
  } catch (const dnnl::error& e) {
    const std::string m = s.runtime == RuntimeDim::m ? "any" : std::to_string(s.M);
    const std::string k = s.runtime == RuntimeDim::k ? "any" : std::to_string(s.K);
    throw Error(detail::concat("oneDNN cannot build a matmul of M=", m, " N=", s.N, " K=", k, " (", dtype_name(s.ab),
                               "->", dtype_name(s.c), "): ", e.what()));
  }
  return ctx.cache.emplace(GemmKey{s}, std::move(g)).first->second;
}

// What a thread keeps between products, grown to the largest need and
// tracked as workspace: oneDNN's scratchpad, and the widened operands of bf16
// products run in f32 (run_widened). A dry run has its own, dropped when it
// ends (its allocator goes with it).
struct ThreadBuffers {
  Tensor scratch, a, b, c;
};
ThreadBuffers& thread_buffers() {
  thread_local ThreadBuffers mine;
  if (!dry_run()) return mine;
  static std::mutex mutex;
  static std::map<std::thread::id, ThreadBuffers> dry;
  const std::lock_guard lock(mutex);
  if (dry.empty())
    DryRun::release_at_end([] {
      const std::lock_guard lock(mutex);
      dry.clear();
    });
  return dry[std::this_thread::get_id()];  // map nodes stay put as others are added
}

double gemm_flops(int64_t M, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
}

void run_widened(const GemmShape& s, const void* A, const void* B, void* C);

// Whether this (normalised, bf16) product runs widened: see matmul.h. A product
// with Aᵀ whose bf16 C would be rounded between K panels stays native.
bool widens(const GemmShape& s) {
  if (s.ab != DType::bf16) return false;
  if (!native_bf16_products()) return true;
  // Inside a parallel region (a caller's own scratchpad) products stay native.
  if (omp_in_parallel() || !bf16_products_widened()) return false;
  if (s.trans_a && !s.trans_b && s.c == DType::bf16) {
    const int64_t k_panel = std::max<int64_t>(1, static_cast<int64_t>(kWidenedPanelBytes / 4) / std::max(s.M, s.N));
    return k_panel >= s.K;
  }
  return true;
}

// Rows of a panel: as many as fit in kWidenedPanelBytes of f32 `cols` wide, at least one.
int64_t panel_rows(int64_t rows, int64_t cols) {
  return std::clamp<int64_t>(static_cast<int64_t>(kWidenedPanelBytes / 4) / std::max<int64_t>(1, cols), 1, rows);
}

// A native product with `scratchpad` (at least the primitive's need), or,
// when null, this thread's own, grown to the largest need it has run.
// A primitive with its operands' memory objects, made once per thread and
// pointed at each call's buffers: attention's tile products are small enough
// (a few microseconds at head_dim 16) that taking the cache's lock and
// building four memory objects and an argument map every call cost a third
// of their time.
struct BoundPrimitive {
  const GemmPrimitive* g = nullptr;
  dnnl::memory a, b, c, scratch;
  std::unordered_map<int, dnnl::memory> args;
};
BoundPrimitive& bound_primitive(const GemmShape& s) {
  thread_local std::unordered_map<GemmKey, BoundPrimitive, GemmKeyHash> mine;
  const GemmKey key{s};
  auto it = mine.find(key);
  if (it != mine.end()) return it->second;
  BoundPrimitive p;
  p.g = &primitive_for(s);  // the cache's entries stay put as others are added
  // Memory of open dimensions cannot be made: run_native makes each call's.
  if (s.runtime != RuntimeDim::none) return mine.emplace(key, std::move(p)).first->second;
  const dnnl::engine& engine = context().engine;
  p.a = dnnl::memory(p.g->a, engine, DNNL_MEMORY_NONE);
  p.b = dnnl::memory(p.g->b, engine, DNNL_MEMORY_NONE);
  p.c = dnnl::memory(p.g->c, engine, DNNL_MEMORY_NONE);
  p.scratch = dnnl::memory(p.g->scratch, engine, DNNL_MEMORY_NONE);
  p.args = {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}, {DNNL_ARG_SCRATCHPAD, p.scratch}};
  return mine.emplace(key, std::move(p)).first->second;
}

void run_native(const GemmShape& s, const void* A, const void* B, void* C, void* scratchpad) {
  BoundPrimitive& bound = bound_primitive(s);
  const GemmPrimitive& g = *bound.g;
  Context& ctx = context();
  const size_t need = g.scratch.get_size();
  if (scratchpad == nullptr && need > 0) {  // tracked as workspace
    Tensor& scratch_buf = thread_buffers().scratch;
    if (!scratch_buf.defined() || scratch_buf.nbytes() < need)
      scratch_buf = Tensor::empty({static_cast<int64_t>((need + 1) / 2)}, DType::bf16, MemCategory::workspace,
                                  "gemm.scratchpad");
    scratchpad = scratch_buf.raw();
  }
  if (dry_run()) return;
  // A stream per thread: kernels may call gemm from inside a parallel region,
  // where oneDNN runs the product on the calling thread alone.
  thread_local dnnl::stream stream(ctx.engine);
  if (s.runtime != RuntimeDim::none) {
    // The operands' memory takes this call's dimensions (a few microseconds,
    // against a kernel kept per row count).
    const dnnl::engine& engine = ctx.engine;
    dnnl::memory a(matrix_desc(s.M, s.K, s.trans_a, s.lda, s.ab), engine, const_cast<void*>(A));
    dnnl::memory b(matrix_desc(s.K, s.N, s.trans_b, s.ldb, s.ab), engine, const_cast<void*>(B));
    dnnl::memory c(dnnl::memory::desc({s.M, s.N}, dnnl_type(s.c), dnnl::memory::dims{s.ldc, 1}), engine, C);
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    if (need > 0) args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(g.scratch, engine, scratchpad));
    g.prim.execute(stream, args);
    stream.wait();
    return;
  }
  bound.a.set_data_handle(const_cast<void*>(A));
  bound.b.set_data_handle(const_cast<void*>(B));
  bound.c.set_data_handle(C);
  if (need > 0) bound.scratch.set_data_handle(scratchpad);
  g.prim.execute(stream, bound.args);
  stream.wait();
}

void run_gemm(const GemmShape& shape, const void* A, const void* B, void* C) {
  if (shape.M == 0 || shape.N == 0) return;
  const GemmShape s = normalised(shape);
  if (s.K == 0) {
    ANVIL_ASSERT(s.accumulate, "gemm with K = 0 must accumulate");  // C += 0: nothing to do
    return;
  }
  if (widens(s)) return run_widened(s, A, B, C);
  run_native(s, A, B, C, nullptr);
}

// rows × cols of bf16 at src (row stride ld) into dense f32 at dst.
void widen_rows(const void* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  const bf16* in = static_cast<const bf16*>(src);
  parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, cols)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const bf16* row = in + r * ld;
      float* out = dst + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16::to_float(row[c].bits);
    }
  });
}

// This thread's f32 buffer `t`, grown (the old one freed first) to at least `bytes`.
float* grown(Tensor& t, size_t bytes, const char* tag) {
  if (!t.defined() || t.nbytes() < bytes) {
    t = Tensor();
    t = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::f32, MemCategory::workspace, tag);
  }
  return t.data<float>();
}

// f32 rows of C (row stride ldc, dense in `f`) back into bf16 C, or from it when accumulating.
void narrow_rows(const float* f, int64_t rows, int64_t cols, void* dst, int64_t ld) {
  bf16* out = static_cast<bf16*>(dst);
  parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, cols)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) convert_f32_to_bf16(f + r * cols, out + r * ld, cols);
  });
}

// One widened panel product: C (p.M × p.N, row stride ldc, in s.c) (+)= fa · fb, through
// the f32 rows in fc when C is bf16.
void run_panel(const GemmShape& p, const GemmShape& s, const float* fa, const float* fb, float* fc, void* C) {
  if (s.c != DType::bf16) return run_gemm(p, fa, fb, C);
  GemmShape q = p;
  q.c = DType::f32;
  q.ldc = p.N;
  if (q.accumulate) widen_rows(C, s.ldc, p.M, p.N, fc);
  run_gemm(q, fa, fb, fc);
  narrow_rows(fc, p.M, p.N, C, s.ldc);
}


// The widened product in the f32 buffers fa, fb, fc (sized by widened_operand_bytes).
void run_widened_in(const GemmShape& s, const void* A, const void* B, void* C, float* fa, float* fb, float* fc) {
  const char* a = static_cast<const char*>(A);
  const char* b = static_cast<const char*>(B);
  GemmShape p = s;
  p.ab = DType::f32;
  if (!s.trans_a) {
    // B whole, A in panels of rows of C.
    const int64_t b_rows = s.trans_b ? s.N : s.K, b_cols = s.trans_b ? s.K : s.N;
    widen_rows(b, s.ldb, b_rows, b_cols, fb);
    p.ldb = b_cols;
    p.lda = s.K;
    const int64_t rows = panel_rows(s.M, s.K);
    for (int64_t m0 = 0; m0 < s.M; m0 += rows) {
      p.M = std::min(rows, s.M - m0);
      widen_rows(a + m0 * s.lda * 2, s.lda, p.M, s.K, fa);
      run_panel(p, s, fa, fb, fc, static_cast<char*>(C) + m0 * s.ldc * static_cast<int64_t>(dtype_size(s.c)));
    }
    return;
  }
  // Aᵀ (A stored K × M): panels of K for A and, stored K × N, for B; each adds
  // into C. A bf16 C is held whole in f32 (fc) across the panels and rounded
  // once at the end, as a native kernel would, not once per panel.
  const int64_t k_rows = s.trans_b ? s.K : panel_rows(s.K, std::max(s.M, s.N));
  p.lda = s.M;
  if (s.c == DType::bf16) {
    p.c = DType::f32;
    p.ldc = s.N;
    if (s.accumulate) widen_rows(C, s.ldc, s.M, s.N, fc);
  }
  for (int64_t k0 = 0; k0 < s.K; k0 += k_rows) {
    p.K = std::min(k_rows, s.K - k0);
    p.accumulate = s.accumulate || k0 > 0;
    widen_rows(a + k0 * s.lda * 2, s.lda, p.K, s.M, fa);
    if (s.trans_b) {  // B stored N × K, whole (then K is one panel)
      widen_rows(b, s.ldb, s.N, s.K, fb);
      p.ldb = s.K;
    } else {
      widen_rows(b + k0 * s.ldb * 2, s.ldb, p.K, s.N, fb);
      p.ldb = s.N;
    }
    run_gemm(p, fa, fb, s.c == DType::bf16 ? static_cast<void*>(fc) : C);
  }
  if (s.c == DType::bf16) narrow_rows(fc, s.M, s.N, C, s.ldc);
}

// The widened product in this thread's kept buffers.
void run_widened(const GemmShape& s, const void* A, const void* B, void* C) {
  ThreadBuffers& kept = thread_buffers();
  const WidenedBytes need = widened_operand_bytes(s);
  float* fa = grown(kept.a, need.a, "gemm.widened_a");
  float* fb = grown(kept.b, need.b, "gemm.widened_b");
  float* fc = need.c > 0 ? grown(kept.c, need.c, "gemm.widened_c") : nullptr;
  if (!dry_run()) run_widened_in(s, A, B, C, fa, fb, fc);
}

// A widened product's buffers carved from a caller's scratchpad, each 64-byte aligned.
size_t aligned64(size_t bytes) { return (bytes + 63) / 64 * 64; }
size_t widened_scratchpad_bytes(const GemmShape& s) {
  const WidenedBytes need = widened_operand_bytes(s);
  return aligned64(need.a) + aligned64(need.b) + aligned64(need.c);
}

}  // namespace

bool native_bf16_products() { return cpu_features().avx512f; }

namespace {
std::atomic<int> g_bf16_widened{-1};  // -1: not chosen yet
}  // namespace

bool bf16_products_widened() {
  int widened = g_bf16_widened.load(std::memory_order_relaxed);
  if (widened < 0) {
    const char* env = std::getenv("ANVIL_BF16_PRODUCTS");
    const std::string choice = env ? env : "";
    ANVIL_CHECK(choice.empty() || choice == "native" || choice == "widened", "ANVIL_BF16_PRODUCTS is \"", choice,
                "\"; set it to native or widened, or unset it to let Anvil choose by the CPU");
    widened = choice.empty() ? bf16_products_faster_widened() : choice == "widened";
    g_bf16_widened.store(widened, std::memory_order_relaxed);
  }
  return widened != 0;
}

void release_widened_buffers() {
  ThreadBuffers& kept = thread_buffers();
  kept.a = kept.b = kept.c = Tensor();
}

void set_bf16_products_widened(bool widened) { g_bf16_widened.store(widened, std::memory_order_relaxed); }

WidenedBytes widened_operand_bytes(const GemmShape& shape) {
  if (shape.M == 0 || shape.N == 0 || shape.K == 0) return {};
  const GemmShape s = normalised(shape);
  if (!widens(s)) return {};
  const size_t c_rows = s.c == DType::bf16 ? static_cast<size_t>(s.trans_a ? s.M : panel_rows(s.M, s.K)) : 0;
  if (!s.trans_a)
    return {static_cast<size_t>(panel_rows(s.M, s.K) * s.K) * 4, static_cast<size_t>(s.K * s.N) * 4,
            c_rows * static_cast<size_t>(s.N) * 4};
  const int64_t k_rows = s.trans_b ? s.K : panel_rows(s.K, std::max(s.M, s.N));
  return {static_cast<size_t>(k_rows * s.M) * 4, static_cast<size_t>((s.trans_b ? s.K : k_rows) * s.N) * 4,
          c_rows * static_cast<size_t>(s.N) * 4};
}

void gemm(const GemmShape& shape, const void* A, const void* B, void* C) {
  const ScopedOpTime op("gemm", gemm_flops(shape.M, shape.N, shape.K));
  run_gemm(shape, A, B, C);
}

size_t gemm_scratchpad_bytes(const GemmShape& shape) {
  if (shape.M == 0 || shape.N == 0 || shape.K == 0) return 0;
  const GemmShape s = normalised(shape);
  // Widened (no native bf16 product on this CPU): the f32 operands live in the scratchpad.
  if (s.ab == DType::bf16 && !native_bf16_products()) return widened_scratchpad_bytes(s);
  return primitive_for(s).scratch.get_size();
}

void gemm(const GemmShape& shape, const void* A, const void* B, void* C, void* scratchpad) {
  const ScopedOpTime op("gemm", gemm_flops(shape.M, shape.N, shape.K));
  if (shape.M == 0 || shape.N == 0) return;
  const GemmShape s = normalised(shape);
  if (s.K == 0) {
    ANVIL_ASSERT(s.accumulate, "gemm with K = 0 must accumulate");
    return;
  }
  if (s.ab == DType::bf16 && !native_bf16_products()) {
    // In the caller's scratchpad, so a product inside a parallel region
    // allocates nothing (the dry run, which runs no parallel body, sees it all).
    const WidenedBytes need = widened_operand_bytes(s);
    float* fa = static_cast<float*>(scratchpad);
    float* fb = fa + aligned64(need.a) / 4;
    float* fc = need.c > 0 ? fb + aligned64(need.b) / 4 : nullptr;
    return run_widened_in(s, A, B, C, fa, fb, fc);
  }
  run_native(s, A, B, C, scratchpad);
}

size_t gemm_kernels_cached() {
  Context& ctx = context();
  std::lock_guard lock(ctx.mutex);
  return ctx.cache.size();
}

std::string matmul_impl_name(DType dtype, int64_t size) {
  GemmShape s;
  s.M = s.N = s.K = size;
  s.ab = s.c = dtype;
  s = normalised(s);
  if (widens(s)) {
    s.ab = s.c = DType::f32;
    std::string name = "widened to f32: ";
    name += primitive_for(s).impl;
    return name;
  }
  return primitive_for(s).impl;
}

void linear_forward(const Tensor& x, const Tensor& w, Tensor& y) {
  const int64_t M = x.size(0), K = x.size(-1), N = w.size(0);
  ANVIL_ASSERT(x.ndim() == 2 && w.ndim() == 2 && w.size(1) == K, "linear: x ", shape_str(x.shape()), " w ",
               shape_str(w.shape()));
  ANVIL_ASSERT(y.size(0) == M && y.size(1) == N && x.dtype() == w.dtype(), "linear: y ", shape_str(y.shape()));
  const ScopedOpTime op("linear.forward", gemm_flops(M, N, K));
  GemmShape s{.M = M, .N = N, .K = K, .trans_b = true, .ab = x.dtype(), .c = y.dtype()};
  if (!x.device().is_cpu()) return gpu_gemm(x.device(), s, x.raw(), w.raw(), y.raw());
  run_gemm(s, x.raw(), w.raw(), y.raw());
}

void linear_forward_accumulate(const Tensor& x, const Tensor& w, Tensor& y) {
  const int64_t M = x.size(0), K = x.size(-1), N = w.size(0);
  ANVIL_ASSERT(x.ndim() == 2 && w.ndim() == 2 && w.size(1) == K && x.dtype() == w.dtype(), "linear: x ",
               shape_str(x.shape()), " w ", shape_str(w.shape()));
  ANVIL_ASSERT(y.size(0) == M && y.size(1) == N, "linear: y ", shape_str(y.shape()));
  const ScopedOpTime op("linear.forward", gemm_flops(M, N, K));
  GemmShape s{.M = M, .N = N, .K = K, .trans_b = true, .ab = x.dtype(), .c = y.dtype(), .accumulate = true};
  if (!x.device().is_cpu()) return gpu_gemm(x.device(), s, x.raw(), w.raw(), y.raw());
  run_gemm(s, x.raw(), w.raw(), y.raw());
}

void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate_dx) {
  const int64_t M = dy.size(0), N = dy.size(1), K = w.size(1);
  ANVIL_ASSERT(w.size(0) == N && dx.size(0) == M && dx.size(1) == K && dy.dtype() == w.dtype(),
               "linear backward: dy ", shape_str(dy.shape()), " w ", shape_str(w.shape()), " dx ",
               shape_str(dx.shape()));
  const ScopedOpTime op("linear.backward_input", gemm_flops(M, N, K));
  GemmShape s{.M = M, .N = K, .K = N, .ab = dy.dtype(), .c = dx.dtype(), .accumulate = accumulate_dx};
  if (!dy.device().is_cpu()) return gpu_gemm(dy.device(), s, dy.raw(), w.raw(), dx.raw());
  run_gemm(s, dy.raw(), w.raw(), dx.raw());
}

namespace {

// dW = dYᵀ·X reduces over the token dimension, which is the row dimension of
// both operands, so as a matmul it needs a transposed A; oneDNN 2.6's AMX
// matmul (brgemm) runs that 25-40% below its untransposed rate. Its inner
// product backward-weights primitive computes exactly this product through
// its own AMX GEMM at full rate (measured 1.6-1.9 TFLOP/s against 1.2-1.3 for
// the transposed matmul at M = 4096, N = 2048), but cannot accumulate: it
// writes a scratch gradient that one vectorised pass adds into dW. That pass
// moves 12 bytes per weight against 2·M FLOPs per weight, a small price.
struct WeightGradPrimitive {
  dnnl::inner_product_backward_weights prim;
  dnnl::memory::desc x, dy, dw;
};

const WeightGradPrimitive& weight_grad_primitive(int64_t M, int64_t N, int64_t K) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, WeightGradPrimitive> cache;
  std::lock_guard lock(mutex);
  auto it = cache.find({M, N, K});
  if (it != cache.end()) return it->second;
  Context& ctx = context();
  WeightGradPrimitive g;
  g.x = dnnl::memory::desc({M, K}, dt::bf16, tag::ab);
  g.dy = dnnl::memory::desc({M, N}, dt::bf16, tag::ab);
  g.dw = dnnl::memory::desc({N, K}, dt::f32, tag::ab);
  const dnnl::memory::desc w_any({N, K}, dt::bf16, tag::ab);
  dnnl::inner_product_forward::primitive_desc hint(
      dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, g.x, w_any, g.dy), ctx.engine);
  dnnl::inner_product_backward_weights::primitive_desc pd(dnnl::inner_product_backward_weights::desc(g.x, g.dw, g.dy),
                                                          ctx.engine, hint);
  ANVIL_ASSERT(pd.diff_weights_desc() == g.dw, "oneDNN chose a blocked weight-gradient layout");
  g.prim = dnnl::inner_product_backward_weights(pd);
  return cache.emplace(std::make_tuple(M, N, K), std::move(g)).first->second;
}

}  // namespace

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw) {
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  ANVIL_ASSERT(x.size(0) == M && dw.size(0) == N && dw.size(1) == K && dy.dtype() == x.dtype(),
               "linear backward: dy ", shape_str(dy.shape()), " x ", shape_str(x.shape()), " dw ",
               shape_str(dw.shape()));
  if (M == 0) return;
  const ScopedOpTime op("linear.backward_weight", gemm_flops(M, N, K));
  if (!dy.device().is_cpu()) {  // cuBLASLt accumulates into dW at full rate: one transposed product
    const GemmShape s{.M = N, .N = K, .K = M, .trans_a = true, .ab = dy.dtype(), .c = dw.dtype(), .accumulate = true};
    return gpu_gemm(dy.device(), s, dy.raw(), x.raw(), dw.raw());
  }
  if (dy.dtype() == DType::bf16 && dw.dtype() == DType::f32 && !omp_in_parallel() && !bf16_products_widened()) {
    const WeightGradPrimitive& g = weight_grad_primitive(M, N, K);
    Context& ctx = context();
    thread_local dnnl::stream stream(ctx.engine);
    Tensor partial = Tensor::empty({N, K}, DType::f32, MemCategory::workspace, "linear.dw_partial");
    if (dry_run()) return;
    dnnl::memory mx(g.x, ctx.engine, x.raw()), mdy(g.dy, ctx.engine, dy.raw()), mdw(g.dw, ctx.engine, partial.raw());
    g.prim.execute(stream, {{DNNL_ARG_SRC, mx}, {DNNL_ARG_DIFF_DST, mdy}, {DNNL_ARG_DIFF_WEIGHTS, mdw}});
    stream.wait();
    float* out = dw.data<float>();
    const float* add = partial.data<float>();
    parallel_for(0, N * K, 1 << 14, [&](int64_t lo, int64_t hi) {
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) out[i] += add[i];
    });
    return;
  }
  GemmShape s{.M = N, .N = K, .K = M, .trans_a = true, .ab = dy.dtype(), .c = dw.dtype(), .accumulate = true};
  run_gemm(s, dy.raw(), x.raw(), dw.raw());
}

}  // namespace anvil
