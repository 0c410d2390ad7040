// The default thread count follows the cores other processes leave free: beside
// a process spinning on one core, anvil takes one core fewer and says so;
// OMP_NUM_THREADS overrides.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "anvil/core/free_cores.h"
#include "test_util.h"

namespace {

// A child process spinning on a core for the test's length.
struct Spinner {
  pid_t pid = fork();
  Spinner() {
    if (pid == 0) {
      for (;;) asm volatile("");  // spins; the empty asm keeps the loop
    }
    usleep(200 * 1000);  // running before anyone samples
  }
  ~Spinner() {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
};

}  // namespace

TEST(FreeCores, BusyCoresRoundToTheNearestAndOneAlwaysRemains) {
  EXPECT_EQ((anvil::CoreLoad{.cores = 2, .busy = 0.3}).free(), 2);
  EXPECT_EQ((anvil::CoreLoad{.cores = 2, .busy = 0.6}).free(), 1);
  EXPECT_EQ((anvil::CoreLoad{.cores = 2, .busy = 2.0}).free(), 1);
  EXPECT_EQ((anvil::CoreLoad{.cores = 8, .busy = 2.6}).free(), 5);
}

TEST(FreeCores, ASpinningProcessCountsAsABusyCore) {
  const anvil::CoreLoad idle = anvil::sample_core_load(300);
  const Spinner spinner;
  const anvil::CoreLoad busy = anvil::sample_core_load(300);
  std::printf("busy cores: %.2f of %d without the spinner, %.2f with it\n", idle.busy, idle.cores, busy.busy);
  if (busy.cores < 2) GTEST_SKIP() << "one core: nothing to leave free";
  EXPECT_GE(busy.busy, idle.busy + 0.6) << "a process spinning on a core is most of a core's time";
  EXPECT_LE(busy.free(), busy.cores - 1);
}

TEST(FreeCores, TrainTakesTheFreeCoresBesideABusyProcessUnlessOmpNumThreadsIsSet) {
  const std::filesystem::path dir = anvil::testing::scratch_root() / "anvil_free_cores_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 100; ++i) text << "Line " << i << ": the wind in the willows.\n";
  }
  const std::string args = "train --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
                           " --training.seq_len 32 --training.local_batch_size 2 --training.steps 1 --job.dump_folder " +
                           (dir / "run").string();
  const Spinner spinner;
  if (anvil::sample_core_load(100).cores < 2) GTEST_SKIP() << "one core: nothing to leave free";
  auto out = anvil::testing::run_anvil(args, "env -u OMP_NUM_THREADS ");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("cores busy at start: "), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("(OMP_NUM_THREADS overrides)"), std::string::npos) << out.text;
  out = anvil::testing::run_anvil(args, "OMP_NUM_THREADS=2 ");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_EQ(out.text.find("cores busy at start"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("; 2 threads"), std::string::npos) << out.text;
}
