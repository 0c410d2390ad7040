// Matrix products on the GPU through cuBLASLt: the CUDA twin of gemm()
// (ops/matmul.h). The caller turns its GemmShape into the call with
// lt_matmul_of (ops/gemm_layout.h, proved on the host by
// tests/gemm_layout_test.cpp); this runs it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "anvil/ops/gemm_layout.h"
#include "anvil/ops/gpu_kernels.h"  // kCublasLtWorkspaceBytes

namespace anvil {

// Runs `call` on `stream` and returns at once: C (+)= alpha·op(A)·op(B) with
// A, B and C Anvil's operands (device pointers, as gemm() takes them).
// `workspace` is device memory of `workspace_bytes` (kCublasLtWorkspaceBytes
// in training; 256-byte aligned), used by this product alone until it ends
// on `stream`. Throws anvil::Error naming the cuBLASLt call and the shape
// when cuBLASLt refuses the product or has no algorithm for it.
//
// The first product of a signature (shape, types, batches, the operands'
// alignments, the workspace size, the GPU) asks cuBLASLt's heuristic for an
// algorithm and keeps it with the descriptors, for the process's life; later
// ones only look it up. Safe to call from several threads.
void gemm_cuda(const LtMatmul& call, const void* A, const void* B, void* C, void* workspace, size_t workspace_bytes,
               cudaStream_t stream);

}  // namespace anvil
