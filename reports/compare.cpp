#include "reports/compare.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "core/stats.hpp"
#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  return summarize(std::move(v)).p50;
}

std::vector<double> numbers(const json& a) {
  std::vector<double> v;
  if (a.is_array())
    for (const auto& x : a)
      if (x.is_number()) v.push_back(x.get<double>());
  return v;
}

// The median absolute deviation from the median, over the median: a run-to-run (or step-to-step)
// noise that one outlier does not inflate.
double relative_mad(const std::vector<double>& v, double center) {
  if (v.empty() || !(center > 0)) return std::nan("");
  std::vector<double> dev;
  for (double x : v) dev.push_back(std::fabs(x - center));
  return median_of(dev) / center;
}

// One side of a time comparison: the values the test runs on, what they are, and their noise.
struct Side {
  std::vector<double> values;
  std::string basis;  // "repetitions" | "steps" | "single"
  double center = std::nan(""), noise = std::nan("");
};

// Per-repetition values when the cell has >= 3 repetitions (they carry the between-run noise), else
// the step samples of its one run, else the one number.
Side time_side(const json& cell, const std::string& metric) {
  Side s;
  const json reps = cell.value("repetitions", json::object());
  if (reps.value("count", 0) >= 3) {
    s.values = numbers(reps.value(metric == "step_time" ? "step_time_p50_s" : "samples_per_s", json::array()));
    s.basis = "repetitions";
    s.center = median_of(s.values);
    // The spread between the runs, robustly (the median absolute deviation over the median): one slow
    // repetition (another tenant for a moment) must not blind the comparison as a range would.
    s.noise = relative_mad(s.values, s.center);
    return s;
  }
  const std::vector<double> steps = numbers(value_at(cell, {"metrics", "timing", "samples_s", "step"}));
  if (steps.size() >= 3) {
    s.basis = "steps";
    if (metric == "step_time") {
      s.values = steps;
    } else {
      // Per-step throughput: the run's samples/s scaled by its mean step over this step.
      const double rate = number_at(cell, {"metrics", "timing", "samples_per_s"});
      const double mean = number_at(cell, {"metrics", "timing", "step_time_s", "mean"});
      for (double t : steps) s.values.push_back(rate * mean / t);
    }
    s.center = median_of(s.values);
    s.noise = relative_mad(s.values, s.center);  // within the run
    return s;
  }
  const double v = metric == "step_time" ? number_at(cell, {"metrics", "timing", "step_time_s", "p50"})
                                         : number_at(cell, {"metrics", "timing", "samples_per_s"});
  if (std::isfinite(v)) s.values = {v};
  s.basis = "single";
  s.center = v;
  return s;
}

std::string pct(double x) { return format_signed_pct(100 * x, 1); }

json metric_entry(const std::string& metric, const std::string& verdict, bool regression, double base, double next) {
  json m{{"metric", metric}, {"verdict", verdict}, {"regression", regression}};
  m["base"] = std::isfinite(base) ? json(base) : json(nullptr);
  m["new"] = std::isfinite(next) ? json(next) : json(nullptr);
  m["change"] = std::isfinite(base) && std::isfinite(next) && base != 0 ? json(next / base - 1) : json(nullptr);
  return m;
}

