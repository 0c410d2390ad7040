// The trainer's data: the configured dataset's training and validation
// streams, packed into windows of seq_len + 1 tokens by a prefetch thread
// while the step computes, and the step's micro-batches.
#pragma once
#include <cstdint>
#include <memory>

#include "anvil/data/stream_loader.h"
#include "anvil/data/tokenizer.h"
#include "anvil/model/args.h"
#include "anvil/train/config.h"
#include "anvil/train/forward_backward.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

class ParallelizedModel;

// The job's tokenizer, checked against the model's vocabulary.
std::unique_ptr<Tokenizer> load_job_tokenizer(const JobConfig& cfg, const ModelArgs& args);

class TrainData {
 public:
  // Opens the dataset and prints its line. Data-parallel rank r reads windows
  // r, r + dp, ...: the union of the ranks' batches is the single-process
  // batch of dp times the size.
  TrainData(const JobConfig& cfg, const Tokenizer& tokenizer, const ParallelDims& par);

  StreamLoader& loader() { return *loader_; }
  // The step's micro-batches are fetched up front, so the loss can be
  // normalised by the token count of the whole step before any backward runs.
  void allocate_batches(int64_t micro_batches);
  const MicroBatches& batches() const { return batches_; }
  // Fills the step's micro-batches; returns their tokens.
  int64_t next_step();
  // Under block-causal attention, what the step's documents make of it: the
  // documents per sequence, the share of the causal mask's query-key pairs
  // attention computes, and under context parallelism each cp rank's pairs
  // against the mean (the load balancer's balance); "" under causal attention.
  std::string attention_summary() const;
  // The loss of the validation set's validation.steps batches, summed over
  // the data-parallel ranks: (loss sum, tokens). The same held-out batches every time.
  std::pair<double, int64_t> validation_loss(ParallelizedModel& layout, const ParallelDims& par);

 private:
  // One batch from `loader` into micro-batch i's buffers: whole sequences, or
  // under context parallelism this rank's chunks of them, laid out for
  // `groups` equal micro-batches of its rows (ContextParallel's local layout
  // in each: the first chunk of the group's sequences, then their second).
  // False when it ran out.
  bool fill(StreamLoader& loader, size_t i, int64_t groups);

  const JobConfig& cfg_;
  std::unique_ptr<StreamLoader> loader_, val_loader_;
  MicroBatches batches_;
  int cp_size_ = 1, cp_rank_ = 0;
  // Block-causal attention: the tokenizer's EOS, which ends a document; -1: causal.
  int32_t document_eos_ = -1;
  // A training batch runs through a pipeline as this many micro-batches, each
  // a slice of its rows; an evaluation batch as one.
  int64_t pp_micro_batches_ = 1;
  CpLoadBalancer cp_balancer_ = CpLoadBalancer::headtail;
};

}  // namespace anvil
