// The terminal summary: one row per cell, read from the report JSON alone.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "core/units.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {
namespace {

std::string pad(const std::string& s, size_t w, bool right = false) {
  if (s.size() >= w) return s;
  return right ? std::string(w - s.size(), ' ') + s : s + std::string(w - s.size(), ' ');
}

}  // namespace

json cell_table(const json& report) {
  const std::vector<std::string> head = {"cell", "status", "step p50", "throughput", "peak mem",
                                         "final loss", "accuracy", "vs 32-true"};
  json rows = json::array();
  for (const auto& c : report["cells"]) {
    std::vector<std::string> r(head.size(), "-");
    r[0] = c["name"].get<std::string>();
    r[1] = c["status"].get<std::string>() + (shown_as_expected(report, c) ? " (expected)" : "");
    const double p50 = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
    if (p50 > 0) r[2] = format_seconds(p50);
    const double tok = number_at(c, {"metrics", "timing", "tokens_per_s"});
    const double smp = number_at(c, {"metrics", "timing", "samples_per_s"});
    if (tok > 0) r[3] = format_rate(tok) + " tok/s";
    else if (smp > 0) r[3] = format_rate(smp) + " samp/s";
    const double mem = number_at(c, {"metrics", "memory", "peak_bytes"});
    if (mem >= 0) r[4] = format_bytes(mem);
    const double loss = number_at(c, {"metrics", "quality", "final_loss"});
    if (std::isfinite(loss)) r[5] = format_fixed(loss, 4);
    const double acc = number_at(c, {"metrics", "quality", "accuracy"});
    if (acc >= 0) r[6] = format_fixed(100 * acc, 1) + "%";
    if (const json* base = fp32_sibling(report, c)) {
      const double b50 = number_at(*base, {"metrics", "timing", "step_time_s", "p50"});
      if (b50 > 0 && p50 > 0) r[7] = format_fixed(b50 / p50, 2) + "x";
    }
    rows.push_back(r);
  }
  return json{{"columns", head}, {"rows", rows}};
}

