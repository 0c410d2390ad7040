#include "anvil/ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

// ---- naive double-precision reference: full (M, V) logits, log-softmax ----
struct Ref {
  double loss = 0;
  int64_t num_tokens = 0;
  std::vector<double> dx, dw;  // grad_scale · ∂loss/∂x, ∂loss/∂w
};

Ref reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& t, int64_t M,
              int64_t D, int64_t V, int32_t ignore, double scale, bool backward = true) {
  Ref r;
  r.dx.assign(static_cast<size_t>(M * D), 0.0);
  r.dw.assign(static_cast<size_t>(V * D), 0.0);
  std::vector<double> logits(static_cast<size_t>(V));
  for (int64_t i = 0; i < M; ++i) {
    if (t[i] == ignore) continue;
    ++r.num_tokens;
    double mx = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += x[i * D + d] * w[v * D + d];
      logits[v] = s;
      mx = std::max(mx, s);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[v] - mx);
    const double lse = mx + std::log(sum);
    r.loss += lse - logits[t[i]];
    if (!backward) continue;
    for (int64_t v = 0; v < V; ++v) {
      const double g = (std::exp(logits[v] - lse) - (v == t[i] ? 1.0 : 0.0)) * scale;
      for (int64_t d = 0; d < D; ++d) {
        r.dx[i * D + d] += g * w[v * D + d];
        r.dw[v * D + d] += g * x[i * D + d];
      }
    }
  }
  return r;
}

// Random targets in [0, V); every `ignore_every`-th row (if > 0) gets the ignore index.
Tensor make_targets(int64_t M, int64_t V, int ignore_every, int32_t ignore, const char* name) {
  Tensor t = Tensor::empty({M}, DType::i32, MemCategory::workspace, "targets");
  const uint64_t key = name_key(name);
  for (int64_t i = 0; i < M; ++i) {
    int32_t id = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * static_cast<float>(V));
    id = std::min<int32_t>(id, static_cast<int32_t>(V - 1));
    if (ignore_every > 0 && i % ignore_every == 1) id = ignore;
    t.data<int32_t>()[i] = id;
  }
  return t;
}

std::vector<int32_t> to_vec(const Tensor& t) { return {t.data<int32_t>(), t.data<int32_t>() + t.numel()}; }

double rel(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-300); }

struct Case {
  int64_t M, D, V, row_block, vocab_chunk;
  int ignore_every;  // 0: no ignored rows
};

std::string name_of(const Case& c) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "M=%lld D=%lld V=%lld block=%lld chunk=%lld ignore_every=%d", (long long)c.M,
                (long long)c.D, (long long)c.V, (long long)c.row_block, (long long)c.vocab_chunk, c.ignore_every);
  return buf;
}

// The f32 op against the double reference: loss, token count, dx and dw (accumulation onto a
// non-zero dw is checked in DwAccumulatesDxOverwrites).
void check_f32(const Case& c, KeepLogits keep);

// Every case each way: the backward keeping the first pass's logits, recomputing them, and as
// cross_entropy_blocking chooses (which may also shrink the row block).
void check_f32(const Case& c) {
  check_f32(c, KeepLogits::keep);
  check_f32(c, KeepLogits::recompute);
  check_f32(c, KeepLogits::automatic);
}

void check_f32(const Case& c, KeepLogits keep) {
  SCOPED_TRACE(name_of(c) + (keep == KeepLogits::keep        ? " keep"
                              : keep == KeepLogits::recompute ? " recompute"
                                                              : " automatic"));
  const int32_t ignore = -100;
  const float scale = 1.0f / 37.0f;
  Tensor x = random_tensor({c.M, c.D}, DType::f32, "x");
  Tensor w = random_tensor({c.V, c.D}, DType::f32, "w", 0.5f);
  Tensor t = make_targets(c.M, c.V, c.ignore_every, ignore, "t");
  Tensor dx = random_tensor({c.M, c.D}, DType::f32, "dx_garbage");  // must be overwritten
  Tensor dw = Tensor::zeros({c.V, c.D}, DType::f32, MemCategory::workspace, "dw");
  CrossEntropyOptions opt{
      .ignore_index = ignore, .row_block = c.row_block, .vocab_chunk = c.vocab_chunk, .keep_logits = keep};

  const CrossEntropyResult res = cross_entropy_forward_backward(x, w, t, scale, dx, dw, opt);
  const CrossEntropyResult fwd = cross_entropy_forward(x, w, t, opt);
  const Ref ref = reference(to_double(x), to_double(w), to_vec(t), c.M, c.D, c.V, ignore, scale);

  EXPECT_EQ(res.num_tokens, ref.num_tokens);
  EXPECT_EQ(fwd.num_tokens, ref.num_tokens);
  const double e_loss = rel(res.loss_sum, ref.loss), e_fwd = rel(fwd.loss_sum, ref.loss);
  const double e_dx = rel_error(dx, ref.dx), e_dw = rel_error(dw, ref.dw);
  std::printf("  f32 %s: loss %.2e fwd %.2e dx %.2e dw %.2e\n", name_of(c).c_str(), e_loss, e_fwd, e_dx, e_dw);
  // f32 tolerance: logits and softmax in f32 carry ~1e-7 relative error each; 1e-5 leaves room for
  // accumulation over D and V without hiding real bugs (a wrong term is O(1)).
  EXPECT_LT(e_loss, 1e-5);
  EXPECT_LT(e_fwd, 1e-5);
  EXPECT_LT(e_dx, 1e-5);
  EXPECT_LT(e_dw, 1e-5);
  // Ignored rows have exactly zero dx.
  const int32_t* tp = t.data<int32_t>();
  for (int64_t i = 0; i < c.M; ++i) {
    if (tp[i] != ignore) continue;
    for (int64_t d = 0; d < c.D; ++d) ASSERT_EQ(dx.data<float>()[i * c.D + d], 0.0f) << "row " << i;
  }
}

