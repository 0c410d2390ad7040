// Matrix products checked as their callers make them (for tests of gemm()'s
// twins: the cuBLASLt replay in gemm_layout_test.cpp, the GPU in
// cuda/cuda_gemm_test.cpp): operands placed inside larger buffers at the
// callers' offsets and row strides, every other element NaN, a
// double-precision reference, and the f32 accumulation bound both sides must
// meet.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "anvil/ops/gemm_layout.h"
#include "anvil/ops/matmul.h"

namespace anvil::gemm_check {

// A buffer of f32 or bf16 elements, every one NaN until set.
struct ElementBuffer {
  DType type;
  std::vector<float> f32;
  std::vector<bf16> b16;
  ElementBuffer(DType t, int64_t n) : type(t) {
    if (t == DType::f32)
      f32.assign(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
    else
      b16.assign(static_cast<size_t>(n), bf16(std::numeric_limits<float>::quiet_NaN()));
  }
  int64_t size() const { return static_cast<int64_t>(type == DType::f32 ? f32.size() : b16.size()); }
  size_t bytes() const { return static_cast<size_t>(size()) * dtype_size(type); }
  void* data() { return type == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(b16.data()); }
  float get(int64_t i) const { return type == DType::f32 ? f32[size_t(i)] : bf16::to_float(b16[size_t(i)].bits); }
  void set(int64_t i, float v) {
    if (type == DType::f32)
      f32[size_t(i)] = v;
    else
      b16[size_t(i)] = bf16(v);
  }
};

// A stored row-major matrix of `rows` × `cols` with row stride ld, `count`
// of them `stride` apart, from element `offset` of its buffer.
struct Placement {
  int64_t offset, rows, cols, ld, count, stride;
  int64_t at(int64_t p, int64_t r, int64_t c) const { return offset + p * stride + r * ld + c; }
  int64_t end() const { return at(count - 1, rows - 1, cols); }
};

// One product as its caller makes it: the shape, the batch, and where each
// operand starts in its buffer (elements).
struct Product {
  std::string kind;
  GemmShape s;
  GemmBatch batch = {};
  int64_t a_offset = 0, b_offset = 0, c_offset = 0;
};

struct Placements {
  Placement a, b, c;
};
inline Placements placements(const Product& p) {
  const GemmShape& s = p.s;
  const int64_t a_rows = s.trans_a ? s.K : s.M, a_cols = s.trans_a ? s.M : s.K;
  const int64_t b_rows = s.trans_b ? s.N : s.K, b_cols = s.trans_b ? s.K : s.N;
  return {{p.a_offset, a_rows, a_cols, s.lda ? s.lda : a_cols, p.batch.count, p.batch.stride_a},
          {p.b_offset, b_rows, b_cols, s.ldb ? s.ldb : b_cols, p.batch.count, p.batch.stride_b},
          {p.c_offset, s.M, s.N, s.ldc ? s.ldc : s.N, p.batch.count, p.batch.stride_c}};
}

// Buffers holding the operands with a margin past their last element, values
// uniform in [-1, 1) (rounded to bf16 where stored so: the reference reads
// the stored values, so the operands' rounding is no error).
struct Operands {
  ElementBuffer a, b, c;
};
inline constexpr int64_t kMargin = 5;
inline Operands make_operands(const Product& p, uint32_t seed) {
  const Placements at = placements(p);
  Operands o{ElementBuffer(p.s.ab, at.a.end() + kMargin), ElementBuffer(p.s.ab, at.b.end() + kMargin),
             ElementBuffer(p.s.c, at.c.end() + kMargin)};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const auto fill = [&](ElementBuffer& buf, const Placement& m) {
    for (int64_t q = 0; q < m.count; ++q)
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c) buf.set(m.at(q, r, c), uniform(rng));
  };
  fill(o.a, at.a);
  fill(o.b, at.b);
  if (p.s.accumulate) fill(o.c, at.c);
  return o;
}

// C's exact value in double from Anvil's row-major definition, and the
// magnitude the rounding error scales with: |alpha|·Σ|a·b| + |C₀|.
struct Reference {
  std::vector<double> value, magnitude;
};
inline Reference reference(const Product& p, const Operands& o) {
  const GemmShape& s = p.s;
  const Placements at = placements(p);
  Reference ref;
  for (int64_t q = 0; q < p.batch.count; ++q)
    for (int64_t i = 0; i < s.M; ++i)
      for (int64_t j = 0; j < s.N; ++j) {
        double sum = 0, mag = 0;
        for (int64_t l = 0; l < s.K; ++l) {
          const double a = o.a.get(s.trans_a ? at.a.at(q, l, i) : at.a.at(q, i, l));
          const double b = o.b.get(s.trans_b ? at.b.at(q, j, l) : at.b.at(q, l, j));
          sum += a * b;
          mag += std::abs(a * b);
        }
        const double c0 = s.accumulate ? o.c.get(at.c.at(q, i, j)) : 0.0;
        ref.value.push_back(s.alpha * sum + c0);
        ref.magnitude.push_back(std::abs(s.alpha) * mag + std::abs(c0));
      }
  return ref;
}

// The error bound of any f32-accumulating product, whatever its summation
// order: K products summed, scaled by alpha and added to C₀, each step
// rounding once at unit roundoff u = FLT_EPSILON / 2, give
// |error| ≤ γ·magnitude with γ = n·u / (1 − n·u), n = K + 2 (Higham, Accuracy
// and Stability of Numerical Algorithms, §3.1). A bf16 C then rounds once
// more, by at most 2⁻⁸ of its value (8 significant bits).
struct Bound {
  double gamma, bf16_rounding;
  double at(double value, double magnitude) const {
    return gamma * magnitude + bf16_rounding * (std::abs(value) + gamma * magnitude);
  }
};
inline Bound bound_of(const GemmShape& s) {
  const double u = FLT_EPSILON / 2.0, n = static_cast<double>(s.K + 2);
  return {n * u / (1.0 - n * u), s.c == DType::bf16 ? std::ldexp(1.0, -8) : 0.0};
}

struct Measured {
  double max_error = 0;     // max |got − exact|
  double max_relative = 0;  // max |got − exact| / magnitude
};

// Checks C against the reference within the bound, and that nothing outside
// C's rows changed; returns the errors.
inline Measured check(const char* who, const Product& p, const ElementBuffer& c, const Reference& ref) {
  const Placements at = placements(p);
  const Bound bound = bound_of(p.s);
  Measured m;
  std::vector<bool> inside(static_cast<size_t>(c.size()), false);
  size_t e = 0;
  for (int64_t q = 0; q < p.batch.count; ++q)
    for (int64_t i = 0; i < p.s.M; ++i)
      for (int64_t j = 0; j < p.s.N; ++j, ++e) {
        const int64_t idx = at.c.at(q, i, j);
        inside[static_cast<size_t>(idx)] = true;
        const double got = c.get(idx), err = std::abs(got - ref.value[e]);
        if (!(err <= bound.at(ref.value[e], ref.magnitude[e]))) {  // NaN fails too
          ADD_FAILURE() << who << ", " << p.kind << ": C[" << q << "][" << i << "][" << j << "] = " << got << ", exact "
                        << ref.value[e] << ", bound " << bound.at(ref.value[e], ref.magnitude[e]);
          return m;
        }
        m.max_error = std::max(m.max_error, err);
        if (ref.magnitude[e] > 0) m.max_relative = std::max(m.max_relative, err / ref.magnitude[e]);
      }
  for (int64_t idx = 0; idx < c.size(); ++idx)
    if (!inside[static_cast<size_t>(idx)] && !std::isnan(c.get(idx))) {
      ADD_FAILURE() << who << ", " << p.kind << ": element " << idx << " outside C's rows was written";
      break;
    }
  return m;
}

// Where an operand `offset` elements into its buffer starts.
inline char* start_of(ElementBuffer& buf, int64_t offset) {
  return static_cast<char*>(buf.data()) + offset * static_cast<int64_t>(dtype_size(buf.type));
}

// The CPU gemm() on the operands, one call per batch.
inline void run_cpu(const Product& p, Operands& o) {
  for (int64_t q = 0; q < p.batch.count; ++q)
    gemm(p.s, start_of(o.a, p.a_offset + q * p.batch.stride_a), start_of(o.b, p.b_offset + q * p.batch.stride_b),
         start_of(o.c, p.c_offset + q * p.batch.stride_c));
}

// ---- the products a training step makes, as their callers make them ----

// Sizes: odd and pairwise distinct so a swapped m and n, or a leading
// dimension taken from the wrong operand, reads the wrong elements.
inline constexpr int64_t kTokens = 37, kModel = 53, kOut = 29;

// The linear layer (matmul.cpp): y = x·wᵀ, dx = dy·w, dw += dyᵀ·x.
inline std::vector<Product> linear_products() {
  const int64_t M = kTokens, K = kModel, N = kOut;
  return {
      {"linear forward f32", {.M = M, .N = N, .K = K, .trans_b = true}},
      {"linear forward bf16 -> bf16", {.M = M, .N = N, .K = K, .trans_b = true, .ab = DType::bf16, .c = DType::bf16}},
      {"linear forward accumulate (residual) bf16 -> f32",
       {.M = M, .N = N, .K = K, .trans_b = true, .ab = DType::bf16, .c = DType::f32, .accumulate = true}},
      {"linear backward input f32", {.M = M, .N = K, .K = N}},
      {"linear backward input accumulate bf16 -> bf16",
       {.M = M, .N = K, .K = N, .ab = DType::bf16, .c = DType::bf16, .accumulate = true}},
      {"linear backward weight f32 (beta 1)", {.M = N, .N = K, .K = M, .trans_a = true, .accumulate = true}},
      {"linear backward weight bf16 -> f32 (beta 1)",
       {.M = N, .N = K, .K = M, .trans_a = true, .ab = DType::bf16, .c = DType::f32, .accumulate = true}},
  };
}

// The LM head's chunked products (cross_entropy.cpp): a block of Bn rows of x
// (from row r0) against a chunk of Cn vocabulary rows of w (from row v0),
// both read at row stride D inside the whole matrices; the last chunk is
// short. dlogits are dense (Bn, Cn).
inline std::vector<Product> lm_head_products() {
  const int64_t D = kModel, V = 71, chunk = 32, r0 = 19, Bn = 17;
  std::vector<Product> out;
  for (const DType dt : {DType::f32, DType::bf16})
    for (const int64_t v0 : {int64_t{32}, int64_t{64}}) {
      const int64_t Cn = std::min(chunk, V - v0);
      const std::string at =
          std::string(dtype_name(dt)) + ", chunk at " + std::to_string(v0) + " of " + std::to_string(Cn) + " rows";
      // logits (Bn, Cn) = x[r0 : r0+Bn] · w[v0 : v0+Cn]ᵀ, f32
      out.push_back({"LM head logits, " + at,
                     {.M = Bn, .N = Cn, .K = D, .trans_b = true, .ab = dt, .c = DType::f32},
                     {},
                     r0 * D,
                     v0 * D});
      // dx_blk (Bn, D) += dlogits (Bn, Cn) · w_chunk (Cn, D); the first chunk overwrites
      out.push_back({"LM head dx, " + at,
                     {.M = Bn, .N = D, .K = Cn, .ab = dt, .c = DType::f32, .accumulate = true},
                     {},
                     0,
                     v0 * D});
      out.push_back(
          {"LM head dx, first chunk, " + at, {.M = Bn, .N = D, .K = Cn, .ab = dt, .c = DType::f32}, {}, 0, v0 * D});
      // dw_chunk (Cn, D) += dlogitsᵀ (Cn, Bn) · x_blk (Bn, D), into w's gradient at row v0
      out.push_back({"LM head dw (beta 1), " + at,
                     {.M = Cn, .N = D, .K = Bn, .trans_a = true, .ab = dt, .c = dt, .accumulate = true},
                     {},
                     0,
                     r0 * D,
                     v0 * D});
    }
  return out;
}

// Attention's tile products on the CPU (attention.cpp), on packed tiles: mq
// query rows, nk keys, head dim D; scores scaled by alpha (scale·log2 e).
inline std::vector<Product> attention_tile_products() {
  const int64_t mq = 13, nk = 11, D = 9;
  const float alpha = 1.0f / std::sqrt(9.0f) * 1.4426950408889634f;
  return {
      {"attention S = alpha·Q K^T",
       {.M = mq, .N = nk, .K = D, .trans_b = true, .ab = DType::bf16, .c = DType::f32, .alpha = alpha}},
      {"attention O += P V", {.M = mq, .N = D, .K = nk, .ab = DType::bf16, .c = DType::f32, .accumulate = true}},
      {"attention backward S^T = alpha·K Q^T",
       {.M = nk, .N = mq, .K = D, .trans_b = true, .ab = DType::bf16, .c = DType::f32, .alpha = alpha}},
      {"attention backward dK += dS^T Q",
       {.M = nk, .N = D, .K = mq, .ab = DType::bf16, .c = DType::f32, .accumulate = true}},
      {"attention backward dQ (+)= dS K",
       {.M = mq, .N = D, .K = nk, .trans_a = true, .ab = DType::bf16, .c = DType::f32, .accumulate = true}},
  };
}

// Every transpose combination with every row padded (ld > width), alpha ≠ 1,
// overwriting and accumulating, in f32 and in bf16, each operand at an odd
// offset into its buffer.
inline std::vector<Product> strided_row_products() {
  const int64_t M = 23, N = 19, K = 31;
  std::vector<Product> out;
  for (const DType dt : {DType::f32, DType::bf16})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const bool acc : {false, true}) {
          GemmShape s{.M = M,
                      .N = N,
                      .K = K,
                      .trans_a = ta,
                      .trans_b = tb,
                      .ab = dt,
                      .c = dt,
                      .alpha = 0.75f,
                      .accumulate = acc};
          s.lda = (ta ? M : K) + 3;
          s.ldb = (tb ? K : N) + 5;
          s.ldc = N + 2;
          const std::string kind = std::string("strided rows ") + (ta ? "A^T" : "A") + (tb ? "·B^T " : "·B ") +
                                   dtype_name(dt) + (acc ? " accumulate" : "");
          out.push_back({kind, s, {}, 1, 3, 5});
        }
  return out;
}

// Strided batches: one head's scores read in place from the (B, T, H, Dh)
// layout of q and k (row stride H·Dh, a sequence apart per batch), written to
// padded rows of a batch stride larger than the rows need.
inline std::vector<Product> strided_batch_products() {
  const int64_t B = 3, T = 7, H = 5, Dh = 6, h = 2, ldc = T + 3;
  std::vector<Product> out;
  for (const DType dt : {DType::f32, DType::bf16})
    out.push_back({std::string("batched head scores from (B,T,H,D) ") + dtype_name(dt),
                   {.M = T,
                    .N = T,
                    .K = Dh,
                    .trans_b = true,
                    .lda = H * Dh,
                    .ldb = H * Dh,
                    .ldc = ldc,
                    .ab = dt,
                    .c = DType::f32,
                    .alpha = 0.5f},
                   {.count = B, .stride_a = T * H * Dh, .stride_b = T * H * Dh, .stride_c = T * ldc + 4},
                   h * Dh,
                   h * Dh,
                   0});
  return out;
}

}  // namespace anvil::gemm_check
