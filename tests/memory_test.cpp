// Memory: the estimator against the tracking allocator, per category, over
// model shapes (with and without grouped-query attention), batch shapes,
// every activation-checkpointing mode and both compute dtypes; the trainer's
// own logged peaks against the estimate; the ordering of the
// activation-checkpointing modes; flat memory under gradient accumulation.
#include "anvil/estimate/memory.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "anvil/core/dry_run.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/rng.h"
#include "anvil/model/llama.h"
#include "anvil/ops/matmul.h"
#include "test_util.h"

using namespace anvil;
namespace fs = std::filesystem;

namespace {

std::pair<Tensor, Tensor> batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Tensor tokens = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "tokens");
  Tensor targets = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "targets");
  const uint64_t key = RngStream{seed, "memory.tokens"}.key();
  for (int64_t i = 0; i < B * T; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i + B * T)) * vocab);
  }
  return {tokens, targets};
}

constexpr int64_t kB = 2, kT = 64;

// Peak activation bytes of one forward_backward, as the allocator saw them.
size_t measured_activation_peak(Llama& model, const AcPolicy& policy) {
  auto [tokens, targets] = batch(kB, kT, model.args().vocab_size, 1);
  auto& alloc = TrackingAllocator::instance();
  alloc.reset_peak();
  const size_t before = alloc.live_bytes(MemCategory::activations);
  model.forward_backward(tokens, targets, 1.0f, policy);
  EXPECT_EQ(alloc.live_bytes(MemCategory::activations), before) << "activations leaked";
  return alloc.peak_bytes(MemCategory::activations) - before;
}

ModelArgs small_model() {
  ModelArgs a = model_flavor("llama3", "debugmodel");
  a.n_layers = 4;
  return a;
}

const AcPolicy kPolicies[] = {{AcMode::none, 1}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2},
                              {AcMode::full, 1}};

// One estimator case: a flavour as published (6 layers each; debugmodel has 16
// heads of 16 over 16 kv heads, 25M 8 heads of 64 over 4 kv heads), a batch
// shape, a compute dtype and a checkpointing policy.
struct MemCase {
  const char* flavor;
  int64_t B, T;
  DType dtype;
  AcPolicy ac;
  int threads = 0;  // 0: as the process runs (OMP_NUM_THREADS); else set for the case
};

std::string case_name(const ::testing::TestParamInfo<MemCase>& info) {
  const MemCase& c = info.param;
  std::string ac = c.ac.mode == AcMode::none           ? "none"
                   : c.ac.mode == AcMode::selective_op ? "selective_op"
                   : c.ac.mode == AcMode::full         ? "full"
                                                       : "selective_layer_" + std::to_string(c.ac.every);
  std::string flavor = c.flavor;
  if (flavor == "25M") flavor = "m25";
  return flavor + "_B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_" + dtype_name(c.dtype) + "_" + ac +
         (c.threads > 0 ? "_threads" + std::to_string(c.threads) : "");
}

std::vector<MemCase> mem_cases() {
  const AcPolicy policies[] = {{AcMode::none, 1},           {AcMode::selective_op, 1}, {AcMode::selective_layer, 1},
                               {AcMode::selective_layer, 2}, {AcMode::selective_layer, 3}, {AcMode::full, 1}};
  // Shapes kept small (the whole file runs in well under a minute): odd and
  // even batches, and sequence lengths below, at and above attention's
  // 64-row diagonal tile (ops/attention.cpp), so the tile choices vary. 25M
  // (grouped-query attention, 8192-token vocabulary) with short sequences.
  const std::pair<const char*, std::vector<std::pair<int64_t, int64_t>>> shapes[] = {
      {"debugmodel", {{1, 32}, {2, 64}, {3, 96}}},
      {"25M", {{1, 16}, {2, 48}}},
  };
  std::vector<MemCase> cases;
  for (const auto& [flavor, bts] : shapes)
    for (auto [B, T] : bts)
      for (DType dt : {DType::f32, DType::bf16})
        for (AcPolicy p : policies) cases.push_back({flavor, B, T, dt, p});
  // Where attention's backward scratch is the largest workspace term (fp32,
  // so no weight-gradient partial; T = 256 against a 1024-token vocabulary
  // chunk): with 2 threads, and with 3, which do not divide the 4 (batch, kv
  // head) pairs, so the backward adds a dQ partial per split.
  cases.push_back({"25M", 1, 256, DType::f32, {AcMode::none, 1}, 2});
  cases.push_back({"25M", 1, 256, DType::f32, {AcMode::full, 1}, 3});
  return cases;
}