TEST(CrossEntropy, F32MatchesReferenceOverChunkSizes) {
  // M = 37 and V = 101 are multiples of none of the block/chunk sizes.
  for (auto [block, chunk] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {5, 3}, {16, 64}, {8, 100}, {37, 101}, {64, 1000}, {0, 0}})
    check_f32({37, 24, 101, block, chunk, 0});
}

TEST(CrossEntropy, F32SingleToken) {
  check_f32({1, 16, 50, 0, 0, 0});
  check_f32({1, 16, 50, 4, 7, 0});
}

TEST(CrossEntropy, F32SomeRowsIgnored) {
  check_f32({40, 20, 90, 16, 32, 3});
  check_f32({40, 20, 90, 0, 0, 2});
}

TEST(CrossEntropy, F32DefaultBlocksWithRemainders) {
  // More rows than the default row block and a vocabulary just over the default chunk.
  static_assert(kCrossEntropyRowBlock == 2048 && kCrossEntropyVocabChunk == 1024, "update the shapes below");
  check_f32({2100, 16, 1100, 0, 0, 5});
}

TEST(CrossEntropy, AllRowsIgnored) {
  const int64_t M = 9, D = 8, V = 20;
  Tensor x = random_tensor({M, D}, DType::f32, "x");
  Tensor w = random_tensor({V, D}, DType::f32, "w");
  Tensor t = Tensor::empty({M}, DType::i32, MemCategory::workspace, "t");
  for (int64_t i = 0; i < M; ++i) t.data<int32_t>()[i] = -1;
  Tensor dx = random_tensor({M, D}, DType::f32, "dx_garbage");
  Tensor dw = random_tensor({V, D}, DType::f32, "dw0");
  const std::vector<double> dw0 = to_double(dw);
  const CrossEntropyResult r = cross_entropy_forward_backward(x, w, t, 1.0f, dx, dw, {.ignore_index = -1});
  EXPECT_EQ(r.loss_sum, 0.0);
  EXPECT_EQ(r.num_tokens, 0);
  for (int64_t i = 0; i < M * D; ++i) ASSERT_EQ(dx.data<float>()[i], 0.0f);
  EXPECT_EQ(to_double(dw), dw0);
  // A whole row block ignored while others count.
  for (int64_t i = 0; i < M; ++i) t.data<int32_t>()[i] = i < 4 ? -1 : static_cast<int32_t>(i);
  dx = random_tensor({M, D}, DType::f32, "dx_garbage");
  const CrossEntropyOptions opt{.ignore_index = -1, .row_block = 4, .vocab_chunk = 6};
  const CrossEntropyResult r2 = cross_entropy_forward_backward(x, w, t, 0.5f, dx, dw, opt);
  const Ref ref = reference(to_double(x), to_double(w), to_vec(t), M, D, V, -1, 0.5);
  EXPECT_EQ(r2.num_tokens, 5);
  EXPECT_LT(rel(r2.loss_sum, ref.loss), 1e-5);
  EXPECT_LT(rel_error(dx, ref.dx), 1e-5);
}