namespace {

// What a reader needs first: the machine, the decisions, what went wrong.
void digest_section(std::ostream& out, const json& report) {
  const json digest = report_digest(report);
  out << "machine: " << digest["machine"].get<std::string>() << "\n";
  if (digest.contains("nodes")) out << "nodes: " << digest["nodes"].get<std::string>() << "\n";
  if (!digest["decisions"].empty()) out << "decisions:\n";
  for (const auto& d : digest["decisions"]) out << "  " << d["topic"].get<std::string>() << ": " << d["text"].get<std::string>() << "\n";
  if (digest["problems"].empty()) out << "what went wrong: nothing\n";
  else out << "what went wrong:\n";
  for (const auto& p : digest["problems"]) out << "  [" << p["severity"].get<std::string>() << "] " << p["text"].get<std::string>() << "\n";
  out << "\n";
}

// The cells' table, its columns as wide as their widest entry.
void table_section(std::ostream& out, const json& report) {
  const json table = cell_table(report);
  const std::vector<std::string> head = table["columns"];
  const std::vector<std::vector<std::string>> rows = table["rows"];
  std::vector<size_t> w(head.size());
  for (size_t i = 0; i < head.size(); ++i) {
    w[i] = head[i].size();
    for (const auto& r : rows) w[i] = std::max(w[i], r[i].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    for (size_t i = 0; i < r.size(); ++i) out << (i ? "  " : "") << pad(r[i], w[i], i >= 2);
    out << "\n";
  };
  line(head);
  std::vector<std::string> rule;
  for (size_t x : w) rule.push_back(std::string(x, '-'));
  line(rule);
  for (const auto& r : rows) line(r);
}

// Under the table: emulated cells, each failed or skipped cell's reason, the memory frontier, what
// checkpointing saved and cost, and the cells a time budget stopped early (fewer steps, so their
// accuracy is not comparable).
void cell_notes(std::ostream& out, const json& report) {
  std::string emulated;
  for (const auto& c : report["cells"])
    if (c.value("emulated", false)) emulated += (emulated.empty() ? "" : ", ") + c["name"].get<std::string>();
  if (!emulated.empty())
    out << "  emulated (fp16 rounded in software on this device: fp16's numerics, not its speed): " << emulated << "\n";
  for (const auto& c : report["cells"])
    if (c.contains("reason") && c["reason"].is_string() && !c["reason"].get<std::string>().empty())
      out << "  " << c["name"].get<std::string>() << ": " << c["status"].get<std::string>() << ": "
          << c["reason"].get<std::string>() << "\n";
  if (report.contains("frontier") && report["frontier"].is_array() && !report["frontier"].empty()) {
    out << "\nfrontier (largest batch under the budget):\n";
    for (const auto& f : report["frontier"]) {
      out << "  " << pad(frontier_label(f), 36)
          << "  batch " << pad(std::to_string(f["largest_batch"].get<int64_t>()), 6, true);
      if (f["samples_per_s"].is_number()) out << "  " << format_rate(f["samples_per_s"].get<double>()) << " samp/s";
      if (f["peak_bytes"].is_number()) out << "  peak " << format_bytes(f["peak_bytes"].get<double>());
      out << "  under " << f["budget"].get<std::string>();
      if (f.contains("error")) out << "  (" << f["error"].get<std::string>() << ")";
      out << "\n";
    }
  }
  for (const auto& c : report["cells"])
    if (c.contains("checkpointing") && c["checkpointing"]["memory_saved_pct"].is_number())
      out << "  " << c["name"].get<std::string>() << ": peak memory "
          << format_signed_pct(-c["checkpointing"]["memory_saved_pct"].get<double>(), 1) << ", activations "
          << (c["checkpointing"]["activation_saved_pct"].is_number()
                  ? format_signed_pct(-c["checkpointing"]["activation_saved_pct"].get<double>(), 1)
                  : std::string("-"))
          << ", step time "
          << format_signed_pct(c["checkpointing"]["recompute_overhead_pct"].get<double>(), 1) << " against "
          << c["checkpointing"]["reference"].get<std::string>() << "\n";
  for (const auto& c : report["cells"])
    if (c.contains("time_budget") && c["time_budget"].value("stopped_early", false))
      out << "  " << c["name"].get<std::string>() << ": the " << format_fixed(c["time_budget"]["budget_s"].get<double>(), 0)
          << " s time budget stopped it after " << c["time_budget"]["steps_run"].get<int64_t>() << " of "
          << c["time_budget"]["steps_planned"].get<int64_t>() << " steps; its numerics are compared at that step\n";
}

// Parallel cells, per rank, against one process at the same per-rank batch.
void parallel_section(std::ostream& out, const json& report) {
  bool parallel_head = false;
  for (const auto& c : report["cells"]) {
    if (!c.contains("parallel")) continue;
    if (!parallel_head) out << "\nparallel (per rank; against one process at the same per-rank batch):\n";
    parallel_head = true;
    const json& p = c["parallel"];
    const json& mem = c["metrics"]["memory"];
    out << "  " << pad(c["name"].get<std::string>(), 28);
    if (p["step_time_vs_single_pct"].is_number())
      out << "  step " << pad(format_signed_pct(p["step_time_vs_single_pct"].get<double>()), 5, true);
    if (p["model_state_bytes"].is_number())
      out << "  model state " << format_bytes(p["model_state_bytes"].get<double>()) << " (expected "
          << format_bytes(mem.value("expected_model_state_bytes", 0.0)) << " = "
          << mem.value("expected_model_state_formula", std::string("?")) << ")";
    const double comm = number_at(c, {"metrics", "comm", "comm_time_s"});
    if (std::isfinite(comm)) out << "  comm " << format_seconds(comm) << "/step";
    if (p["exposed_comm_fraction"].is_number())
      out << ", exposed " << format_fixed(100 * p["exposed_comm_fraction"].get<double>(), 0) << "% of step";
    if (p["overlap"].is_number()) out << ", overlap " << format_fixed(100 * p["overlap"].get<double>(), 0) << "%";
    if (p["rng_violations"].is_number()) out << "  rng violations " << p["rng_violations"].get<int64_t>();
    if (c.contains("slowest_rank") && c["slowest_rank"].is_number())
      out << "  slowest rank " << c["slowest_rank"].get<int64_t>();
    out << "\n";
  }
}

// Collectives cells: each op's busbw at its largest size, and per level where the cell measured levels
// (the GEMM and memory figures are in the recommendations).
void collectives_section(std::ostream& out, const json& report) {
  for (const auto& c : report["cells"]) {
    const json rows = value_at(c, {"metrics", "comm", "collectives"});
    if (!value_at(c, {"metrics", "hardware", "collectives"}).is_object() || !rows.is_array()) continue;
    out << "\ncollectives (" << c["metrics"]["hardware"]["collectives"].value("backend", "?") << ", "
        << c["metrics"]["hardware"]["collectives"].value("world_size", 0) << " ranks), at the largest size:\n";
    for (const auto& [op, r] : largest_per_op(rows))
      out << "  " << pad(op, 15) << " " << format_bytes(r.value("bytes", 0.0)) << "  busbw "
          << format_fixed(r.value("busbw_gbps", 0.0), 2) << " GB/s  algbw " << format_fixed(r.value("algbw_gbps", 0.0), 2)
          << " GB/s  " << format_seconds(r.value("time_s", 0.0)) << " per call\n";
    const json levels = value_at(c, {"metrics", "hardware", "collectives", "levels", "rows"});
    for (const std::string level : {"intra-node", "inter-node"}) {
      json mine = json::array();
      for (const auto& r : levels.is_array() ? levels : json::array())
        if (r.value("level", "") == level) mine.push_back(r);
      for (const auto& [op, r] : largest_per_op(mine))
        out << "  " << pad(op, 15) << " " << (level == "intra-node" ? "within a node" : "across nodes ") << " (groups of "
            << r.value("group_size", 0) << ") " << format_bytes(r.value("bytes", 0.0)) << "  busbw "
            << format_fixed(r.value("busbw_gbps", 0.0), 3) << " GB/s  " << format_seconds(r.value("time_s", 0.0)) << " per call\n";
    }
  }
}

// Self-supervised cells: the frozen encoder beside its floors and sibling, then what pre-training
// bought per label fraction against scratch at equal compute.
void ssl_section(std::ostream& out, const json& report) {
  const json ssl = report.contains("ssl") ? report["ssl"] : ssl_summary(report);
  if (!ssl.is_object()) return;
  auto acc = [](const json& v) { return v.is_number() ? format_fixed(v.get<double>(), 3) : std::string("-"); };
  auto pts = [](const json& v) {
    return v.is_number() ? (v.get<double>() >= 0 ? "+" : "-") + format_fixed(std::fabs(100 * v.get<double>()), 1) : std::string("-");
  };
  out << "\nself-supervised (frozen encoder kNN / linear; floors: random-encoder / raw-pixel linear):\n";
  for (const auto& r : ssl["rows"]) {
    out << "  " << pad(r["cell"].get<std::string>(), 28) << "  " << acc(r["knn"]) << " / " << acc(r["linear"])
        << "  floors " << acc(r["random_encoder_linear"]) << " / " << acc(r["raw_pixels_linear"]);
    if (r["finetune_full"].is_number()) out << "  fine-tune " << acc(r["finetune_full"]);
    if (r["supervised_accuracy"].is_number()) out << "  supervised " << acc(r["supervised_accuracy"]);
    if (r["health"].is_string()) out << "  " << r["health"].get<std::string>();
    out << "\n";
  }
  std::string cell, line;
  auto flush = [&] {
    if (!line.empty()) out << "  " << pad(cell, 28) << "  " << line << "\n";
    line.clear();
  };
  for (const auto& e : ssl["label_efficiency"]) {
    if (!e["verdict"].is_string()) continue;
    if (e["cell"] != cell) flush(), cell = e["cell"];
    char f[32];
    std::snprintf(f, sizeof f, "%g%%", 100 * e["fraction"].get<double>());
    line += (line.empty() ? "vs scratch: " : "; ") + std::string(f) + " " + e["verdict"].get<std::string>() + " (" +
            pts(e["delta_mean"]) + " [" + pts(e["delta_low"]) + ", " + pts(e["delta_high"]) + "] points)";
  }
  flush();
}

// The recommendations in full (the summary above has their short form), one per kind: a kind said of
// many cells once, with the cells.
void recommendations_section(std::ostream& out, const json& report) {
  const json groups = recommendation_groups(report);
  if (!groups.empty()) out << "\nrecommendations (in full: report.md, report.html):\n";
  for (const auto& g : groups) {
    out << "  [" << g["severity"].get<std::string>() << "] " << g["items"][0]["text"].get<std::string>() << "\n";
    if (g["items"].size() > 1) out << "      and " << g["items"].size() - 1 << " more like it: " << g["cells"].size() << " cells\n";
  }
}

}  // namespace

// The digest first, then the table and what a reader needs beside it, each kind of cell's section, and
// the recommendations.
std::string render_summary(const json& report) {
  std::ostringstream out;
  digest_section(out, report);
  table_section(out, report);
  cell_notes(out, report);
  parallel_section(out, report);
  collectives_section(out, report);
  ssl_section(out, report);
  recommendations_section(out, report);
  return out.str();
}

}  // namespace trainscope::reports