// Peak bytes of the workspace category during `fn`, without oneDNN's GEMM
// scratchpad (which the estimate leaves out), read from the allocator's
// timeline; and the scratchpad's own largest size, for the record.
struct WorkspacePeak {
  size_t without_scratchpad = 0, scratchpad = 0;
};
template <class F>
WorkspacePeak measure_workspace(F&& fn) {
  auto& alloc = TrackingAllocator::instance();
  std::map<const void*, std::pair<size_t, bool>> live;  // bytes, is scratchpad
  size_t current = 0, scratch = 0;
  for (const LiveAllocation& a : alloc.live_allocations()) {
    if (a.category != MemCategory::workspace) continue;
    const bool sp = a.tag == "gemm.scratchpad";
    live[a.ptr] = {a.bytes, sp};
    (sp ? scratch : current) += a.bytes;
  }
  WorkspacePeak peak{current, scratch};
  alloc.clear_timeline();
  alloc.set_timeline(true);
  fn();
  alloc.set_timeline(false);
  for (const MemEvent& e : alloc.timeline()) {
    if (e.category != MemCategory::workspace) continue;
    if (e.is_alloc) {
      const bool sp = e.tag == "gemm.scratchpad";
      live[e.ptr] = {e.bytes, sp};
      (sp ? scratch : current) += e.bytes;
    } else if (auto it = live.find(e.ptr); it != live.end()) {
      (it->second.second ? scratch : current) -= it->second.first;
      live.erase(it);
    }
    peak.without_scratchpad = std::max(peak.without_scratchpad, current);
    peak.scratchpad = std::max(peak.scratchpad, scratch);
  }
  alloc.clear_timeline();
  return peak;
}

}  // namespace

class MemoryEstimateCase : public ::testing::TestWithParam<MemCase> {};

