// report.html: one self-contained page (tables, plots with Chart.js inlined from Debian's
// libjs-chart.js, no network: a Content-Security-Policy forbids every fetch). The chart data are
// computed here from the report; the page only draws them.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/units.hpp"
#include "reports/render/html.hpp"
#include "reports/render/render.hpp"
#include "reports/report.hpp"

namespace trainscope::reports {

json chart(const std::string& id, const std::string& title, const std::string& type, json data, json options) {
  // Chart.js 3 draws every dataset grey unless told: a colour-blind-safe palette (Okabe-Ito).
  static const char* palette[] = {"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"};
  for (size_t i = 0; i < data["datasets"].size(); ++i) {
    json& d = data["datasets"][i];
    if (!d.contains("borderColor")) d["borderColor"] = palette[i % 8];
    if (!d.contains("backgroundColor")) d["backgroundColor"] = palette[i % 8];
  }
  options["animation"] = false;
  options["responsive"] = true;
  options["plugins"]["title"] = {{"display", true}, {"text", title}};
  json spec = {{"id", id}, {"title", title}};
  // Bars along named cells run sideways, one row per cell, so that long cell names stay readable at
  // a laptop's width: the chart is as tall as its rows need.
  if (type == "bar" && options.value("indexAxis", "") == "y" && data.contains("labels")) {
    options["maintainAspectRatio"] = false;
    spec["height"] = 90 + 26 * data["labels"].size() * std::max<size_t>(1, std::min<size_t>(data["datasets"].size(), 4)) / 2;
  }
  spec["config"] = {{"type", type}, {"data", data}, {"options", options}};
  return spec;
}

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string script_json(const json& j) {
  std::string s = j.dump();
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<' && i + 1 < s.size() && s[i + 1] == '/') out += "<\\/", ++i;
    else out += s[i];
  }
  return out;
}

