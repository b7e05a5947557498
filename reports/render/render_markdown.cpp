// report.md, and the technique tables that report.html shares.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>

#include "core/units.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

std::string text_or_dash(const json& v, const std::function<std::string(double)>& f) {
  return v.is_number() ? f(v.get<double>()) : "-";
}

std::string md_escape(std::string s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += ' ';
    else out += c;
  }
  return out;
}

// A JSON scalar as text, without quotes.
std::string value_text_plain(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "-";
  return v.dump();
}

void md_table(std::ostringstream& out, const json& columns, const json& rows) {
  out << "|";
  for (const auto& c : columns) out << " " << md_escape(c.get<std::string>()) << " |";
  out << "\n|";
  for (size_t i = 0; i < columns.size(); ++i) out << " --- |";
  out << "\n";
  for (const auto& r : rows) {
    out << "|";
    for (const auto& v : r) out << " " << md_escape(v.is_string() ? v.get<std::string>() : v.dump()) << " |";
    out << "\n";
  }
}

// A compared value in a table cell: numbers as they are, a curve or trajectory by its length and
// ends, a dict by its first entries.
std::string compact(const json& v) {
  if (v.is_null()) return "-";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v.get<double>());
    return buf;
  }
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    if (v.empty()) return "[]";
    if (v.size() <= 4) return v.dump();
    return std::to_string(v.size()) + " values, " + compact(v.front()) + " .. " + compact(v.back());
  }
  if (v.is_object()) {
    std::string out;
    size_t n = 0;
    for (auto it = v.begin(); it != v.end() && n < 3; ++it, ++n) out += (n ? ", " : "") + it.key() + "=" + compact(it.value());
    return v.size() > 3 ? out + ", ..." : out;
  }
  return v.dump();
}

void parity_tables(const json& report, json& tables) {
  json summary = json::array(), details = json::array(), engines = json::array();
  auto seconds = [](const json& v) { return text_or_dash(v, [](double x) { return format_seconds(x); }); };
  // One summary row and its comparisons per reference: PyTorch's, then each other system's (`engines`).
  auto add = [&](const std::string& name, const json& p) {
    for (const auto& k : p.value("checks", json::array())) {
      const std::string v = k.value("verdict", "");
      std::string note = k.value("note", "");
      if (k.contains("tolerance") && v == "within")
        note = "tolerance " + compact(k["tolerance"]) + (k.contains("tolerance_from") ? ": " + k.value("tolerance_from", "") : "");
      details.push_back({name, k.value("name", "?"), compact(k.value("trainscope", json())), compact(k.value("pytorch", json())),
                         compact(k.value("difference", json())), v, note});
    }
    const json t = p.value("step_time_s", json::object());
    const ParityCounts n = parity_counts(p);
    summary.push_back({name, p.value("reference", p.value("reason", "-")), p.value("verdict", "?"),
                       std::to_string(n.exact) + " / " + std::to_string(n.within) + " / " + std::to_string(n.design) +
                           " / " + std::to_string(n.differs),
                       seconds(t.value("trainscope", json())), seconds(t.value("pytorch", json())),
                       text_or_dash(t.value("ratio", json()), [](double x) { return format_fixed(x, 2) + "x"; })});
  };
  for (const auto& c : report["cells"]) {
    if (!c.contains("parity")) continue;
    const std::string name = c["name"];
    add(name, c["parity"]);
    for (const auto& e : c["parity"].value("engines", json::array())) {
      json shown = e;
      if (e.value("verdict", "") == "skipped") shown["reference"] = e.value("engine", "?") + ": skipped, " + e.value("reason", "");
      add(name + " (" + e.value("engine", "?") + ")", shown);
    }
    auto bytes = [](const json& v) { return text_or_dash(v, [](double x) { return format_bytes(x); }); };
    for (const auto& r : c["parity"].value("engines_table", json::array()))
      engines.push_back({name, r.value("engine", "?"), seconds(r.value("step_time_p50_s", json())),
                         bytes(r.value("model_state_bytes", json())), bytes(r.value("peak_above_start_bytes", json())),
                         bytes(r.value("comm_bytes_per_step", json()))});
  }
  if (summary.empty()) return;
  tables.push_back({{"title", "Parity: each technique against PyTorch's own implementation and the systems the field uses"},
                    {"columns", {"cell (reference)", "reference", "verdict", "exact / within / design / differs",
                                 "step p50 trainscope", "step p50 reference", "trainscope / reference"}},
                    {"rows", summary}});
  if (!engines.empty())
    tables.push_back({{"title", "The ZeRO engines side by side (rank 0; the same model, batches and machine)"},
                      {"columns", {"cell", "engine", "step p50", "model state at rest", "peak during a step above the start",
                                   "bytes communicated per step"}},
                      {"rows", engines}});
  tables.push_back({{"title", "Parity: every comparison"},
                    {"columns", {"cell (reference)", "compared", "trainscope", "reference", "difference", "verdict", "why"}},
                    {"rows", details}});
}

