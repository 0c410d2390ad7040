#include "anvil/train/forward_backward.h"

#include "anvil/core/dry_run.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/embedding.h"

namespace anvil {

namespace {
// A micro-batch's host tensor where the model runs (default_device()): itself
// on the host; on a GPU a copy (the loader fills host memory). The documents
// stay on the host on every device: only the attention reads them, and a
// GPU's reads them there (ops/attention_gpu.h).
Tensor where_the_model_runs(const Tensor& t, const char* tag) {
  if (!t.defined() || t.device() == default_device()) return t;
  return t.to(default_device(), MemCategory::activations, tag);
}

// The ops check token ids and targets on the host; a GPU's kernels cannot
// throw, so a batch bound for one is checked here, before the copy.
void check_batch_for_the_device(const Llama& model, const Tensor& tokens, const Tensor& targets) {
  if (tokens.device() == default_device() || dry_run()) return;
  check_token_ids(tokens, model.args().vocab_size, "the batch's tokens");
  if (targets.defined()) count_targets(targets, model.args().vocab_size, CrossEntropyOptions{}.ignore_index);
}
}  // namespace

ForwardBackwardResult forward_backward_single_stage(Llama& model, const MicroBatches& batches, float grad_scale,
                                                    const AcPolicy& policy, const ForwardBackwardHooks& hooks) {
  ForwardBackwardResult out;
  const int64_t n = batches.size();
  for (int64_t i = 0; i < n; ++i) {
    if (hooks.before_micro_batch) hooks.before_micro_batch(i, n);
    const auto b = static_cast<size_t>(i);
    check_batch_for_the_device(model, batches.tokens[b], batches.targets[b]);
    const CrossEntropyResult r = model.forward_backward(
        where_the_model_runs(batches.tokens[b], "batch.tokens"), where_the_model_runs(batches.targets[b], "batch.targets"),
        grad_scale, policy, batches.documents_of(b));
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
  check_batch_for_the_device(model, tokens, targets);
  return model.forward(where_the_model_runs(tokens, "batch.tokens"), where_the_model_runs(targets, "batch.targets"),
                       documents);
}

}  // namespace anvil