// Step time (lower is better) or throughput (higher is better).
json compare_time(const json& b, const json& n, const std::string& metric, const CompareOptions& o) {
  const Side sb = time_side(b, metric), sn = time_side(n, metric);
  const bool lower_better = metric == "step_time";
  const double change = sn.center / sb.center - 1;
  // A change is real only when it is significant, above the minimum effect and above the noise the
  // two runs show. Within-run samples understate the between-run noise, so they need a larger effect.
  const bool reps = sb.basis == "repetitions" && sn.basis == "repetitions";
  const double min_effect = reps ? o.min_effect : o.min_effect * o.sample_effect_factor;
  const bool worse = lower_better ? change > 0 : change < 0;
  double p = std::nan("");
  if (sb.values.size() >= 2 && sn.values.size() >= 2)
    p = change > 0 ? mann_whitney_greater_p(sb.values, sn.values) : mann_whitney_greater_p(sn.values, sb.values);
  const double noise = std::max(std::isfinite(sb.noise) ? sb.noise : 0.0, std::isfinite(sn.noise) ? sn.noise : 0.0);
  // A change of at least the minimum effect that is not significant, or not above the noise, cannot be
  // decided from these reports: "inconclusive", never "same" (more repetitions, or `trainscope ab`).
  std::string verdict;
  if (!std::isfinite(change)) verdict = "inconclusive";
  else if (std::fabs(change) < min_effect) verdict = "same";
  else if (!(p <= o.alpha) || std::fabs(change) <= noise) verdict = "inconclusive";
  else verdict = worse ? "slower" : "faster";
  json m = metric_entry(metric == "step_time" ? "step_time_p50" : "throughput", verdict, verdict == "slower",
                        sb.center, sn.center);
  m["p_value"] = std::isfinite(p) ? json(p) : json(nullptr);
  m["basis"] = reps ? "repetitions" : (sb.basis == "single" || sn.basis == "single" ? "single" : "steps");
  m["min_effect"] = min_effect;
  m["noise"] = noise;
  m["n"] = {sb.values.size(), sn.values.size()};
  return m;
}

// A peak (lower is better): exact on CPU, so any increase beyond the tolerance is a regression.
json compare_peak(const std::string& metric, double base, double next, const CompareOptions& o) {
  if (!std::isfinite(base) || !std::isfinite(next)) return nullptr;
  const double change = base > 0 ? next / base - 1 : (next > 0 ? INFINITY : 0.0);
  const std::string verdict = change > o.memory_tolerance ? "worse" : change < -o.memory_tolerance ? "better" : "same";
  json m = metric_entry(metric, verdict, verdict == "worse", base, next);
  m["tolerance"] = o.memory_tolerance;
  return m;
}

std::vector<json> compare_quality(const json& b, const json& n, const CompareOptions& o) {
  std::vector<json> out;
  const double lb = number_at(b, {"metrics", "quality", "final_loss"}), ln = number_at(n, {"metrics", "quality", "final_loss"});
  if (std::isfinite(lb) && std::isfinite(ln)) {
    const double change = (ln - lb) / std::max(1e-12, std::fabs(lb));
    const std::string v = change > o.loss_tolerance ? "worse" : change < -o.loss_tolerance ? "better" : "same";
    json m = metric_entry("final_loss", v, v == "worse", lb, ln);
    m["tolerance"] = o.loss_tolerance;
    out.push_back(m);
  }
  const double ab = number_at(b, {"metrics", "quality", "accuracy"}), an = number_at(n, {"metrics", "quality", "accuracy"});
  if (std::isfinite(ab) && std::isfinite(an)) {
    const double drop = ab - an;
    const std::string v = drop > o.accuracy_tolerance ? "worse" : drop < -o.accuracy_tolerance ? "better" : "same";
    json m = metric_entry("accuracy", v, v == "worse", ab, an);
    m["tolerance"] = o.accuracy_tolerance;
    out.push_back(m);
  }
  const std::string vb = b.contains("numerics") ? b["numerics"].value("verdict", "") : "";
  const std::string vn = n.contains("numerics") ? n["numerics"].value("verdict", "") : "";
  if (!vb.empty() && !vn.empty()) {
    const int rank_b = vb == "matches" ? 0 : vb == "drifts" ? 1 : 2, rank_n = vn == "matches" ? 0 : vn == "drifts" ? 1 : 2;
    json m{{"metric", "numerics"}, {"base", vb}, {"new", vn},
           {"verdict", rank_n > rank_b ? "worse" : rank_n < rank_b ? "better" : "same"}, {"regression", rank_n > rank_b}};
    out.push_back(m);
  }
  if (o.exact_loss) {
    const json sb = value_at(b, {"metrics", "quality", "step_losses"});
    const json sn = value_at(n, {"metrics", "quality", "step_losses"});
    json m{{"metric", "loss_curve"}};
    if (!sb.is_array() || !sn.is_array()) {
      m["verdict"] = "missing";
      m["regression"] = true;
      m["detail"] = "no step losses on one side: --exact-loss needs reports that record them";
    } else {
      int64_t first = -1;
      for (size_t i = 0; i < std::max(sb.size(), sn.size()) && first < 0; ++i)
        if (i >= sb.size() || i >= sn.size() || sb[i] != sn[i]) first = static_cast<int64_t>(i);
      m["verdict"] = first < 0 ? "same" : "worse";
      m["regression"] = first >= 0;
      m["first_different_step"] = first >= 0 ? json(first) : json(nullptr);
    }
    out.push_back(m);
  }
  return out;
}

