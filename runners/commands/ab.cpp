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
  double block_best_a = -1, block_best_b = -1, block_p50_a = -1, block_p50_b = -1;  // the block in progress
};

json cell_of(const json& report, const std::string& name) {
  for (const auto& c : report["cells"])
    if (c["name"] == name) return c;
  return nullptr;
}

// The gate's run: its design (blocks, looks), the slots it runs, the verdicts it reaches.
class AbGate {
 public:
  explicit AbGate(const AbArgs& a);
  int run();

 private:
  void plan_looks();
  Slot run_slot(char side, const std::string& filter);
  std::string block_order(int j) const;
  void run_block(int j);
  void record(CellResult& r, char side, const json& cell);
  json verdict_of(const std::string& name, double p, double p_holm) const;
  std::string decide();
  json result(const std::string& verdict, double seconds) const;
  void report(const json& result) const;

  const AbArgs& a_;
  std::string base_version_, new_version_, out_;
  double min_effect_ = 0;
  std::vector<std::string> names_;
  int looks_ = 1, start_blocks_ = 0, max_blocks_ = 0, done_ = 0, slot_index_ = 0;
  double alpha_look_ = 0;
  std::map<std::string, CellResult> cells_;
  json slots_ = json::array();  // per slot, the whole process's wall and CPU time
  json verdicts_;
};

AbGate::AbGate(const AbArgs& a) : a_(a) {
  base_version_ = check_binary(a.base, "base");
  new_version_ = check_binary(a.fresh, "new");
  min_effect_ = parse_percent(a.min_effect);
  if (a.alpha <= 0 || a.alpha >= 0.5) throw UsageError("ab: --alpha must be in (0, 0.5)");
  if (a.blocks < 2 || a.max_blocks < a.blocks) throw UsageError("ab: need 2 <= --blocks <= --max-blocks");
  for (const auto& c : suites::expand(suites::load_suite(a.suite), a.filter)) names_.push_back(c.name);
  if (names_.empty()) throw UsageError("ab: no cell of suite '" + a.suite + "' matches --filter '" + a.filter + "'");
  out_ = a.out.empty() ? "results/ab-" + utc_now(true) : a.out;
  plan_looks();
}

// An inconclusive gate decides again after two more blocks, up to --max-blocks: each look is another
// chance of a false alarm (measured: 1 of 3 A/A false alarms in 41 came at the third look), so alpha
// is split over the looks (Bonferroni), alpha / looks at each. With n blocks the exact signed-rank
// test's smallest p is 2^-n, and the upper bound exists only when 2^-n <= alpha_look / K: fewer blocks
// could never decide on time. Start at the least n that can (even, so that ABBA and BAAB balance):
// 6 blocks and 3 looks for one cell, 8 blocks and 2 looks for the gate's 4 cells, at alpha 0.05.
void AbGate::plan_looks() {
  start_blocks_ = a_.blocks;
  max_blocks_ = a_.max_blocks;
  for (int pass = 0; pass < 8; ++pass) {
    const double per_look = a_.alpha / looks_;
    const int needed = static_cast<int>(std::ceil(std::log2(static_cast<double>(names_.size()) / per_look)));
    start_blocks_ = std::max(a_.blocks, needed + needed % 2);
    max_blocks_ = std::max(a_.max_blocks, start_blocks_);
    const int next = 1 + (max_blocks_ - start_blocks_ + 1) / 2;
    if (next <= looks_) break;
    looks_ = next;
  }
  alpha_look_ = a_.alpha / looks_;
}

