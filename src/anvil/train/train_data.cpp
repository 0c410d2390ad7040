#include "anvil/train/train_data.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/brown.h"
#include "anvil/data/shard.h"
#include "anvil/distributed/context_parallel.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/document_mask.h"
#include "anvil/train/console.h"
#include "anvil/train/parallelize.h"
#include "anvil/train/train_step.h"

namespace anvil {

namespace {

// The token sources of the configured dataset, for training and validation.
struct DataSources {
  std::unique_ptr<TokenSource> train, validation;  // validation may be null
  std::string description;
};

// The source at `path`, which the key `key` named: its errors name the key
// and what a valid value looks like, in anvil train's terms.
std::unique_ptr<TokenSource> open_source(const std::string& key, const std::string& kind, const std::string& path,
                                         const Tokenizer& tok, uint64_t tokenizer_hash) {
  SourceOptions opts;
  opts.bad_input_hint =
      kind == "shards" ? "set " + key + " to a folder of token shards that anvil tokenize wrote"
                       : "set " + key + " to a text or JSON Lines file (.txt, .jsonl, .jsonl.gz), a folder of them, "
                                        "or a glob such as 'data/*.jsonl'";
  opts.text_field_hint = "anvil train reads each line's \"text\"; anvil tokenize --text-field reads another field";
  try {
    if (kind == "shards") return std::make_unique<ShardSource>(list_shards(path), tokenizer_hash, tok.vocab_size());
    return std::make_unique<DocumentTokenSource>(std::vector<std::string>{path}, opts, tok);
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    throw Error(detail::concat(key, " = '", path, "': ", e.what()));
  }
}

DataSources open_dataset(const JobConfig& cfg, const Tokenizer& tok, uint64_t tokenizer_hash) {
  const auto& t = cfg.training;
  DataSources d;
  if (t.dataset == "brown") {
    // Small enough to tokenize up front; every 20th file is held out, so both
    // splits span all the corpus' genres.
    const std::vector<TextDocument> docs = read_brown_corpus(t.dataset_path);
    std::vector<std::string> train, validation;
    for (size_t i = 0; i < docs.size(); ++i) (i % 20 == 19 ? validation : train).push_back(docs[i].text);
    auto train_src = std::make_unique<TokenVectorSource>("brown/train", tokenize_documents(tok, train));
    d.description = detail::concat("brown at ", t.dataset_path, ": ", train.size(), " train documents (",
                                   with_commas(train_src->unit_tokens(0)), " tokens), ", validation.size(),
                                   " validation");
    d.train = std::move(train_src);
    d.validation = std::make_unique<TokenVectorSource>("brown/validation", tokenize_documents(tok, validation));
    return d;
  }
  d.train = open_source("training.dataset_path", t.dataset, t.dataset_path, tok, tokenizer_hash);
  d.description = detail::concat(t.dataset, " at ", t.dataset_path, ": ", d.train->num_units(), " file(s)");
  // Disabled means not opened: a stale validation path does not stop a run that does not validate.
  if (cfg.validation.enable && !cfg.validation.dataset_path.empty())
    d.validation = open_source("validation.dataset_path", t.dataset, cfg.validation.dataset_path, tok, tokenizer_hash);
  return d;
}

}  // namespace

std::unique_ptr<Tokenizer> load_job_tokenizer(const JobConfig& cfg, const ModelArgs& args) {
  const std::string& path = cfg.model.tokenizer_path;
  std::error_code ec;
  if (!path.empty() && path != "bytes" && !std::filesystem::is_regular_file(path, ec)) {
    // Which script makes the missing file: Llama 3's is fetched, any other is trained.
    const bool llama3 = path.find("llama3") != std::string::npos || path.find("tokenizer.model") != std::string::npos;
    throw Error(detail::concat(
        "model.tokenizer_path = '", path, "': no such file. ",
        llama3 ? "scripts/prepare_llama3_tokenizer.sh fetches Llama 3's tokenizer into data/tokenizers/llama3/"
               : "scripts/train.sh trains data/tokenizers/shakespeare-2048/tokenizer.json on the Shakespeare corpus; "
                 "for another corpus run anvil tokenizer train --input DIR --vocab-size N --output " + path,
        "; or set model.tokenizer_path = \"\" (--model.tokenizer_path '') to train on raw bytes"));
  }
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(path.empty() ? "bytes" : path);
  ANVIL_CHECK(tokenizer->vocab_size() <= args.vocab_size, "the ", tokenizer->name(), " tokenizer has ",
              tokenizer->vocab_size(), " tokens but the model's vocabulary is ", args.vocab_size,
              "; pick a flavour with a larger vocabulary or a smaller tokenizer");
  return tokenizer;
}

TrainData::TrainData(const JobConfig& cfg, const Tokenizer& tokenizer, const ParallelDims& par)
    : cfg_(cfg),
      cp_size_(par.cp_size),
      cp_rank_(par.cp_rank),
      pp_micro_batches_(par.pp_micro_batches),
      cp_balancer_(par.cp_balancer) {
  const auto& tc = cfg.training;
  const auto t_data = std::chrono::steady_clock::now();
  if (cfg.model.attn_mask_type == "block_causal") {
    document_eos_ = tokenizer.eos_id();
    ANVIL_CHECK(document_eos_ >= 0, "model.attn_mask_type = \"block_causal\" finds documents by their EOS token, and the ",
                tokenizer.name(), " tokenizer has none; set model.attn_mask_type = \"causal\" or use a tokenizer "
                "with <|endoftext|> or <eos>");
  }
  const uint64_t tokenizer_hash =
      cfg.model.tokenizer_path.empty() ? byte_tokenizer_hash() : tokenizer_file_hash(cfg.model.tokenizer_path);
  DataSources data = open_dataset(cfg, tokenizer, tokenizer_hash);
  ANVIL_CHECK(!cfg.validation.enable || data.validation, "validation.enable = true needs validation.dataset_path ",
              "for the ", tc.dataset, " dataset (only brown holds out a split by itself)");
  StreamLoaderOptions loader_opts{.seq_len = tc.seq_len, .batch_size = tc.local_batch_size, .rank = par.dp_rank,
                                  .world = par.dp_size, .seed = static_cast<uint64_t>(tc.seed)};
  loader_ = std::make_unique<StreamLoader>(std::move(data.train), loader_opts);
  if (cfg.validation.enable) {
    StreamLoaderOptions val_opts = loader_opts;
    val_opts.prefetch = false;
    val_opts.what = "the validation data";
    val_loader_ = std::make_unique<StreamLoader>(std::move(data.validation), val_opts);
  }
  std::printf("anvil: dataset %s; %s tokenizer (%.2fs)\n", data.description.c_str(), tokenizer.name().c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_data).count());
}