// The hardware suite: what the device reached per dtype and per kind of traffic, against its datasheet.
void hardware_tables(const json& report, json& tables) {
  json rows = json::array();
  auto pct = [](const json& v) { return v.is_number() ? format_fixed(100 * v.get<double>(), 1) + "%" : std::string("-"); };
  for (const auto& c : report["cells"]) {
    const json hw = value_at(c, {"metrics", "hardware"});
    if (!hw.is_object()) continue;
    for (const auto& g : hw.value("gemm", json::array())) {
      if (g.contains("skipped")) {
        rows.push_back({"GEMM " + g.value("dtype", "?"), "skipped", "-", "-", g.value("skipped", "")});
        continue;
      }
      rows.push_back({"GEMM " + g.value("dtype", "?"),
                      format_fixed(g.value("achievable_flops_per_s", 0.0) / 1e12, 2) + " TFLOPS",
                      text_or_dash(g.value("datasheet_flops_per_s", json()), [](double x) { return format_fixed(x / 1e12, 1) + " TFLOPS"; }),
                      pct(g.value("fraction_of_datasheet", json())), "best shape " + g.value("best_shape", json()).dump()});
    }
    if (hw.contains("memory")) {
      const json& m = hw["memory"];
      rows.push_back({"device memory copy", format_fixed(m.value("bandwidth_gbps", 0.0), 1) + " GB/s",
                      text_or_dash(m.value("datasheet_gbps", json()), [](double x) { return format_fixed(x, 0) + " GB/s"; }),
                      pct(m.value("fraction_of_datasheet", json())), m.value("method", "")});
    }
    if (hw.contains("collectives")) {
      // Per op, the largest size: where busbw approaches the link's bandwidth.
      for (const auto& [op, r] : largest_per_op(value_at(c, {"metrics", "comm", "collectives"})))
        rows.push_back({op + " (" + hw["collectives"].value("backend", "?") + ", " + std::to_string(hw["collectives"].value("world_size", 0)) + " ranks)",
                        "busbw " + format_fixed(r.value("busbw_gbps", 0.0), 2) + " GB/s", "-", "-",
                        "at " + format_bytes(r.value("bytes", 0.0)) + ", " + format_seconds(r.value("time_s", 0.0)) + " per call"});
      // Across hosts, each level on its own groups.
      const json levels = value_at(hw, {"collectives", "levels", "rows"});
      for (const std::string level : {"intra-node", "inter-node"}) {
        json mine = json::array();
        for (const auto& r : levels.is_array() ? levels : json::array())
          if (r.value("level", "") == level) mine.push_back(r);
        for (const auto& [op, r] : largest_per_op(mine))
          rows.push_back({op + " " + (level == "intra-node" ? "within a node" : "across nodes") + " (groups of " +
                              std::to_string(r.value("group_size", 0)) + ")",
                          "busbw " + format_fixed(r.value("busbw_gbps", 0.0), 3) + " GB/s", "-", "-",
                          "at " + format_bytes(r.value("bytes", 0.0)) + ", " + format_seconds(r.value("time_s", 0.0)) + " per call"});
      }
    }
    if (hw.contains("copy")) {
      const json& m = hw["copy"];
      if (m.contains("skipped")) rows.push_back({"host-device copy", "skipped", "-", "-", m.value("skipped", "")});
      else
        rows.push_back({"host-device copy",
                        format_fixed(m.value("host_to_device_gbps", 0.0), 1) + " / " + format_fixed(m.value("device_to_host_gbps", 0.0), 1) + " GB/s",
                        "-", "-", "host to device / device to host; " + m.value("method", "")});
    }
  }
  for (const auto& c : report["cells"]) {
    const json w = value_at(c, {"metrics", "timing", "throughput_over_run"});
    if (!w.is_object() || w.value("windows", json::array()).size() < 2 || !value_at(c, {"metrics", "hardware"}).is_null()) continue;
    if (report["suite"].value("name", "") != "hardware") continue;
    std::string per;
    for (const auto& x : w["windows"]) per += (per.empty() ? "" : ", ") + format_rate(x.value("samples_per_s", 0.0));
    rows.push_back({"sustained training " + c.value("name", ""), per + " samples/s per " + format_fixed(w.value("window_s", 0.0), 0) + " s",
                    "-", "-", "drop first to last window: " + pct(w.value("drop", json()))});
  }
  if (rows.empty()) return;
  tables.push_back({{"title", "Hardware: measured against the datasheet"},
                    {"columns", {"measured", "reached", "datasheet", "of datasheet", "how"}},
                    {"rows", rows}});
}