TEST(CrossEntropy, FiniteDifferences) {
  // Tiny shapes: 3 rows (one ignored), D = 4, V = 7, blocks of 2 rows and chunks of 3 words.
  const int64_t M = 3, D = 4, V = 7;
  const double scale = 0.25;
  Tensor x = random_tensor({M, D}, DType::f32, "x");
  Tensor w = random_tensor({V, D}, DType::f32, "w");
  Tensor t = Tensor::empty({M}, DType::i32, MemCategory::workspace, "t");
  t.data<int32_t>()[0] = 6, t.data<int32_t>()[1] = -100, t.data<int32_t>()[2] = 2;
  Tensor dx = Tensor::zeros({M, D}, DType::f32, MemCategory::workspace, "dx");
  Tensor dw = Tensor::zeros({V, D}, DType::f32, MemCategory::workspace, "dw");
  cross_entropy_forward_backward(x, w, t, static_cast<float>(scale), dx, dw, {.row_block = 2, .vocab_chunk = 3});
  const std::vector<double> xd = to_double(x), wd = to_double(w);
  const std::vector<int32_t> tv = to_vec(t);
  const auto gx = numerical_grad(
      [&](const std::vector<double>& xv) { return scale * reference(xv, wd, tv, M, D, V, -100, 1, false).loss; }, xd);
  const auto gw = numerical_grad(
      [&](const std::vector<double>& wv) { return scale * reference(xd, wv, tv, M, D, V, -100, 1, false).loss; }, wd);
  const double ex = rel_error(dx, gx), ew = rel_error(dw, gw);
  std::printf("  finite differences: dx %.2e dw %.2e\n", ex, ew);
  EXPECT_LT(ex, 1e-5);
  EXPECT_LT(ew, 1e-5);
}

TEST(CrossEntropy, DwAccumulatesDxOverwrites) {
  const int64_t M = 20, D = 12, V = 30;
  const float scale = 0.1f;
  Tensor x = random_tensor({M, D}, DType::f32, "x");
  Tensor w = random_tensor({V, D}, DType::f32, "w");
  Tensor t = make_targets(M, V, 4, -100, "t");
  Tensor dx1 = random_tensor({M, D}, DType::f32, "dx_garbage1");
  Tensor dx2 = random_tensor({M, D}, DType::f32, "dx_garbage2");
  // dw starts non-zero, at the size of one call's gradient, as after an earlier micro-batch.
  Tensor dw = random_tensor({V, D}, DType::f32, "dw0", 0.05f);
  const std::vector<double> dw0 = to_double(dw);
  const Ref ref = reference(to_double(x), to_double(w), to_vec(t), M, D, V, -100, scale);
  const CrossEntropyOptions opt{.row_block = 8, .vocab_chunk = 7};
  std::vector<double> want = dw0;
  cross_entropy_forward_backward(x, w, t, scale, dx1, dw, opt);
  for (size_t i = 0; i < want.size(); ++i) want[i] += ref.dw[i];
  const double e1 = rel_error(dw, want);
  cross_entropy_forward_backward(x, w, t, scale, dx2, dw, opt);
  for (size_t i = 0; i < want.size(); ++i) want[i] += ref.dw[i];
  const double e2 = rel_error(dw, want);
  std::printf("  dw0 + g: %.2e, dw0 + 2g: %.2e\n", e1, e2);
  EXPECT_LT(e1, 1e-5);
  EXPECT_LT(e2, 1e-5);
  EXPECT_EQ(to_double(dx1), to_double(dx2));  // dx is written, not accumulated
  EXPECT_LT(rel_error(dx1, ref.dx), 1e-5);
}

