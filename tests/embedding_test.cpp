// Embedding gather/scatter-add against naive references, for every dtype pair;
// duplicate ids, accumulation, finite differences, out-of-range ids.
#include "anvil/ops/embedding.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

// f32 accumulation of up to ~60 repeats of an id (2 calls × ~30 duplicates)
// against double: each add rounds at 6e-8 relative to the running sum, so the
// error stays well below 1e-5 in the norm.
constexpr double kF32Tol = 1e-5;

// Ids in [0, V), deterministic, with many repeats when M > V.
Tensor make_tokens(Shape shape, int64_t V, uint32_t seed) {
  Tensor t = Tensor::empty(std::move(shape), DType::i32, MemCategory::workspace, "tokens");
  uint32_t s = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 1664525u + 1013904223u;
    t.data<int32_t>()[i] = static_cast<int32_t>((s >> 8) % static_cast<uint32_t>(V));
  }
  return t;
}

std::vector<double> ref_gather(const Tensor& tokens, const std::vector<double>& table, int64_t D) {
  std::vector<double> out(static_cast<size_t>(tokens.numel() * D));
  for (int64_t m = 0; m < tokens.numel(); ++m)
    for (int64_t j = 0; j < D; ++j) out[m * D + j] = table[tokens.data<int32_t>()[m] * D + j];
  return out;
}

// dtable += scatter of dout, `times` times.
std::vector<double> ref_scatter(const Tensor& tokens, const std::vector<double>& dout, std::vector<double> dtable,
                                int64_t D, int times = 1) {
  for (int k = 0; k < times; ++k)
    for (int64_t m = 0; m < tokens.numel(); ++m)
      for (int64_t j = 0; j < D; ++j) dtable[tokens.data<int32_t>()[m] * D + j] += dout[m * D + j];
  return dtable;
}

// The value `v` after one rounding to dtype `dt` (nothing for f32 inputs that are f32 already).
double rounded(double v, DType dt) {
  const float f = static_cast<float>(v);
  return dt == DType::f32 ? f : to_f32(from_f32<bf16>(f));
}

struct Case {
  int64_t B, T, V, D;
};
// A single token; D not a multiple of 16 or 32; D large enough that several
// threads share the rows (forward) or the columns (backward); M ≫ V for repeats.
const std::vector<Case> kCases = {{1, 1, 5, 7}, {3, 5, 11, 33}, {2, 150, 10, 1000}, {1, 64, 50, 2048}, {4, 7, 3, 1}};

TEST(Embedding, ForwardIsExactGatherForEveryDtypePair) {
  for (const Case& c : kCases) {
    const Tensor tokens = make_tokens({c.B, c.T}, c.V, 7);
    for (DType tdt : {DType::f32, DType::bf16}) {
      for (DType odt : {DType::f32, DType::bf16}) {
        Tensor table = random_tensor({c.V, c.D}, tdt, "table_" + std::to_string(c.D));
        Tensor out = Tensor::empty({c.B, c.T, c.D}, odt, MemCategory::workspace, "out");
        embedding_forward(tokens, table, out);
        // A gather is exact; only an f32 -> bf16 pair rounds, once, to nearest even.
        std::vector<double> want = ref_gather(tokens, to_double(table), c.D);
        for (double& v : want) v = rounded(v, odt);
        EXPECT_EQ(to_double(out), want) << dtype_name(tdt) << " -> " << dtype_name(odt) << " D=" << c.D;
      }
    }
  }
}