// The pitfalls suite: one table per pitfall, in the order the suite lists them.
void pitfall_tables(const json& report, json& tables) {
  const json list = report.contains("pitfalls") ? report["pitfalls"] : pitfalls_summary(report);
  if (!list.is_array()) return;
  int index = 0;
  for (const auto& p : list) {
    json rows = json::array();
    auto part = [&](const char* label, const json& items) {
      bool first = true;
      for (const auto& i : items) {
        const std::string text = i.is_object() ? "`" + i.value("cell", "?") + "` " + i.value("summary", "") : i.get<std::string>();
        rows.push_back({first ? label : "", text});
        first = false;
      }
    };
    part("done wrong", p["wrong"]);
    part("what the probes saw", p["saw"]);
    part("the fix", p["fix"]);
    part("its measured cost", p["cost"]);
    rows.push_back({"verdict", p.value("verdict", "")});
    const std::string state = p["reproduced"].is_boolean() ? (p["reproduced"].get<bool>() ? "reproduced" : "not reproduced")
                                                           : "not run";
    tables.push_back({{"section", kPitfallsSection},
                      {"title", std::to_string(++index) + ". " + p.value("title", p.value("id", "?")) + " (" + state + ")"},
                      {"columns", {"", "what was measured"}},
                      {"rows", rows}});
  }
}

// The self-supervised suite: encoders against their floors, label efficiency at equal compute, and
// the data-size axis.
constexpr const char* kSslSection = "Self-supervised pre-training";

// `trainscope plan --check DIR --into-report`: each cell's predicted memory (and step time, with a
// hardware report) beside what it measured.
void plan_tables(const json& report, json& tables) {
  if (!report.contains("plan_check")) return;
  auto bytes = [](const json& v) { return text_or_dash(v, [](double x) { return format_bytes(x); }); };
  // An error that rounds to zero is shown as 0.0%, not -0.0%.
  auto err = [](const json& v) { return text_or_dash(v, [](double x) { return format_signed_pct(std::fabs(x) < 5e-4 ? 0.0 : 100 * x, 1); }); };
  auto secs = [](const json& v) { return text_or_dash(v, [](double x) { return format_seconds(x); }); };
  json rows = json::array();
  for (const auto& c : report["cells"]) {
    if (!c.contains("plan")) continue;
    const json& p = c["plan"];
    if (p.contains("skipped")) {
      rows.push_back({c["name"], "not planned: " + p["skipped"].get<std::string>(), "-", "-", "-", "-", "-", "-", "-"});
      continue;
    }
    const json pred = p.value("predicted", json::object()), meas = p.value("measured", json::object());
    rows.push_back({c["name"], bytes(pred.value("model_state_total_bytes", json())), bytes(meas.value("model_state_total_bytes", json())),
                    bytes(pred.value("peak_bytes", json())), bytes(meas.value("peak_bytes", json())), err(p.value("peak_error", json())),
                    secs(pred.value("time", json::object()).value("step_s", json())), secs(meas.value("step_time_s", json())),
                    err(p.value("step_error", json()))});
  }
  if (rows.empty()) return;
  const json& hw = report["plan_check"].value("hardware", json());
  tables.push_back({{"section", kPlanSection},
                    {"title", std::string("Each cell predicted by `trainscope plan` from its configuration") +
                                  (hw.is_string() ? " and the hardware report " + hw.get<std::string>() : " (memory only: no hardware report)")},
                    {"columns", {"cell", "model state predicted", "measured", "peak predicted", "measured", "peak error",
                                 "step predicted", "measured", "step error"}},
                    {"rows", rows}});
}

