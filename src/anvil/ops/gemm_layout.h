// An Anvil matrix product (GemmShape, row-major) as the cuBLASLt call that
// computes it (column-major). Plain C++, no CUDA headers: the mapping is
// proved on any host (tests/gemm_layout_test.cpp replays it with a naive
// column-major GEMM) and ops/cuda/gemm.cu only translates it into cuBLASLt's
// descriptors.
//
// Why the operands swap: a row-major matrix X [r, c] with row stride ld is,
// read column-major, Xᵀ [c, r] with leading dimension ld. So Anvil's
// C = op(A)·op(B) is, column-major, Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLASLt's A is
// Anvil's B, its B is Anvil's A, its m = N, n = M, and each transpose flag
// carries over to the operand it travels with.
#pragma once
#include <cstdint>

#include "anvil/ops/matmul.h"

namespace anvil {

// cuBLASLt's cublasOperation_t: N reads the stored matrix, T its transpose.
enum class LtOp : uint8_t { N, T };
// Element types as cudaDataType_t names them: f32 is CUDA_R_32F, bf16 CUDA_R_16BF.
enum class LtType : uint8_t { f32, bf16 };
// cublasComputeType_t. Every product accumulates in f32: CUBLAS_COMPUTE_32F,
// which for f32 operands is full fp32 (TF32 is CUBLAS_COMPUTE_32F_FAST_TF32,
// never used: it rounds the operands to 10-bit mantissas, an error the CPU
// path does not make).
enum class LtCompute : uint8_t { f32 };
// One of Anvil's two operands (GemmShape's A and B).
enum class GemmOperand : uint8_t { a, b };

// Strided batches in Anvil's terms: `count` products of one GemmShape, the
// i-th reading A + i·stride_a, B + i·stride_b and writing C + i·stride_c
// (strides in elements).
struct GemmBatch {
  int64_t count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

// One cublasLtMatmul: D = alpha·op(A)·op(B) + beta·C, column-major, D in
// place over C (same pointer, type and layout). A is m × k after op (stored
// m × k for N, k × m for T), B is k × n after op, C is m × n; element (i, j)
// of a stored matrix is at i + j·ld.
struct LtMatmul {
  LtOp transa = LtOp::N, transb = LtOp::N;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  GemmOperand a_operand = GemmOperand::b, b_operand = GemmOperand::a;  // which Anvil operand each is
  int64_t batch_count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // of cuBLASLt's A, B, C (elements)
  float alpha = 1.0f, beta = 0.0f;                   // beta 1 when the product accumulates
  LtType a_type = LtType::f32, b_type = LtType::f32, c_type = LtType::f32;
  LtCompute compute = LtCompute::f32;
  LtType scale_type = LtType::f32;  // alpha and beta are f32 (CUBLASLT_MATMUL_DESC_SCALE_TYPE)

  // The stored (rows, cols) of cuBLASLt's A and B: what their layouts declare.
  int64_t a_rows() const { return transa == LtOp::N ? m : k; }
  int64_t a_cols() const { return transa == LtOp::N ? k : m; }
  int64_t b_rows() const { return transb == LtOp::N ? k : n; }
  int64_t b_cols() const { return transb == LtOp::N ? n : k; }
};

// The call computing `s` (over `batch`). Throws anvil::Error, naming the
// shape, for what cuBLASLt cannot take: a row stride below its row's width,
// an f32 product into bf16 (no such cuBLASLt type combination), i32
// operands, or a batch count past int32.
LtMatmul lt_matmul_of(const GemmShape& s, const GemmBatch& batch = {});

// Anvil's pointer for cuBLASLt's operand `which` (a_operand or b_operand).
inline const void* operand_pointer(GemmOperand which, const void* A, const void* B) {
  return which == GemmOperand::a ? A : B;
}

}  // namespace anvil
