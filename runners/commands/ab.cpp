#include "runners/commands/ab.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "core/errors.hpp"
#include "core/stats.hpp"
#include "core/units.hpp"
#include "reports/report.hpp"
#include "runners/process/folder_lock.hpp"
#include "suites/suite_file.hpp"

namespace trainscope::runners {

namespace {

namespace fs = std::filesystem;

// Runs a command, returning its exit status and what it printed (stdout and stderr together).
std::pair<int, std::string> capture(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, ""};
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// A binary `ab` can drive: it exists, runs, and says it is trainscope.
std::string check_binary(const std::string& path, const char* side) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || access(path.c_str(), X_OK) != 0)
    throw UsageError(std::string("ab: --") + side + " " + path + ": no executable file there");
  const auto [rc, out] = capture(quote(path) + " --version");
  // `trainscope --version` prints "<major>.<minor>.<patch> (<commit>)".
  if (rc != 0 || out.empty() || !std::isdigit(static_cast<unsigned char>(out[0])) || out.find('.') == std::string::npos)
    throw UsageError(std::string("ab: --") + side + " " + path + " is not a trainscope binary (--version said: " +
                     out.substr(0, out.find('\n')) + ")");
  return out.substr(0, out.find('\n'));
}

double parse_percent(const std::string& text) {
  const auto v = parse_fraction(text);
  if (!v || *v <= 0 || *v >= 1) throw UsageError("ab: --min-effect '" + text + "' is not a percentage in (0, 100%) (e.g. 5%)");
  return *v;
}

struct Slot {
  char side;  // 'A' base, 'B' new
  json report;
};

