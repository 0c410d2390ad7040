#include "anvil/cli/report_cmd.h"

#include <charconv>
#include <cstdio>

#include "anvil/core/error.h"

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil report <dump_folder> [--output PATH] [--trace-step N]\n"
    "  <dump_folder>   a run's job.dump_folder: metrics.jsonl, and any step-N.trace.json and\n"
    "                  step-N.snapshot.json files below it\n"
    "  --output        where to write the page (default: <dump_folder>/report.html)\n"
    "  --trace-step    the traced step whose memory timeline to chart (default: 1 if traced, else the first)\n\n"
    "examples:\n"
    "  anvil report outputs\n"
    "  anvil report outputs --output /tmp/run.html --trace-step 10\n";

}  // namespace

ReportOptions parse_report_args(const std::vector<std::string>& args) {
  ReportOptions o;
  auto value = [&](size_t& i) -> const std::string& {
    ANVIL_CHECK(i + 1 < args.size(), "anvil report: ", args[i], " needs a value\n", kUsage);
    return args[++i];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--output") {
      o.output = value(i);
    } else if (a == "--trace-step") {
      const std::string& v = value(i);
      int64_t step = 0;
      const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), step);
      ANVIL_CHECK(ec == std::errc() && end == v.data() + v.size() && step >= 0, "anvil report: --trace-step ", v,
                  " is not a step number");
      o.trace_step = step;
    } else if (a.rfind("--", 0) == 0) {
      throw Error("anvil report: unknown option '" + a + "'\n" + kUsage);
    } else {
      ANVIL_CHECK(o.dump_folder.empty(), "anvil report: one dump folder at a time ('", o.dump_folder.string(),
                  "' and '", a, "')\n", kUsage);
      o.dump_folder = a;
    }
  }
  ANVIL_CHECK(!o.dump_folder.empty(), "anvil report: which dump folder?\n", kUsage);
  return o;
}

int report_command(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
  const std::filesystem::path out = write_report(parse_report_args(args));
  std::printf("%s\n", out.string().c_str());
  return 0;
}

}  // namespace anvil