// One process of one side running one cell; its wall and CPU time kept as a diagnostic (a slot whose
// CPU time is far below its wall time waited for the cores: another tenant).
Slot AbGate::run_slot(char side, const std::string& filter) {
  const std::string& bin = side == 'A' ? a_.base : a_.fresh;
  const auto& sets = side == 'A' ? a_.base_sets : a_.new_sets;
  const char* who = side == 'A' ? "base" : "new";
  const std::string dir = out_ + "/slots/" + std::to_string(slot_index_++) + "-" + who;
  std::string cmd = quote(bin) + " run --suite " + quote(a_.suite) + " --filter " + quote(filter) + " --nproc " +
                    std::to_string(a_.nproc) + " --out " + quote(dir);
  for (const auto& [k, v] : sets) cmd += " --set " + quote(k + "=" + v);
  const double cpu0 = children_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  const auto [rc, text] = capture(cmd);
  slots_.push_back({{"slot", dir.substr(out_.size() + 1)}, {"side", who},
                    {"wall_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()},
                    {"cpu_s", children_cpu_seconds() - cpu0}});
  if (!fs::exists(dir + "/report.json") && rc == 2)  // the build refused its arguments or the suite: bad input
    throw UsageError(std::string("ab: the ") + who + " build refused the run: " + text.substr(0, text.find('\n')));
  if (!fs::exists(dir + "/report.json"))
    throw std::runtime_error(std::string("ab: the ") + who + " build wrote no report (exit " + std::to_string(rc) +
                             "): " + text.substr(0, text.find('\n')));
  return Slot{side, reports::read_report(dir)};
}

// One block: per cell, four slots in the order ABBA (BAAB when odd), one process each, and per side
// the fastest step over its two processes (--per-side k: k pairs alternating AB and BA, ABBAAB at
// 3, BAABBA when odd). Interference on a shared runner (another tenant, a descheduled thread) only
// ever adds time to a step, so the fastest step estimates the code's own cost; the medians carry
// the tenant's noise with them (benchmarks/2026-12-04-gate.md). The cells take turns rather than
// sharing a process, because on a shared runner whole stretches of seconds run slow: four slots of
// one short cell fall within one such stretch more often than four slots of every cell. The medians'
// ratio is kept beside it as a diagnostic.
std::string AbGate::block_order(int j) const {
  std::string order;
  for (int i = 0; i < a_.per_side; ++i) order += (i + j) % 2 == 0 ? "AB" : "BA";
  return order;
}

// A side's slot of a cell: its status, or its fastest step, median step and peak memory.
void AbGate::record(CellResult& r, char side, const json& c) {
  const std::string status = c.value("status", "?");
  if (status != "ok") {
    (side == 'A' ? r.base_status : r.new_status) = status;
    r.reason = c.value("reason", "");
    return;
  }
  const json& step = c["metrics"]["timing"]["step_time_s"];
  auto keep_lower = [](double& kept, double v) { kept = kept < 0 ? v : std::min(kept, v); };
  keep_lower(side == 'A' ? r.block_best_a : r.block_best_b, step.value("min", 0.0));
  keep_lower(side == 'A' ? r.block_p50_a : r.block_p50_b, step.value("p50", 0.0));
  const json& mem = c["metrics"]["memory"];
  const double peak = mem.value("step_peak_bytes", json()).is_number() ? mem["step_peak_bytes"].get<double>() : mem.value("peak_bytes", 0.0);
  keep_lower(side == 'A' ? r.base_peak : r.new_peak, peak);
}

void AbGate::run_block(int j) {
  // Each slot runs one cell (an anchored, escaped --filter), so that a block's slots of a cell follow
  // each other within seconds.
  auto only = [](const std::string& name) {
    std::string escaped;
    for (char c : name) escaped += std::string(std::strchr(".^$|()[]{}*+?\\", c) ? "\\" : "") + c;
    return "^" + escaped + "$";
  };
  for (const auto& name : names_) {
    CellResult& r = cells_[name];
    r.block_best_a = r.block_best_b = r.block_p50_a = r.block_p50_b = -1;
    for (char side : block_order(j)) {
      const Slot s = run_slot(side, only(name));
      const json c = cell_of(s.report, name);
      if (c.is_null())
        throw UsageError(std::string("ab: the ") + (side == 'A' ? "base" : "new") + " build's suite '" + a_.suite + "' has no cell '" + name + "'");
      record(r, side, c);
    }
    if (r.block_best_a > 0 && r.block_best_b > 0) {
      r.ratios.push_back(std::log(r.block_best_b / r.block_best_a));
      r.p50_ratios.push_back(std::log(r.block_p50_b / r.block_p50_a));
    }
  }
}

// A cell's verdict: a status that got worse, else the effect, its test and upper bound, and memory.
json AbGate::verdict_of(const std::string& name, double p, double p_holm) const {
  const CellResult& r = cells_.at(name);
  json v = {{"cell", name}, {"blocks", r.ratios.size()}, {"log_ratios", r.ratios}, {"p50_log_ratios", r.p50_ratios}};
  auto say = [&](const std::string& verdict, const std::string& why) {
    v["verdict"] = verdict;
    v["why"] = why;
  };
  if (r.new_status != "ok" && r.base_status == "ok") {
    say("regression", "status " + r.new_status + " on the new build (ok on the base): " + r.reason);
    return v;
  }
  if (r.base_status != "ok") {
    say("inconclusive", "the base build's cell is " + r.base_status + ": " + r.reason);
    return v;
  }
  const double effect = std::exp(hodges_lehmann(r.ratios)) - 1;
  const double upper = std::exp(hodges_lehmann_upper(r.ratios, alpha_look_ / static_cast<double>(names_.size()))) - 1;
  v["effect"] = effect;
  v["upper_bound"] = upper;
  v["p"] = p;
  v["p_holm"] = p_holm;
  if (effect > min_effect_ && p_holm <= alpha_look_)
    say("regression", "fastest step +" + format_fixed(100 * effect, 1) + "% (Hodges-Lehmann over " + std::to_string(r.ratios.size()) +
                          " blocks), p = " + format_fixed(p_holm, 4) + " (Holm) <= " + format_fixed(alpha_look_, 4) + " (alpha over " +
                          std::to_string(looks_) + " looks)");
  else if (upper < 2 * min_effect_)
    say("pass", "a slowdown of " + format_fixed(200 * min_effect_, 0) + "% or more is ruled out (upper bound " +
                    format_signed_pct(100 * upper, 1) + ")");
  else
    say("inconclusive", "effect " + format_signed_pct(100 * effect, 1) + ", upper bound " + format_signed_pct(100 * upper, 1) +
                            ", p = " + format_fixed(p_holm, 4) + ": neither a significant slowdown above " +
                            format_fixed(100 * min_effect_, 0) + "% nor one below " + format_fixed(200 * min_effect_, 0) + "% ruled out");
  // Memory on a CPU is exact: a peak that grew beyond 1% is a regression too.
  if (r.base_peak > 0 && r.new_peak > r.base_peak * 1.01) {
    v["memory"] = {{"base_peak_bytes", r.base_peak}, {"new_peak_bytes", r.new_peak}};
    say("regression", v["why"].get<std::string>() + "; peak memory +" + format_fixed(100 * (r.new_peak / r.base_peak - 1), 1) + "%");
  }
  return v;
}

// The blocks run so far decided: per cell a one-sided test, Holm over the cells, then the run's verdict.
std::string AbGate::decide() {
  std::vector<double> p;
  for (const auto& name : names_) p.push_back(cells_[name].ratios.empty() ? 1.0 : wilcoxon_signed_rank_greater_p(cells_[name].ratios));
  const std::vector<double> adjusted = holm_adjust(p);
  verdicts_ = json::array();
  bool any_regression = false, all_pass = true;
  for (size_t i = 0; i < names_.size(); ++i) {
    const json v = verdict_of(names_[i], p[i], adjusted[i]);
    any_regression = any_regression || v["verdict"] == "regression";
    all_pass = all_pass && v["verdict"] == "pass";
    verdicts_.push_back(v);
  }
  return any_regression ? "regression" : all_pass ? "pass" : "inconclusive";
}

json AbGate::result(const std::string& verdict, double seconds) const {
  return {{"schema", "trainscope.ab/1"},
          {"base", {{"binary", a_.base}, {"version", base_version_}, {"sets", json(a_.base_sets)}}},
          {"new", {{"binary", a_.fresh}, {"version", new_version_}, {"sets", json(a_.new_sets)}}},
          {"suite", a_.suite},
          {"design", "blocks of " + block_order(0) + " slots (" + block_order(1) + " when odd) per cell, a fresh process per slot "
                     "running that cell; per block and cell ln(fastest step of new / fastest step of base) over each side's " +
                     std::to_string(a_.per_side) + " process(es)"},
          {"per_side", a_.per_side},
          {"min_effect", min_effect_},
          {"alpha", a_.alpha},
          {"looks", looks_},
          {"alpha_per_look", alpha_look_},
          {"blocks", done_},
          {"seconds", seconds},
          {"verdict", verdict},
          {"cells", verdicts_},
          {"slots", slots_}};
}

// ab.json and ab.md (the pull-request comment) beside the slots, and the format asked for on stdout.
void AbGate::report(const json& res) const {
  const std::string verdict = res["verdict"], pattern = block_order(0);
  const double seconds = res["seconds"];
  std::ofstream(out_ + "/ab.json") << res.dump(2) << "\n";
  std::string text = "ab: " + std::to_string(done_) + " " + pattern + " blocks of " + std::to_string(names_.size()) + " cell(s) in " +
                     format_seconds(seconds) + "; verdict: " + verdict + "\n";
  for (const auto& v : verdicts_) text += "  " + v["cell"].get<std::string>() + ": " + v["verdict"].get<std::string>() + ": " + v.value("why", std::string()) + "\n";
  double wall[2] = {0, 0}, cpu[2] = {0, 0};
  for (const auto& sl : slots_) {
    const int k = sl["side"] == "base" ? 0 : 1;
    wall[k] += sl["wall_s"].get<double>();
    cpu[k] += sl["cpu_s"].get<double>();
  }
  text += "  processes: base " + format_seconds(wall[0]) + " wall, " + format_seconds(cpu[0]) + " CPU; new " + format_seconds(wall[1]) +
          " wall, " + format_seconds(cpu[1]) + " CPU\n";
  std::string md = "### trainscope ab: **" + verdict + "**\n\n" + std::to_string(done_) + " " + pattern + " blocks of " + a_.suite + " in " +
                   format_seconds(seconds) + "; base `" + base_version_ + "`, new `" + new_version_ +
                   "`\n\n| cell | verdict | effect | upper bound | p (Holm) | blocks | why |\n| --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& v : verdicts_)
    md += "| " + v["cell"].get<std::string>() + " | " + v["verdict"].get<std::string>() + " | " +
          (v.contains("effect") ? format_signed_pct(100 * v["effect"].get<double>(), 1) : "-") + " | " +
          (v.contains("upper_bound") ? format_signed_pct(100 * v["upper_bound"].get<double>(), 1) : "-") + " | " +
          (v.contains("p_holm") ? format_fixed(v["p_holm"].get<double>(), 4) : "-") + " | " + v["blocks"].dump() + " | " +
          v.value("why", std::string()) + " |\n";
  std::ofstream(out_ + "/ab.md") << md;
  if (a_.format == "json") std::cout << res.dump(2) << "\n";
  else if (a_.format == "md") std::cout << md;
  else std::cout << text;
  // In a GitHub Actions job the Markdown also goes to the job's summary page (as `compare` does).
  if (const char* summary = std::getenv("GITHUB_STEP_SUMMARY"); summary && *summary) std::ofstream(summary, std::ios::app) << md << "\n";
}

int AbGate::run() {
  const FolderLock lock(out_);
  const auto started = std::chrono::steady_clock::now();
  std::string verdict;
  try {
    while (done_ < start_blocks_) run_block(done_++);
    while ((verdict = decide()) == "inconclusive" && done_ < max_blocks_) {
      const int more = std::min(2, max_blocks_ - done_);
      std::fprintf(stderr, "ab: inconclusive after %d blocks: %d more\n", done_, more);
      for (int k = 0; k < more; ++k) run_block(done_++);
    }
  } catch (const std::exception& e) {
    // A build that cannot run its cells ends the gate with an error; what ran is kept (every slot's
    // report under slots/, and ab.json saying where it stopped).
    std::ofstream(out_ + "/ab.json") << json{{"schema", "trainscope.ab/1"}, {"suite", a_.suite}, {"blocks_started", done_},
                                             {"verdict", "error"}, {"error", e.what()}, {"slots", slots_}}.dump(2)
                                     << "\n";
    throw;
  }
  report(result(verdict, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
  return verdict == "regression" ? 1 : verdict == "pass" ? 0 : 3;
}

}  // namespace

int ab_command(const AbArgs& a) { return AbGate(a).run(); }

}  // namespace trainscope::runners
