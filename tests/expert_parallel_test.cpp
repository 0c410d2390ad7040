// Expert parallelism: the mixture-of-experts layer with its experts split over
// 2 and 4 ranks, against the single process (tests/ep_worker.cpp, under
// mpirun).
#include <gtest/gtest.h>

#include "mpi_test_util.h"

TEST(ExpertParallelLayer, TwoRanksMatchTheSingleProcess) {
  anvil::testing::expect_worker_passes(ANVIL_EP_WORKER, 2, 4);
}
TEST(ExpertParallelLayer, FourRanksMatchTheSingleProcess) {
  anvil::testing::expect_worker_passes(ANVIL_EP_WORKER, 4, 4);
}