TEST(Embedding, BackwardAccumulatesWithDuplicates) {
  for (const Case& c : kCases) {
    const Tensor tokens = make_tokens({c.B * c.T}, c.V, 11);
    for (DType gdt : {DType::f32, DType::bf16}) {
      Tensor dout = random_tensor({c.B * c.T, c.D}, gdt, "dout_" + std::to_string(c.D));
      Tensor dtable = random_tensor({c.V, c.D}, DType::f32, "dtable0_" + std::to_string(c.D));
      const std::vector<double> want = ref_scatter(tokens, to_double(dout), to_double(dtable), c.D, 2);
      embedding_backward(dout, tokens, dtable);  // called twice: adds twice
      embedding_backward(dout, tokens, dtable);
      // bf16 dout into an f32 dtable: the bf16 values are exact, the adds f32.
      const double e = rel_error(dtable, want);
      std::printf("backward %s dout -> f32 dtable M=%ld V=%ld D=%ld: rel err %.2e\n", dtype_name(gdt), c.B * c.T, c.V,
                  c.D, e);
      EXPECT_LT(e, kF32Tol) << "D=" << c.D;
    }
  }
}

// A bf16 dtable rounds after every add. The kernel adds in f32 then rounds to
// bf16, token by token in order; the sum of two bf16 values is exact in f32 (for
// exponents within 15 of each other, always the case here), so emulating that
// sequence in the test must give the same bits.
TEST(Embedding, BackwardIntoBf16TableRoundsEachAddInTokenOrder) {
  for (const Case& c : kCases) {
    const Tensor tokens = make_tokens({c.B * c.T}, c.V, 13);
    for (DType gdt : {DType::f32, DType::bf16}) {
      Tensor dout = random_tensor({c.B * c.T, c.D}, gdt, "dout16_" + std::to_string(c.D));
      Tensor dtable = random_tensor({c.V, c.D}, DType::bf16, "dtable16_" + std::to_string(c.D));
      std::vector<double> want = to_double(dtable);
      const std::vector<double> g = to_double(dout);
      for (int64_t m = 0; m < tokens.numel(); ++m)
        for (int64_t j = 0; j < c.D; ++j) {
          double& t = want[tokens.data<int32_t>()[m] * c.D + j];
          t = rounded(static_cast<double>(static_cast<float>(t) + static_cast<float>(g[m * c.D + j])), DType::bf16);
        }
      embedding_backward(dout, tokens, dtable);
      EXPECT_EQ(to_double(dtable), want) << dtype_name(gdt) << " D=" << c.D;
    }
  }
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int64_t V = 4, D = 3;
  const Tensor tokens = make_tokens({6}, V, 5);  // 6 tokens over 4 ids: repeats
  Tensor table = random_tensor({V, D}, DType::f32, "fd_table");
  Tensor g = random_tensor({6, D}, DType::f32, "fd_g");  // loss = Σ out·g, so dout = g
  const std::vector<double> gd = to_double(g);
  const auto num = numerical_grad(
      [&](const std::vector<double>& t) { return weighted_sum(ref_gather(tokens, t, D), gd); }, to_double(table));
  Tensor dtable = Tensor::zeros({V, D}, DType::f32, MemCategory::workspace, "dtable");
  embedding_backward(g, tokens, dtable);
  const double e = rel_error(dtable, num);
  std::printf("finite differences: rel err %.2e\n", e);
  EXPECT_LT(e, kF32Tol);
}

TEST(Embedding, OutOfRangeIdThrowsAndNamesIt) {
  const int64_t V = 10, D = 4;
  Tensor table = random_tensor({V, D}, DType::f32, "oob_table");
  Tensor out = Tensor::empty({2, 3, D}, DType::f32, MemCategory::workspace, "out");
  for (int32_t bad : {-1, 10, 1 << 30}) {
    Tensor tokens = make_tokens({2, 3}, V, 3);
    tokens.data<int32_t>()[5] = bad;  // sequence 1, token 2
    try {
      embedding_forward(tokens, table, out);
      ADD_FAILURE() << "no throw for id " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token id " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 5 (sequence 1, token 2)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
    }
    // The backward checks too, before writing anything.
    Tensor dtable = Tensor::zeros({V, D}, DType::f32, MemCategory::workspace, "dtable");
    Tensor dout = random_tensor({6, D}, DType::f32, "oob_dout");
    EXPECT_THROW(embedding_backward(dout, tokens, dtable), Error);
    for (double v : to_double(dtable)) EXPECT_EQ(v, 0.0);
  }
}

}  // namespace