void ssl_tables(const json& report, json& tables) {
  const json ssl = report.contains("ssl") ? report["ssl"] : ssl_summary(report);
  if (!ssl.is_object()) return;
  auto acc = [](const json& v) { return v.is_number() ? format_fixed(v.get<double>(), 3) : std::string("-"); };
  auto pair = [&](const json& a, const json& b) { return acc(a) + " / " + acc(b); };
  auto secs = [](const json& v) { return text_or_dash(v, [](double x) { return format_fixed(x, x >= 10 ? 0 : 1) + " s"; }); };
  auto pts = [](double d) { return (d >= 0 ? "+" : "-") + format_fixed(std::fabs(100 * d), 1); };
  auto pct = [](const json& f) {
    if (!f.is_number()) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g%%", 100 * f.get<double>());
    return std::string(buf);
  };
  auto count = [](const json& v) { return v.is_number() ? std::to_string(std::llround(v.get<double>())) : std::string("-"); };
  json rows = json::array();
  for (const auto& r : ssl.value("rows", json::array()))
    rows.push_back({r.value("cell", "?"), r.value("method", "?"), r.value("encoder", "?"), count(r["unlabeled_size"]),
                    acc(r["knn"]), acc(r["linear"]), acc(r["finetune_full"]),
                    pair(r["random_encoder_knn"], r["random_encoder_linear"]), pair(r["raw_pixels_knn"], r["raw_pixels_linear"]),
                    acc(r["supervised_accuracy"]),
                    r["beats_floors"].is_boolean() ? std::string(r["beats_floors"].get<bool>() ? "yes" : "no (" + r.value("floor", "?") + ")") : "-",
                    secs(r["pretrain_wall_s"]),
                    text_or_dash(r["images_per_s"], [](double x) { return format_rate(x); }),
                    text_or_dash(r["step_cost_vs_supervised"], [](double x) { return format_fixed(x, 2) + "x"; }),
                    r["health"].is_string() ? r["health"].get<std::string>() +
                                                  (r["collapse_step"].is_number() ? " at step " + count(r["collapse_step"]) : "")
                                            : "-"});
  if (!rows.empty())
    tables.push_back({{"section", kSslSection}, {"title", "Frozen encoders against their floors and the supervised sibling"},
                      {"columns", {"cell", "method", "encoder", "unlabeled", "kNN", "linear", "fine-tune (all labels)",
                                   "random-encoder kNN / linear", "raw-pixel kNN / linear", "supervised", "beats floors",
                                   "pre-train", "img/s", "step cost vs supervised", "health"}},
                      {"rows", rows}});
  json eff = json::array();
  for (const auto& e : ssl.value("label_efficiency", json::array())) {
    int probes = 0, tunes = 0;
    for (const auto& sd : e["seeds"]) probes += sd["ssl_path"] == "probe", tunes += sd["ssl_path"] == "finetune";
    const std::string path = probes && tunes ? "probe/fine-tune" : tunes ? "fine-tune" : probes ? "probe" : "-";
    std::string delta = "-";
    if (e["delta_mean"].is_number()) {
      delta = pts(e["delta_mean"].get<double>());
      if (e["delta_low"].is_number()) delta += " [" + pts(e["delta_low"].get<double>()) + ", " + pts(e["delta_high"].get<double>()) + "]";
      delta += " over " + std::to_string(e["n"].get<int64_t>());
    }
    const int flagged = e.value("scratch_outside_compute", 0);
    eff.push_back({e.value("cell", "?"), pct(e["fraction"]), count(e["labels"]), acc(e["ssl_accuracy_mean"]) + " (" + path + ")",
                   acc(e["scratch_accuracy_mean"]) + (flagged ? " (" + std::to_string(flagged) + " beyond the compute)" : ""),
                   delta, e["verdict"].is_string() ? e["verdict"].get<std::string>() : "-", secs(e["ssl_cost_s_mean"]),
                   e["label_equivalent"].is_object() ? e["label_equivalent"].value("text", "-") : "-"});
  }
  if (!eff.empty())
    tables.push_back({{"section", kSslSection}, {"title", "Label efficiency: pre-training against the best scratch run within the same compute"},
                      {"columns", {"cell", "fraction", "labels", "SSL accuracy (path)", "best scratch within that compute",
                                   "delta, points [95% CI] over seeds", "verdict", "SSL cost", "label-equivalent for scratch"}},
                      {"rows", eff}});
  json sizes = json::array();
  for (const auto& g : ssl.value("data_size", json::array()))
    for (const auto& r : g["rows"])
      sizes.push_back({g.value("method", "?") + " on " + g.value("encoder", "?"), r.value("cell", "?"), count(r["unlabeled_size"]),
                       acc(r["linear"]), acc(r["knn"]), acc(r["finetune"]) + (g["fraction"].is_number() ? " at " + pct(g["fraction"]) : ""),
                       secs(r["pretrain_wall_s"])});
  if (!sizes.empty())
    tables.push_back({{"section", kSslSection}, {"title", "Unlabeled data size"},
                      {"columns", {"method", "cell", "unlabeled images", "linear", "kNN", "fine-tune (fewest labels)", "pre-train"}},
                      {"rows", sizes}});
}

}  // namespace

