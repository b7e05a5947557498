#include "runners/commands/parity.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "core/build_info.hpp"
#include "core/errors.hpp"
#include "core/units.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"
#include "runners/process/folder_lock.hpp"
#include "runners/process/isolation.hpp"
#include "suites/suite_file.hpp"

namespace trainscope::runners {

namespace fs = std::filesystem;

namespace {

// execv wants a path: a bare name is looked up on PATH, as a shell would.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return fs::exists(name) ? name : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((fs::path(dir) / name).c_str(), X_OK) == 0) return (fs::path(dir) / name).string();
  return "";
}

}  // namespace

void merge_parity(json& report, const json& parity) {
  const json& rows = parity.contains("cells") ? parity["cells"] : json::object();
  int pass = 0, differs = 0, failed = 0, skipped = 0;
  for (auto& cell : report["cells"]) {
    const std::string name = cell.value("name", "");
    if (!rows.contains(name)) continue;
    cell["parity"] = rows[name];
    const std::string v = rows[name].value("verdict", "failed");
    (v == "pass" ? pass : v == "differs" ? differs : v == "skipped" ? skipped : failed) += 1;
  }
  // A skipped row (its reference package is not installed) says why and fails nothing.
  report["parity"] = {{"torch", parity.value("torch", "")},
                      {"reference", "tests/parity/reference.py"},
                      {"cells", pass + differs + failed + skipped},
                      {"pass", pass},
                      {"differs", differs},
                      {"failed", failed},
                      {"skipped", skipped}};
}

int parity_command(ParityOptions o) {
  // Everything the PyTorch side needs is checked before the first cell runs.
  const std::string reference_dir = o.reference.empty() ? parity_reference_dir() : o.reference;
  const fs::path script = fs::path(reference_dir) / "reference.py";
  if (!fs::exists(script))
    throw UsageError("parity: no PyTorch reference at " + script.string() + " (--reference DIR: the folder holding reference.py)");
  const std::string python_name = o.python.empty() ? parity_python() : o.python;
  const std::string python = find_program(python_name);
  if (python.empty()) throw UsageError("parity: no Python '" + python_name + "' (--python PATH: a Python with the torch wheel)");
  {
    // A suite none of whose cells dumps anything would run for nothing: say so before it runs.
    suites::Suite suite = suites::load_suite(o.run.suite);
    for (const auto& [key, text] : o.run.sets) suites::apply_override(suite, key, parse_value(key, text));
    const auto cells = suites::expand(suite, o.run.filter);
    if (std::none_of(cells.begin(), cells.end(), [](const suites::Cell& c) { return c.config.parity_dump; }))
      throw UsageError("parity: no cell of suite '" + suite.name + "' sets parity_dump = true (the built-in `parity` suite does)");
  }
  if (o.run.out.empty()) o.run.out = "results/parity-" + utc_now(true);
  const FolderLock lock(o.run.out);  // parity.json and the suite's report share the folder
  const std::string log = o.run.out + "/parity.log";
  const ChildOutcome probe = run_child({python, "-c", "import torch"}, log, 300);
  if (probe.kind != ChildOutcome::Kind::Exited || probe.exit_code != 0)
    throw UsageError("parity: '" + python + "' cannot import torch (--python PATH: a Python with the torch wheel): " +
                     last_line(log));

  const int suite_rc = run_suite(o.run);
  if (interrupted()) return 130;

  const std::string report_path = o.run.out + "/report.json";
  const std::string parity_path = o.run.out + "/parity.json";
  std::vector<std::string> argv{python, script.string(), "--report", report_path, "--out", parity_path};
  if (fs::exists(accounting_library())) {
    argv.emplace_back("--accounting");
    argv.emplace_back(accounting_library());
  } else {
    std::fprintf(stderr, "warning: %s is missing: the memory comparisons are left out\n", accounting_library());
  }
  std::printf("\nPyTorch references (%s) ...\n", script.string().c_str());
  std::fflush(stdout);
  fs::remove(parity_path);
  const ChildOutcome ref = run_child(argv, log, o.timeout_s);
  if (ref.kind != ChildOutcome::Kind::Exited || !fs::exists(parity_path)) {
    // The suite's report stands as it was; the reference's last words say why there is no parity.
    std::fprintf(stderr, "trainscope: error: parity: the PyTorch reference %s: %s (log: %s)\n",
                 describe(ref, o.timeout_s).c_str(), last_line(log).c_str(), log.c_str());
    return 1;
  }
  json report = reports::read_report(report_path);
  merge_parity(report, reports::read_json_file(parity_path));
  reports::write_json_atomic(report_path, report);
  reports::write_renderings(report, o.run.out);

  const json& p = report["parity"];
  for (const auto& cell : report["cells"]) {
    if (!cell.contains("parity")) continue;
    const json& row = cell["parity"];
    const reports::ParityCounts n = reports::parity_counts(row);
    std::string ratio = "-";
    if (const json r = reports::value_at(row, {"step_time_s", "ratio"}); r.is_number()) ratio = format_fixed(r.get<double>(), 2) + "x";
    std::printf("  %-24s %-8s %2d exact, %d within, %d design, %d differ; step time vs PyTorch %s%s\n",
                cell["name"].get<std::string>().c_str(), row.value("verdict", "?").c_str(), n.exact, n.within, n.design,
                n.differs, ratio.c_str(), row.contains("reason") ? ("  (" + row.value("reason", "") + ")").c_str() : "");
    for (const auto& e : row.value("engines", json::array())) {
      const reports::ParityCounts m = reports::parity_counts(e);
      std::string r = "-";
      if (const json v = reports::value_at(e, {"step_time_s", "ratio"}); v.is_number()) r = format_fixed(v.get<double>(), 2) + "x";
      std::printf("    %-22s %-8s %2d exact, %d within, %d design, %d differ; step time vs it %s%s\n",
                  ("against " + e.value("engine", "?")).c_str(), e.value("verdict", "?").c_str(), m.exact, m.within, m.design,
                  m.differs, r.c_str(), e.contains("reason") ? ("  (" + e.value("reason", "") + ")").c_str() : "");
    }
  }
  std::printf("parity: %d of %d cells pass against torch %s%s; report: %s\n", p.value("pass", 0), p.value("cells", 0),
              p.value("torch", "?").c_str(),
              p.value("skipped", 0) ? (", " + std::to_string(p.value("skipped", 0)) + " skipped").c_str() : "",
              report_path.c_str());
  if (p.value("cells", 0) == 0) {
    std::fprintf(stderr, "trainscope: error: parity: no cell left a parity dump (parity_dump = true)\n");
    return 1;
  }
  return suite_rc != 0 || p.value("pass", 0) + p.value("skipped", 0) != p.value("cells", 0) ? 1 : 0;
}

}  // namespace trainscope::runners
