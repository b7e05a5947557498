#include "runners/commands/history.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <regex>
#include <tuple>

#include "core/errors.hpp"
#include "core/stats.hpp"
#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::runners {

namespace {

namespace fs = std::filesystem;
using reports::number_at;
using reports::value_at;

struct Stored {
  std::string path, created, commit;
  json report;
};

// The metric's value in a cell, NaN when it has none; `higher_is_worse` says which way a regression goes.
double value_of(const json& cell, const std::string& metric) {
  if (metric == "step_time") return number_at(cell, {"metrics", "timing", "step_time_s", "p50"});
  if (metric == "throughput") return number_at(cell, {"metrics", "timing", "samples_per_s"});
  return number_at(cell, {"metrics", "memory", "peak_bytes"});
}

std::string format_value(double v, const std::string& metric) {
  if (metric == "step_time") return format_seconds(v);
  if (metric == "throughput") return format_rate(v) + "/s";
  return format_bytes(v);
}

double median(std::vector<double> v) { return summarize(std::move(v)).p50; }

Stored stored_of(const std::string& path, const json& r) {
  const json commit = value_at(r, {"trainscope", "commit"});
  return {path, r["created"], commit.is_string() ? commit.get<std::string>() : "", r};
}

// The reports under each path, oldest first. A report named on the command line must read; one found by
// searching a folder that does not (a run still writing, a truncated file) is skipped with a warning, so
// one bad file does not stop the dashboard.
std::vector<Stored> load_reports(const std::vector<std::string>& paths, int& skipped) {
  std::vector<Stored> stored;
  for (const auto& p : paths) {
    if (!fs::exists(p)) throw UsageError("history: " + p + ": no such file or folder");
    if (!fs::is_directory(p) || fs::exists(fs::path(p) / "report.json")) {
      stored.push_back(stored_of(p, reports::read_report(p)));
      continue;
    }
    for (const auto& e : fs::recursive_directory_iterator(p, fs::directory_options::skip_permission_denied)) {
      if (!e.is_regular_file() || e.path().filename() != "report.json") continue;
      try {
        stored.push_back(stored_of(e.path().parent_path().string(), reports::read_report(e.path().string())));
      } catch (const std::exception& ex) {
        std::cerr << "history: skipped " << e.path().string() << ": " << ex.what() << "\n";
        ++skipped;
      }
    }
  }
  if (stored.empty()) throw UsageError("history: no report found in " + paths.front());
  std::stable_sort(stored.begin(), stored.end(),
                   [](const Stored& x, const Stored& y) { return std::tie(x.created, x.path) < std::tie(y.created, y.path); });
  return stored;
}

// A cell's series: the reports it ran ok in (their index) and its values there.
using Series = std::vector<std::pair<size_t, double>>;

// A cell's change points (E-divisive means over its values x, in the series' order) whose segments'
// medians differ by at least min_effect, each a regression or an improvement; counts the regressions.
json change_points(const Series& s, const std::vector<double>& x, const std::vector<Stored>& stored, const HistoryArgs& a,
                   double min_effect, int& regressions) {
  const auto found = e_divisive_change_points(x, a.alpha);
  std::vector<size_t> bounds{0};
  for (const auto& cp : found) bounds.push_back(cp.index);
  bounds.push_back(x.size());
  const auto segment = [&x](size_t from, size_t to) {
    return median({x.begin() + static_cast<std::ptrdiff_t>(from), x.begin() + static_cast<std::ptrdiff_t>(to)});
  };
  json changes = json::array();
  for (size_t k = 0; k < found.size(); ++k) {
    const double before = segment(bounds[k], bounds[k + 1]), after = segment(bounds[k + 1], bounds[k + 2]);
    const double change = after / before - 1;
    if (!(std::fabs(change) >= min_effect)) continue;
    const bool worse = a.metric != "throughput" ? change > 0 : change < 0;
    regressions += worse;
    const Stored& at = stored[s[found[k].index].first];
    changes.push_back({{"index", found[k].index}, {"report", at.path}, {"created", at.created}, {"commit", at.commit},
                       {"before", before}, {"after", after}, {"change", change}, {"p", found[k].p},
                       {"direction", worse ? "regression" : "improvement"}});
  }
  return changes;
}

// The history for people: one line (text) or table row (md) per cell with its change points.
std::string render_history(const json& result, const std::vector<Stored>& stored, const std::string& metric, bool md) {
  std::string out = md ? "### trainscope history: " : "history: ";
  const int skipped = result["skipped"], regressions = result["regressions"];
  out += std::to_string(stored.size()) + " reports from " + stored.front().created + " to " + stored.back().created + ", " + metric +
         ": " + std::to_string(regressions) + " regression(s) found" + (skipped ? " (" + std::to_string(skipped) + " unreadable skipped)" : "") + "\n";
  if (md) out += "\n| cell | reports | first | latest | change points |\n| --- | --- | --- | --- | --- |\n";
  for (const auto& c : result["cells"]) {
    std::string points;
    for (const auto& cp : c["change_points"])
      points += (points.empty() ? "" : "; ") + std::string(cp["direction"] == "regression" ? (md ? "**regression**" : "REGRESSION") : "improvement") + " " +
                format_signed_pct(100 * cp["change"].get<double>(), 1) + " at report " + std::to_string(cp["index"].get<size_t>() + 1) + " (" +
                cp["created"].get<std::string>() + (cp["commit"].get<std::string>().empty() ? "" : ", " + cp["commit"].get<std::string>()) +
                "), p = " + format_fixed(cp["p"].get<double>(), 3);
    const std::string first = format_value(c["first"], metric), latest = format_value(c["latest"], metric);
    if (md) out += "| " + c["cell"].get<std::string>() + " | " + c["reports"].dump() + " | " + first + " | " + latest + " | " + (points.empty() ? "none" : points) + " |\n";
    else out += "  " + c["cell"].get<std::string>() + ": " + c["reports"].dump() + " reports, " + first + " -> " + latest + "; " + (points.empty() ? "no change point" : points) + "\n";
  }
  return out;
}

}  // namespace

