// Matrix products through oneDNN (AMX for bf16 on CPUs that have it).
// Every matrix product in Anvil goes through gemm(); primitives are created once
// per shape and cached, because creating one JIT-compiles a kernel (~ms).
#pragma once
#include <cstdint>
#include <string>

#include "anvil/core/tensor.h"

namespace anvil {

// C[M,N] = alpha * op(A)[M,K] · op(B)[K,N]  (+ C when accumulate).
// Row-major; op(A) = A, or Aᵀ when trans_a (A is then stored [K,M]); likewise B.
// A and B share a dtype (f32 or bf16); C may be f32 or bf16 (f32 accumulation).
// lda/ldb/ldc are row strides in elements (0 = tightly packed).
// A product whose row count follows the data (an expert's last row block)
// leaves M, or K for a weight gradient's sum over rows, to each call: one
// oneDNN kernel (DNNL_RUNTIME_DIM_VAL) then serves every count, where a fixed
// shape keeps one kernel per count for the life of the process. Strides must
// not depend on the dimension left open (a transposed A with M open takes an
// explicit lda).
enum class RuntimeDim : uint8_t { none, m, k };
struct GemmShape {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  int64_t lda = 0, ldb = 0, ldc = 0;
  DType ab = DType::f32;
  DType c = DType::f32;
  float alpha = 1.0f;
  bool accumulate = false;
  RuntimeDim runtime = RuntimeDim::none;
};

void gemm(const GemmShape& s, const void* A, const void* B, void* C);

// Products run from inside a parallel region (attention's tiles) take their
// oneDNN scratchpad from the caller, who sizes it before the loop with
// gemm_scratchpad_bytes (the most any of its products needs; 0 for none), so
// the op's memory is fixed when it starts rather than grown on each thread.
size_t gemm_scratchpad_bytes(const GemmShape& s);
void gemm(const GemmShape& s, const void* A, const void* B, void* C, void* scratchpad);

// How many product kernels (oneDNN primitives, one per shape run) the process
// keeps. They live outside the allocator for the life of the process, so a
// caller whose shapes follow the data bounds its shapes (ops/moe_experts.h).
size_t gemm_kernels_cached();

// The name of the kernel oneDNN picks for a square product in `dtype`
// (e.g. "brg:avx512_core_amx"); used to check that bf16 runs on AMX. A bf16
// product that runs widened reads "widened to f32: " and the f32 kernel.
std::string matmul_impl_name(DType dtype, int64_t size = 512);

// ---- bf16 products widened to f32 ----
// On CPUs whose bf16 instructions are slower than their fp32 FMAs
// (bf16_products_faster_widened(), core/cpu_peak.h), gemm() runs a bf16
// product as an f32 one: it widens the operands (exactly) into f32 buffers,
// A in panels of rows so that a panel stays under kWidenedPanelBytes, and
// runs oneDNN's f32 kernel; the result is the bf16 kernel's up to summation
// order (both accumulate in f32). Products called inside a parallel region
// (attention's tiles, single-threaded) stay native: widening per tile costs
// more than it gains. The environment variable ANVIL_BF16_PRODUCTS=native or
// =widened overrides the choice, to measure one against the other. Below
// AVX-512 (an AVX2-only CPU) oneDNN has no bf16 product at all: there every
// bf16 product widens, whatever the choice, those in parallel regions included.
bool bf16_products_widened();
// Whether oneDNN can run bf16 products natively on this CPU (AVX-512 and up).
bool native_bf16_products();
// Sets the choice for this process (tests run both routes on any CPU).
void set_bf16_products_widened(bool widened);
inline constexpr size_t kWidenedPanelBytes = size_t{16} << 20;
// The f32 buffers a widened product of this shape needs, each grown per
// thread to the largest seen and kept ("gemm.widened_a", "_b", "_c"): an A
// panel and B whole; for a product with Aᵀ, panels of both along K; and, when
// C is bf16 (oneDNN has no f32 product into bf16), the f32 rows of C the panel
// writes. Zero when the product is not widened (f32, or bf16 running natively).
struct WidenedBytes {
  size_t a = 0, b = 0, c = 0;
};
WidenedBytes widened_operand_bytes(const GemmShape& s);
// Frees the calling thread's widened buffers (they grow again on the next
// widened product): for a measurement that must start from nothing kept.
void release_widened_buffers();

// ---- Linear layer: Y = X·Wᵀ (no bias, as in Llama) ----
// x  (M, K)  activations, f32 or bf16
// w  (N, K)  weight in the compute dtype (same dtype as x)
// y  (M, N)  output, same dtype as x
void linear_forward(const Tensor& x, const Tensor& w, Tensor& y);
// y (M, N) += x·wᵀ, y in x's dtype or f32: a residual add (or a partial sum)
// folded into the product.
void linear_forward_accumulate(const Tensor& x, const Tensor& w, Tensor& y);
// dy (M, N); dx (M, K) is overwritten, or added to when accumulate_dx.
void linear_backward_input(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate_dx = false);
// dw (N, K) += dyᵀ·x, in place and in one pass; dw may be f32 (the gradient
// accumulator in mixed precision) while dy and x are bf16.
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw);

}  // namespace anvil
