#include "runners/suite_run.hpp"

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <map>

#include "core/errors.hpp"
#include "core/units.hpp"
#include "probes/env.hpp"
#include "reports/report.hpp"
#include "runners/cell.hpp"
#include "runners/frontier.hpp"
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

// Runs one cell in a child process and returns its result, whatever happened to the process.
json run_isolated(const std::string& name, const json& config, const std::string& device, const std::string& stem,
                  double timeout_s) {
  reports::write_json_atomic(stem + ".spec.json", {{"name", name}, {"config", config}, {"device", device}});
  fs::remove(stem + ".json");
  const ChildOutcome r =
      run_child({self_exe(), "_cell", "--spec", stem + ".spec.json", "--result", stem + ".json"}, stem + ".log", timeout_s);
  json cell;
  if (r.kind == ChildOutcome::Kind::Exited && fs::exists(stem + ".json")) {
    cell = reports::read_json_file(stem + ".json");
  } else {
    const std::string status = r.kind == ChildOutcome::Kind::TimedOut ? "timeout" : "failed";
    std::string reason = describe(r, timeout_s);
    const std::string said = last_line(stem + ".log");
    if (!said.empty() && r.kind != ChildOutcome::Kind::TimedOut) reason += ": " + said;
    cell = cell_without_metrics(name, config, device, status, reason);
    reports::write_json_atomic(stem + ".json", cell);
  }
  cell["wall_s"] = r.wall_s;
  cell["log"] = fs::path(stem + ".log").filename().string();
  return cell;
}

// The frontier: for each distinct configuration (batch size aside) of the chosen models, the largest
// batch that trains under the budget, each try a short run in its own process.
json run_frontier(const json& spec, const std::vector<suites::Cell>& cells, const std::string& budget,
                  const std::string& out) {
  json results = json::array();
  std::vector<json> seen;
  fs::create_directories(out + "/frontier");
  for (const auto& c : cells) {
    const json& models = spec["models"];
    if (!models.empty() && std::find(models.begin(), models.end(), json(c.config.model)) == models.end()) continue;
    RunConfig base = c.config;
    base.batch_size = 1;
    base.steps = spec["steps"];
    base.warmup_steps = 1;
    base.eval = false;
    base.overflow_every = 0;
    base.memory_budget = budget;
    if (std::find(seen.begin(), seen.end(), base.to_json()) != seen.end()) continue;
    seen.push_back(base.to_json());
    const std::string device = suites::resolve_device(base.device);
    const std::string label = base.model + "/" + base.precision + "/ckpt-" + base.checkpoint;
    if (!suites::unsupported_reason(base, device).empty() || interrupted()) continue;
    std::printf("frontier %s under %s: ", label.c_str(), budget.c_str());
    std::fflush(stdout);
    std::map<int64_t, json> tried;
    std::string error;
    const FrontierResult f = frontier_search(
        [&](int64_t bs) {
          if (!error.empty() || interrupted()) return false;
          RunConfig cfg = base;
          cfg.batch_size = bs;
          const std::string stem = out + "/frontier/" + file_stem(label) + "_bs" + std::to_string(bs);
          json cell = run_isolated(label + "/bs" + std::to_string(bs), cfg.to_json(), device, stem, cfg.timeout_s);
          const std::string status = cell["status"];
          std::printf("%lld:%s ", static_cast<long long>(bs), status.c_str());
          std::fflush(stdout);
          if (status != "ok" && status != "oom") error = "batch " + std::to_string(bs) + " " + status + ": " + cell.value("reason", "");
          tried[bs] = cell;
          return status == "ok";
        },
        spec["start"], spec["limit"]);
    json entry{{"model", base.model}, {"precision", base.precision}, {"checkpoint", base.checkpoint},
               {"budget", budget}, {"largest_batch", f.largest_fit},
               {"first_failing_batch", f.first_fail > 0 ? json(f.first_fail) : json(nullptr)}};
    json tries = json::array();
    for (const auto& [bs, ok] : f.tries) tries.push_back({bs, tried[bs]["status"]});
    entry["tries"] = tries;
    entry["samples_per_s"] = nullptr;
    entry["peak_bytes"] = nullptr;
    if (f.largest_fit > 0) {
      const json& m = tried[f.largest_fit]["metrics"];
      entry["samples_per_s"] = m["timing"]["samples_per_s"];
      entry["peak_bytes"] = m["memory"]["peak_bytes"];
    }
    if (!error.empty()) entry["error"] = error;
    std::printf("-> %lld\n", static_cast<long long>(f.largest_fit));
    results.push_back(entry);
  }
  return results;
}

}  // namespace

int run_suite(const RunOptions& o) {
  suites::Suite suite = suites::load_suite(o.suite);
  if (!o.device.empty()) suites::apply_override(suite, "device", o.device);
  if (!o.memory_budget.empty()) suites::apply_override(suite, "memory_budget", o.memory_budget);
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
      cell = run_isolated(c.name, config, device, stem, c.config.timeout_s);
      ran_s += cell["wall_s"].get<double>();
      ++ran;
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

  json frontier;
  if (!interrupted() && (!suite.frontier.is_null() || o.frontier)) {
    json spec = suite.frontier.is_null() ? json{{"budget", "none"}, {"steps", 3}, {"start", 8}, {"limit", 4096},
                                                {"models", json::array()}}
                                         : suite.frontier;
    const std::string budget = o.memory_budget.empty() ? spec["budget"].get<std::string>() : o.memory_budget;
    if (budget == "none") throw UsageError("the frontier needs a budget: [frontier] budget in the suite, or --memory-budget");
    frontier = run_frontier(spec, cells, budget, out);
  }
  const json report = reports::make_report(env, suite_json, results, frontier);
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
