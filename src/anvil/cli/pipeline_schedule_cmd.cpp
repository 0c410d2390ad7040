#include "anvil/cli/pipeline_schedule_cmd.h"

#include "anvil/cli/count_arg.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>

#include "anvil/core/error.h"
#include "anvil/pipeline/schedule.h"

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil pipeline-schedule (--schedule NAME | --csv PATH) --ranks P --micro-batches M\n"
    "                               [--stages-per-rank V] [--format table|csv]\n"
    "  --schedule         GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble\n"
    "  --csv              a schedule file as parallelism.pipeline_parallel_schedule_csv reads it\n"
    "  --stages-per-rank  the looped schedules' V (default 2)\n"
    "  --format           table (default): each rank's actions, in-flight micro-batches and the unit-cost\n"
    "                     bubble; csv: the program as a CSV schedule file\n\n"
    "examples:\n"
    "  anvil pipeline-schedule --schedule 1F1B --ranks 4 --micro-batches 8\n"
    "  anvil pipeline-schedule --schedule Interleaved1F1B --ranks 4 --micro-batches 8 --format csv > schedule.csv\n";

}  // namespace

int pipeline_schedule_command(const std::vector<std::string>& args) {
  std::string name, csv, format = "table";
  int ranks = 0, micro_batches = 0, per_rank = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    ANVIL_CHECK(a.rfind("--", 0) == 0 && i + 1 < args.size(), "anvil pipeline-schedule: '", a,
                "' is not an option with a value\n", kUsage);
    const std::string& v = args[++i];
    if (a == "--schedule") name = v;
    else if (a == "--csv") csv = v;
    else if (a == "--ranks") ranks = static_cast<int>(parse_count_arg("anvil pipeline-schedule", a, v, 0));
    else if (a == "--micro-batches") micro_batches = static_cast<int>(parse_count_arg("anvil pipeline-schedule", a, v, 0));
    else if (a == "--stages-per-rank") per_rank = static_cast<int>(parse_count_arg("anvil pipeline-schedule", a, v, 0));
    else if (a == "--format") format = v;
    else throw Error("anvil pipeline-schedule: unknown option '" + a + "'\n" + kUsage);
  }
  ANVIL_CHECK(name.empty() != csv.empty(), "anvil pipeline-schedule: give --schedule or --csv\n", kUsage);
  ANVIL_CHECK(ranks >= 1 && micro_batches >= 1, "anvil pipeline-schedule: --ranks and --micro-batches are needed\n",
              kUsage);
  ANVIL_CHECK(format == "table" || format == "csv", "anvil pipeline-schedule: --format is table or csv, not '",
              format, "'");
  const PipeSchedule s =
      csv.empty()
          ? make_pipeline_schedule(name, ranks, schedule_stages_per_rank(name, per_rank), micro_batches)
          : read_pipeline_schedule_csv(csv, ranks, micro_batches);
  if (format == "csv") {
    std::printf("%s", format_pipeline_csv(s.program).c_str());
    return 0;
  }
  std::printf("%s: %d ranks, %d stages, %d micro-batches\n", s.name.c_str(), ranks, s.placement.stages(),
              micro_batches);
  const PipeTimeline t = simulate_pipeline_schedule(s, PipeCosts{});
  double mean = 0;
  for (int r = 0; r < ranks; ++r) {
    std::string stages, row;
    for (int st : s.placement.stages_of(r)) {
      if (!stages.empty()) stages += ',';
      stages += std::to_string(st);
    }
    for (const PipeAction& a : s.program[static_cast<size_t>(r)]) {
      row += ' ';
      row += action_name(a);
    }
    std::printf("rank %d (stages %s, at most %d in flight, bubble %.3f):%s\n", r, stages.c_str(),
                max_in_flight(s.program[static_cast<size_t>(r)]), t.bubble_fraction(r), row.c_str());
    mean += t.bubble_fraction(r) / ranks;
  }
  std::printf("simulated bubble: mean %.4f over ranks, unit costs F = I = W = 1, B = 2, makespan %.0f\n", mean,
              t.makespan);
  return 0;
}

}  // namespace anvil
