#include "anvil/ops/gemm_layout.h"

#include <limits>

#include "anvil/core/error.h"

namespace anvil {

namespace {

std::string shape_text(const GemmShape& s, const GemmBatch& batch) {
  return detail::concat("M=", s.M, " N=", s.N, " K=", s.K, s.trans_a ? " Aᵀ" : "", s.trans_b ? " Bᵀ" : "",
                        " lda=", s.lda, " ldb=", s.ldb, " ldc=", s.ldc, " (", dtype_name(s.ab), "->", dtype_name(s.c),
                        ")", batch.count != 1 ? detail::concat(" ×", batch.count, " batches") : "");
}

LtType lt_type(DType t) { return t == DType::bf16 ? LtType::bf16 : LtType::f32; }

}  // namespace

LtMatmul lt_matmul_of(const GemmShape& s, const GemmBatch& batch) {
  ANVIL_CHECK(s.M >= 0 && s.N >= 0 && s.K >= 0, "cuBLASLt product of negative size: ", shape_text(s, batch));
  ANVIL_CHECK(s.ab != DType::i32 && s.c != DType::i32, "cuBLASLt products take f32 or bf16: ", shape_text(s, batch));
  ANVIL_CHECK(!(s.ab == DType::f32 && s.c == DType::bf16),
              "cuBLASLt has no f32 product into bf16 (CUBLAS_COMPUTE_32F takes f32 A/B with f32 C only): ",
              shape_text(s, batch));
  ANVIL_CHECK(batch.count >= 1 && batch.count <= std::numeric_limits<int32_t>::max(),
              "cuBLASLt batch count must be 1 .. 2^31-1: ", shape_text(s, batch));

  // Anvil's row strides, 0 meaning packed (as matmul.cpp reads them). Each is
  // a column-major leading dimension of the same matrix read transposed, so
  // it must cover the stored row's width, as cuBLASLt requires of ld.
  const int64_t a_width = s.trans_a ? s.M : s.K, b_width = s.trans_b ? s.K : s.N;
  const int64_t lda = s.lda != 0 ? s.lda : a_width, ldb = s.ldb != 0 ? s.ldb : b_width, ldc = s.ldc != 0 ? s.ldc : s.N;
  ANVIL_CHECK(lda >= a_width && ldb >= b_width && ldc >= s.N,
              "cuBLASLt needs each row stride at least its row's width: ", shape_text(s, batch));

  LtMatmul call;
  // Cᵀ [N, M] = op(B)ᵀ [N, K] · op(A)ᵀ [K, M] (column-major; see gemm_layout.h).
  call.m = s.N;
  call.n = s.M;
  call.k = s.K;
  call.a_operand = GemmOperand::b;
  call.b_operand = GemmOperand::a;
  // B stored [K, N] reads column-major as Bᵀ [N, K]: already op(B)ᵀ, so N;
  // B stored [N, K] (trans_b) reads as [K, N] and needs T. Likewise A.
  call.transa = s.trans_b ? LtOp::T : LtOp::N;
  call.transb = s.trans_a ? LtOp::T : LtOp::N;
  call.lda = ldb;
  call.ldb = lda;
  call.ldc = ldc;
  call.batch_count = batch.count;
  call.stride_a = batch.stride_b;
  call.stride_b = batch.stride_a;
  call.stride_c = batch.stride_c;
  call.alpha = s.alpha;
  call.beta = s.accumulate ? 1.0f : 0.0f;
  call.a_type = call.b_type = lt_type(s.ab);
  call.c_type = lt_type(s.c);
  call.compute = LtCompute::f32;
  call.scale_type = LtType::f32;
  return call;
}

}  // namespace anvil
