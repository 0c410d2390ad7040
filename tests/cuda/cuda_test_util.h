// What the CUDA tests share.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "anvil/cuda/device.h"

// Skips the calling test, with the runtime's reason, where no GPU is present.
#define SKIP_WITHOUT_GPU()                                                                  \
  do {                                                                                      \
    std::string why;                                                                        \
    if (anvil::cuda_devices(&why).empty()) GTEST_SKIP() << "no CUDA GPU (" << why << ")"; \
  } while (0)