json technique_tables(const json& report) {
  json tables = json::array();
  json precision = json::array(), checkpointing = json::array(), parallel = json::array();
  for (const auto& c : report["cells"]) {
    const std::string name = c["name"];
    if (c.contains("numerics")) {
      const json& n = c["numerics"];
      std::string speedup = "-";
      if (const json* base = fp32_sibling(report, c)) {
        const double b = number_at(*base, {"metrics", "timing", "step_time_s", "p50"});
        const double t = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
        if (b > 0 && t > 0) speedup = format_fixed(b / t, 2) + "x";
      }
      precision.push_back({name, c["config"].value("model", "?"), c["config"].value("precision", "?"), speedup,
                           text_or_dash(n.value("final_loss_rel_diff", json()), [](double x) { return format_fixed(100 * x, 2) + "%"; }),
                           text_or_dash(n.value("max_curve_rel_dev", json()), [](double x) { return format_fixed(100 * x, 1) + "%"; }),
                           n.value("verdict", "-")});
    }
    if (c.contains("checkpointing")) {
      const json& k = c["checkpointing"];
      checkpointing.push_back(
          {name, c["config"].value("checkpoint", "?"), std::to_string(c["config"].value("batch_size", 0)),
           text_or_dash(value_at(c, {"metrics", "memory", "peak_bytes"}), [](double x) { return format_bytes(x); }),
           text_or_dash(k.value("memory_saved_pct", json()), [](double x) { return format_fixed(x, 1) + "%"; }),
           text_or_dash(k.value("recompute_overhead_pct", json()), [](double x) { return format_signed_pct(x, 1); }),
           k.value("reference", "-")});
    }
    if (c.contains("parallel")) {
      const json& p = c["parallel"];
      parallel.push_back(
          {name, c["config"].value("parallel", "?"), std::to_string(c["config"].value("world_size", 1)),
           text_or_dash(value_at(c, {"metrics", "memory", "model_state_total_bytes"}), [](double x) { return format_bytes(x); }),
           text_or_dash(value_at(c, {"metrics", "memory", "expected_model_state_bytes"}), [](double x) { return format_bytes(x); }),
           value_at(c, {"metrics", "memory", "expected_model_state_formula"}).is_string()
               ? c["metrics"]["memory"]["expected_model_state_formula"].get<std::string>()
               : "-",
           text_or_dash(p.value("step_time_vs_single_pct", json()), [](double x) { return format_signed_pct(x); }),
           text_or_dash(p.value("exposed_comm_fraction", json()), [](double x) { return format_fixed(100 * x, 0) + "%"; }),
           text_or_dash(p.value("overlap", json()), [](double x) { return format_fixed(100 * x, 0) + "%"; })});
    }
  }
  if (!precision.empty())
    tables.push_back({{"title", "Precision x model: speed-up and numerics against 32-true"},
                      {"columns", {"cell", "model", "precision", "speed-up", "final loss diff", "max curve dev", "verdict"}},
                      {"rows", precision}});
  if (!checkpointing.empty())
    tables.push_back({{"title", "Checkpoint policy x batch: peak memory and recompute cost against none"},
                      {"columns", {"cell", "policy", "batch", "peak memory", "memory saved", "step time", "against"}},
                      {"rows", checkpointing}});
  if (!parallel.empty())
    tables.push_back({{"title", "Strategy x world size: model state per rank, measured and expected"},
                      {"columns", {"cell", "strategy", "ranks", "measured", "expected", "formula", "step vs one process",
                                   "exposed comm", "overlap"}},
                      {"rows", parallel}});
  if (report.contains("frontier") && report["frontier"].is_array() && !report["frontier"].empty()) {
    json rows = json::array();
    for (const auto& f : report["frontier"])
      rows.push_back({frontier_label(f), f.value("budget", "?"), std::to_string(f.value("largest_batch", 0)),
                      text_or_dash(f.value("samples_per_s", json()), [](double x) { return format_rate(x) + " samp/s"; }),
                      text_or_dash(f.value("peak_bytes", json()), [](double x) { return format_bytes(x); })});
    tables.push_back({{"title", "Frontier: the largest batch under the memory budget"},
                      {"columns", {"configuration", "budget", "largest batch", "throughput", "peak memory"}},
                      {"rows", rows}});
  }
  parity_tables(report, tables);
  hardware_tables(report, tables);
  ssl_tables(report, tables);
  pitfall_tables(report, tables);
  plan_tables(report, tables);
  return tables;
}

