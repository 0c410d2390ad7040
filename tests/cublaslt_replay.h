// cublasLtMatmul as documented, on the host: the naive GEMM the tests replay
// Anvil's cuBLASLt calls (ops/gemm_layout.h) through, written from cuBLASLt's
// column-major semantics and not from Anvil's row-major helpers.
//   D = alpha·op(A)·op(B) + beta·C per batch p, operands at X + p·stride_x; a
//   stored matrix's element (i, j) is at i + j·ld (column-major); op(X) is X
//   (CUBLAS_OP_N) or X^T (CUBLAS_OP_T); op(A) is m × k, op(B) k × n, C and D
//   m × n. With beta = 0 C is not read. D is C here (in place).
//   CUBLAS_COMPUTE_32F: products summed in f32, and D converted to its type
//   once at the end.
#pragma once
#include <cstdint>

#include "anvil/core/dtype.h"
#include "anvil/ops/gemm_layout.h"

namespace anvil::cublaslt_replay {

inline float load(LtType t, const void* base, int64_t i) {
  if (t == LtType::f32) return static_cast<const float*>(base)[i];
  return bf16::to_float(static_cast<const bf16*>(base)[i].bits);
}
inline void store(LtType t, void* base, int64_t i, float v) {
  if (t == LtType::f32)
    static_cast<float*>(base)[i] = v;
  else
    static_cast<bf16*>(base)[i].bits = bf16::from_float(v);
}

// A and B are cuBLASLt's (operand_pointer of the call's a_operand, b_operand).
inline void column_major_gemm(const LtMatmul& c, const void* A, const void* B, void* C) {
  for (int64_t p = 0; p < c.batch_count; ++p) {
    const int64_t a0 = p * c.stride_a, b0 = p * c.stride_b, c0 = p * c.stride_c;
    for (int64_t j = 0; j < c.n; ++j)
      for (int64_t i = 0; i < c.m; ++i) {
        float acc = 0.0f;
        for (int64_t l = 0; l < c.k; ++l) {
          const float a = load(c.a_type, A, a0 + (c.transa == LtOp::N ? i + l * c.lda : l + i * c.lda));
          const float b = load(c.b_type, B, b0 + (c.transb == LtOp::N ? l + j * c.ldb : j + l * c.ldb));
          acc += a * b;
        }
        float d = c.alpha * acc;
        if (c.beta != 0.0f) d += c.beta * load(c.c_type, C, c0 + i + j * c.ldc);
        store(c.c_type, C, c0 + i + j * c.ldc, d);
      }
  }
}

}  // namespace anvil::cublaslt_replay
