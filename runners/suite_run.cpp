#include "runners/suite_run.hpp"

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "core/errors.hpp"
#include "core/units.hpp"
#include "probes/env.hpp"
#include "reports/report.hpp"
#include "runners/cell.hpp"
#include "runners/isolation.hpp"
#include "suites/suite_file.hpp"
#include "suites/train.hpp"

namespace trainscope::runners {
namespace fs = std::filesystem;
namespace {

std::string file_stem(const std::string& cell_name) {
  std::string s = cell_name;
  for (char& ch : s)
    if (ch == '/' || ch == ' ' || ch == '=') ch = '_';
  return s;
}

// A previous result of the same cell and configuration that finished (for --resume).
bool reusable(const std::string& path, const json& config, json& cell) {
  if (!fs::exists(path)) return false;
  try {
    cell = reports::read_json_file(path);
  } catch (const UsageError&) {
    return false;
  }
  return cell.value("config", json()) == config && cell.value("status", "") != "failed" &&
         cell.value("status", "") != "timeout";
}

}  // namespace

int run_suite(const RunOptions& o) {
  suites::Suite suite = suites::load_suite(o.suite);
  if (!o.device.empty()) suites::apply_override(suite, "device", o.device);
  for (const auto& [key, text] : o.sets) suites::apply_override(suite, key, parse_value(key, text));
  const std::vector<suites::Cell> cells = suites::expand(suite, o.filter);
  if (cells.empty()) throw UsageError("no cell of suite '" + suite.name + "' matches --filter '" + o.filter + "'");

  const std::string out = o.out.empty() ? "results/" + utc_now(true) : o.out;
  fs::create_directories(out + "/cells");
  install_interrupt_handler();

  const json env = probes::collect_env();
  for (const auto& w : env["warnings"]) std::fprintf(stderr, "warning: %s\n", w.get<std::string>().c_str());
  const json suite_json = suites::suite_to_json(suite);
  const std::string report_path = out + "/report.json";
  std::printf("trainscope %s: suite %s, %zu cell(s) -> %s\n", env["trainscope"]["version"].get<std::string>().c_str(),
              suite.name.c_str(), cells.size(), report_path.c_str());
  std::fflush(stdout);

  std::vector<json> results;
  const auto start = std::chrono::steady_clock::now();
  double ran_s = 0;
  int ran = 0;
  for (size_t i = 0; i < cells.size() && !interrupted(); ++i) {
    const auto& c = cells[i];
    const std::string device = suites::resolve_device(c.config.device);
    const json config = c.config.to_json();
    const std::string stem = out + "/cells/" + file_stem(c.name);
    std::printf("[%zu/%zu] %s on %s ... ", i + 1, cells.size(), c.name.c_str(), device.c_str());
    std::fflush(stdout);

    json cell;
    std::string note;
    if (const std::string why = suites::unsupported_reason(c.config, device); !why.empty()) {
      cell = cell_without_metrics(c.name, config, device, "skipped", why);
      reports::write_json_atomic(stem + ".json", cell);
    } else if (o.resume && reusable(stem + ".json", config, cell)) {
      note = " (from the previous run)";
    } else {
      reports::write_json_atomic(stem + ".spec.json", {{"name", c.name}, {"config", config}, {"device", device}});
      fs::remove(stem + ".json");
      const ChildOutcome r = run_child({self_exe(), "_cell", "--spec", stem + ".spec.json", "--result", stem + ".json"},
                                       stem + ".log", c.config.timeout_s);
      ran_s += r.wall_s;
      ++ran;
      const bool exited = r.kind == ChildOutcome::Kind::Exited;
      if (exited && fs::exists(stem + ".json")) {
        cell = reports::read_json_file(stem + ".json");
      } else {
        const std::string status = r.kind == ChildOutcome::Kind::TimedOut ? "timeout" : "failed";
        std::string reason = describe(r, c.config.timeout_s);
        const std::string said = last_line(stem + ".log");
        if (!said.empty() && r.kind != ChildOutcome::Kind::TimedOut) reason += ": " + said;
        cell = cell_without_metrics(c.name, config, device, status, reason);
        reports::write_json_atomic(stem + ".json", cell);
      }
      cell["wall_s"] = r.wall_s;
      cell["log"] = fs::path(stem + ".log").filename().string();
    }
    results.push_back(cell);
    reports::write_json_atomic(report_path, reports::make_report(env, suite_json, results));

    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const size_t left = cells.size() - i - 1;
    std::string eta = ran > 0 && left > 0 ? ", ~" + format_seconds(ran_s / ran * static_cast<double>(left)) + " left" : "";
    std::printf("%s%s%s (elapsed %s%s)\n", cell["status"].get<std::string>().c_str(),
                cell.contains("wall_s") ? (" in " + format_seconds(cell["wall_s"].get<double>())).c_str() : "",
                note.c_str(), format_seconds(elapsed).c_str(), eta.c_str());
    if (cell["status"] != "ok" && cell["status"] != "skipped")
      std::printf("      %s\n", cell["reason"].get<std::string>().c_str());
    std::fflush(stdout);
  }

  const json report = reports::make_report(env, suite_json, results);
  reports::write_json_atomic(report_path, report);
  const std::string summary = reports::render_summary(report);
  std::printf("\n%s\nreport: %s\n", summary.c_str(), report_path.c_str());
  if (interrupted()) {
    std::printf("interrupted: %zu of %zu cells recorded; rerun with --resume --out %s to finish\n",
                results.size(), cells.size(), out.c_str());
    return 130;
  }
  for (const auto& c : results)
    if (c["status"] != "ok" && c["status"] != "skipped") return 1;
  return 0;
}

}  // namespace trainscope::runners