// Parameters, gradients and activations exactly; workspace as an upper bound.
TEST_P(MemoryEstimateCase, MatchesTheAllocator) {
  const MemCase& c = GetParam();
  const int threads_before = num_threads();
  if (c.threads > 0) set_num_threads(c.threads);
  struct Restore {
    int n;
    ~Restore() { set_num_threads(n); }
  } restore{threads_before};
  const ModelArgs args = model_flavor("llama3", c.flavor);
  auto& alloc = TrackingAllocator::instance();
  // Nothing of the model may be live yet: the workspace measured below starts
  // from the test's own token batch and the model's RoPE table, as the
  // trainer's step does from its batch and the table.
  const size_t params_before = alloc.live_bytes(MemCategory::parameters);
  const size_t grads_before = alloc.live_bytes(MemCategory::gradients);
  release_widened_buffers();  // an earlier test's, in this process: the step's own grow within it
  // As the trainer holds one process's model: in bf16, each block's weights cast while it runs.
  Llama model(args, c.dtype, c.T, LlamaOptions{.compute_copy = ComputeCopy::per_group});
  model.params().init(1);
  const MemoryEstimate est = estimate_memory(args, {c.B, c.T, c.dtype, c.ac, 1, num_threads()});

  auto [tokens, targets] = batch(c.B, c.T, args.vocab_size, 1);
  alloc.reset_peak();
  const size_t act_before = alloc.live_bytes(MemCategory::activations);
  const WorkspacePeak ws = measure_workspace([&] { model.forward_backward(tokens, targets, 1.0f, c.ac); });
  // The fp32 master, and at the peak the casts of the groups in use.
  EXPECT_EQ(alloc.peak_bytes(MemCategory::parameters) - params_before, est.bytes(MemCategory::parameters));
  EXPECT_EQ(alloc.live_bytes(MemCategory::activations), act_before) << "activations leaked";
  EXPECT_EQ(alloc.peak_bytes(MemCategory::activations) - act_before, est.bytes(MemCategory::activations));
  // The backward creates the fp32 gradient buffer.
  EXPECT_EQ(alloc.live_bytes(MemCategory::gradients) - grads_before, est.bytes(MemCategory::gradients));

  const size_t bound = est.bytes(MemCategory::workspace);
  std::printf("workspace: measured %zu, bound %zu (%.3f); oneDNN scratchpad %zu, not in the bound\n",
              ws.without_scratchpad, bound, static_cast<double>(ws.without_scratchpad) / static_cast<double>(bound),
              ws.scratchpad);
  // Every term of the estimate is the size of buffers an op allocates, and the
  // kept part is live throughout, so the peak reaches the bound when its
  // largest term runs: measured equal in every case here. 1% below is allowed;
  // a looser bound means a term no longer follows its op's allocations.
  EXPECT_LE(ws.without_scratchpad, bound);
  EXPECT_GE(static_cast<double>(ws.without_scratchpad), 0.99 * static_cast<double>(bound));
}

INSTANTIATE_TEST_SUITE_P(Shapes, MemoryEstimateCase, ::testing::ValuesIn(mem_cases()), case_name);

TEST(MemoryEstimate, CheckpointingModesOrderAsDocumented) {
  const ModelArgs args = small_model();
  Llama model(args, DType::bf16, kT);
  model.params().init(1);
  size_t peak[4];
  for (int i = 0; i < 4; ++i) peak[i] = measured_activation_peak(model, kPolicies[i]);
  std::printf("activation peak: none %zu, selective op %zu, selective layer(2) %zu, full %zu bytes\n", peak[0],
              peak[1], peak[2], peak[3]);
  EXPECT_GT(peak[0], peak[1]);
  EXPECT_GT(peak[1], peak[2]);
  EXPECT_GT(peak[2], peak[3]);

  // Full: one block input per layer, plus one block's working set.
  const size_t inputs = static_cast<size_t>(args.n_layers * kB * kT * args.dim) * 2;
  const size_t block = block_saved_bytes(args, {kB, kT, DType::bf16, {AcMode::none, 1}}, 0);
  std::printf("full: %zu = %zu block inputs + %zu; one block's saved tensors %zu\n", peak[3], inputs,
              peak[3] - inputs, block);
  EXPECT_GE(peak[3], inputs + block);
  // The working set beyond the block's own tensors is a few (M, D) or (M, F) gradients.
  EXPECT_LE(peak[3], inputs + block + block / 2);
}

TEST(GradientAccumulation, PeakMemoryIsFlatInTheNumberOfMicroBatches) {
  const ModelArgs args = small_model();
  Llama model(args, DType::bf16, kT);
  model.params().init(1);
  auto& alloc = TrackingAllocator::instance();
  size_t peak_one = 0;
  for (int micro_batches : {1, 2, 4, 8}) {
    model.params().zero_grad();
    alloc.reset_peak();
    for (int i = 0; i < micro_batches; ++i) {
      auto [tokens, targets] = batch(kB, kT, args.vocab_size, static_cast<uint64_t>(i));
      model.forward_backward(tokens, targets, 1.0f / static_cast<float>(micro_batches), {AcMode::none, 1});
    }
    const size_t peak = alloc.peak_total();
    if (micro_batches == 1) peak_one = peak;
    std::printf("%d micro-batches: peak %zu bytes\n", micro_batches, peak);
    EXPECT_LE(static_cast<double>(peak), 1.02 * static_cast<double>(peak_one));
  }
}

