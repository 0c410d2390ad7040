#include "anvil/train/forward_backward.h"

namespace anvil {

ForwardBackwardResult forward_backward_single_stage(Llama& model, const MicroBatches& batches, float grad_scale,
                                                    const AcPolicy& policy, const ForwardBackwardHooks& hooks) {
  ForwardBackwardResult out;
  const int64_t n = batches.size();
  for (int64_t i = 0; i < n; ++i) {
    if (hooks.before_micro_batch) hooks.before_micro_batch(i, n);
    const auto b = static_cast<size_t>(i);
    const CrossEntropyResult r =
        model.forward_backward(batches.tokens[b], batches.targets[b], grad_scale, policy, batches.documents_of(b));
    out.loss_sum += r.loss_sum;
    out.loss_tokens += r.num_tokens;
    // A signal reaches one rank, or the ranks at different moments: they
    // agree here, so all leave the step after the same micro-batch and no
    // rank is left waiting in a collective the others skipped.
    if (hooks.stop_requested && hooks.stop_requested()) {
      out.stopped_after = i + 1;
      break;
    }
  }
  return out;
}

CrossEntropyResult evaluate_single_stage(Llama& model, const Tensor& tokens, const Tensor& targets,
                                         const Tensor& documents) {
  return model.forward(tokens, targets, documents);
}

}  // namespace anvil