// CPU seconds (user + system) of the children this process has waited for so far.
double children_cpu_seconds() {
  rusage u {};
  getrusage(RUSAGE_CHILDREN, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct CellResult {
  std::vector<double> ratios;      // per block: ln(fastest step of new / fastest step of base)
  std::vector<double> p50_ratios;  // per block: the same for the better step-time median, a diagnostic
  std::string base_status = "ok", new_status = "ok", reason;
  double base_peak = -1, new_peak = -1;
};

json cell_of(const json& report, const std::string& name) {
  for (const auto& c : report["cells"])
    if (c["name"] == name) return c;
  return nullptr;
}

}  // namespace

int ab_command(const AbArgs& a) {
  const std::string base_version = check_binary(a.base, "base");
  const std::string new_version = check_binary(a.fresh, "new");
  const double min_effect = parse_percent(a.min_effect);
  if (a.alpha <= 0 || a.alpha >= 0.5) throw UsageError("ab: --alpha must be in (0, 0.5)");
  if (a.blocks < 2 || a.max_blocks < a.blocks) throw UsageError("ab: need 2 <= --blocks <= --max-blocks");
  std::vector<std::string> names;
  for (const auto& c : suites::expand(suites::load_suite(a.suite), a.filter)) names.push_back(c.name);
  if (names.empty()) throw UsageError("ab: no cell of suite '" + a.suite + "' matches --filter '" + a.filter + "'");
  const std::string out = a.out.empty() ? "results/ab-" + utc_now(true) : a.out;
  // An inconclusive gate decides again after two more blocks, up to --max-blocks: each look is another
  // chance of a false alarm (measured: 1 of 3 A/A false alarms in 41 came at the third look), so alpha
  // is split over the looks (Bonferroni), alpha / looks at each. With n blocks the exact signed-rank
  // test's smallest p is 2^-n, and the upper bound exists only when 2^-n <= alpha_look / K: fewer blocks
  // could never decide on time. Start at the least n that can (even, so that ABBA and BAAB balance):
  // 6 blocks and 3 looks for one cell, 8 blocks and 2 looks for the gate's 4 cells, at alpha 0.05.
  int looks = 1, start_blocks = a.blocks, max_blocks = a.max_blocks;
  for (int pass = 0; pass < 8; ++pass) {
    const double per_look = a.alpha / looks;
    const int needed = static_cast<int>(std::ceil(std::log2(static_cast<double>(names.size()) / per_look)));
    start_blocks = std::max(a.blocks, needed + needed % 2);
    max_blocks = std::max(a.max_blocks, start_blocks);
    const int next = 1 + (max_blocks - start_blocks + 1) / 2;
    if (next <= looks) break;
    looks = next;
  }
  const double alpha_look = a.alpha / looks;
  const FolderLock lock(out);
  // Each slot runs one cell (an anchored, escaped --filter), so that a block's four slots of a cell
  // follow each other within seconds.
  auto only = [](const std::string& name) {
    std::string escaped;
    for (char c : name) escaped += std::string(std::strchr(".^$|()[]{}*+?\\", c) ? "\\" : "") + c;
    return "^" + escaped + "$";
  };
  std::map<std::string, CellResult> cells;
  int slot_index = 0;
  // Per slot, wall and CPU time of the whole process: a diagnostic beside the step times (a slot whose
  // CPU time is far below its wall time waited for the cores: another tenant).
  json slots = json::array();
  const auto started = std::chrono::steady_clock::now();
  auto run_slot = [&](char side, const std::string& filter) {
    const std::string& bin = side == 'A' ? a.base : a.fresh;
    const auto& sets = side == 'A' ? a.base_sets : a.new_sets;
    const std::string dir = out + "/slots/" + std::to_string(slot_index++) + "-" + (side == 'A' ? "base" : "new");
    std::string cmd = quote(bin) + " run --suite " + quote(a.suite) + " --filter " + quote(filter) + " --nproc " +
                      std::to_string(a.nproc) + " --out " + quote(dir);
    for (const auto& [k, v] : sets) cmd += " --set " + quote(k + "=" + v);
    const double cpu0 = children_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    const auto [rc, text] = capture(cmd);
    slots.push_back({{"slot", dir.substr(out.size() + 1)}, {"side", side == 'A' ? "base" : "new"},
                     {"wall_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()},
                     {"cpu_s", children_cpu_seconds() - cpu0}});
    if (!fs::exists(dir + "/report.json") && rc == 2)  // the build refused its arguments or the suite: bad input
      throw UsageError(std::string("ab: the ") + (side == 'A' ? "base" : "new") + " build refused the run: " +
                       text.substr(0, text.find('\n')));
    if (!fs::exists(dir + "/report.json"))
      throw std::runtime_error(std::string("ab: the ") + (side == 'A' ? "base" : "new") + " build wrote no report (exit " +
                               std::to_string(rc) + "): " + text.substr(0, text.find('\n')));
    return Slot{side, reports::read_report(dir)};
  };
  // One block: per cell, four slots in the order ABBA (BAAB when odd), one process each, and per side
  // the fastest step over its two processes (--per-side k: k pairs alternating AB and BA, ABBAAB at
  // 3, BAABBA when odd). Interference on a shared runner (another tenant, a descheduled thread) only
  // ever adds time to a step, so the fastest step estimates the code's own cost; the medians carry
  // the tenant's noise with them (measured in docs/ci.md). The cells take turns rather than sharing a
  // process, because on a shared runner whole stretches of seconds run slow: four slots of one short
  // cell fall within one such stretch more often than four slots of every cell. The medians' ratio is
  // kept beside it as a diagnostic.
  auto block_order = [&](int j) {
    std::string order;
    for (int i = 0; i < a.per_side; ++i) order += (i + j) % 2 == 0 ? "AB" : "BA";
    return order;
  };
  const std::string pattern = block_order(0);  // ABBA at the default, its mirror in odd blocks
  auto run_block = [&](int j) {
    const std::string order = block_order(j);
    for (const auto& name : names) {
      double best_a = -1, best_b = -1, p50_a = -1, p50_b = -1;
      CellResult& r = cells[name];
      for (char side : order) {
        const Slot s = run_slot(side, only(name));
        const json c = cell_of(s.report, name);
        if (c.is_null()) throw UsageError(std::string("ab: the ") + (side == 'A' ? "base" : "new") + " build's suite '" + a.suite +
                                          "' has no cell '" + name + "'");
        const std::string status = c.value("status", "?");
        if (status != "ok") {
          (side == 'A' ? r.base_status : r.new_status) = status;
          r.reason = c.value("reason", "");
          continue;
        }
        const json& step = c["metrics"]["timing"]["step_time_s"];
        auto keep_lower = [](double& kept, double v) { kept = kept < 0 ? v : std::min(kept, v); };
        keep_lower(side == 'A' ? best_a : best_b, step.value("min", 0.0));
        keep_lower(side == 'A' ? p50_a : p50_b, step.value("p50", 0.0));
        const double peak = c["metrics"]["memory"].value("step_peak_bytes", json()).is_number()
                                ? c["metrics"]["memory"]["step_peak_bytes"].get<double>()
                                : c["metrics"]["memory"].value("peak_bytes", 0.0);
        keep_lower(side == 'A' ? r.base_peak : r.new_peak, peak);
      }
      if (best_a > 0 && best_b > 0) {
        r.ratios.push_back(std::log(best_b / best_a));
        r.p50_ratios.push_back(std::log(p50_b / p50_a));
      }
    }
  };

  int done = 0;
  json verdicts;
  std::string run_verdict;
  // A build that cannot run its cells ends the gate with an error; what ran is kept (every slot's
  // report under slots/, and ab.json saying where it stopped).
  auto record_error = [&](const std::string& what) {
    std::ofstream f(out + "/ab.json");
    f << json{{"schema", "trainscope.ab/1"}, {"suite", a.suite}, {"blocks_started", done}, {"verdict", "error"}, {"error", what},
              {"slots", slots}}.dump(2)
      << "\n";
  };
  try {
  while (true) {
    while (done < start_blocks) run_block(done++);
    // Per cell: effect, one-sided test, upper bound; Holm over the cells.
    std::vector<double> p;
    for (const auto& name : names) p.push_back(cells[name].ratios.empty() ? 1.0 : wilcoxon_signed_rank_greater_p(cells[name].ratios));
    const std::vector<double> adjusted = holm_adjust(p);
    verdicts = json::array();
    bool any_regression = false, all_pass = true;
    for (size_t i = 0; i < names.size(); ++i) {
      const CellResult& r = cells[names[i]];
      json v = {{"cell", names[i]}, {"blocks", r.ratios.size()}, {"log_ratios", r.ratios}, {"p50_log_ratios", r.p50_ratios}};
      std::string verdict;
      if (r.new_status != "ok" && r.base_status == "ok") {
        verdict = "regression";
        v["why"] = "status " + r.new_status + " on the new build (ok on the base): " + r.reason;
      } else if (r.base_status != "ok") {
        verdict = "inconclusive";
        v["why"] = "the base build's cell is " + r.base_status + ": " + r.reason;
      } else {
        const double effect = std::exp(hodges_lehmann(r.ratios)) - 1;
        const double upper = std::exp(hodges_lehmann_upper(r.ratios, alpha_look / static_cast<double>(names.size()))) - 1;
        v["effect"] = effect;
        v["upper_bound"] = upper;
        v["p"] = p[i];
        v["p_holm"] = adjusted[i];
        if (effect > min_effect && adjusted[i] <= alpha_look) {
          verdict = "regression";
          v["why"] = "fastest step +" + format_fixed(100 * effect, 1) + "% (Hodges-Lehmann over " + std::to_string(r.ratios.size()) +
                     " blocks), p = " + format_fixed(adjusted[i], 4) + " (Holm) <= " + format_fixed(alpha_look, 4) +
                     " (alpha over " + std::to_string(looks) + " looks)";
        } else if (upper < 2 * min_effect) {
          verdict = "pass";
          v["why"] = "a slowdown of " + format_fixed(200 * min_effect, 0) + "% or more is ruled out (upper bound " +
                     format_signed_pct(100 * upper, 1) + ")";
        } else {
          verdict = "inconclusive";
          v["why"] = "effect " + format_signed_pct(100 * effect, 1) + ", upper bound " + format_signed_pct(100 * upper, 1) +
                     ", p = " + format_fixed(adjusted[i], 4) + ": neither a significant slowdown above " +
                     format_fixed(100 * min_effect, 0) + "% nor one below " + format_fixed(200 * min_effect, 0) + "% ruled out";
        }
        // Memory on a CPU is exact: a peak that grew beyond 1% is a regression too.
        if (r.base_peak > 0 && r.new_peak > r.base_peak * 1.01) {
          v["memory"] = {{"base_peak_bytes", r.base_peak}, {"new_peak_bytes", r.new_peak}};
          verdict = "regression";
          v["why"] = v["why"].get<std::string>() + "; peak memory +" + format_fixed(100 * (r.new_peak / r.base_peak - 1), 1) + "%";
        }
      }
      v["verdict"] = verdict;
      any_regression = any_regression || verdict == "regression";
      all_pass = all_pass && verdict == "pass";
      verdicts.push_back(v);
    }
    run_verdict = any_regression ? "regression" : all_pass ? "pass" : "inconclusive";
    if (run_verdict != "inconclusive" || done >= max_blocks) break;
    const int more = std::min(2, max_blocks - done);
    std::fprintf(stderr, "ab: inconclusive after %d blocks: %d more\n", done, more);
    for (int k = 0; k < more; ++k) run_block(done++);
  }
  } catch (const std::exception& e) {
    record_error(e.what());
    throw;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  json result = {{"schema", "trainscope.ab/1"},
                 {"base", {{"binary", a.base}, {"version", base_version}, {"sets", json(a.base_sets)}}},
                 {"new", {{"binary", a.fresh}, {"version", new_version}, {"sets", json(a.new_sets)}}},
                 {"suite", a.suite},
                 {"design", "blocks of " + pattern + " slots (" + block_order(1) + " when odd) per cell, a fresh process per slot running that cell; per block and cell ln(fastest step of new / fastest step of base) over each side's " + std::to_string(a.per_side) + " process(es)"},
                 {"per_side", a.per_side},
                 {"min_effect", min_effect},
                 {"alpha", a.alpha},
                 {"looks", looks},
                 {"alpha_per_look", alpha_look},
                 {"blocks", done},
                 {"seconds", seconds},
                 {"verdict", run_verdict},
                 {"cells", verdicts},
                 {"slots", slots}};
  {
    std::ofstream f(out + "/ab.json");
    f << result.dump(2) << "\n";
  }
  std::string text;
  text += "ab: " + std::to_string(done) + " " + pattern + " blocks of " + std::to_string(names.size()) + " cell(s) in " + format_seconds(seconds) +
          "; verdict: " + run_verdict + "\n";
  for (const auto& v : verdicts) text += "  " + v["cell"].get<std::string>() + ": " + v["verdict"].get<std::string>() + ": " + v.value("why", std::string()) + "\n";
  double wall[2] = {0, 0}, cpu[2] = {0, 0};
  for (const auto& sl : slots) {
    const int k = sl["side"] == "base" ? 0 : 1;
    wall[k] += sl["wall_s"].get<double>();
    cpu[k] += sl["cpu_s"].get<double>();
  }
  text += "  processes: base " + format_seconds(wall[0]) + " wall, " + format_seconds(cpu[0]) + " CPU; new " + format_seconds(wall[1]) +
          " wall, " + format_seconds(cpu[1]) + " CPU\n";
  std::string md = "### trainscope ab: **" + run_verdict + "**\n\n" + std::to_string(done) + " " + pattern + " blocks of " + a.suite +
                   " in " + format_seconds(seconds) + "; base `" + base_version + "`, new `" + new_version +
                   "`\n\n| cell | verdict | effect | upper bound | p (Holm) | blocks | why |\n| --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& v : verdicts)
    md += "| " + v["cell"].get<std::string>() + " | " + v["verdict"].get<std::string>() + " | " +
          (v.contains("effect") ? format_signed_pct(100 * v["effect"].get<double>(), 1) : "-") + " | " +
          (v.contains("upper_bound") ? format_signed_pct(100 * v["upper_bound"].get<double>(), 1) : "-") + " | " +
          (v.contains("p_holm") ? format_fixed(v["p_holm"].get<double>(), 4) : "-") + " | " + v["blocks"].dump() + " | " +
          v.value("why", std::string()) + " |\n";
  {
    std::ofstream f(out + "/ab.md");  // the pull-request comment, beside ab.json
    f << md;
  }
  if (a.format == "json") std::cout << result.dump(2) << "\n";
  else if (a.format == "md") std::cout << md;
  else std::cout << text;
  // In a GitHub Actions job the Markdown also goes to the job's summary page (as `compare` does).
  if (const char* summary = std::getenv("GITHUB_STEP_SUMMARY"); summary && *summary) {
    std::ofstream f(summary, std::ios::app);
    f << md << "\n";
  }
  return run_verdict == "regression" ? 1 : run_verdict == "pass" ? 0 : 3;
}

}  // namespace trainscope::runners