// The trainer itself: one step of `anvil train`, whose logged per-category
// peaks (the allocator's, over the whole step: forward, backward, clipping and
// the optimizer step that creates AdamW's two fp32 moments) must equal the
// estimate for parameters, gradients, optimizer state and activations.
class TrainerMemory : public ::testing::TestWithParam<DType> {};

TEST_P(TrainerMemory, LoggedPeaksMatchTheEstimate) {
  const DType dt = GetParam();
  const fs::path dir = anvil::testing::scratch_root() / (std::string("anvil_memory_train_") + dtype_name(dt));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "text.txt");
    for (int i = 0; i < 200; ++i) f << "The jury said the election was conducted well, number " << i % 13 << ".\n";
  }
  const int64_t B = 2, T = 64;
  const auto out = anvil::testing::run_anvil(
      "train --model.flavor 25M --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
      " --training.seq_len " + std::to_string(T) + " --training.local_batch_size " + std::to_string(B) +
      " --training.steps 1 --metrics.log_freq 1 --training.mixed_precision_param " +
      (dt == DType::bf16 ? "bfloat16" : "float32") +
      " --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --job.dump_folder " +
      (dir / "out").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  std::ifstream jsonl(dir / "out" / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(jsonl, line)) << out.text;
  const nlohmann::json row = nlohmann::json::parse(line);
  const MemoryEstimate est =
      estimate_memory(model_flavor("llama3", "25M"), {B, T, dt, {AcMode::selective_layer, 2}});
  for (MemCategory c : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state,
                        MemCategory::activations}) {
    const size_t logged = row.at("max_active_bytes_by_category").at(category_name(c)).get<size_t>();
    std::printf("%s: logged peak %zu, estimate %zu\n", category_name(c), logged, est.bytes(c));
    EXPECT_EQ(logged, est.bytes(c)) << category_name(c);
  }
  EXPECT_EQ(row.at("live_bytes_after_optimizer_by_category").at("optimizer_state").get<size_t>(),
            est.bytes(MemCategory::optimizer_state));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TrainerMemory, ::testing::Values(DType::f32, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// block_saved_bytes (the pipeline's automatic cut weighs stages by it) against
// a dry run of the model's forward: what every block keeps between its
// forward and backward, under every policy and dtype, is the formula's sum
// (and the last block's output, kept for the head), for Llama, Qwen3 and
// Qwen3-MoE.
TEST(MemoryEstimate, BlockSavedBytesIsWhatTheDryRunKeeps) {
  for (const char* family : {"llama3", "qwen3", "qwen3_moe"}) {
    const ModelArgs args = std::string(family) == "qwen3_moe" ? model_flavor("qwen3", "debugmodel_moe")
                                                               : model_flavor(family, "debugmodel");
    const int64_t B = 2, T = 48;
    for (DType dt : {DType::f32, DType::bf16})
      for (const AcPolicy& policy : {AcPolicy{AcMode::none, 1}, AcPolicy{AcMode::selective_op, 1},
                                     AcPolicy{AcMode::selective_layer, 2}, AcPolicy{AcMode::full, 1}}) {
        DryRun dry;
        Llama model(args, dt, T);
        const Tensor tokens = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "tokens");
        const size_t before = dry.allocator().live_bytes(MemCategory::activations);
        StageSaved saved;
        (void)model.forward(tokens, B, T, policy, saved);
        const size_t kept = dry.allocator().live_bytes(MemCategory::activations) - before;
        size_t formula = static_cast<size_t>(B * T * args.dim) * dtype_size(dt);  // the head's input
        for (int l = 0; l < args.n_layers; ++l)
          formula += block_saved_bytes(args, {B, T, dt, policy}, l);
        EXPECT_EQ(kept, formula) << family << " " << dtype_name(dt) << ", mode " << static_cast<int>(policy.mode);
      }
  }
}