namespace {

void html_table(std::ostringstream& out, const json& columns, const json& rows) {
  out << "<table><tr>";
  for (const auto& c : columns) out << "<th>" << esc(c.get<std::string>()) << "</th>";
  out << "</tr>\n";
  for (const auto& r : rows) {
    out << "<tr>";
    for (const auto& v : r) out << "<td>" << esc(v.is_string() ? v.get<std::string>() : v.dump()) << "</td>";
    out << "</tr>\n";
  }
  out << "</table>\n";
}

json points(const json& pairs) {
  json p = json::array();
  for (const auto& xy : pairs)
    if (xy.is_array() && xy.size() == 2 && xy[0].is_number() && xy[1].is_number()) p.push_back({{"x", xy[0]}, {"y", xy[1]}});
  return p;
}

// Chart.js scales with titled axes: x and y titles (empty: none).
json axes(const std::string& x, const std::string& y, json x_extra = json::object(), json y_extra = json::object()) {
  if (!x.empty()) x_extra["title"] = {{"display", true}, {"text", x}};
  if (!y.empty()) y_extra["title"] = {{"display", true}, {"text", y}};
  return {{"x", x_extra}, {"y", y_extra}};
}

// Loss curves, overlaid per model (the configuration group the precision and policy axes vary).
void loss_charts(json& charts, const json& report) {
  const json& cells = report["cells"];
  std::map<std::string, json> by_model;
  for (const auto& c : cells) {
    const json curve = points(value_at(c, {"metrics", "quality", "loss_curve"}));
    if (curve.empty()) continue;
    by_model[c["config"].value("model", "?")].push_back({{"label", c["name"]}, {"data", curve}, {"pointRadius", 0}});
  }
  for (const auto& [model, datasets] : by_model)
    charts.push_back(chart("loss-" + model, "Loss curves: " + model, "line", {{"datasets", datasets}},
                           {{"scales", {{"x", {{"type", "linear"}, {"title", {{"display", true}, {"text", "step"}}}}},
                                        {"y", {{"title", {{"display", true}, {"text", "loss"}}}}}}}}));
}

// Loss-scale trajectory, the back-offs (skipped steps) marked.
void loss_scale_charts(json& charts, const json& report) {
  const json& cells = report["cells"];
  for (const auto& c : cells) {
    const json traj = value_at(c, {"metrics", "overflow", "scale_trajectory"});
    if (!traj.is_array() || traj.empty()) continue;
    json scale = points(traj), backoffs = json::array();
    for (size_t i = 1; i < traj.size(); ++i)
      if (traj[i][1].get<double>() < traj[i - 1][1].get<double>())
        backoffs.push_back({{"x", traj[i][0].get<int64_t>() - 1}, {"y", traj[i - 1][1]}});
    const int64_t steps = value_at(c, {"metrics", "overflow", "steps"}).is_number() ? c["metrics"]["overflow"]["steps"].get<int64_t>() : 0;
    if (steps > 0 && !scale.empty()) scale.push_back({{"x", steps - 1}, {"y", scale.back()["y"]}});
    charts.push_back(chart("scale-" + c["name"].get<std::string>(), "Loss scale: " + c["name"].get<std::string>(), "line",
                           {{"datasets", {{{"label", "scale"}, {"data", scale}, {"stepped", true}, {"pointRadius", 0}},
                                          {{"label", "skipped step (back-off)"}, {"data", backoffs}, {"showLine", false},
                                           {"pointStyle", "crossRot"}, {"pointRadius", 6}}}}},
                           {{"scales", axes("step", "loss scale (log)", {{"type", "linear"}}, {{"type", "logarithmic"}})}}));
  }
}

// Step-time distribution per cell: p50 / p90 / p99 (and min), in milliseconds.
void step_time_chart(json& charts, const json& report) {
  const json& cells = report["cells"];
  json labels = json::array(), p50 = json::array(), p90 = json::array(), p99 = json::array(), mn = json::array();
  for (const auto& c : cells) {
    const double m = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
    if (!(m > 0)) continue;
    labels.push_back(c["name"]);
    mn.push_back(1e3 * number_at(c, {"metrics", "timing", "step_time_s", "min"}));
    p50.push_back(1e3 * m);
    p90.push_back(1e3 * number_at(c, {"metrics", "timing", "step_time_s", "p90"}));
    p99.push_back(1e3 * number_at(c, {"metrics", "timing", "step_time_s", "p99"}));
  }
  if (!labels.empty())
    charts.push_back(chart("step-times", "Step time per cell (ms): min, p50, p90, p99", "bar",
                           {{"labels", labels},
                            {"datasets", {{{"label", "min"}, {"data", mn}}, {{"label", "p50"}, {"data", p50}},
                                          {{"label", "p90"}, {"data", p90}}, {{"label", "p99"}, {"data", p99}}}}},
                           {{"indexAxis", "y"}, {"scales", axes("step time (ms)", "")}}));
}

// Memory per phase, with the model state measured beside the analytic expectation (MiB).
void memory_chart(json& charts, const json& report) {
  const json& cells = report["cells"];
  json ml = json::array(), fwd = json::array(), bwd = json::array(), opt = json::array(), state = json::array(),
       expected = json::array();
  for (const auto& c : cells) {
    if (!value_at(c, {"metrics", "memory", "phase_peak_bytes"}).is_object()) continue;
    const double mib = 1024.0 * 1024.0;
    ml.push_back(c["name"]);
    fwd.push_back(number_at(c, {"metrics", "memory", "phase_peak_bytes", "forward"}) / mib);
    bwd.push_back(number_at(c, {"metrics", "memory", "phase_peak_bytes", "backward"}) / mib);
    opt.push_back(number_at(c, {"metrics", "memory", "phase_peak_bytes", "optimizer"}) / mib);
    const double s = number_at(c, {"metrics", "memory", "model_state_total_bytes"});
    const double e = number_at(c, {"metrics", "memory", "expected_model_state_bytes"});
    state.push_back(std::isfinite(s) ? json(s / mib) : json(nullptr));
    expected.push_back(std::isfinite(e) ? json(e / mib) : json(nullptr));
  }
  if (!ml.empty())
    charts.push_back(chart("memory", "Memory per phase and model state (MiB)", "bar",
                           {{"labels", ml},
                            {"datasets", {{{"label", "forward peak"}, {"data", fwd}}, {{"label", "backward peak"}, {"data", bwd}},
                                          {{"label", "optimizer peak"}, {"data", opt}},
                                          {{"label", "model state measured"}, {"data", state}},
                                          {{"label", "model state expected"}, {"data", expected}}}}},
                           {{"indexAxis", "y"}, {"scales", axes("MiB", "")}}));
}

// Per-block fp16 range map: fraction of gradients beyond fp16's range and below its normal range.
void fp16_range_chart(json& charts, const json& report) {
  const json& cells = report["cells"];
  json bl = json::array(), over = json::array(), under = json::array(), aover = json::array();
  for (const auto& c : cells)
    for (const auto& l : value_at(c, {"metrics", "overflow", "layers"}).is_array() ? c["metrics"]["overflow"]["layers"] : json::array()) {
      if (bl.size() >= 80) break;
      bl.push_back(c["name"].get<std::string>() + ": " + l.value("block", "?"));
      over.push_back(l["gradient"].is_object() ? l["gradient"].value("frac_beyond_fp16", 0.0) : 0.0);
      under.push_back(l["gradient"].is_object() ? l["gradient"].value("frac_below_fp16_normal", 0.0) : 0.0);
      aover.push_back(l["activation"].is_object() ? l["activation"].value("frac_beyond_fp16", 0.0) : 0.0);
    }
  if (!bl.empty())
    charts.push_back(chart("fp16-map", "fp16 range per block (fraction of values)", "bar",
                           {{"labels", bl},
                            {"datasets", {{{"label", "gradients beyond fp16"}, {"data", over}},
                                          {{"label", "gradients below fp16 normal"}, {"data", under}},
                                          {{"label", "activations beyond fp16"}, {"data", aover}}}}},
                           {{"indexAxis", "y"}, {"scales", axes("fraction of values", "")}}));
}

// Communication per parallel cell: exposed against overlapped (ms per step).
void comm_chart(json& charts, const json& report) {
  const json& cells = report["cells"];
  json cl = json::array(), exposed = json::array(), overlapped = json::array();
  for (const auto& c : cells) {
    const double total = number_at(c, {"metrics", "comm", "comm_time_s"}), exp = number_at(c, {"metrics", "comm", "exposed_comm_time_s"});
    if (!std::isfinite(total) || !std::isfinite(exp)) continue;
    cl.push_back(c["name"]);
    exposed.push_back(1e3 * exp);
    overlapped.push_back(1e3 * std::max(0.0, total - exp));
  }
  if (!cl.empty())
    charts.push_back(chart("comm", "Communication per step (ms): exposed and overlapped", "bar",
                           {{"labels", cl},
                            {"datasets", {{{"label", "exposed"}, {"data", exposed}}, {{"label", "overlapped"}, {"data", overlapped}}}}},
                           {{"indexAxis", "y"}, {"scales", axes("ms per step", "", {{"stacked", true}}, {{"stacked", true}})}}));
}

// SSL health: the embeddings' effective rank (RankMe) per step, per cell; a collapse drives it to 1.
void ssl_health_chart(json& charts, const json& report) {
  const json& cells = report["cells"];
  json health = json::array();
  for (const auto& c : cells) {
    const json samples = value_at(c, {"metrics", "ssl_health", "samples"});
    json data = json::array();
    for (const auto& sm : samples.is_array() ? samples : json::array())
      if (sm.is_object() && sm.value("step", json()).is_number() && sm.value("rankme", json()).is_number())
        data.push_back({{"x", sm["step"]}, {"y", sm["rankme"]}});
    if (!data.empty()) health.push_back({{"label", c["name"]}, {"data", data}, {"pointRadius", 2}});
  }
  if (!health.empty())
    charts.push_back(chart("ssl-rankme", "SSL health: effective rank of the embeddings (RankMe) per step", "line",
                           {{"datasets", health}},
                           {{"scales", {{"x", {{"type", "linear"}, {"title", {{"display", true}, {"text", "step"}}}}},
                                        {"y", {{"title", {{"display", true}, {"text", "RankMe"}}}}}}}}));
}

// The frontier: largest batch against its throughput, per policy.
void frontier_chart(json& charts, const json& report) {
  if (!report.contains("frontier") || !report["frontier"].is_array()) return;
  json datasets = json::array();
  for (const auto& f : report["frontier"]) {
    if (!f.value("samples_per_s", json()).is_number()) continue;
    datasets.push_back({{"label", frontier_label(f)}, {"data", {{{"x", f["largest_batch"]}, {"y", f["samples_per_s"]}}}}, {"pointRadius", 6}});
  }
  if (!datasets.empty())
    charts.push_back(chart("frontier", "Frontier: largest batch under the budget against throughput (samples/s)", "scatter",
                           {{"datasets", datasets}}, {{"scales", axes("largest batch (log)", "samples/s", {{"type", "logarithmic"}})}}));
}

// Every plot the report has data for.
json chart_specs(const json& report) {
  json charts = json::array();
  for (const auto add : {loss_charts, loss_scale_charts, step_time_chart, memory_chart, fp16_range_chart, comm_chart, ssl_health_chart,
                         frontier_chart})
    add(charts, report);
  return charts;
}

// Speed-up against the 32-true sibling as a coloured matrix: configurations down, precisions across.
std::string heat_map(const json& report) {
  std::vector<std::string> precisions;
  std::map<std::string, std::map<std::string, double>> grid;  // configuration -> precision -> speed-up
  for (const auto& c : report["cells"]) {
    const json* base = fp32_sibling(report, c);
    if (!base) continue;
    const double b = number_at(*base, {"metrics", "timing", "step_time_s", "p50"}), t = number_at(c, {"metrics", "timing", "step_time_s", "p50"});
    if (!(b > 0 && t > 0)) continue;
    const std::string prec = c["config"].value("precision", "?");
    if (std::find(precisions.begin(), precisions.end(), prec) == precisions.end()) precisions.push_back(prec);
    grid[base->at("name").get<std::string>()][prec] = b / t;
  }
  if (precisions.size() < 2) return "";
  std::ostringstream out;
  out << "<h2>Speed-up against 32-true</h2>\n<table class=\"heat\"><tr><th>reference cell</th>";
  for (const auto& p : precisions) out << "<th>" << esc(p) << "</th>";
  out << "</tr>\n";
  for (const auto& [row, values] : grid) {
    out << "<tr><td>" << esc(row) << "</td>";
    for (const auto& p : precisions) {
      const auto it = values.find(p);
      if (it == values.end()) {
        out << "<td>-</td>";
        continue;
      }
      // Green above 1x, red below, on a log scale clipped at 4x either way.
      const double v = std::clamp(std::log2(it->second) / 2.0, -1.0, 1.0);
      const int r = v < 0 ? 255 : static_cast<int>(255 * (1 - v)), g = v > 0 ? 255 : static_cast<int>(255 * (1 + v));
      out << "<td style=\"background: rgb(" << r << "," << g << ",200)\">" << format_fixed(it->second, 2) << "x</td>";
    }
    out << "</tr>\n";
  }
  out << "</table>\n";
  return out.str();
}

}  // namespace