// Cells match by name and configuration; `inject = slow:<pct>` stands for a code change (it is how the
// gate is measured), so it does not make another configuration.
std::string cell_key(const json& c) {
  json config = c.value("config", json::object());
  if (config.value("inject", "").rfind("slow:", 0) == 0) config["inject"] = "none";
  config.erase("trace");  // recording a timeline is not another configuration
  config.erase("operator_times");  // nor is timing its operators
  return c.value("name", "") + "\x1f" + config.dump();
}

// The environment facts that make two runs different machines (or software).
json env_facts(const json& env) {
  json f;
  f["cpu"] = value_at(env, {"cpu", "model"});
  f["cpu cores"] = value_at(env, {"cpu", "logical_cores"});
  json gpus = json::array();
  for (const auto& g : env.value("gpus", json::array())) gpus.push_back(g.value("name", std::string("?")));
  f["gpus"] = gpus;
  f["torch"] = value_at(env, {"torch", "version"});
  f["cpu capability"] = value_at(env, {"torch", "cpu_capability"});
  f["blas"] = value_at(env, {"blas", "name"});
  f["cuda driver"] = value_at(env, {"cuda", "driver_version"});
  f["cuda runtime"] = value_at(env, {"cuda", "runtime_version"});
  return f;
}

std::set<std::string> recommendation_keys(const json& r) {
  std::set<std::string> keys;
  for (const auto& x : r.value("recommendations", json::array())) {
    std::string cells;
    for (const auto& c : x.value("cells", json::array())) cells += (cells.empty() ? "" : ", ") + c.get<std::string>();
    keys.insert(x.value("id", std::string("?")) + " [" + cells + "]");
  }
  return keys;
}

}  // namespace