std::string render_markdown(const json& report) {
  std::ostringstream out;
  const json& env = report["env"];
  out << "# trainscope report: " << report["suite"].value("name", "?") << "\n\n";
  out << "Created " << report.value("created", "?") << " by trainscope " << report["trainscope"].value("version", "?")
      << " (" << report["trainscope"].value("commit", "?") << ") on " << md_escape(machine_line(env)) << ".\n\n";
  if (const std::string nodes = nodes_line(report); !nodes.empty()) out << "Ranks on " << md_escape(nodes) << ".\n\n";
  // The summary first: the decisions the run supports and what went wrong, each linked to its evidence.
  const json digest = report_digest(report);
  out << "## Summary\n\n";
  if (digest["decisions"].empty()) out << "No decision to make from this run's cells.\n";
  for (const auto& d : digest["decisions"])
    out << "- **" << d["topic"].get<std::string>() << "**: " << md_escape(d["text"].get<std::string>()) << " ([evidence](#"
        << d["anchor"].get<std::string>() << "))\n";
  out << "\n**What went wrong**";
  if (digest["problems"].empty())
    out << ": nothing; " << digest["cells_ok"].get<int>() << " cell(s) ok.\n";
  else {
    out << "\n\n";
    for (const auto& p : digest["problems"]) {
      out << "- " << p["severity"].get<std::string>() << ": " << md_escape(p["text"].get<std::string>());
      if (p["anchor"].is_string()) out << " ([details](#" << p["anchor"].get<std::string>() << "))";
      out << "\n";
    }
  }
  out << "\n## Cells\n\n";
  const json table = cell_table(report);
  md_table(out, table["columns"], table["rows"]);
  std::string section;
  for (const auto& t : technique_tables(report)) {
    // Tables of one section share its heading.
    if (t.contains("section")) {
      if (t["section"] != section) out << "\n## " << t["section"].get<std::string>() << "\n";
      section = t["section"];
      out << "\n### " << t["title"].get<std::string>() << "\n\n";
    } else {
      section.clear();
      out << "\n## " << t["title"].get<std::string>() << "\n\n";
    }
    md_table(out, t["columns"], t["rows"]);
  }
  // Recommendations said once per kind, two lines at most; the detail and the figures behind a fold.
  out << "\n## Recommendations\n\n";
  const json groups = recommendation_groups(report);
  if (groups.empty()) out << "None.\n";
  for (const auto& g : groups) {
    out << "<a id=\"" << g["anchor"].get<std::string>() << "\"></a>\n**" << g["severity"].get<std::string>() << "** "
        << md_escape(g["headline"].get<std::string>()) << "\n\n<details><summary>Evidence: " << md_escape(g["cells"].size() == 1 ? g["cells"][0].get<std::string>() : std::to_string(g["cells"].size()) + " cells")
        << "</summary>\n\n";
    for (const auto& item : g["items"]) {
      out << md_escape(item["text"].get<std::string>()) << "\n\n";
      const json rows = evidence_rows(item["evidence"]);
      if (!rows.empty()) {
        md_table(out, json{"figure", "value"}, rows);
        out << "\n";
      }
    }
    out << "</details>\n\n";
  }
  std::string unfinished;
  for (const auto& c : report["cells"]) {
    const std::string s = c["status"];
    if (s != "ok")
      unfinished += "- `" + c["name"].get<std::string>() + "`: " + s + (shown_as_expected(report, c) ? " (expected)" : "") + ": " +
                    md_escape(c.value("reason", "")) + "\n";
  }
  if (!unfinished.empty()) out << "\n## Cells that did not finish or were skipped\n\n" << unfinished;
  // The environment and the suite last: they are for whoever reproduces the run.
  out << "\n## Environment\n\n";
  out << "- host: " << env.value("host", "?") << "; CPU: " << value_text_plain(value_at(env, {"cpu", "model"})) << ", "
      << value_text_plain(value_at(env, {"cpu", "logical_cores"})) << " logical cores; memory "
      << text_or_dash(env.value("memory_bytes", json()), [](double x) { return format_bytes(x); }) << "\n";
  out << "- torch " << value_text_plain(value_at(env, {"torch", "version"})) << " (CPU kernels: "
      << value_text_plain(value_at(env, {"torch", "cpu_capability"})) << "); BLAS " << value_text_plain(value_at(env, {"blas", "name"})) << "\n";
  std::string gpus;
  for (const auto& g : env.value("gpus", json::array())) gpus += (gpus.empty() ? "" : ", ") + g.value("name", std::string("?"));
  out << "- GPUs: " << (gpus.empty() ? value_text_plain(value_at(env, {"cuda", "status"})) : gpus) << "\n";
  for (const auto& w : env.value("warnings", json::array())) out << "- warning: " << w.get<std::string>() << "\n";
  out << "\n## Suite\n\n" << report["suite"].value("description", "") << "\n\n";
  const json axes = report["suite"].value("axes", json::object());
  for (const auto& [key, values] : axes.items()) {
    std::string list;
    for (const auto& v : values) list += (list.empty() ? "" : ", ") + value_text_plain(v);
    out << "- axis `" << key << "`: " << list << "\n";
  }
  if (report["suite"].value("repeat", 1) > 1) out << "- each cell run " << report["suite"]["repeat"].get<int>() << " times\n";
  return out.str();
}

void write_renderings(const json& report, const std::string& dir) {
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name, tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary);
      f << text;
      if (!f) throw std::runtime_error("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot write " + path);
  };
  write("report.md", render_markdown(report));
  write("report.html", render_html(report));
}

}  // namespace trainscope::reports
