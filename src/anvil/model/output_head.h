// The last module: the final RMSNorm, the output projection and the
// cross-entropy loss, fused (ops/cross_entropy.h) so the logits are never
// whole. Its forward and backward run together: what a micro-batch saves for
// it is its input, the residual stream after the last block.
#pragma once
#include "anvil/core/tensor.h"
#include "anvil/model/args.h"
#include "anvil/model/parallel_style.h"
#include "anvil/model/params.h"
#include "anvil/ops/cross_entropy.h"

namespace anvil {

class OutputHead {
 public:
  // norm_index, output_index: the final norm's and the output projection's
  // parameters (the embedding's, with tied embeddings).
  OutputHead(ParamStore& params, int norm_index, int output_index, const ModelArgs& args, const ParallelStyle& style)
      : params_(params),
        norm_(norm_index),
        output_(output_index),
        eps_(static_cast<float>(args.norm_eps)),
        style_(style) {}

  // Training: h (residual_rows(M), D), targets (M) i32 (ignore_index carries no
  // loss). Returns the loss and writes dh, the gradient of grad_scale ·
  // loss_sum with respect to h; accumulates the parameter gradients.
  CrossEntropyResult forward_backward(const Tensor& h, const Tensor& targets, float grad_scale, Tensor& dh);
  // Evaluation: the loss only.
  CrossEntropyResult forward(const Tensor& h, const Tensor& targets) const;
  // The logits (M, this rank's vocabulary rows) in the compute dtype, which
  // training never forms; for the pipeline's keep-outputs diagnostic.
  Tensor logits(const Tensor& h) const;

 private:
  ParamStore& params_;
  int norm_, output_;
  float eps_;
  const ParallelStyle& style_;
};

}  // namespace anvil
