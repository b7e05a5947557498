#pragma once
// Renderers for people, from report.json alone: report.md (a pull request, a wiki page) and
// report.html (one self-contained page with plots, no network needed). Both carry the same content:
// environment, suite, cell table, the technique tables, the frontier, recommendations with their
// evidence, and the cells that did not finish.
#include <string>

#include "core/config.hpp"

namespace trainscope::reports {

std::string render_markdown(const json& report);

// Chart.js is read from `chartjs_path` (Debian's libjs-chart.js) and inlined; without it the page
// has the tables and says why the plots are missing.
inline constexpr const char* kChartJsPath = "/usr/share/javascript/chart.js/chart.min.js";
std::string render_html(const json& report, const std::string& chartjs_path = kChartJsPath);

// Writes DIR/report.md and DIR/report.html (atomically, like report.json).
void write_renderings(const json& report, const std::string& dir);

// What a reader needs first (reports/render/digest.cpp): {"machine": one line, "nodes": one line where the
// ranks spanned hosts, "decisions": [{"topic",
// "text", "anchor"}], "problems": [{"severity", "text", "anchor"}], "cells_ok", "cells_other"}.
json report_digest(const json& report);
// The machine in one line: CPU and cores, memory, GPUs, torch and CUDA.
std::string machine_line(const json& env);
// Where the ranks ran when they spanned hosts ("2 nodes (torchrun): node0 (ranks 0, 1), node1 (ranks
// 2, 3)"); empty for a run on one host.
std::string nodes_line(const json& report);
// Recommendations with the same id and severity as one group: {"id", "severity", "topic", "anchor",
// "headline" (at most two lines), "cells", "items": [{"text", "evidence", "cells"}]}, worst first.
json recommendation_groups(const json& report);
// A recommendation's evidence for people: [[what, value with its unit], ...].
json evidence_rows(const json& evidence);
// The anchor GitHub gives a heading (lowercase; letters, digits, spaces and hyphens kept; spaces to
// hyphens); report.html gives its headings the same ids, so one link works in both.
std::string heading_anchor(const std::string& title);
inline constexpr const char* kPitfallsSection = "Pitfalls: classic mistakes reproduced and diagnosed";
inline constexpr const char* kPlanSection = "Plan against measurement";
// A sentence without its parenthetical detail, at most about 200 characters.
std::string short_text(const std::string& text);

// The terminal summary's table as data: {"columns": [...], "rows": [[...], ...]} (strings).
json cell_table(const json& report);

// The rows of the technique tables, shared by both renderers: {"title", "columns": [...], "rows":
// [[...]]} (and "section" where several tables share one heading), one per technique present in the report (precision, checkpointing, parallel, frontier,
// parity, hardware, and the self-supervised tables: encoders, label efficiency, data size).
json technique_tables(const json& report);

}  // namespace trainscope::reports
