#pragma once
// Pieces every self-contained trainscope page shares (report.html, plan.html): escaping, the page head
// with its Content-Security-Policy (no network), Chart.js inlined and the chart specs drawn, with the
// errors and the count of drawn charts written onto <body> for tests.
#include <string>

#include "core/config.hpp"

namespace trainscope::reports {

std::string esc(const std::string& s);
// JSON inside a <script>: "</" would end the element.
std::string script_json(const json& j);
// A Chart.js chart spec (id, title, config) with the colour-blind-safe palette.
json chart(const std::string& id, const std::string& title, const std::string& type, json data, json options = json::object());
// <!DOCTYPE> to <body>: title, styles, the policy, the counters.
std::string page_head(const std::string& title, size_t charts_expected);
// The canvases and the scripts that draw `charts` (a notice instead when Chart.js is missing).
std::string chart_scripts(const json& charts, const std::string& chartjs, const std::string& chartjs_path);

}  // namespace trainscope::reports