void TrainData::allocate_batches(int64_t micro_batches) {
  batches_ = allocate_micro_batches(cfg_, micro_batches, cp_size_);
}

bool TrainData::fill(StreamLoader& loader, size_t i, int64_t groups) {
  if (cp_size_ == 1) {
    if (!loader.next_batch(batches_.tokens[i], batches_.targets[i])) return false;
    if (document_eos_ >= 0) fill_document_bounds(batches_.tokens[i], document_eos_, batches_.documents[i]);
    return true;
  }
  // The cp group's ranks read the same sequences (the same data-parallel
  // rank's windows) and keep their own chunks of them; the documents are the
  // whole sequences'.
  if (!loader.next_batch(batches_.loaded_tokens, batches_.loaded_targets)) return false;
  if (document_eos_ >= 0) fill_document_bounds(batches_.loaded_tokens, document_eos_, batches_.documents[i]);
  const int64_t B = batches_.loaded_tokens.size(0), T = batches_.loaded_tokens.size(1), b = B / groups;
  const int64_t whole = b * T, local = b * T / cp_size_;  // one group's tokens before and after
  for (int64_t g = 0; g < groups; ++g) {
    cp_local_rows(cp_balancer_, cp_size_, cp_rank_, batches_.loaded_tokens.data<int32_t>() + g * whole, b, T,
                  batches_.tokens[i].data<int32_t>() + g * local);
    cp_local_rows(cp_balancer_, cp_size_, cp_rank_, batches_.loaded_targets.data<int32_t>() + g * whole, b, T,
                  batches_.targets[i].data<int32_t>() + g * local);
  }
  return true;
}