int history_command(const HistoryArgs& a) {
  const auto min_effect = parse_fraction(a.min_effect);
  if (!min_effect || *min_effect < 0 || *min_effect >= 1) throw UsageError("history: --min-effect '" + a.min_effect + "' is not a percentage in [0, 100%)");
  if (a.alpha <= 0 || a.alpha >= 0.5) throw UsageError("history: --alpha must be in (0, 0.5)");
  std::regex filter;
  try {
    filter = std::regex(a.filter.empty() ? ".*" : a.filter);
  } catch (const std::regex_error&) {
    throw UsageError("history: --filter '" + a.filter + "' is not a regular expression");
  }
  int skipped = 0;
  const std::vector<Stored> stored = load_reports(a.paths, skipped);
  // Per cell (in the order cells first appear): the reports it ran ok in and its values.
  std::vector<std::string> order;
  std::map<std::string, Series> series;
  for (size_t i = 0; i < stored.size(); ++i)
    for (const auto& c : stored[i].report["cells"]) {
      const std::string name = c["name"];
      if (!std::regex_search(name, filter) || c.value("status", "") != "ok") continue;
      const double v = value_of(c, a.metric);
      if (!std::isfinite(v)) continue;
      if (!series.count(name)) order.push_back(name);
      series[name].push_back({i, v});
    }
  json cells = json::array();
  int regressions = 0;
  for (const auto& name : order) {
    const Series& s = series[name];
    std::vector<double> x;
    for (const auto& [i, v] : s) x.push_back(v);
    const json changes = change_points(s, x, stored, a, *min_effect, regressions);
    cells.push_back({{"cell", name}, {"reports", x.size()}, {"first", x.front()}, {"latest", x.back()}, {"values", x}, {"change_points", changes}});
  }
  const json result = {{"schema", "trainscope.history/1"}, {"metric", a.metric}, {"reports", stored.size()}, {"skipped", skipped},
                       {"method", "E-divisive means, permutation test (199 shuffles, fixed seed), segments of at least 4 reports"},
                       {"alpha", a.alpha}, {"min_effect", *min_effect}, {"regressions", regressions}, {"cells", cells}};
  std::cout << (a.format == "json" ? result.dump(2) + "\n" : render_history(result, stored, a.metric, a.format == "md"));
  return 0;
}

}  // namespace trainscope::runners
