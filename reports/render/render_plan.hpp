#pragma once
// A plan (trainscope.plan/1 JSON) for people: the terminal, Markdown and a self-contained HTML page
// with the memory of each configuration against the device's as stacked bars.
#include <string>

#include "core/config.hpp"

namespace trainscope::reports {

std::string render_plan_text(const json& plan, size_t rows = 12);
std::string render_plan_markdown(const json& plan, size_t rows = 20);
std::string render_plan_html(const json& plan, const std::string& chartjs_path);

}  // namespace trainscope::reports
