// Flavour shapes and parameter counts against the published figures.
#include <gtest/gtest.h>

#include "anvil/core/error.h"
#include "anvil/model/args.h"

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
