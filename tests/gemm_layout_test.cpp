// The cuBLASLt call lt_matmul_of builds for each kind of product a training
// step makes, replayed on the host by a naive GEMM written from cuBLASLt's
// documented column-major semantics, against the CPU gemm() on the same
// operands: both within the f32 accumulation bound of a double-precision
// reference. Operands sit inside larger buffers at the callers' offsets (a
// vocabulary chunk of the LM head's weight, a head of a (B, T, H, D) tensor),
// outputs not accumulated into start as NaN (a product that reads C when it
// should not turns them to NaN), and every element outside the output's rows
// stays NaN (a write past a row or a batch shows).
#include "anvil/ops/gemm_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "anvil/core/error.h"
#include "anvil/ops/matmul.h"
#include "cublaslt_replay.h"
#include "gemm_check.h"

namespace {

using namespace anvil;
using namespace anvil::gemm_check;
using anvil::cublaslt_replay::column_major_gemm;

void run_replay(const Product& p, Operands& o) {
  const LtMatmul call = lt_matmul_of(p.s, p.batch);
  const void* A = start_of(o.a, p.a_offset);
  const void* B = start_of(o.b, p.b_offset);
  column_major_gemm(call, operand_pointer(call.a_operand, A, B), operand_pointer(call.b_operand, A, B),
                    start_of(o.c, p.c_offset));
}

void expect_replay_matches_cpu(const Product& p, uint32_t seed) {
  SCOPED_TRACE(p.kind);
  Operands cpu = make_operands(p, seed);
  Operands lt = make_operands(p, seed);
  const Reference ref = reference(p, cpu);
  run_cpu(p, cpu);
  run_replay(p, lt);
  const Measured on_cpu = check("CPU gemm", p, cpu.c, ref);
  const Measured replay = check("cuBLASLt replay", p, lt.c, ref);
  std::printf("%-58s K=%-3ld bound γ=%.2e%s | CPU gemm %.2e (rel %.2e) | replay %.2e (rel %.2e)\n", p.kind.c_str(),
              long(p.s.K), bound_of(p.s).gamma, p.s.c == DType::bf16 ? " +2^-8|C|" : "         ", on_cpu.max_error,
              on_cpu.max_relative, replay.max_error, replay.max_relative);
}

}  // namespace

TEST(GemmLayout, LinearProductsReplayAsTheCpuGemm) {
  uint32_t seed = 1;
  for (const Product& p : linear_products()) expect_replay_matches_cpu(p, seed++);
}

TEST(GemmLayout, LmHeadChunkProductsReplayAsTheCpuGemm) {
  uint32_t seed = 100;
  for (const Product& p : lm_head_products()) expect_replay_matches_cpu(p, seed++);
}

TEST(GemmLayout, AttentionTileProductsReplayAsTheCpuGemm) {
  uint32_t seed = 200;
  for (const Product& p : attention_tile_products()) expect_replay_matches_cpu(p, seed++);
}

TEST(GemmLayout, StridedRowsReplayAsTheCpuGemm) {
  uint32_t seed = 300;
  for (const Product& p : strided_row_products()) expect_replay_matches_cpu(p, seed++);
}

TEST(GemmLayout, StridedBatchesReplayAsTheCpuGemm) {
  uint32_t seed = 400;
  for (const Product& p : strided_batch_products()) expect_replay_matches_cpu(p, seed++);
}

TEST(GemmLayout, RefusesWhatCublasLtCannotTake) {
  const auto refused = [](const GemmShape& s, const GemmBatch& b = {}) {
    try {
      lt_matmul_of(s, b);
    } catch (const Error& e) {
      return std::string(e.what()).find("M=5 N=6 K=7") != std::string::npos;  // names the shape
    }
    return false;
  };
  EXPECT_TRUE(refused({.M = 5, .N = 6, .K = 7, .lda = 6}));                   // row of A is K = 7 wide
  EXPECT_TRUE(refused({.M = 5, .N = 6, .K = 7, .trans_b = true, .ldb = 6}));  // row of B^T storage is K wide
  EXPECT_TRUE(refused({.M = 5, .N = 6, .K = 7, .ldc = 5}));
  EXPECT_TRUE(refused({.M = 5, .N = 6, .K = 7, .ab = DType::f32, .c = DType::bf16}));
  EXPECT_TRUE(refused({.M = 5, .N = 6, .K = 7}, {.count = int64_t{1} << 31}));
  EXPECT_FALSE(refused({.M = 5, .N = 6, .K = 7, .trans_a = true, .lda = 5, .ab = DType::bf16, .c = DType::bf16}));
}
