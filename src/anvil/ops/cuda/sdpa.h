// Causal grouped-query attention on the GPU through cuDNN's fused SDPA (flash
// attention), forward and backward: the CUDA twin of attention_forward and
// attention_backward (ops/attention.h) for bf16 tensors in Anvil's layout:
//   q, out, dout, dq (B, T, Hq, D) bf16; k, v, dk, dv (B, T, Hkv, D) bf16;
//   lse (B, Hq, T) f32, the natural-log log-sum-exp of the scaled scores per
//   query row, exactly attention_forward's (ops/cuda/sdpa_graph.h says why).
// Query t sees keys 0..t; scale 0 means 1/sqrt(D). Block-causal attention
// (shape.docs_batch > 0): query t sees the keys of its own document up to
// itself, through cuDNN's ragged SDPA (ops/sdpa_layout.h); `documents` is then
// the device copy of the documents' pack (sdpa_documents_packed) and the
// stats token-major (B·T, Hq) f32 in place of the lse. Ragged SDPA runs on
// Hopper and later only (cuDNN's check; on an older GPU validate fails).
//
// No cuDNN header here, so callers do not compile the frontend.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "anvil/ops/gpu_kernels.h"  // SdpaShape

namespace anvil {


// The device workspace the graph of `shape` needs, in bytes (0 is possible).
// The caller allocates a fixed buffer of at least the largest over its shapes
// from the device pool and passes it to every call. Builds the graph if this
// process has not yet (see below), so it needs a GPU.
size_t sdpa_forward_workspace_bytes(const SdpaShape& shape);
size_t sdpa_backward_workspace_bytes(const SdpaShape& shape);

// Run on `stream` and return at once. Pointers are device memory; workspace
// is `workspace_bytes` of device memory, used by this call alone until it ends
// on `stream`, at least what the *_workspace_bytes functions say (else the
// call throws before running anything).
// `stats` is the lse (B, Hq, T) for causal shapes; documents null then.
void sdpa_forward_cuda(const SdpaShape& shape, const void* q, const void* k, const void* v, void* out, float* stats,
                       const void* documents, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// dq, dk, dv are overwritten (keys no query sees get 0).
void sdpa_backward_cuda(const SdpaShape& shape, const void* dout, const void* q, const void* k, const void* v,
                        const void* out, const float* stats, const void* documents, void* dq, void* dk, void* dv,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Every failure throws anvil::Error naming the graph (forward or backward),
// the shape, the step (validate, build_operation_graph,
// create_execution_plans, check_support, build_plans, execute) and cuDNN's
// message (or the CUDA runtime's). Without a GPU every call fails at its
// first step, cudaGetDevice (validate would too: the frontend asks the CUDA
// runtime for the device's properties there).
//
// Graphs are built on a signature's first use (the shape, scale, direction
// and the current GPU: a build costs from tens of milliseconds to seconds)
// and kept for the process's life; the plan is the first that cuDNN's
// heuristic (mode A) offers and that builds. One cuDNN handle per GPU, made
// on first use, never destroyed (at exit the CUDA runtime may be gone before
// it). Safe to call from several threads: executions are serialised, since a
// handle carries the stream they run on.

}  // namespace anvil
