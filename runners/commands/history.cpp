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
  // A report named on the command line must read; one found by searching a folder that does not (a
  // run still writing, a truncated file) is skipped with a warning, so one bad file does not stop the
  // dashboard.
  std::vector<Stored> stored;
  int skipped = 0;
  for (const auto& p : a.paths) {
    if (!fs::exists(p)) throw UsageError("history: " + p + ": no such file or folder");
    if (!fs::is_directory(p) || fs::exists(fs::path(p) / "report.json")) {
      const json r = reports::read_report(p);
      stored.push_back(stored_of(p, r));
      continue;
    }
    for (const auto& e : fs::recursive_directory_iterator(p, fs::directory_options::skip_permission_denied)) {
      if (!e.is_regular_file() || e.path().filename() != "report.json") continue;
      try {
        const json r = reports::read_report(e.path().string());
        stored.push_back(stored_of(e.path().parent_path().string(), r));
      } catch (const std::exception& ex) {
        std::cerr << "history: skipped " << e.path().string() << ": " << ex.what() << "\n";
        ++skipped;
      }
    }
  }
  if (stored.empty()) throw UsageError("history: no report found in " + a.paths.front());
  std::stable_sort(stored.begin(), stored.end(), [](const Stored& x, const Stored& y) { return std::tie(x.created, x.path) < std::tie(y.created, y.path); });

  // Per cell (in the order cells first appear): the reports it ran ok in and its values.
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::pair<size_t, double>>> series;
  for (size_t i = 0; i < stored.size(); ++i)
    for (const auto& c : stored[i].report["cells"]) {
      const std::string name = c["name"];
      if (!std::regex_search(name, filter) || c.value("status", "") != "ok") continue;
      const double v = value_of(c, a.metric);
      if (!std::isfinite(v)) continue;
      if (!series.count(name)) order.push_back(name);
      series[name].push_back({i, v});
    }
  const bool lower_is_better = a.metric != "throughput";
  json cells = json::array();
  int regressions = 0;
  for (const auto& name : order) {
    const auto& s = series[name];
    std::vector<double> x;
    for (const auto& [i, v] : s) x.push_back(v);
    const auto found = e_divisive_change_points(x, a.alpha);
    json changes = json::array();
    std::vector<size_t> bounds{0};
    for (const auto& cp : found) bounds.push_back(cp.index);
    bounds.push_back(x.size());
    for (size_t k = 0; k < found.size(); ++k) {
      // The medians of the segments either side of this change point.
      const double before = median({x.begin() + static_cast<std::ptrdiff_t>(bounds[k]), x.begin() + static_cast<std::ptrdiff_t>(bounds[k + 1])});
      const double after = median({x.begin() + static_cast<std::ptrdiff_t>(bounds[k + 1]), x.begin() + static_cast<std::ptrdiff_t>(bounds[k + 2])});
      const double change = after / before - 1;
      if (!(std::fabs(change) >= *min_effect)) continue;
      const bool worse = lower_is_better ? change > 0 : change < 0;
      regressions += worse;
      const Stored& at = stored[s[found[k].index].first];
      changes.push_back({{"index", found[k].index}, {"report", at.path}, {"created", at.created}, {"commit", at.commit},
                         {"before", before}, {"after", after}, {"change", change}, {"p", found[k].p},
                         {"direction", worse ? "regression" : "improvement"}});
    }
    cells.push_back({{"cell", name}, {"reports", x.size()}, {"first", x.front()}, {"latest", x.back()}, {"values", x}, {"change_points", changes}});
  }
  const json result = {{"schema", "trainscope.history/1"}, {"metric", a.metric}, {"reports", stored.size()}, {"skipped", skipped},
                       {"method", "E-divisive means, permutation test (199 shuffles, fixed seed), segments of at least 4 reports"},
                       {"alpha", a.alpha}, {"min_effect", *min_effect}, {"regressions", regressions}, {"cells", cells}};
  if (a.format == "json") {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  const bool md = a.format == "md";
  std::string out = md ? "### trainscope history: " : "history: ";
  out += std::to_string(stored.size()) + " reports from " + stored.front().created + " to " + stored.back().created + ", " + a.metric +
         ": " + std::to_string(regressions) + " regression(s) found" + (skipped ? " (" + std::to_string(skipped) + " unreadable skipped)" : "") + "\n";
  if (md) out += "\n| cell | reports | first | latest | change points |\n| --- | --- | --- | --- | --- |\n";
  for (const auto& c : cells) {
    std::string points;
    for (const auto& cp : c["change_points"])
      points += (points.empty() ? "" : "; ") + std::string(cp["direction"] == "regression" ? (md ? "**regression**" : "REGRESSION") : "improvement") + " " +
                format_signed_pct(100 * cp["change"].get<double>(), 1) + " at report " + std::to_string(cp["index"].get<size_t>() + 1) + " (" +
                cp["created"].get<std::string>() + (cp["commit"].get<std::string>().empty() ? "" : ", " + cp["commit"].get<std::string>()) +
                "), p = " + format_fixed(cp["p"].get<double>(), 3);
    const std::string first = format_value(c["first"], a.metric), latest = format_value(c["latest"], a.metric);
    if (md) out += "| " + c["cell"].get<std::string>() + " | " + c["reports"].dump() + " | " + first + " | " + latest + " | " + (points.empty() ? "none" : points) + " |\n";
    else out += "  " + c["cell"].get<std::string>() + ": " + c["reports"].dump() + " reports, " + first + " -> " + latest + "; " + (points.empty() ? "no change point" : points) + "\n";
  }
  std::cout << out;
  return 0;
}

}  // namespace trainscope::runners