json compare_reports(const json& base, const json& next, const CompareOptions& o) {
  json out;
  // The environment first: across machines or software, a difference is not a regression test.
  json env_diff = json::array();
  const json fb = env_facts(base.value("env", json::object())), fn = env_facts(next.value("env", json::object()));
  for (auto it = fb.begin(); it != fb.end(); ++it)
    if (fn.value(it.key(), json()) != it.value())
      env_diff.push_back({{"fact", it.key()}, {"base", it.value()}, {"new", fn.value(it.key(), json())}});
  out["env_diff"] = env_diff;

  std::map<std::string, const json*> in_base, in_new;
  for (const auto& c : base["cells"]) in_base[cell_key(c)] = &c;
  for (const auto& c : next["cells"]) in_new[cell_key(c)] = &c;
  json cells = json::array();
  int regressions = 0;
  std::map<std::string, int> counts;
  for (const auto& c : base["cells"]) {
    const auto it = in_new.find(cell_key(c));
    if (it == in_new.end()) {
      cells.push_back({{"name", c["name"]}, {"verdict", "missing"}, {"regression", false}, {"metrics", json::array()}});
      ++counts["missing"];
      continue;
    }
    const json& n = *it->second;
    json entry{{"name", c["name"]}, {"status", {{"base", c["status"]}, {"new", n["status"]}}}};
    json metrics = json::array();
    bool regression = false;
    const std::string sb = c.value("status", ""), sn = n.value("status", "");
    if (sb == "ok" && sn != "ok") {
      // A cell that ran and now does not (failed, oom, diverged, timeout, or no longer runs) always is.
      entry["verdict"] = "status";
      regression = true;
      json m{{"metric", "status"}, {"verdict", "worse"}, {"regression", true}, {"base", sb}, {"new", sn}};
      m["reason"] = n.value("reason", "");
      metrics.push_back(m);
    } else if (sb == "ok" && sn == "ok") {
      for (const std::string metric : {"step_time", "throughput"}) metrics.push_back(compare_time(c, n, metric, o));
      const json peak = compare_peak("peak_bytes", number_at(c, {"metrics", "memory", "peak_bytes"}),
                                     number_at(n, {"metrics", "memory", "peak_bytes"}), o);
      if (!peak.is_null()) metrics.push_back(peak);
      // On a GPU the caching allocator's reserved peak apart from the allocated one.
      const json reserved = compare_peak("reserved_peak_bytes", number_at(c, {"metrics", "memory", "reserved_peak_bytes"}),
                                         number_at(n, {"metrics", "memory", "reserved_peak_bytes"}), o);
      if (!reserved.is_null()) metrics.push_back(reserved);
      for (auto& q : compare_quality(c, n, o)) metrics.push_back(q);
      for (const auto& m : metrics) regression = regression || m.value("regression", false);
      // The cell's verdict: its step time's, unless something else regressed.
      entry["verdict"] = regression && metrics[0]["verdict"] != "slower" ? "worse" : metrics[0]["verdict"];
    } else {
      entry["verdict"] = sb == sn ? "same" : "status";
      metrics.push_back({{"metric", "status"}, {"verdict", sb == sn ? "same" : "changed"}, {"regression", false},
                         {"base", sb}, {"new", sn}});
    }
    entry["regression"] = regression;
    entry["metrics"] = metrics;
    regressions += regression;
    ++counts[entry["verdict"].get<std::string>()];
    cells.push_back(entry);
  }
  for (const auto& c : next["cells"])
    if (!in_base.count(cell_key(c))) {
      cells.push_back({{"name", c["name"]}, {"verdict", "new"}, {"regression", false}, {"metrics", json::array()}});
      ++counts["new"];
    }
  out["cells"] = cells;

  const auto rb = recommendation_keys(base), rn = recommendation_keys(next);
  json appeared = json::array(), disappeared = json::array();
  for (const auto& k : rn)
    if (!rb.count(k)) appeared.push_back(k);
  for (const auto& k : rb)
    if (!rn.count(k)) disappeared.push_back(k);
  out["recommendations"] = {{"appeared", appeared}, {"disappeared", disappeared}};
  out["regressions"] = regressions;
  // Cells without a regression whose time could not be decided: the comparison as a whole is then
  // inconclusive (exit 3), not "no regression".
  int inconclusive = 0;
  for (const auto& c : cells) {
    bool undecided = false;
    for (const auto& m : c["metrics"]) undecided = undecided || m.value("verdict", "") == "inconclusive";
    inconclusive += undecided && !c.value("regression", false);
  }
  out["inconclusive"] = inconclusive;
  out["verdict"] = regressions > 0 ? "regression" : inconclusive > 0 ? "inconclusive" : "no regression";
  out["summary"] = counts;
  out["options"] = {{"min_effect", o.min_effect}, {"alpha", o.alpha}, {"sample_effect_factor", o.sample_effect_factor},
                    {"memory_tolerance", o.memory_tolerance}, {"loss_tolerance", o.loss_tolerance},
                    {"accuracy_tolerance", o.accuracy_tolerance}, {"exact_loss", o.exact_loss}};
  out["base"] = {{"suite", value_at(base, {"suite", "name"})}, {"created", base.value("created", json())},
                 {"commit", value_at(base, {"trainscope", "commit"})}};
  out["new"] = {{"suite", value_at(next, {"suite", "name"})}, {"created", next.value("created", json())},
                {"commit", value_at(next, {"trainscope", "commit"})}};
  return out;
}