// bf16 x and w. The reference uses the same bf16-rounded inputs in double, so only the op's own
// rounding is measured:
// - loss: bf16·bf16 products are exact in f32 and AMX accumulates in f32, so the logits (and the
//   loss) keep f32 accuracy: 1e-5.
// - dx, dw: dlogits are rounded to bf16 before the products (relative 2^-9 ≈ 0.002 per value, each
//   independent, so the norm-relative error of a sum of many such terms stays around 2^-9/√3);
//   a bf16 output (dx here, dw in the second case) adds another 2^-9 rounding. Tolerance 5e-3.
void check_bf16(DType dx_dtype, DType dw_dtype, KeepLogits keep) {
  const int64_t M = 70, D = 48, V = 333;
  const float scale = 1.0f / 64.0f;
  SCOPED_TRACE(std::string("dx ") + dtype_name(dx_dtype) + " dw " + dtype_name(dw_dtype) +
               (keep == KeepLogits::keep ? " keep" : " recompute"));
  Tensor x = random_tensor({M, D}, DType::bf16, "x");
  Tensor w = random_tensor({V, D}, DType::bf16, "w", 0.5f);
  Tensor t = make_targets(M, V, 6, -100, "t");
  Tensor dx = random_tensor({M, D}, dx_dtype, "dx_garbage");
  Tensor dw = Tensor::zeros({V, D}, dw_dtype, MemCategory::workspace, "dw");
  const CrossEntropyOptions opt{.row_block = 32, .vocab_chunk = 128, .keep_logits = keep};
  const CrossEntropyResult res = cross_entropy_forward_backward(x, w, t, scale, dx, dw, opt);
  const CrossEntropyResult fwd = cross_entropy_forward(x, w, t, opt);
  const Ref ref = reference(to_double(x), to_double(w), to_vec(t), M, D, V, -100, scale);
  const double e_loss = rel(res.loss_sum, ref.loss), e_fwd = rel(fwd.loss_sum, ref.loss);
  const double e_dx = rel_error(dx, ref.dx), e_dw = rel_error(dw, ref.dw);
  std::printf("  bf16 (dx %s, dw %s): loss %.2e fwd %.2e dx %.2e dw %.2e\n", dtype_name(dx_dtype),
              dtype_name(dw_dtype), e_loss, e_fwd, e_dx, e_dw);
  EXPECT_EQ(res.num_tokens, ref.num_tokens);
  EXPECT_LT(e_loss, 1e-5);
  EXPECT_LT(e_fwd, 1e-5);
  EXPECT_LT(e_dx, 5e-3);
  EXPECT_LT(e_dw, 5e-3);
}

TEST(CrossEntropy, Bf16MixedPrecisionAgainstDouble) {
  for (const KeepLogits keep : {KeepLogits::keep, KeepLogits::recompute}) {
    check_bf16(DType::bf16, DType::f32, keep);  // the trainer's configuration: bf16 activations, f32 gradients
    check_bf16(DType::f32, DType::bf16, keep);
    check_bf16(DType::bf16, DType::bf16, keep);
  }
}

// Which way the backward goes by default, and the row block it then takes.
TEST(CrossEntropy, BlockingKeepsLogitsWhenEnoughRowsFitTheBudget) {
  // 125M's head (V = 32000) at 4096 tokens: 524 rows of every chunk's logits fit in 64 MiB.
  const CrossEntropyBlocking b = cross_entropy_blocking(4096, 32000, /*backward=*/true);
  EXPECT_TRUE(b.keep_logits);
  EXPECT_EQ(b.rows, kCrossEntropyKeptLogitsBytes / (4 * 32000));
  EXPECT_EQ(b.chunk, kCrossEntropyVocabChunk);
  // Llama 3's 128256 entries keep 130 rows, too few: recompute in full blocks.
  const CrossEntropyBlocking big = cross_entropy_blocking(8192, 128256, true);
  EXPECT_FALSE(big.keep_logits);
  EXPECT_EQ(big.rows, kCrossEntropyRowBlock);
  // Fewer tokens than the minimum still keep, all in one block; the forward alone never keeps.
  EXPECT_TRUE(cross_entropy_blocking(100, 128256, true).keep_logits);
  EXPECT_FALSE(cross_entropy_blocking(4096, 32000, /*backward=*/false).keep_logits);
  // One chunk holds the whole vocabulary: nothing to recompute, nothing to keep.
  EXPECT_FALSE(cross_entropy_blocking(4096, 1000, true).keep_logits);
  // The loss-parallel shard kernels always recompute, in full blocks.
  const CrossEntropyBlocking shard = cross_entropy_shard_blocking(4096, 32000);
  EXPECT_FALSE(shard.keep_logits);
  EXPECT_EQ(shard.rows, kCrossEntropyRowBlock);
}

TEST(CrossEntropy, OutOfRangeTargetThrows) {
  const int64_t M = 5, D = 8, V = 10;
  Tensor x = random_tensor({M, D}, DType::f32, "x");
  Tensor w = random_tensor({V, D}, DType::f32, "w");
  Tensor dx = random_tensor({M, D}, DType::f32, "dx0");
  Tensor dw = random_tensor({V, D}, DType::f32, "dw0");
  const std::vector<double> dx0 = to_double(dx), dw0 = to_double(dw);
  for (int32_t bad : {10, -5, 1 << 30}) {
    Tensor t = make_targets(M, V, 0, -100, "t");
    t.data<int32_t>()[3] = bad;
    try {
      cross_entropy_forward_backward(x, w, t, 1.0f, dx, dw);
      ADD_FAILURE() << "no error for target " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("row 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
    }
    EXPECT_THROW(cross_entropy_forward(x, w, t), Error);
  }
  // Nothing was written.
  EXPECT_EQ(to_double(dx), dx0);
  EXPECT_EQ(to_double(dw), dw0);
}

}  // namespace
