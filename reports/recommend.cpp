// Recommendations: rules over a report. Each cites the measured numbers and the cells it rests on.
#include <cmath>

#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

double get(const json& c, std::initializer_list<const char*> path) {
  const json* at = &c;
  for (const char* k : path) {
    if (!at->is_object() || !at->contains(k)) return std::nan("");
    at = &(*at)[k];
  }
  return at->is_number() ? at->get<double>() : std::nan("");
}

json rec(const std::string& id, const std::string& severity, const std::string& text, json evidence,
         json cells) {
  return json{{"id", id}, {"severity", severity}, {"text", text}, {"evidence", std::move(evidence)},
              {"cells", std::move(cells)}};
}

// The thresholds the precision rule uses, written into its evidence.
constexpr double kFaster = 1.10;        // at least 10% faster to recommend switching
constexpr double kLossTolerance = 0.02;  // relative final-loss difference counted as "matches"
constexpr double kAccuracyTolerance = 0.01;

}  // namespace

json recommend(const json& report) {
  json out = json::array();
  const json& env = report["env"];

  if (env.contains("blas") && env["blas"].value("reference", false))
    out.push_back(rec("env.reference-blas", "warn",
                      "torch calls the reference BLAS (" + env["blas"].value("path", std::string("?")) +
                          "): fp32 timings are ~20x too slow and fp32-vs-bf16 ratios are meaningless; "
                          "install libopenblas0-openmp",
                      {{"blas", env["blas"]}}, json::array()));

  json broken = json::array();
  std::string reasons;
  for (const auto& c : report["cells"]) {
    const std::string s = c["status"];
    if (s == "failed" || s == "timeout" || s == "oom") {
      broken.push_back(c["name"]);
      reasons += (reasons.empty() ? "" : "; ") + c["name"].get<std::string>() + ": " + s +
                 (c.contains("reason") ? " (" + c["reason"].get<std::string>() + ")" : "");
    }
  }
  if (!broken.empty())
    out.push_back(rec("run.cells-failed", "critical",
                      std::to_string(broken.size()) + " cell(s) did not finish: " + reasons,
                      {{"count", broken.size()}}, broken));

  // bf16-mixed against 32-true of the same configuration: speed and numerical agreement.
  for (const auto& c : report["cells"]) {
    if (c["config"].value("precision", "") != "bf16-mixed" || c["status"] != "ok") continue;
    const json* base = fp32_sibling(report, c);
    if (!base || (*base)["status"] != "ok") continue;
    const double t16 = get(c, {"metrics", "timing", "step_time_s", "p50"});
    const double t32 = get(*base, {"metrics", "timing", "step_time_s", "p50"});
    const double l16 = get(c, {"metrics", "quality", "final_loss"});
    const double l32 = get(*base, {"metrics", "quality", "final_loss"});
    const double a16 = get(c, {"metrics", "quality", "accuracy"});
    const double a32 = get(*base, {"metrics", "quality", "accuracy"});
    if (!(t16 > 0 && t32 > 0 && std::isfinite(l16) && std::isfinite(l32))) continue;
    const double speedup = t32 / t16;
    const double loss_diff = std::fabs(l16 - l32) / std::max(1e-12, std::fabs(l32));
    const bool acc_known = std::isfinite(a16) && std::isfinite(a32);
    const bool matches = loss_diff <= kLossTolerance || (acc_known && std::fabs(a16 - a32) <= kAccuracyTolerance);
    const std::string model = c["config"].value("model", "?");
    json evidence{{"step_time_p50_s", {{"32-true", t32}, {"bf16-mixed", t16}}},
                  {"speedup", speedup},
                  {"final_loss", {{"32-true", l32}, {"bf16-mixed", l16}}},
                  {"final_loss_rel_diff", loss_diff},
                  {"thresholds", {{"faster", kFaster}, {"loss_rel", kLossTolerance}, {"accuracy_abs", kAccuracyTolerance}}}};
    if (acc_known) evidence["accuracy"] = {{"32-true", a32}, {"bf16-mixed", a16}};
    const json cells = {base->at("name"), c["name"]};
    std::string quality = "final loss " + format_fixed(100 * loss_diff, 1) + "% from fp32";
    if (acc_known)
      quality += ", accuracy " + format_fixed(100 * a16, 1) + "% vs " + format_fixed(100 * a32, 1) + "%";
    if (speedup >= kFaster && matches)
      out.push_back(rec("precision.use-bf16-mixed", "info",
                        model + ": bf16-mixed runs here at " + format_fixed(speedup, 2) + "x the speed of fp32 (" +
                            quality + "): use it",
                        evidence, cells));
    else if (!matches)
      out.push_back(rec("precision.bf16-drifts", "warn",
                        model + ": bf16-mixed drifts from fp32 (" + quality + ") at " + format_fixed(speedup, 2) +
                            "x the speed: check the numerics before switching",
                        evidence, cells));
    else
      out.push_back(rec("precision.keep-fp32", "info",
                        model + ": bf16-mixed matches fp32 (" + quality + ") but is only " +
                            format_fixed(speedup, 2) + "x its speed here: no gain from switching on this device",
                        evidence, cells));
  }
  return out;
}

}  // namespace trainscope::reports