int64_t TrainData::next_step() {
  const ScopedPhase phase(SpanCategory::data, "data");
  int64_t tokens = 0;
  for (size_t i = 0; i < batches_.tokens.size(); ++i) {
    ANVIL_CHECK(fill(*loader_, i, pp_micro_batches_), "the dataset ran out of tokens");
    tokens += batches_.tokens[i].numel();  // packed windows never ignore a target
  }
  return tokens;
}

std::string TrainData::attention_summary() const {
  if (document_eos_ < 0) return "";
  int64_t documents = 0, sequences = 0;
  double pairs = 0, causal_pairs = 0;
  AttentionTileCount tiles;  // of the whole sequences, on the kernels' default grid
  std::vector<double> rank_pairs(static_cast<size_t>(cp_size_), 0.0);
  for (const Tensor& bounds : batches_.documents) {
    const int64_t T = bounds.size(2), c = T / (2 * cp_size_);
    for (int64_t b = 0; b < bounds.size(0); ++b) {
      documents += documents_in(bounds, b);
      ++sequences;
      pairs += static_cast<double>(document_attention_pairs(bounds, b, 0, T));
      const AttentionTileCount n = attention_tile_count(1, T, T, {}, AttentionWindow{0, 0, bounds.slice(b, 1)});
      tiles.forward += n.forward, tiles.backward += n.backward;
      tiles.causal_forward += n.causal_forward, tiles.causal_backward += n.causal_backward;
      causal_pairs += static_cast<double>(T) * static_cast<double>(T + 1) / 2;
      for (int r = 0; cp_size_ > 1 && r < cp_size_; ++r)
        for (int j = 0; j < 2; ++j)
          rank_pairs[static_cast<size_t>(r)] += static_cast<double>(
              document_attention_pairs(bounds, b, cp_chunk(cp_balancer_, cp_size_, r, j) * c, c));
    }
  }
  char line[256];
  std::snprintf(line, sizeof line, "block-causal attention: %.1f documents per sequence, %.1f%% of the causal mask's "
                "query-key pairs, %.1f%% of its tiles (MFU counts the causal FLOPs, as torchtitan does)",
                static_cast<double>(documents) /
                static_cast<double>(std::max<int64_t>(1, sequences)), 100.0 * pairs / std::max(1.0, causal_pairs),
                100.0 * tiles.kept());
  std::string out = line;
  if (cp_size_ > 1) {
    out += detail::concat("; each cp rank's pairs over the mean (", cp_load_balancer_name(cp_balancer_), "):");
    for (int r = 0; r < cp_size_; ++r) {
      std::snprintf(line, sizeof line, " %d: %.2f", r, rank_pairs[static_cast<size_t>(r)] * cp_size_ / std::max(1.0, pairs));
      out += line;
    }
  }
  return out;
}

std::pair<double, int64_t> TrainData::validation_loss(ParallelizedModel& layout, const ParallelDims& par) {
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < cfg_.validation.steps; ++i) {
    ANVIL_CHECK(fill(*val_loader_, 0, 1), "the validation set ran out of tokens");
    const CrossEntropyResult r = layout.evaluate(batches_.tokens[0], batches_.targets[0], batches_.documents_of(0));
    sum += r.loss_sum, tokens += r.num_tokens;
  }
  sum_loss_over_dp(par, sum, tokens);
  val_loader_->set_state(StreamState{});  // the same held-out batches every time
  return {sum, tokens};
}

}  // namespace anvil
