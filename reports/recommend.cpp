// Recommendations: rules over a report. Each cites the measured numbers and the cells it rests on.
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "core/units.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

json rec(const std::string& id, const std::string& severity, const std::string& text, json evidence,
         json cells) {
  return json{{"id", id}, {"severity", severity}, {"text", text}, {"evidence", std::move(evidence)},
              {"cells", std::move(cells)}};
}

// The thresholds the precision rule uses, written into its evidence.
constexpr double kFaster = 1.10;        // at least 10% faster to recommend switching
constexpr double kAccuracyTolerance = 0.01;

// What mamf-finder measured (bf16 and fp8 e4m3, best shape's mean over the dense datasheet peak): the
// fraction a healthy device of the kind reaches. Known for these devices only.
double published_fraction(const std::string& device, const std::string& dtype) {
  static const std::map<std::pair<std::string, std::string>, double> f = {
      {{"NVIDIA H100 80GB HBM3", "bf16"}, 0.803}, {{"NVIDIA H100 80GB HBM3", "fp8"}, 0.709},
      {{"NVIDIA H200", "bf16"}, 0.803},           {{"NVIDIA H200", "fp8"}, 0.734},
      {{"NVIDIA A100-SXM4-80GB", "bf16"}, 0.869}, {{"NVIDIA A100-SXM4-40GB", "bf16"}, 0.869},
      {{"AMD Instinct MI300X", "bf16"}, 0.514}};
  const auto it = f.find({device, dtype});
  return it == f.end() ? 0.0 : it->second;
}

// The hardware suite's rules: what falls short of the datasheet and by how much, and a throughput that
// falls during a sustained run.
constexpr double kShortfall = 0.10;   // 10 points under the published fraction: warn
constexpr double kMemoryShort = 0.80; // a copy reaching under 80% of the datasheet's bandwidth: warn
constexpr double kThrottleDrop = 0.05;

void hardware_rules(const json& report, json& out) {
  for (const auto& c : report["cells"]) {
    if (c.value("status", "") != "ok") continue;
    const std::string device = c.value("device_name", "");
    const json gemm = value_at(c, {"metrics", "hardware", "gemm"});
    for (const auto& g : gemm.is_array() ? gemm : json::array()) {
      if (g.contains("skipped") || !g["achievable_flops_per_s"].is_number()) continue;
      const std::string dtype = g["dtype"];
      const double achieved = g["achievable_flops_per_s"];
      const json& s = g["best_shape"];
      const std::string shape = s.dump();
      if (!g["fraction_of_datasheet"].is_number()) {
        out.push_back(rec("hardware.gemm." + dtype, "info",
                          dtype + " GEMM reaches " + format_fixed(achieved / 1e12, 2) + " TFLOPS at best (shape " + shape +
                              "); no datasheet for '" + device + "': nothing to hold it against",
                          {{"achievable_flops_per_s", achieved}, {"best_shape", s}}, {c["name"]}));
        continue;
      }
      const double frac = g["fraction_of_datasheet"], published = published_fraction(device, dtype);
      std::string text = dtype + " GEMM reaches " + format_fixed(100 * frac, 1) + "% of the datasheet (" +
                         format_fixed(achieved / 1e12, 1) + " of " +
                         format_fixed(g["datasheet_flops_per_s"].get<double>() / 1e12, 1) + " TFLOPS, shape " + shape + ")";
      std::string severity = "info";
      if (published > 0) {
        text += "; mamf-finder reports " + format_fixed(100 * published, 1) + "% on this device";
        if (frac < published - kShortfall) {
          severity = "warn";
          text += ": " + format_fixed(100 * (published - frac), 1) + " points short (clocks, power limit, or a slow library)";
        }
      }
      out.push_back(rec("hardware.gemm." + dtype, severity, text,
                        {{"fraction_of_datasheet", frac}, {"published_fraction", published > 0 ? json(published) : json(nullptr)},
                         {"achievable_flops_per_s", achieved}, {"datasheet_flops_per_s", g["datasheet_flops_per_s"]},
                         {"shortfall_points", kShortfall}},
                        {c["name"]}));
    }
    // SDPA's fused attention (GPU): its rate at the largest shape measured, the one nearest training's.
    for (const auto& g : gemm.is_array() ? gemm : json::array()) {
      const json att = g.value("attention", json::array());
      if (!att.is_array() || att.empty() || !att.back()["forward_flops_per_s"].is_number()) continue;
      const json& a = att.back();
      const double f = a["forward_flops_per_s"], b = a["backward_flops_per_s"];
      // A CPU's attention runs at GFLOP/s: the unit follows the rate, so that it never prints as 0.
      const bool giga = f < 1e12;
      const double unit = giga ? 1e9 : 1e12;
      std::string text = g["dtype"].get<std::string>() + " fused attention (SDPA, " + a.value("backend", std::string("?")) +
                         " kernel, causal, seq " + std::to_string(a["seq"].get<int64_t>()) + ", head dim " +
                         std::to_string(a["head_dim"].get<int64_t>()) + "): " + format_fixed(f / unit, 0) +
                         (giga ? " GFLOPS forward, " : " TFLOPS forward, ") + format_fixed(b / unit, 0) + " backward";
      if (g["datasheet_flops_per_s"].is_number())
        text += " (" + format_fixed(100 * f / g["datasheet_flops_per_s"].get<double>(), 0) + "% and " +
                format_fixed(100 * b / g["datasheet_flops_per_s"].get<double>(), 0) + "% of the datasheet)";
      out.push_back(rec("hardware.attention." + g["dtype"].get<std::string>(), "info", text,
                        {{"forward_flops_per_s", f}, {"backward_flops_per_s", b}, {"shape", a}}, {c["name"]}));
    }
    // A cluster's two levels: the all-reduce's bus bandwidth at the largest size within a node and
    // across nodes.
    const json levels = value_at(c, {"metrics", "hardware", "collectives", "levels", "rows"});
    if (levels.is_array() && !levels.empty()) {
      std::map<std::string, json> best;  // level -> its largest all-reduce row
      for (const auto& r : levels)
        if (r.value("op", "") == "all-reduce" && (!best.count(r["level"]) || r["bytes"] > best[r["level"]]["bytes"])) best[r["level"]] = r;
      if (best.count("intra-node") && best.count("inter-node")) {
        const double intra = best["intra-node"]["busbw_gbps"], inter = best["inter-node"]["busbw_gbps"];
        const double ratio = inter > 0 ? intra / inter : 0;
        std::string text = "all-reduce bus bandwidth " + format_fixed(inter, 3) + " GB/s across nodes against " +
                           format_fixed(intra, 3) + " GB/s within a node (" + format_bytes(best["inter-node"]["bytes"].get<double>()) + ")";
        if (ratio >= 2)
          text += ": " + format_fixed(ratio, 1) + "x slower, so collectives over every rank are bound by the link between the nodes; " +
                  "sharding within a node and reducing across nodes (hybrid sharding) keeps the heavy traffic inside";
        out.push_back(rec("hardware.collectives.levels", "info", text,
                          {{"intra_node_busbw_gbps", intra}, {"inter_node_busbw_gbps", inter}, {"ratio", ratio}}, {c["name"]}));
      }
    }
    const json mem = value_at(c, {"metrics", "hardware", "memory"});
    if (mem.is_object() && mem["bandwidth_gbps"].is_number()) {
      const double bw = mem["bandwidth_gbps"];
      if (mem["fraction_of_datasheet"].is_number()) {
        const double frac = mem["fraction_of_datasheet"];
        out.push_back(rec("hardware.memory", frac < kMemoryShort ? "warn" : "info",
                          "device memory copies at " + format_fixed(bw, 0) + " GB/s, " + format_fixed(100 * frac, 1) +
                              "% of the datasheet's " + format_fixed(mem["datasheet_gbps"].get<double>(), 0) + " GB/s",
                          {{"bandwidth_gbps", bw}, {"fraction_of_datasheet", frac}, {"threshold", kMemoryShort}}, {c["name"]}));
      } else {
        out.push_back(rec("hardware.memory", "info",
                          "memory copies at " + format_fixed(bw, 1) + " GB/s (read + write); no datasheet for '" + device + "'",
                          {{"bandwidth_gbps", bw}}, {c["name"]}));
      }
    }
    const json drop = value_at(c, {"metrics", "timing", "throughput_over_run", "drop"});
    if (drop.is_number() && drop.get<double>() > kThrottleDrop) {
      const json& w = c["metrics"]["timing"]["throughput_over_run"];
      out.push_back(rec("hardware.throttling", "warn",
                        "throughput fell " + format_fixed(100 * drop.get<double>(), 1) + "% from the first to the last " +
                            format_fixed(w["window_s"].get<double>(), 0) +
                            " s window of the run: clock or power throttling (or a noisy neighbour)",
                        {{"drop", drop}, {"threshold", kThrottleDrop}, {"windows", w["windows"]}}, {c["name"]}));
    }
  }
}

