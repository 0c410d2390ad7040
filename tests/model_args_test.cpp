// Flavour shapes and parameter counts against the published figures.
#include <gtest/gtest.h>

#include "anvil/core/error.h"
#include "anvil/model/args.h"
#include "test_util.h"

using namespace anvil;

TEST(ModelArgs, PublishedParameterCounts) {
  struct Row {
    const char* name;
    const char* flavor;
    int64_t ffn_hidden;
    int64_t params;
  };
  const Row rows[] = {
      {"llama3", "debugmodel", 768, 6'163'712},        {"llama3", "1B", 8192, 1'235'814'400},
      {"llama3", "3B", 8192, 3'212'749'824},           {"llama3", "8B", 14336, 8'030'261'248},
      {"llama3", "70B", 28672, 70'553'706'496},        {"llama3", "405B", 53248, 405'853'388'800},
      {"llama2", "7B", 11008, 6'738'415'616},          {"llama2", "13B", 13824, 13'015'864'320},
      {"llama2", "70B", 28672, 68'976'648'192},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string(r.name) + "/" + r.flavor);
    const ModelArgs a = model_flavor(r.name, r.flavor);
    a.validate();
    EXPECT_EQ(a.ffn_hidden_dim(), r.ffn_hidden);
    EXPECT_EQ(a.num_params(), r.params);
  }
}

// Qwen3's model cards give the parameters to two or three figures, in all
// and without the embedding (the input embedding only, tied or not): 0.6B
// and 0.44B, 1.7B and 1.4B, 4.0B and 3.6B, 8.2B and 6.95B, 14.8B and 13.2B,
// 32.8B and 31.2B. The exact counts follow from the config.json shapes.
TEST(ModelArgs, Qwen3ParameterCountsMatchTheModelCards) {
  struct Row {
    const char* flavor;
    int64_t params;
    double card_total, card_non_embedding;  // billions
    double ulp_total, ulp_non_embedding;    // the cards' last digit, in billions
  };
  const Row rows[] = {
      {"0.6B", 596'049'920, 0.6, 0.44, 0.1, 0.01},   {"1.7B", 1'720'574'976, 1.7, 1.4, 0.1, 0.1},
      {"4B", 4'022'468'096, 4.0, 3.6, 0.1, 0.1},     {"8B", 8'190'735'360, 8.2, 6.95, 0.1, 0.01},
      {"14B", 14'768'307'200, 14.8, 13.2, 0.1, 0.1}, {"32B", 32'762'123'264, 32.8, 31.2, 0.1, 0.1},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string("qwen3/") + r.flavor);
    const ModelArgs a = model_flavor("qwen3", r.flavor);
    a.validate();
    EXPECT_EQ(a.head_dim(), 128);
    EXPECT_TRUE(a.qk_norm);
    EXPECT_EQ(a.num_params(), r.params);
    const double total = static_cast<double>(a.num_params()) / 1e9;
    const double non_embedding = static_cast<double>(a.num_params() - a.num_embedding_params()) / 1e9 -
                                 (a.tie_embeddings ? 0 : static_cast<double>(a.num_embedding_params()) / 1e9);
    EXPECT_NEAR(total, r.card_total, r.ulp_total / 2 + 1e-9);
    EXPECT_NEAR(non_embedding, r.card_non_embedding, r.ulp_non_embedding / 2 + 1e-9);
  }
  // The debug flavour's heads are not dim wide: 8 heads of 64 over dim 256.
  const ModelArgs debug = model_flavor("qwen3", "debugmodel");
  EXPECT_EQ(debug.head_dim() * debug.n_heads, 512);
  EXPECT_EQ(debug.dim, 256);
}

// Qwen3-MoE's model cards: 30.5B in all, 3.3B activated, 29.9B without the
// embeddings (input and output); 235B, 22B and 234B. Every block's
// feed-forward is 128 experts, 8 per token, with a router of 128 × dim. The
// counts are within one unit of the cards' last digit: the cards round 233.85
// up to 234 but cut 3.353 down to 3.3 (activated, both embeddings counted).
TEST(ModelArgs, Qwen3MoeParameterCountsMatchTheModelCards) {
  struct Row {
    const char* flavor;
    int64_t params, active;
    double card_total, card_active, card_non_embedding;  // billions
    double ulp;                                          // the cards' last digit, in billions
  };
  for (const Row& r : {Row{"30B-A3B", 30'532'122'624, 3'353'032'704, 30.5, 3.3, 29.9, 0.1},
                       Row{"235B-A22B", 235'093'634'560, 22'190'763'520, 235, 22, 234, 1}}) {
    SCOPED_TRACE(std::string("qwen3/") + r.flavor);
    const ModelArgs a = model_flavor("qwen3", r.flavor);
    a.validate();
    EXPECT_TRUE(a.moe());
    EXPECT_EQ(a.num_experts, 128);
    EXPECT_EQ(a.experts_per_token, 8);
    EXPECT_EQ(a.num_params(), r.params);
    EXPECT_EQ(a.active_params(), r.active);
    const double non_embedding = static_cast<double>(a.num_params() - 2 * a.num_embedding_params());
    EXPECT_NEAR(static_cast<double>(a.num_params()) / 1e9, r.card_total, r.ulp);
    EXPECT_NEAR(static_cast<double>(a.active_params()) / 1e9, r.card_active, r.ulp);
    EXPECT_NEAR(non_embedding / 1e9, r.card_non_embedding, r.ulp);
  }
  const ModelArgs dense = model_flavor("qwen3", "8B");
  EXPECT_EQ(dense.active_params(), dense.num_params());
  ModelArgs bad = model_flavor("qwen3", "debugmodel_moe");
  for (const int64_t k : {9, 0}) {  // of 8 experts; none
    bad.experts_per_token = k;
    const std::string e = anvil::testing::error_of([&] { bad.validate(); });
    EXPECT_NE(e.find(detail::concat("a mixture of experts needs 1 <= experts_per_token (", k, ") <= num_experts (8")),
              std::string::npos)
        << e;
  }
}

TEST(ModelArgs, CpuFlavoursAreTheAdvertisedSize) {
  const ModelArgs small = model_flavor("llama3", "25M");
  const ModelArgs medium = model_flavor("llama3", "125M");
  EXPECT_NEAR(static_cast<double>(small.num_params()), 25e6, 3e6);
  EXPECT_NEAR(static_cast<double>(medium.num_params()), 125e6, 5e6);
  EXPECT_LT(small.n_kv_heads, small.n_heads);  // the GQA flavour of the parity tests
}

TEST(ModelArgs, UnknownFlavourListsTheKnownOnes) {
  try {
    model_flavor("llama3", "9B");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama3/8B"), std::string::npos) << e.what();
  }
}

TEST(ModelArgs, ValidateNamesTheBadField) {
  ModelArgs a = model_flavor("llama3", "debugmodel");
  a.n_kv_heads = 5;
  EXPECT_THROW(a.validate(), Error);
}
