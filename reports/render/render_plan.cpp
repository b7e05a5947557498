#include "reports/render/render_plan.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/units.hpp"
#include "reports/render/html.hpp"

namespace trainscope::reports {

namespace {

// GB (1e9 bytes, as device memory is sold) without the unit, for table cells.
std::string gb(double bytes) { return format_fixed(bytes / 1e9, 1); }
std::string pct(const json& v) {
  if (!v.is_number()) return "-";
  char b[16];
  std::snprintf(b, sizeof b, "%.1f%%", 100 * v.get<double>());
  return b;
}

struct Row {
  std::string cells[9];
};

std::vector<Row> top_rows(const json& plan, size_t n) {
  std::vector<Row> rows;
  for (const auto& c : plan["candidates"]) {
    if (!c["fits"].get<bool>() || rows.size() >= n) break;
    Row r;
    r.cells[0] = c["precision"];
    r.cells[1] = c["label"];
    r.cells[2] = c["checkpoint"];
    r.cells[3] = c["attention"];
    r.cells[4] = std::to_string(c["micro_batch"].get<int64_t>()) + " x " + std::to_string(c["accumulation"].get<int64_t>());
    r.cells[5] = gb(c["memory"]["peak_bytes"].get<double>());
    r.cells[6] = format_rate(c["tokens_per_s_per_gpu"].get<double>());
    r.cells[7] = pct(c.value("mfu", json()));
    r.cells[8] = format_seconds(c["time"]["step_s"].get<double>()) + " (" + c["time"]["bound"].get<std::string>() + ")";
    rows.push_back(r);
  }
  return rows;
}

const char* kHeads[9] = {"precision", "parallel", "checkpoint", "attention", "micro x accum", "peak GB/GPU", "tokens/s/GPU", "MFU", "step"};

std::string header_line(const json& plan) {
  const json& q = plan["request"];
  char line[512];
  std::snprintf(line, sizeof line, "%s (%s parameters, seq %lld) on %lld x %s (%lld per node, %lld node%s), global batch %s tokens",
                q["model_name"].get<std::string>().c_str(), with_thousands(q["parameters"].get<int64_t>()).c_str(),
                static_cast<long long>(q["seq_len"].get<int64_t>()), static_cast<long long>(q["cluster"]["ranks"].get<int64_t>()),
                q["device"].get<std::string>().c_str(), static_cast<long long>(q["cluster"]["gpus_per_node"].get<int64_t>()),
                static_cast<long long>(q["cluster"]["nodes"].get<int64_t>()), q["cluster"]["nodes"].get<int64_t>() > 1 ? "s" : "",
                with_thousands(q["global_batch_tokens"].get<int64_t>()).c_str());
  return line;
}

}  // namespace

std::string render_plan_text(const json& plan, size_t n) {
  std::ostringstream out;
  out << "plan: " << header_line(plan) << "\n";
  out << "device: " << plan["device"]["source"].get<std::string>() << "; " << gb(plan["request"]["usable_bytes"].get<double>())
      << " GB usable per GPU; MFU on the " << plan["flops"]["convention"].get<std::string>() << " FLOP convention ("
      << format_fixed(plan["flops"]["per_token"].get<double>() / 1e9, 2) << " GFLOP/token)\n";
  out << "searched " << plan["searched"] << " configurations in " << format_seconds(plan["search_seconds"].get<double>()) << ": "
      << plan["fit"] << " fit\n\n";
  const auto rows = top_rows(plan, n);
  if (!rows.empty()) {
    char line[400];
    std::snprintf(line, sizeof line, "%-11s %-12s %-12s %-9s %-14s %11s %12s %6s  %s\n", kHeads[0], kHeads[1], kHeads[2], kHeads[3],
                  kHeads[4], kHeads[5], kHeads[6], kHeads[7], kHeads[8]);
    out << line;
    for (const auto& r : rows) {
      std::snprintf(line, sizeof line, "%-11s %-12s %-12s %-9s %-14s %11s %12s %6s  %s\n", r.cells[0].c_str(), r.cells[1].c_str(),
                    r.cells[2].c_str(), r.cells[3].c_str(), r.cells[4].c_str(), r.cells[5].c_str(), r.cells[6].c_str(),
                    r.cells[7].c_str(), r.cells[8].c_str());
      out << line;
    }
    out << "\n";
  }
  for (const auto& rj : plan["rejected"])
    out << "does not fit: " << rj["precision"].get<std::string>() << " " << rj["parallel"].get<std::string>() << ": "
        << rj["reason"].get<std::string>() << "\n";
  out << "\nrecommendation: " << plan["recommendation"]["text"].get<std::string>() << "\n";
  for (const auto& w : plan["recommendation"]["reasoning"]) out << "  - " << w.get<std::string>() << "\n";
  return out.str();
}

std::string render_plan_markdown(const json& plan, size_t n) {
  std::ostringstream out;
  out << "# Plan: " << header_line(plan) << "\n\n";
  out << "**Recommendation.** " << plan["recommendation"]["text"].get<std::string>() << "\n\n";
  for (const auto& w : plan["recommendation"]["reasoning"]) out << "- " << w.get<std::string>() << "\n";
  out << "\nSearched " << plan["searched"] << " configurations, " << plan["fit"] << " fit in "
      << gb(plan["request"]["usable_bytes"].get<double>()) << " GB usable per GPU. Device figures: "
      << plan["device"]["source"].get<std::string>() << ". MFU on the " << plan["flops"]["convention"].get<std::string>()
      << " FLOP convention.\n\n";
  const auto rows = top_rows(plan, n);
  if (!rows.empty()) {
    out << "|";
    for (const char* h : kHeads) out << " " << h << " |";
    out << "\n|";
    for (int i = 0; i < 9; ++i) out << " --- |";
    out << "\n";
    for (const auto& r : rows) {
      out << "|";
      for (const auto& c : r.cells) out << " " << c << " |";
      out << "\n";
    }
  }
  if (!plan["rejected"].empty()) {
    out << "\n**Does not fit.**\n\n";
    for (const auto& rj : plan["rejected"])
      out << "- " << rj["precision"].get<std::string>() << " " << rj["parallel"].get<std::string>() << ": "
          << rj["reason"].get<std::string>() << "\n";
  }
  return out.str();
}

std::string render_plan_html(const json& plan, const std::string& chartjs_path) {
  std::string chartjs;
  {
    std::ifstream f(chartjs_path, std::ios::binary);
    if (f) chartjs.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  // Memory per configuration (the fastest that fit, and the smallest of each that does not) as stacked
  // bars: parameters, gradients, optimizer state, activations, the transient at the peak; the usable
  // memory as a line.
  json labels = json::array(), params = json::array(), grads = json::array(), opt = json::array(), acts = json::array(),
       rest = json::array(), limit = json::array(), tput = json::array();
  size_t shown = 0;
  for (const auto& c : plan["candidates"]) {
    if (!c.contains("memory") || shown >= 16) continue;
    const json& m = c["memory"];
    labels.push_back(c["precision"].get<std::string>() + " " + c["label"].get<std::string>() + " " + c["checkpoint"].get<std::string>() +
                     " mb" + std::to_string(c["micro_batch"].get<int64_t>()) + (c["fits"].get<bool>() ? "" : " (no fit)"));
    params.push_back(m["model_state_bytes"]["params"].get<double>() / 1e9);
    grads.push_back(m["model_state_bytes"]["grads"].get<double>() / 1e9);
    opt.push_back(m["model_state_bytes"]["optimizer"].get<double>() / 1e9);
    acts.push_back(m["activation_bytes"].get<double>() / 1e9);
    rest.push_back(m["peak_transient_bytes"].get<double>() / 1e9);
    limit.push_back(plan["request"]["usable_bytes"].get<double>() / 1e9);
    tput.push_back(c.value("tokens_per_s_per_gpu", 0.0));
    ++shown;
  }
  json memory_chart = chart("plan-memory", "Memory per GPU (GB) by configuration, against the usable memory", "bar",
                            {{"labels", labels},
                             {"datasets", {{{"label", "parameters"}, {"data", params}, {"stack", "m"}},
                                           {{"label", "gradients"}, {"data", grads}, {"stack", "m"}},
                                           {{"label", "optimizer state"}, {"data", opt}, {"stack", "m"}},
                                           {{"label", "activations"}, {"data", acts}, {"stack", "m"}},
                                           {{"label", "transient at the peak"}, {"data", rest}, {"stack", "m"}},
                                           {{"label", "usable"}, {"data", limit}, {"type", "line"}, {"pointRadius", 0}}}}},
                            {{"scales", {{"x", {{"stacked", true}, {"title", {{"display", true}, {"text", "configuration"}}}}},
                                         {"y", {{"stacked", true}, {"title", {{"display", true}, {"text", "GB per GPU"}}}}}}}});
  json tput_chart = chart("plan-throughput", "Predicted tokens/s per GPU", "bar",
                          {{"labels", labels}, {"datasets", {{{"label", "tokens/s per GPU"}, {"data", tput}}}}},
                          {{"scales", {{"y", {{"title", {{"display", true}, {"text", "tokens/s per GPU"}}}}}}}});
  const json charts = json::array({memory_chart, tput_chart});
  std::ostringstream out;
  out << page_head("trainscope plan: " + plan["request"]["model_name"].get<std::string>(), chartjs.empty() ? 0 : charts.size());
  out << "<h1>Plan: " << esc(header_line(plan)) << "</h1>\n";
  out << "<p><b>Recommendation.</b> " << esc(plan["recommendation"]["text"].get<std::string>()) << "</p><ul>";
  for (const auto& w : plan["recommendation"]["reasoning"]) out << "<li>" << esc(w.get<std::string>()) << "</li>";
  out << "</ul>\n";
  const auto rows = top_rows(plan, 20);
  out << "<table><tr>";
  for (const char* h : kHeads) out << "<th>" << esc(h) << "</th>";
  out << "</tr>\n";
  for (const auto& r : rows) {
    out << "<tr>";
    for (const auto& c : r.cells) out << "<td>" << esc(c) << "</td>";
    out << "</tr>\n";
  }
  out << "</table>\n";
  out << chart_scripts(charts, chartjs, chartjs_path);
  out << "<details><summary>The plan as JSON</summary><pre>" << esc(plan.dump(1)) << "</pre></details>\n";
  out << "</body></html>\n";
  return out.str();
}

}  // namespace trainscope::reports