std::string page_head(const std::string& title, size_t charts_expected) {
  std::ostringstream out;
  out << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      << "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; "
         "style-src 'unsafe-inline'; img-src data:\">\n"
      << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
      << "<title>" << esc(title) << "</title>\n<style>\n"
      << "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}th{background:#f3f3f3}"
         ".chart{margin:1.5em 0;position:relative}.warn{color:#a60}.critical{color:#b00}.info{color:#036}.shown{color:#555}"
         "code{font-size:12px;word-break:break-all}.summary{border:1px solid #bbb;background:#fafafa;padding:0 1em 1em}"
         ".rec{margin:.6em 0}details{margin:.2em 0 .2em 1.5em;color:#222}summary{cursor:pointer;color:#555}\n"
      << "</style></head>\n<body data-charts-expected=\"" << charts_expected
      << "\" data-charts-drawn=\"0\" data-errors=\"\">\n";
  return out.str();
}

std::string chart_scripts(const json& charts, const std::string& chartjs, const std::string& chartjs_path) {
  std::ostringstream out;
  if (chartjs.empty()) {
    out << "<p class=\"warn\">Chart.js was not found at " << esc(chartjs_path)
        << " (apt-get install libjs-chart.js, then trainscope report DIR): the plots are left out.</p>\n";
  } else {
    for (const auto& c : charts)
      out << "<div class=\"chart\"" << (c.contains("height") ? " style=\"height:" + c["height"].dump() + "px\"" : std::string()) << "><canvas id=\""
          << esc(c["id"].get<std::string>()) << "\" role=\"img\" aria-label=\"" << esc(c["title"].get<std::string>()) << "\"></canvas></div>\n";
    // Errors and the number of charts drawn are written onto <body>, where a test (or a person) reads them.
    out << "<script>window.addEventListener('error', function (e) { var b = document.body;"
           " b.dataset.errors = (b.dataset.errors ? b.dataset.errors + '; ' : '') + e.message; });</script>\n";
    out << "<script>\n" << chartjs << "\n</script>\n";
    out << "<script>\nvar TRAINSCOPE_CHARTS = " << script_json(charts) << ";\n"
        << "TRAINSCOPE_CHARTS.forEach(function (c) {\n"
           "  var chart = new Chart(document.getElementById(c.id), c.config);\n"
           "  var points = chart.data.datasets.reduce(function (n, d) { return n + d.data.length; }, 0);\n"
           "  if (points > 0) document.body.dataset.chartsDrawn = String(Number(document.body.dataset.chartsDrawn) + 1);\n"
           "});\n</script>\n";
  }
  return out.str();
}