namespace {

std::string value_text(const json& m, const char* side) {
  const json& v = m.value(side, json());
  if (v.is_null()) return "-";
  if (v.is_string()) return v.get<std::string>();
  const std::string metric = m.value("metric", "");
  const double x = v.get<double>();
  if (metric == "step_time_p50") return format_seconds(x);
  if (metric == "throughput") return format_rate(x) + "/s";
  if (metric == "peak_bytes" || metric == "reserved_peak_bytes") return format_bytes(x);
  if (metric == "accuracy") return format_fixed(100 * x, 1) + "%";
  return format_fixed(x, 4);
}

std::string detail_text(const json& m) {
  std::string d;
  if (m.contains("p_value") && !m["p_value"].is_null())
    d = "p=" + format_fixed(m["p_value"].get<double>(), 3) + ", noise " + format_fixed(100 * m["noise"].get<double>(), 1) +
        "% (" + m["basis"].get<std::string>() + ", " + std::to_string(m["n"][0].get<int>()) + " vs " +
        std::to_string(m["n"][1].get<int>()) + ")";
  else if (m.contains("basis"))
    d = "no statistic (" + m["basis"].get<std::string>() + ")";
  if (m.contains("first_different_step") && !m["first_different_step"].is_null())
    d = "first differs at step " + std::to_string(m["first_different_step"].get<int64_t>());
  if (m.contains("reason") && !m["reason"].get<std::string>().empty()) d = m["reason"].get<std::string>();
  return d;
}

std::string marker(const std::string& verdict, bool regression, bool colour) {
  if (!colour) return verdict;
  const char* c = regression ? "\033[31m" : verdict == "faster" || verdict == "better" ? "\033[32m"
                              : verdict == "inconclusive" || verdict == "new" || verdict == "missing" ? "\033[33m" : "";
  return *c ? std::string(c) + verdict + "\033[0m" : verdict;
}

// "no regression" only when every cell was decided.
std::string headline(const json& cmp) {
  const int n = cmp["regressions"], undecided = cmp.value("inconclusive", 0);
  if (n > 0) return std::to_string(n) + " cell(s) regressed";
  if (undecided > 0)
    return "inconclusive: " + std::to_string(undecided) + " cell(s) could not be decided (more repetitions, or trainscope ab)";
  return "no regression";
}

std::string pad_to(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }

}  // namespace

std::string render_compare_text(const json& cmp, bool colour) {
  std::ostringstream out;
  if (!cmp["env_diff"].empty()) {
    out << "environment differs (a comparison across machines or software is not a regression test):\n";
    for (const auto& d : cmp["env_diff"]) out << "  " << d["fact"].get<std::string>() << ": " << d["base"].dump() << " -> " << d["new"].dump() << "\n";
    out << "\n";
  }
  size_t w = 4;
  for (const auto& c : cmp["cells"]) w = std::max(w, c["name"].get<std::string>().size());
  out << pad_to("cell", w) << "  " << pad_to("metric", 20) << pad_to("base", 14) << pad_to("new", 14) << pad_to("change", 9)
      << pad_to("verdict", 9) << "detail\n";
  for (const auto& c : cmp["cells"]) {
    if (c["metrics"].empty()) {
      out << pad_to(c["name"].get<std::string>(), w) << "  " << marker(c["verdict"], false, colour) << "\n";
      continue;
    }
    bool first = true;
    for (const auto& m : c["metrics"]) {
      out << pad_to(first ? c["name"].get<std::string>() : "", w) << "  " << pad_to(m["metric"], 20)
          << pad_to(value_text(m, "base"), 14) << pad_to(value_text(m, "new"), 14)
          << pad_to(m.contains("change") && m["change"].is_number() ? pct(m["change"].get<double>()) : "", 9);
      const std::string v = m["verdict"];
      out << marker(v, m.value("regression", false), colour) << std::string(v.size() < 9 ? 9 - v.size() : 1, ' ')
          << detail_text(m) << "\n";
      first = false;
    }
  }
  const auto& rec = cmp["recommendations"];
  for (const auto& k : rec["appeared"]) out << "recommendation appeared: " << k.get<std::string>() << "\n";
  for (const auto& k : rec["disappeared"]) out << "recommendation disappeared: " << k.get<std::string>() << "\n";
  out << "\n" << headline(cmp) << " (";
  bool first = true;
  for (auto it = cmp["summary"].begin(); it != cmp["summary"].end(); ++it) {
    out << (first ? "" : ", ") << it.value().get<int>() << " " << it.key();
    first = false;
  }
  out << ")\n";
  return out.str();
}