// The self-supervised suite: what pre-training bought against training from scratch at equal compute,
// encoders that do not beat their floors, collapse, and the data-size axis.
std::string points(double delta) { return (delta >= 0 ? "+" : "-") + format_fixed(std::fabs(100 * delta), 1); }
std::string acc3(const json& v) { return v.is_number() ? format_fixed(v.get<double>(), 3) : "-"; }
std::string secs(double s) { return format_fixed(s, s >= 10 ? 0 : s >= 1 ? 1 : 2) + " s"; }
std::string fraction_pct(const json& f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", 100 * f.get<double>());
  return buf;
}
std::string count_text(const json& v) {
  return v.is_number() ? std::to_string(static_cast<int64_t>(std::llround(v.get<double>()))) : "?";
}

void ssl_rules(const json& report, json& out) {
  const json ssl = report.contains("ssl") ? report["ssl"] : ssl_summary(report);
  if (!ssl.is_object()) return;
  std::vector<std::string> order;
  std::map<std::string, std::vector<const json*>> by_cell;
  const json efficiency = ssl.value("label_efficiency", json::array());  // by_cell points into it
  for (const auto& e : efficiency) {
    const std::string cell = e["cell"];
    if (!by_cell.count(cell)) order.push_back(cell);
    by_cell[cell].push_back(&e);
  }
  for (const auto& cell : order) {
    const auto& entries = by_cell[cell];
    const json& head = *entries.front();
    std::string clauses;
    json fractions = json::array();
    for (const json* e : entries) {
      const json& x = *e;
      fractions.push_back({{"fraction", x["fraction"]}, {"labels", x["labels"]}, {"n", x["n"]},
                           {"ssl_accuracy_mean", x["ssl_accuracy_mean"]}, {"scratch_accuracy_mean", x["scratch_accuracy_mean"]},
                           {"delta_mean", x["delta_mean"]}, {"delta_low", x["delta_low"]}, {"delta_high", x["delta_high"]},
                           {"verdict", x["verdict"]}, {"pretrain_wall_s", x["pretrain_wall_s"]},
                           {"pretrained_from", x["pretrained_from"]}, {"upstream_pretrain_wall_s", x["upstream_pretrain_wall_s"]},
                           {"finetune_s_mean", x["finetune_s_mean"]}, {"ssl_cost_s_mean", x["ssl_cost_s_mean"]},
                           {"scratch_outside_compute", x["scratch_outside_compute"]},
                           {"label_equivalent", x["label_equivalent"]}});
      if (!x["verdict"].is_string() || !x["fraction"].is_number()) continue;
      const bool first = clauses.empty();
      const int64_t n = x["n"];
      int tuned = 0, paired = 0;
      for (const auto& sd : x["seeds"])
        if (sd["delta"].is_number()) ++paired, tuned += sd["ssl_path"] == "finetune";
      std::string clause = x["verdict"].get<std::string>() + " at " + fraction_pct(x["fraction"]) + (first ? " labels" : "") +
                           " (" + points(x["delta_mean"].get<double>()) + " points";
      if (x["delta_low"].is_number())
        clause += ", 95% CI " + points(x["delta_low"].get<double>()) + ".." + points(x["delta_high"].get<double>());
      else
        clause += ", one label seed: no interval";
      if (first) clause += ", over " + std::to_string(n) + " label seed" + (n == 1 ? "" : "s");
      clause += std::string(first ? " at " : ", at ") + (x["pretrain_wall_s"].is_number() ? secs(x["pretrain_wall_s"]) : std::string("?")) + " pre-training";
      if (first && x["pretrained_from"].is_string())
        clause += " (" + (x["upstream_pretrain_wall_s"].is_number() ? secs(x["upstream_pretrain_wall_s"]) : std::string("?")) + " of it in " + x["pretrained_from"].get<std::string>() + ", whose encoder it starts from)";
      else if (first && x["pretrained"].is_string())
        clause += " (not counting the pre-training of " + x["pretrained"].get<std::string>() + ": no cell of this report saved it)";
      clause += " + ";
      if (tuned == 0) clause += "a linear probe";
      else {
        clause += secs(x["finetune_s_mean"].get<double>()) + " fine-tune";
        if (tuned < paired) clause += " on " + std::to_string(tuned) + " of " + std::to_string(paired) + " seeds, a linear probe on the others";
      }
      if (first) clause += " against the best scratch run within that compute";
      const int flagged = x["scratch_outside_compute"];
      if (flagged > 0)
        clause += "; on " + std::to_string(flagged) + " seed" + (flagged == 1 ? "" : "s") +
                  " even the scratch run's first logged point took longer";
      clauses += (first ? "" : "; ") + clause + ")";
    }
    const std::string who = head["method"].get<std::string>() + " on " + head["encoder"].get<std::string>() + " (" + cell + ")";
    const std::string text = clauses.empty()
                                 ? who + ": no supervised sibling with scratch runs on the same label subsets: "
                                         "label efficiency against training from scratch not measured"
                                 : who + " " + clauses;
    json cells = {cell};
    if (head["supervised_cell"].is_string()) cells.push_back(head["supervised_cell"]);
    out.push_back(rec("ssl-label-efficiency", "info", text,
                      {{"supervised_cell", head["supervised_cell"]},
                       {"confidence", ssl.value("confidence", 0.95)},
                       {"cost", "pre-training wall time, plus the fine-tune's where fine-tuning gave the better "
                                "accuracy; a linear probe on frozen features is not counted (negligible next to pre-training)"},
                       {"fractions", fractions}},
                      cells));
  }
  for (const auto& r : ssl.value("rows", json::array())) {
    if (!is_ssl_method(r.value("method", "")) || r["beats_floors"] != false) continue;
    const std::string floor = r["floor"];
    const std::string other = floor == "raw-pixel" ? "random-encoder" : "raw-pixel";
    const json& other_linear = r[other == "raw-pixel" ? "raw_pixels_linear" : "random_encoder_linear"];
    std::string text = r["cell"].get<std::string>() + ": " + r["method"].get<std::string>() + " on " +
                       r["encoder"].get<std::string>() + ": a linear probe on its frozen features reaches " + acc3(r["linear"]) +
                       ", " + points(r["linear"].get<double>() - r["floor_linear"].get<double>()) + " points against the " +
                       floor + " floor (" + acc3(r["floor_linear"]) + ")";
    if (other_linear.is_number()) text += "; the " + other + " floor is " + acc3(other_linear);
    text += floor == "raw-pixel" ? ": the pre-trained features separate the classes less well than the pixels themselves"
                                 : ": pre-training left the encoder no better than its random initialisation";
    out.push_back(rec("ssl-below-floor", "warn", text,
                      {{"linear", r["linear"]}, {"floor", floor}, {"floor_linear", r["floor_linear"]},
                       {"margin", r["linear"].get<double>() - r["floor_linear"].get<double>()},
                       {"random_encoder_linear", r["random_encoder_linear"]}, {"raw_pixels_linear", r["raw_pixels_linear"]}},
                      {r["cell"]}));
  }
  for (const auto& c : report["cells"]) {
    const json h = value_at(c, {"metrics", "ssl_health"});
    if (!h.is_object() || h.value("verdict", "") != "collapsed") continue;
    const json step = h.value("collapse_step", json());
    json at = nullptr;  // the health sample at the collapse (the last one when the step is unknown)
    for (const auto& sm : h.value("samples", json::array()))
      if (!step.is_number() || (sm.value("step", json()) == step)) at = sm;
    const std::string reason = h.value("reason", json()).is_string() ? h["reason"].get<std::string>() : "";
    out.push_back(rec("ssl-collapse", "critical",
                      c["name"].get<std::string>() + ": " + c["config"].value("method", "?") + " collapsed" +
                          (step.is_number() ? " at step " + std::to_string(step.get<int64_t>()) : std::string()) +
                          (reason.empty() ? "" : ": " + reason) + "; its features and accuracies are not to be trusted",
                      {{"collapse_step", step}, {"reason", h.value("reason", json())}, {"std_reference", h.value("std_reference", json())},
                       {"collapse_loss", h.value("collapse_loss", json())}, {"sample", at}},
                      {c["name"]}));
  }
  for (const auto& g : ssl.value("data_size", json::array())) {
    const json& rows = g["rows"];
    if (rows.size() < 2) continue;
    const json &small = rows.front(), &large = rows.back();
    std::string text = "pre-training " + g["method"].get<std::string>() + " on " + g["encoder"].get<std::string>() + " on " +
                       count_text(small["unlabeled_size"]) + " images reaches " + acc3(small["linear"]) + " linear vs " +
                       acc3(large["linear"]) + " on " + count_text(large["unlabeled_size"]);
    std::string middle;
    for (size_t i = 1; i + 1 < rows.size(); ++i)
      middle += (middle.empty() ? "" : ", ") + count_text(rows[i]["unlabeled_size"]) + ": " + acc3(rows[i]["linear"]);
    if (!middle.empty()) text += " (" + middle + ")";
    if (g["fraction"].is_number() && small["finetune"].is_number() && large["finetune"].is_number())
      text += "; fine-tuned on " + fraction_pct(g["fraction"]) + " of the labels, " + acc3(small["finetune"]) + " vs " +
              acc3(large["finetune"]);
    json cells = json::array();
    for (const auto& r : rows) cells.push_back(r["cell"]);
    out.push_back(rec("ssl-data-size", "info", text, g, cells));
  }
}

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
    if ((s == "failed" || s == "timeout" || s == "oom") && !shown_as_expected(report, c)) {
      broken.push_back(c["name"]);
      reasons += (reasons.empty() ? "" : "; ") + c["name"].get<std::string>() + ": " + s +
                 (c.contains("reason") ? " (" + c["reason"].get<std::string>() + ")" : "");
    }
  }
  if (!broken.empty())
    out.push_back(rec("run.cells-failed", "critical",
                      std::to_string(broken.size()) + " cell(s) did not finish: " + reasons,
                      {{"count", broken.size()}}, broken));
  // A cell the suite expects to go wrong (a classic mistake shown on purpose) that ended ok: the
  // demonstration no longer demonstrates, which someone should look at.
  for (const auto& c : report["cells"]) {
    if (!expectation_missed(report, c)) continue;
    const json expected = expected_statuses(report, c["name"]);
    std::string statuses;
    for (const auto& st : expected) statuses += (statuses.empty() ? "" : " or ") + st.get<std::string>();
    out.push_back(rec("run.expected-failure-missing", "warn",
                      c["name"].get<std::string>() + " was expected to end " + statuses +
                          " but ended ok: the mistake it shows was not reproduced here",
                      {{"expected", expected}, {"status", "ok"}}, json::array({c["name"]})));
  }

  // bf16-mixed against 32-true of the same configuration: speed and numerical agreement.
  for (const auto& c : report["cells"]) {
    if (c["config"].value("precision", "") != "bf16-mixed" || c["status"] != "ok") continue;
    const json* base = fp32_sibling(report, c);
    if (!base || (*base)["status"] != "ok") continue;
    const double t16 = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
    const double t32 = number_at(*base, {"metrics", "timing", "step_time_s", "p50"});
    double l16 = number_at(c, {"metrics", "quality", "final_loss"});
    double l32 = number_at(*base, {"metrics", "quality", "final_loss"});
    const double a16 = number_at(c, {"metrics", "quality", "accuracy"});
    const double a32 = number_at(*base, {"metrics", "quality", "accuracy"});
    // A time budget stopped one of the two early: losses at the steps both ran (numerics), and no
    // accuracy comparison (one was trained for fewer steps).
    const bool budgeted = c.contains("numerics") && c["numerics"].contains("compared_at_step");
    if (budgeted) {
      l16 = number_at(c, {"numerics", "final_loss"});
      l32 = number_at(c, {"numerics", "reference_final_loss"});
    }
    if (!(t16 > 0 && t32 > 0 && std::isfinite(l16) && std::isfinite(l32))) continue;
    const double speedup = t32 / t16;
    const double loss_diff = std::fabs(l16 - l32) / std::max(1e-12, std::fabs(l32));
    const bool acc_known = !budgeted && std::isfinite(a16) && std::isfinite(a32);
    const bool matches = loss_diff <= kMatchFinalLoss || (acc_known && std::fabs(a16 - a32) <= kAccuracyTolerance);
    const std::string model = c["config"].value("model", "?");
    json evidence{{"step_time_p50_s", {{"32-true", t32}, {"bf16-mixed", t16}}},
                  {"speedup", speedup},
                  {"final_loss", {{"32-true", l32}, {"bf16-mixed", l16}}},
                  {"final_loss_rel_diff", loss_diff},
                  {"thresholds", {{"faster", kFaster}, {"loss_rel", kMatchFinalLoss}, {"accuracy_abs", kAccuracyTolerance}}}};
    if (acc_known) evidence["accuracy"] = {{"32-true", a32}, {"bf16-mixed", a16}};
    const json cells = {base->at("name"), c["name"]};
    std::string quality = "final loss " + format_fixed(100 * loss_diff, 1) + "% from fp32";
    if (budgeted) {
      quality += " at step " + std::to_string(c["numerics"]["compared_at_step"].get<int64_t>()) +
                 ", where the time budget stopped one of them";
      evidence["compared_at_step"] = c["numerics"]["compared_at_step"];
    }
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
  // fp16 with the scaler: how often it skipped and where the scale settled.
  for (const auto& c : report["cells"]) {
    if (c["config"].value("precision", "") != "16-mixed" || !c.contains("metrics")) continue;
    const json& o = c["metrics"].value("overflow", json::object());
    if (o.empty() || o["scale_trajectory"].is_null()) continue;
    const int64_t skipped = o.value("skipped_steps", 0), steps = o.value("steps", 0);
    const double final_scale = o.value("final_scale", 0.0), min_scale = o.value("min_scale", 0.0);
    const bool collapsed = o.value("scale_collapsed", false);
    const std::string where = c["name"].get<std::string>();
    std::string text = where + ": 16-mixed skipped " + std::to_string(skipped) + " of " + std::to_string(steps) +
                       " steps; the loss scale settled at 2^" + format_fixed(std::log2(final_scale), 0) +
                       " after " + std::to_string(o.value("scale_settled_step", 0)) + " steps";
    if (!o["first_overflow_step"].is_null())
      text += " (first overflow at step " + std::to_string(o["first_overflow_step"].get<int64_t>()) + ")";
    if (collapsed) text += "; the scale fell to 2^" + format_fixed(std::log2(min_scale), 0) +
                           ": gradients overflow fp16 even unscaled, prefer bf16";
    json evidence{{"skipped_steps", skipped}, {"steps", steps}, {"final_scale", final_scale},
                  {"min_scale", min_scale}, {"scale_settled_step", o["scale_settled_step"]},
                  {"first_overflow_step", o["first_overflow_step"]}, {"scale_collapsed", collapsed}};
    if (skipped > 0 || collapsed)
      out.push_back(rec("precision.fp16-loss-scaling", collapsed ? "warn" : "info", text, evidence, {c["name"]}));
  }

  // fp16 without a scaler that blew up, with the blocks that left fp16's range.
  for (const auto& c : report["cells"]) {
    if (c["config"].value("precision", "") != "16-mixed-noscale" || c["status"] != "diverged") continue;
    const json o = c.contains("metrics") ? c["metrics"].value("overflow", json::object()) : json::object();
    std::string blocks;
    for (const auto& b : o.value("overflow_blocks", json::array())) blocks += (blocks.empty() ? "" : ", ") + b.get<std::string>();
    const json first = c.contains("metrics") ? c["metrics"]["quality"].value("first_nonfinite_step", json()) : json();
    std::string text = c["name"].get<std::string>() + ": fp16 without loss scaling diverged";
    if (first.is_number()) text += " at step " + std::to_string(first.get<int64_t>());
    if (!blocks.empty()) text += "; values of " + blocks + " exceeded fp16's range (65504)";
    text += ": use 16-mixed with the scaler, or bf16";
    out.push_back(rec("precision.fp16-noscale-diverged", "critical", text,
                      {{"first_nonfinite_step", first}, {"overflow_blocks", o.value("overflow_blocks", json::array())},
                       {"first_overflow_step", o.value("first_overflow_step", json())}},
                      {c["name"]}));
  }

  // Gradients that fp16 cannot represent without scaling: read from cells whose gradients are unscaled.
  std::set<std::string> models_seen;
  for (const auto& c : report["cells"]) {
    const std::string prec = c["config"].value("precision", "");
    if ((prec != "32-true" && prec != "16-mixed-noscale") || c["status"] != "ok" || !c.contains("metrics")) continue;
    if (c["config"].value("loss_multiplier", 1.0) != 1.0) continue;
    const std::string model = c["config"].value("model", "?");
    if (models_seen.count(model)) continue;
    const json o = c["metrics"].value("overflow", json::object());
    std::string worst;
    double frac = 0;
    for (const auto& l : o.value("layers", json::array()))
      if (l["gradient"].is_object() && l["gradient"]["frac_below_fp16_normal"].get<double>() > frac) {
        frac = l["gradient"]["frac_below_fp16_normal"].get<double>();
        worst = l["block"].get<std::string>();
      }
    if (frac < 0.01) continue;
    models_seen.insert(model);
    out.push_back(rec("precision.fp16-underflow", "warn",
                      model + ": " + format_fixed(100 * frac, 1) + "% of the gradients of " + worst +
                          " are below fp16's normal range (6.1e-5) unscaled: in fp16 keep the loss scaler, or use bf16",
                      {{"block", worst}, {"frac_below_fp16_normal", frac}, {"threshold", 0.01}}, {c["name"]}));
  }

  // Any other mode whose numerics drift from fp32 (bf16-mixed has its own rule above).
  for (const auto& c : report["cells"]) {
    if (!c.contains("numerics") || c["config"].value("precision", "") == "bf16-mixed") continue;
    if (c["numerics"].value("verdict", "") != "drifts") continue;
    const json& n = c["numerics"];
    out.push_back(rec("precision.drifts", "warn",
                      c["name"].get<std::string>() + ": final loss " +
                          format_fixed(100 * n["final_loss_rel_diff"].get<double>(), 1) + "% from fp32, largest deviation " +
                          format_fixed(100 * n["max_curve_rel_dev"].get<double>(), 1) + "% along the curve",
                      n, {c["name"], n["reference"]}));
  }

  // Checkpointing: memory saved against time spent, per model and batch size.
  std::map<std::string, std::vector<const json*>> by_config;
  for (const auto& c : report["cells"])
    if (c.contains("checkpointing")) {
      json key = c["config"];
      key.erase("checkpoint");
      by_config[key.dump()].push_back(&c);
    }
  for (const auto& [key, group] : by_config) {
    std::string text;
    json evidence = json::object(), cells = json::array();
    double best_saving = -1e9;
    for (const json* c : group) {
      const json& k = (*c)["checkpointing"];
      if (!k["memory_saved_pct"].is_number() || !k["recompute_overhead_pct"].is_number()) continue;
      const std::string policy = (*c)["config"]["checkpoint"];
      text += (text.empty() ? "" : "; ") + policy + ": peak memory " +
              format_signed_pct(-k["memory_saved_pct"].get<double>()) + ", step time " +
              format_signed_pct(k["recompute_overhead_pct"].get<double>());
      evidence[policy] = k;
      best_saving = std::max(best_saving, k["memory_saved_pct"].get<double>());
      cells.push_back((*c)["name"]);
      if (cells.size() == 1) cells.push_back(k["reference"]);
    }
    if (text.empty()) continue;
    const json& cfg = group.front()->at("config");
    if (best_saving < 5.0) {  // the peak is not made of activations: recomputing buys nothing
      out.push_back(rec("checkpoint.leave-off", "info",
                        cfg.value("model", "?") + " at batch " + std::to_string(cfg.value("batch_size", 0)) +
                            ": no policy lowers peak memory by 5% or more (" + text +
                            "); the peak is not activations: leave checkpointing off",
                        evidence, cells));
      continue;
    }
    out.push_back(rec("checkpoint.tradeoff", "info",
                      cfg.value("model", "?") + " at batch " + std::to_string(cfg.value("batch_size", 0)) +
                          ", against no checkpointing: " + text,
                      evidence, cells));
  }

  // The frontier: the largest batch each policy fits under the budget.
  if (report.contains("frontier") && report["frontier"].is_array()) {
    std::map<std::string, std::vector<const json*>> by_model;
    for (const auto& f : report["frontier"]) {
      const int world = f.value("world_size", 1);
      by_model[f["model"].get<std::string>() + "/" + f["precision"].get<std::string>() +
               (world > 1 ? "/" + f.value("parallel", "?") + " at " + std::to_string(world) + " ranks" : std::string())]
          .push_back(&f);
    }
    for (const auto& [model, entries] : by_model) {
      const json* none = nullptr;
      const json* best = nullptr;
      for (const json* f : entries) {
        if ((*f)["checkpoint"] == "none") none = f;
        if (!best || (*f)["largest_batch"].get<int64_t>() > (*best)["largest_batch"].get<int64_t>()) best = f;
      }
      if (!none || !best) continue;
      const int64_t b0 = (*none)["largest_batch"], b = (*best)["largest_batch"];
      json evidence = json::object();
      for (const json* f : entries) evidence[(*f)["checkpoint"].get<std::string>()] = {{"largest_batch", (*f)["largest_batch"]}, {"samples_per_s", (*f)["samples_per_s"]}};
      evidence["budget"] = (*none)["budget"];
      if (b > b0) {
        std::string text = model + ": under " + (*none)["budget"].get<std::string>() + ", " + (*best)["checkpoint"].get<std::string>() +
                           " fits batch " + std::to_string(b) + " where none fits " + std::to_string(b0);
        if ((*best)["samples_per_s"].is_number() && (*none)["samples_per_s"].is_number())
          text += " (" + format_rate((*best)["samples_per_s"].get<double>()) + " vs " +
                  format_rate((*none)["samples_per_s"].get<double>()) + " samples/s at the frontier)";
        out.push_back(rec("checkpoint.frontier", "info", text, evidence, json::array()));
      } else {
        out.push_back(rec("checkpoint.leave-off", "info",
                          model + ": under " + (*none)["budget"].get<std::string>() + " no policy fits a larger batch than none (" +
                              std::to_string(b0) + "): memory is to spare, leave checkpointing off",
                          evidence, json::array()));
      }
    }
  }

  // Parallel strategies: memory against DDP, exposed communication, scaling, and RNG streams.
  constexpr double kExposedWarn = 0.25;  // exposed communication above this share of the step
  for (const auto& c : report["cells"]) {
    if (!c.contains("parallel") || c["status"] != "ok") continue;
    const json& p = c["parallel"];
    const json& cfg = c["config"];
    const std::string strategy = cfg.value("parallel", "?"), model = cfg.value("model", "?");
    const std::string at = " at " + std::to_string(cfg.value("world_size", 0)) + " ranks";
    if ((strategy.rfind("zero", 0) == 0 || strategy == "hsdp") && p["model_state_vs_ddp_pct"].is_number()) {
      const json* ddp = sibling(report, c, "parallel", "ddp");
      const double state = p["model_state_bytes"], state0 = number_at(*ddp, {"metrics", "memory", "model_state_total_bytes"});
      std::string text = model + ": " + strategy + " cuts model-state memory per rank from " + format_bytes(state0) +
                         " to " + format_bytes(state) + at + " (expected " +
                         format_bytes(p["expected_model_state_bytes"].get<double>()) + ")";
      if (p["step_time_vs_ddp_pct"].is_number())
        text += " for " + format_signed_pct(p["step_time_vs_ddp_pct"].get<double>()) + " step time against ddp";
      out.push_back(rec("parallel.zero-memory", "info", text,
                        {{"model_state_bytes", state}, {"ddp_model_state_bytes", state0},
                         {"expected_model_state_bytes", p["expected_model_state_bytes"]},
                         {"step_time_vs_ddp_pct", p["step_time_vs_ddp_pct"]}},
                        {c["name"], (*ddp)["name"]}));
    }
    if (p["exposed_comm_fraction"].is_number() && p["exposed_comm_fraction"].get<double>() > kExposedWarn) {
      const double f = p["exposed_comm_fraction"];
      const std::string remedy = strategy == "zero3" || strategy == "hsdp"
                                     ? (cfg.value("prefetch", true)
                                            ? "prefetch is on: fewer, larger units (whole stages) or a faster link"
                                            : "turn prefetch on, so the next block's all-gather runs during this one")
                                     : "larger buckets (bucket_mb) cut per-bucket latency; more overlap needs the last buckets to be small" +
                                           std::string(strategy == "ddp" ? "" : " (the all-gather after the step cannot overlap)");
      out.push_back(rec("parallel.exposed-comm", "warn",
                        model + "/" + strategy + ": exposed communication is " + format_fixed(100 * f, 0) +
                            "% of the step" + at + " (overlap " +
                            (p["overlap"].is_number() ? format_fixed(100 * p["overlap"].get<double>(), 0) + "%" : std::string("-")) +
                            "): " + remedy,
                        {{"exposed_comm_fraction", f}, {"overlap", p["overlap"]}, {"threshold", kExposedWarn}},
                        {c["name"]}));
    }
    if (strategy == "ddp" && p["scaling_efficiency"].is_number())
      out.push_back(rec("parallel.scaling", p["scaling_efficiency"].get<double>() < 0.5 ? "warn" : "info",
                        model + "/" + strategy + at + ": " +
                            format_fixed(p["scaling_efficiency"].get<double>() * cfg.value("world_size", 1.0), 2) +
                            "x the throughput of one process at the same per-rank batch (scaling efficiency " +
                            format_fixed(100 * p["scaling_efficiency"].get<double>(), 0) + "%)",
                        {{"scaling_efficiency", p["scaling_efficiency"]}, {"step_time_vs_single_pct", p["step_time_vs_single_pct"]}},
                        {c["name"], p["reference"]}));
  }
  // Across nodes: hsdp against zero3 and ddp on the same cell, on the links this run measured. Each
  // strategy's communication per step by level says which link bounds it: zero3 and ddp run every
  // collective over the whole world (across the nodes), hsdp only its gradient slices.
  for (const auto& c : report["cells"]) {
    if (c["status"] != "ok" || c["config"].value("parallel", "") != "hsdp" || c.value("nodes", json::array()).size() < 2) continue;
    std::vector<const json*> cells = {&c};
    for (const char* other : {"zero3", "ddp"})
      if (const json* o = sibling(report, c, "parallel", other); o && (*o)["status"] == "ok") cells.push_back(o);
    if (cells.size() < 2) continue;
    const json* fastest = nullptr;
    std::string parts;
    json evidence = json::object(), names = json::array();
    for (const json* x : cells) {
      const std::string strategy = (*x)["config"]["parallel"];
      const double t = number_at(*x, {"metrics", "timing", "step_time_s", "p50"});
      if (!std::isfinite(t) || t <= 0) continue;
      if (!fastest || t < number_at(*fastest, {"metrics", "timing", "step_time_s", "p50"})) fastest = x;
      const json levels = (*x)["metrics"].value("comm", json::object()).value("levels", json::object());
      std::string by_level, bound;
      double most = 0;
      json ev = {{"step_time_s", t}};
      for (const char* level : {"intra-node", "inter-node"}) {
        if (!levels.contains(level)) continue;
        const std::string where = std::string(level) == "intra-node" ? "within a node" : "across nodes";
        const double s = levels[level].value("comm_time_s", 0.0), exposed = levels[level].value("exposed_comm_time_s", 0.0);
        by_level += (by_level.empty() ? "" : ", ") + format_seconds(s) + " " + where;
        ev[level + std::string("_comm_time_s")] = s;
        ev[level + std::string("_exposed_comm_time_s")] = exposed;
        // The level the step waits on most bounds it, as far as communication does.
        if (exposed > most) most = exposed, bound = where;
      }
      parts += (parts.empty() ? "" : "; ") + strategy + " " + format_seconds(t) + " per step" +
               (by_level.empty() ? "" : " (communication " + by_level + (bound.empty() ? "" : "; waits most on the links " + bound) + ")");
      evidence[strategy] = ev;
      names.push_back((*x)["name"]);
    }
    if (!fastest) continue;
    const json& cfg = c["config"];
    const std::string fast = (*fastest)["config"]["parallel"];
    const std::string text = cfg.value("model", "?") + " at " + std::to_string(cfg.value("world_size", 0)) + " ranks on " +
                             std::to_string(c["nodes"].size()) + " nodes: " + parts + ". " + fast + " is fastest on these links" +
                             (fast == "hsdp" ? ": its gathers stay inside a node and only the gradient slices cross" :
                              fast == "ddp" ? ": the model state fits unsharded and one all-reduce per bucket beats sharding's traffic" :
                              ": the link across nodes is fast enough for full sharding's gathers");
    out.push_back(rec("parallel.across-nodes", "info", text, evidence, names));
  }

  // busbw against the GPUs' link, where the device is known (per-direction NVLink bandwidth from
  // NVIDIA's datasheets; nccl-tests' busbw approaches it for large messages within one node).
  struct Link {
    const char* gpu;
    double gbps;
    const char* link;
  };
  static const Link kLinks[] = {{"H200", 450, "NVLink 4 (900 GB/s both ways)"},
                                {"H100 80GB HBM3", 450, "NVLink 4 (900 GB/s both ways)"},
                                {"H100 SXM", 450, "NVLink 4 (900 GB/s both ways)"},
                                {"A100-SXM", 300, "NVLink 3 (600 GB/s both ways)"}};
  const json gpus = env.value("gpus", json::array());
  const std::string gpu = gpus.is_array() && !gpus.empty() && gpus[0].is_object() ? gpus[0].value("name", "") : "";
  const Link* link = nullptr;
  for (const auto& l : kLinks)
    if (!gpu.empty() && gpu.find(l.gpu) != std::string::npos) link = &l;
  for (const auto& c : report["cells"]) {
    if (!link || c["status"] != "ok" || c.value("backend", "") != "nccl" || !c.contains("metrics") ||
        !c["metrics"].contains("comm") || c["config"].value("world_size", 1) > static_cast<int64_t>(gpus.size()))
      continue;
    const json& comm = c["metrics"]["comm"];
    if (!comm.contains("collectives") || !comm["collectives"].is_array()) continue;
    const json* largest = nullptr;  // the largest all-reduce: the best chance at the link's rate
    for (const auto& k : comm["collectives"])
      if (k["op"] == "all-reduce" && (!largest || k["bytes"].get<double>() > (*largest)["bytes"].get<double>())) largest = &k;
    if (!largest) continue;
    const double busbw = (*largest)["busbw_gbps"], share = busbw / link->gbps;
    out.push_back(rec("parallel.busbw-vs-link", share < 0.5 ? "warn" : "info",
                      c["name"].get<std::string>() + ": all-reduce of " + format_bytes((*largest)["bytes"].get<double>()) +
                          " reaches busbw " + format_fixed(busbw, 1) + " GB/s, " + format_fixed(100 * share, 0) + "% of " +
                          gpu + "'s " + link->link + " per-direction " + format_fixed(link->gbps, 0) + " GB/s" +
                          (share < 0.5 ? " (small messages are latency-bound; for large ones check NCCL's topology)" : ""),
                      {{"busbw_gbps", busbw}, {"link_gbps", link->gbps}, {"bytes", (*largest)["bytes"]}, {"gpu", gpu}},
                      {c["name"]}));
  }

  // RNG streams: what each violation means and what fixes it.
  static const std::map<std::string, std::string> kFix = {
      {"initial-weights", "ranks start from different weights: broadcast rank 0's parameters before training"},
      {"parameters", "parameters drift apart across ranks: their gradients or updates are not synchronised"},
      {"cpu-generator", "the model's generator differs across ranks: seed it identically on every rank and draw "
                        "per-rank randomness (data, augmentation) from generators of their own"},
      {"cuda-generator", "the GPU generator differs across ranks: seed it identically on every rank"},
      {"dropout-masks", "dropout masks differ across ranks where the replicated model needs them equal: seed the "
                        "model's generator identically on every rank"},
      {"data-samples", "every rank trains on the same samples (no diversity across ranks): shard the data by rank"},
      {"augmentation", "the augmentation stream is identical on all ranks: seed it per rank"}};
  for (const auto& c : report["cells"]) {
    if (!c.contains("metrics") || !c["metrics"].contains("rng")) continue;
    for (const auto& st : c["metrics"]["rng"].value("streams", json::array())) {
      if (st["verdict"] != "violated") continue;
      const std::string name = st["name"];
      std::string ranks;
      for (const auto& r : st["ranks"]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r.get<int>());
      const auto fix = kFix.find(name);
      out.push_back(rec("rng." + name, "critical",
                        c["name"].get<std::string>() + ": " + st["class"].get<std::string>() + " stream '" + name +
                            "' violated from step " + std::to_string(st["first_violation_step"].get<int64_t>()) +
                            " on ranks " + ranks + ": " + (fix != kFix.end() ? fix->second : st.value("detail", "")),
                        st, {c["name"]}));
    }
  }

  // A GPU without bf16: the fast option is fp16 with the scaler.
  for (const auto& c : report["cells"]) {
    if (c["status"] != "skipped" || c["config"].value("precision", "").rfind("bf16", 0) != 0) continue;
    if (c.value("reason", "").find("compute capability") == std::string::npos) continue;
    out.push_back(rec("precision.no-bf16", "info",
                      "this GPU has no bf16 (" + c["reason"].get<std::string>() +
                          "): 16-mixed with the loss scaler is the fast option",
                      {{"reason", c["reason"]}}, {c["name"]}));
    break;
  }
  hardware_rules(report, out);
  ssl_rules(report, out);
  // Each pitfall of the suite: its verdict, at warn when the run did not reproduce it.
  for (const auto& p : report.value("pitfalls", json::array())) {
    json cells = json::array();
    for (const char* part : {"wrong", "fix"})
      for (const auto& e : p[part]) cells.push_back(e["cell"]);
    const bool reproduced = p["reproduced"].is_boolean() && p["reproduced"].get<bool>();
    out.push_back(rec("pitfall." + p["kind"].get<std::string>(), reproduced ? "info" : "warn",
                      p.value("title", p["id"].get<std::string>()) + (reproduced ? ": " : " (not reproduced): ") + p.value("verdict", ""),
                      {{"id", p["id"]}, {"reproduced", p["reproduced"]}}, cells));
  }
  return out;
}

}  // namespace trainscope::reports