std::string render_html(const json& report, const std::string& chartjs_path) {
  std::string chartjs;
  {
    std::ifstream f(chartjs_path, std::ios::binary);
    if (f) chartjs.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  const json charts = chart_specs(report);
  std::ostringstream out;
  const std::string title = "trainscope report: " + report["suite"].value("name", std::string("?"));
  out << page_head(title, chartjs.empty() ? 0 : charts.size());
  const json& env = report["env"];
  out << "<h1>" << esc(title) << "</h1>\n<p>Created " << esc(report.value("created", "?")) << " by trainscope "
      << esc(report["trainscope"].value("version", "?")) << " (" << esc(report["trainscope"].value("commit", "?"))
      << ") on " << esc(machine_line(env)) << ".</p>\n";
  if (const std::string nodes = nodes_line(report); !nodes.empty()) out << "<p>Ranks on " << esc(nodes) << ".</p>\n";
  // The summary first: the decisions the run supports and what went wrong, each linked to its evidence.
  const json digest = report_digest(report);
  out << "<section class=\"summary\"><h2 id=\"summary\">Summary</h2>\n<ul class=\"decisions\">";
  if (digest["decisions"].empty()) out << "<li>No decision to make from this run's cells.</li>";
  for (const auto& d : digest["decisions"])
    out << "<li><b>" << esc(d["topic"].get<std::string>()) << "</b>: " << esc(d["text"].get<std::string>()) << " <a href=\"#"
        << esc(d["anchor"].get<std::string>()) << "\">evidence</a></li>";
  out << "</ul>\n<h3>What went wrong</h3>\n";
  if (digest["problems"].empty()) out << "<p>Nothing; " << digest["cells_ok"].get<int>() << " cell(s) ok.</p>\n";
  else {
    out << "<ul>";
    for (const auto& p : digest["problems"]) {
      out << "<li class=\"" << esc(p["severity"].get<std::string>()) << "\"><b>" << esc(p["severity"].get<std::string>()) << "</b> "
          << esc(p["text"].get<std::string>());
      if (p["anchor"].is_string()) out << " <a href=\"#" << esc(p["anchor"].get<std::string>()) << "\">details</a>";
      out << "</li>";
    }
    out << "</ul>\n";
  }
  out << "</section>\n<h2 id=\"cells\">Cells</h2>\n";
  const json table = cell_table(report);
  html_table(out, table["columns"], table["rows"]);
  std::string section;
  for (const auto& t : technique_tables(report)) {
    const std::string t_title = t["title"].get<std::string>();
    if (t.contains("section")) {
      if (t["section"] != section)
        out << "<h2 id=\"" << esc(heading_anchor(t["section"].get<std::string>())) << "\">" << esc(t["section"].get<std::string>()) << "</h2>\n";
      section = t["section"];
      out << "<h3 id=\"" << esc(heading_anchor(t_title)) << "\">" << esc(t_title) << "</h3>\n";
    } else {
      section.clear();
      out << "<h2 id=\"" << esc(heading_anchor(t_title)) << "\">" << esc(t_title) << "</h2>\n";
    }
    html_table(out, t["columns"], t["rows"]);
  }
  out << heat_map(report);
  // Recommendations said once per kind, two lines at most; the detail, the figures and the raw JSON
  // behind folds.
  out << "<h2 id=\"recommendations\">Recommendations</h2>\n";
  const json groups = recommendation_groups(report);
  if (groups.empty()) out << "<p>None.</p>\n";
  for (const auto& g : groups) {
    out << "<div class=\"rec " << esc(g["severity"].get<std::string>()) << "\" id=\"" << esc(g["anchor"].get<std::string>()) << "\"><b>"
        << esc(g["severity"].get<std::string>()) << "</b> " << esc(g["headline"].get<std::string>())
        << "<details><summary>Evidence: " << esc(g["cells"].size() == 1 ? g["cells"][0].get<std::string>() : std::to_string(g["cells"].size()) + " cells")
        << "</summary>";
    for (const auto& item : g["items"]) {
      out << "<p>" << esc(item["text"].get<std::string>()) << "</p>";
      const json rows = evidence_rows(item["evidence"]);
      if (!rows.empty()) html_table(out, json{"figure", "value"}, rows);
      out << "<details><summary>raw JSON</summary><code>" << esc(item["evidence"].dump()) << "</code></details>";
    }
    out << "</details></div>\n";
  }
  std::string unfinished;
  for (const auto& c : report["cells"])
    if (c["status"] != "ok")
      unfinished += "<li><code>" + esc(c["name"].get<std::string>()) + "</code>: " + esc(c["status"].get<std::string>()) +
                    (shown_as_expected(report, c) ? " (expected)" : "") + ": " + esc(c.value("reason", "")) + "</li>";
  if (!unfinished.empty()) out << "<h2 id=\"unfinished\">Cells that did not finish or were skipped</h2>\n<ul>" << unfinished << "</ul>\n";

  out << "<h2>Plots</h2>\n";
  out << chart_scripts(charts, chartjs, chartjs_path);
  // The environment and the suite last: they are for whoever reproduces the run.
  std::string gpus;
  for (const auto& g : env.value("gpus", json::array())) gpus += (gpus.empty() ? "" : ", ") + g.value("name", std::string("?"));
  auto plain = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  out << "<h2 id=\"environment\">Environment</h2>\n<ul><li>host " << esc(env.value("host", "?")) << "; CPU "
      << esc(plain(value_at(env, {"cpu", "model"}))) << ", " << esc(plain(value_at(env, {"cpu", "logical_cores"})))
      << " logical cores</li><li>torch " << esc(plain(value_at(env, {"torch", "version"}))) << "; BLAS "
      << esc(plain(value_at(env, {"blas", "name"}))) << "</li><li>GPUs: "
      << esc(gpus.empty() ? plain(value_at(env, {"cuda", "status"})) : gpus) << "</li>";
  for (const auto& w : env.value("warnings", json::array())) out << "<li class=\"warn\">" << esc(w.get<std::string>()) << "</li>";
  out << "</ul>\n<h2 id=\"suite\">Suite</h2>\n<p>" << esc(report["suite"].value("description", "")) << "</p><ul>";
  const json axes = report["suite"].value("axes", json::object());
  for (const auto& [key, values] : axes.items()) {
    std::string list;
    for (const auto& v : values) list += (list.empty() ? "" : ", ") + plain(v);
    out << "<li>axis <code>" << esc(key) << "</code>: " << esc(list) << "</li>";
  }
  out << "</ul>\n</body></html>\n";
  return out.str();
}

}  // namespace trainscope::reports
