#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "anvil/core/error.h"
#include "anvil/ops/cuda/gemm.h"

namespace anvil {

namespace {

std::string call_text(const LtMatmul& c) {
  const auto op = [](LtOp o) { return o == LtOp::N ? "N" : "T"; };
  const auto type = [](LtType t) { return t == LtType::f32 ? "f32" : "bf16"; };
  return detail::concat("m=", c.m, " n=", c.n, " k=", c.k, " transa=", op(c.transa), " transb=", op(c.transb),
                        " lda=", c.lda, " ldb=", c.ldb, " ldc=", c.ldc, " batches=", c.batch_count, " A/B ",
                        type(c.a_type), " C ", type(c.c_type), " alpha=", c.alpha, " beta=", c.beta);
}

void check(cublasStatus_t status, const char* function, const LtMatmul& c) {
  ANVIL_CHECK(status == CUBLAS_STATUS_SUCCESS, function, " failed (", cublasLtGetStatusName(status), ": ",
              cublasLtGetStatusString(status), ") for the product ", call_text(c));
}

cudaDataType_t cuda_type(LtType t) { return t == LtType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

cublasOperation_t cuda_op(LtOp o) { return o == LtOp::N ? CUBLAS_OP_N : CUBLAS_OP_T; }

// CUBLAS_COMPUTE_32F accumulates in f32 on every operand type; for f32
// operands it is full fp32 (CUBLAS_COMPUTE_32F_FAST_TF32 would round them to
// TF32, and CUBLAS_COMPUTE_32F_EMULATED_16BFX9 would emulate it with bf16
// products; neither is asked for).
cublasComputeType_t cuda_compute(LtCompute c) {
  switch (c) {
    case LtCompute::f32:
      return CUBLAS_COMPUTE_32F;
  }
  throw Error("unknown LtCompute");
}

// The process's cuBLASLt handle, made on first use (thread-safe static
// initialisation). A cuBLASLt handle holds no stream or workspace (both are
// passed per call), so threads share it. Never destroyed: at exit the CUDA
// runtime may already be torn down, and the driver frees it with the process.
cublasLtHandle_t handle() {
  static const cublasLtHandle_t h = [] {
    cublasLtHandle_t made = nullptr;
    const cublasStatus_t status = cublasLtCreate(&made);
    ANVIL_CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasLtCreate failed (", cublasLtGetStatusName(status), ": ",
                cublasLtGetStatusString(status), ")");
    return made;
  }();
  return h;
}

// The alignment cuBLASLt may assume of an operand, in bytes: the largest power
// of two dividing its address and, over batches, its batch stride, at most
// 256 (the heuristic's default assumption, which a vocabulary chunk or a
// head's columns at an odd offset break).
uint32_t alignment(const void* ptr, int64_t batch_count, int64_t stride_elements, LtType type) {
  uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | 256u;
  if (batch_count > 1) bits |= static_cast<uint64_t>(stride_elements) * (type == LtType::f32 ? 4u : 2u);
  return static_cast<uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

// What the algorithm depends on: everything of the call but alpha and beta's
// values (cuBLASLt picks algorithms without them; beta's zeroness is kept,
// since beta = 0 lets C go unread), the operands' alignments, the workspace
// size and the GPU.
using Signature = std::array<int64_t, 23>;

// Descriptors initialised in place (cuBLASLt's opaque structs, nothing to
// destroy) and the algorithm the heuristic picked for them.
struct Plan {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t a, b, c;  // C's layout is D's too (D is C)
  cublasLtMatmulAlgo_t algo;
};

void layout(cublasLtMatrixLayoutOpaque_t* out, LtType type, int64_t rows, int64_t cols, int64_t ld, int64_t stride,
            const LtMatmul& c) {
  check(cublasLtMatrixLayoutInit(out, cuda_type(type), static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
        "cublasLtMatrixLayoutInit", c);
  if (c.batch_count == 1) return;
  const int32_t count = static_cast<int32_t>(c.batch_count);
  check(cublasLtMatrixLayoutSetAttribute(out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
        "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)", c);
  check(cublasLtMatrixLayoutSetAttribute(out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
        "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)", c);
}

struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};

std::unique_ptr<Plan> make_plan(const LtMatmul& c, const std::array<uint32_t, 3>& align, size_t workspace_bytes) {
  auto plan = std::make_unique<Plan>();
  check(cublasLtMatmulDescInit(&plan->desc, cuda_compute(c.compute), cuda_type(c.scale_type)), "cublasLtMatmulDescInit",
        c);
  const int32_t transa = cuda_op(c.transa), transb = cuda_op(c.transb);
  check(cublasLtMatmulDescSetAttribute(&plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa),
        "cublasLtMatmulDescSetAttribute(TRANSA)", c);
  check(cublasLtMatmulDescSetAttribute(&plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb),
        "cublasLtMatmulDescSetAttribute(TRANSB)", c);
  layout(&plan->a, c.a_type, c.a_rows(), c.a_cols(), c.lda, c.stride_a, c);
  layout(&plan->b, c.b_type, c.b_rows(), c.b_cols(), c.ldb, c.stride_b, c);
  layout(&plan->c, c.c_type, c.m, c.n, c.ldc, c.stride_c, c);

  cublasLtMatmulPreference_t made = nullptr;
  check(cublasLtMatmulPreferenceCreate(&made), "cublasLtMatmulPreferenceCreate", c);
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter> pref(made);
  const uint64_t max_workspace = workspace_bytes;
  check(cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                             sizeof max_workspace),
        "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", c);
  const cublasLtMatmulPreferenceAttributes_t align_attr[] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    const uint32_t bytes = align[static_cast<size_t>(i < 3 ? i : 2)];  // D is C
    check(cublasLtMatmulPreferenceSetAttribute(pref.get(), align_attr[i], &bytes, sizeof bytes),
          "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)", c);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  check(cublasLtMatmulAlgoGetHeuristic(handle(), &plan->desc, &plan->a, &plan->b, &plan->c, &plan->c, pref.get(), 1,
                                       &result, &found),
        "cublasLtMatmulAlgoGetHeuristic", c);
  ANVIL_CHECK(found > 0 && result.state == CUBLAS_STATUS_SUCCESS,
              "cublasLtMatmulAlgoGetHeuristic found no algorithm for the product ", call_text(c), " (alignments A ",
              align[0], " B ", align[1], " C ", align[2], " bytes, workspace ", workspace_bytes, " bytes)");
  plan->algo = result.algo;
  return plan;
}

// Plans by signature, for the process's life (a training step makes a few
// dozen shapes). Map nodes stay put, so a plan found is used unlocked.
Plan& plan_for(const LtMatmul& c, const std::array<uint32_t, 3>& align, size_t workspace_bytes) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  ANVIL_CHECK(err == cudaSuccess, "cudaGetDevice failed (", cudaGetErrorString(err), ") for the product ",
              call_text(c));
  const Signature key = {device,
                         static_cast<int64_t>(c.transa),
                         static_cast<int64_t>(c.transb),
                         c.m,
                         c.n,
                         c.k,
                         c.lda,
                         c.ldb,
                         c.ldc,
                         c.batch_count,
                         c.stride_a,
                         c.stride_b,
                         c.stride_c,
                         static_cast<int64_t>(c.a_type),
                         static_cast<int64_t>(c.b_type),
                         static_cast<int64_t>(c.c_type),
                         static_cast<int64_t>(c.compute),
                         static_cast<int64_t>(c.scale_type),
                         c.beta == 0.0f,
                         align[0],
                         align[1],
                         align[2],
                         static_cast<int64_t>(workspace_bytes)};
  static std::mutex mutex;
  static std::map<Signature, std::unique_ptr<Plan>> plans;
  const std::lock_guard lock(mutex);
  std::unique_ptr<Plan>& plan = plans[key];
  if (!plan) plan = make_plan(c, align, workspace_bytes);
  return *plan;
}

}  // namespace

void gemm_cuda(const LtMatmul& c, const void* A, const void* B, void* C, void* workspace, size_t workspace_bytes,
               cudaStream_t stream) {
  if (c.m == 0 || c.n == 0) return;
  if (c.k == 0) {  // D = beta·C: nothing to add, as gemm() requires
    ANVIL_CHECK(c.beta == 1.0f, "a product with K = 0 must accumulate: ", call_text(c));
    return;
  }
  // cuBLAS asks 256-byte alignment of a workspace (cublasSetWorkspace).
  ANVIL_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
              "cuBLASLt workspace must be 256-byte aligned, for the product ", call_text(c));
  const void* lt_a = operand_pointer(c.a_operand, A, B);
  const void* lt_b = operand_pointer(c.b_operand, A, B);
  const std::array<uint32_t, 3> align = {alignment(lt_a, c.batch_count, c.stride_a, c.a_type),
                                         alignment(lt_b, c.batch_count, c.stride_b, c.b_type),
                                         alignment(C, c.batch_count, c.stride_c, c.c_type)};
  Plan& plan = plan_for(c, align, workspace_bytes);
  // Host scalars (CUBLASLT_POINTER_MODE_HOST, the default), read before the call returns.
  const float alpha = c.alpha, beta = c.beta;
  check(cublasLtMatmul(handle(), &plan.desc, &alpha, lt_a, &plan.a, lt_b, &plan.b, &beta, C, &plan.c, C, &plan.c,
                       &plan.algo, workspace, workspace_bytes, stream),
        "cublasLtMatmul", c);
}

}  // namespace anvil