std::string render_compare_markdown(const json& cmp) {
  std::ostringstream out;
  out << "### trainscope compare: " << headline(cmp) << "\n\n";
  if (!cmp["env_diff"].empty()) {
    out << "> **Environment differs**: a comparison across machines or software is not a regression test.\n>\n";
    for (const auto& d : cmp["env_diff"])
      out << "> - " << d["fact"].get<std::string>() << ": `" << d["base"].dump() << "` -> `" << d["new"].dump() << "`\n";
    out << "\n";
  }
  out << "| cell | metric | base | new | change | verdict | detail |\n| --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& c : cmp["cells"]) {
    if (c["metrics"].empty()) {
      out << "| " << c["name"].get<std::string>() << " | | | | | " << c["verdict"].get<std::string>() << " | |\n";
      continue;
    }
    for (const auto& m : c["metrics"]) {
      const bool reg = m.value("regression", false);
      const std::string v = m["verdict"];
      out << "| " << c["name"].get<std::string>() << " | " << m["metric"].get<std::string>() << " | " << value_text(m, "base")
          << " | " << value_text(m, "new") << " | "
          << (m.contains("change") && m["change"].is_number() ? pct(m["change"].get<double>()) : "") << " | "
          << (reg ? "**" + v + "** (regression)" : v) << " | " << detail_text(m) << " |\n";
    }
  }
  const auto& rec = cmp["recommendations"];
  if (!rec["appeared"].empty() || !rec["disappeared"].empty()) {
    out << "\n";
    for (const auto& k : rec["appeared"]) out << "- recommendation appeared: `" << k.get<std::string>() << "`\n";
    for (const auto& k : rec["disappeared"]) out << "- recommendation disappeared: `" << k.get<std::string>() << "`\n";
  }
  return out.str();
}

json export_bmf(const json& report) {
  json out = json::object();
  for (const auto& c : report["cells"]) {
    if (c.value("status", "") != "ok") continue;
    json m = json::object();
    const json reps = c.value("repetitions", json::object());
    auto measure = [&](const char* name, double value, const std::vector<double>& spread) {
      if (!std::isfinite(value)) return;
      json v{{"value", value}};
      if (!spread.empty()) {
        v["lower_value"] = *std::min_element(spread.begin(), spread.end());
        v["upper_value"] = *std::max_element(spread.begin(), spread.end());
      }
      m[name] = v;
    };
    std::vector<double> p50s = numbers(reps.value("step_time_p50_s", json::array())), rates = numbers(reps.value("samples_per_s", json::array()));
    for (double& x : p50s) x *= 1e9;
    measure("latency", number_at(c, {"metrics", "timing", "step_time_s", "p50"}) * 1e9, p50s);
    measure("throughput", number_at(c, {"metrics", "timing", "samples_per_s"}), rates);
    measure("peak-memory-bytes", number_at(c, {"metrics", "memory", "peak_bytes"}), {});
    out[c["name"].get<std::string>()] = m;
  }
  return out;
}

}  // namespace trainscope::reports
