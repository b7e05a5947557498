#include "runners/commands/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

#include "core/errors.hpp"
#include "core/pipeline.hpp"
#include "core/model_shape.hpp"
#include "core/units.hpp"
#include "plan/check.hpp"
#include "plan/device.hpp"
#include "plan/search.hpp"
#include "reports/render/render.hpp"
#include "reports/render/render_plan.hpp"
#include "reports/report.hpp"
#include "runners/process/folder_lock.hpp"

namespace trainscope::runners {

namespace {

namespace fs = std::filesystem;

// "10%" or "0.1" -> 0.1, in [0, 0.9].
double parse_headroom(const std::string& text) {
  const auto v = parse_fraction(text);
  if (!v || *v < 0 || *v > 0.9) throw UsageError("plan: --memory-headroom '" + text + "' is not a fraction in [0, 90%] (e.g. 10%)");
  return *v;
}

// Tokens: 4194304, 4M (x 2^20), 512K (x 2^10).
int64_t parse_tokens(const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    double mult = 1;
    const std::string suffix = text.substr(used);
    if (suffix == "K" || suffix == "k") mult = 1024;
    else if (suffix == "M" || suffix == "m") mult = 1024.0 * 1024;
    else if (suffix == "G" || suffix == "g") mult = 1024.0 * 1024 * 1024;
    else if (!suffix.empty()) throw std::invalid_argument(text);
    if (v <= 0) throw std::out_of_range(text);
    return static_cast<int64_t>(std::llround(v * mult));
  } catch (const std::exception&) {
    throw UsageError("plan: --global-batch '" + text + "' is not a token count (e.g. 4M = 4,194,304 tokens, or 1048576)");
  }
}

json parse_value(const std::string& v) {
  try {
    return json::parse(v);
  } catch (const json::exception&) {
    return v;
  }
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) throw std::runtime_error("plan: cannot write " + path.string());
}

// The hardware reports as one: every cell of each (the first one's environment), and their paths.
json read_hardware(const std::vector<std::string>& paths) {
  json merged;
  std::string source;
  for (const auto& path : paths) {
    const json r = reports::read_report(path);
    if (merged.is_null()) {
      merged = r;
    } else {
      for (const auto& c : r.value("cells", json::array())) merged["cells"].push_back(c);
    }
    source += (source.empty() ? "" : " + ") + path;
  }
  if (!merged.is_null()) merged["source"] = source;
  return merged;
}

// `--set pp=N`, `--set pp_virtual=N` and `--set cp=N` positive whole numbers, `--set pp_schedule` a schedule's name,
// `--set cp_method` ring or allgather (one line otherwise).
void check_layout_axes(const std::map<std::string, std::string>& fixed) {
  for (const char* dim : {"pp", "pp_virtual", "cp"})
    if (const auto f = fixed.find(dim); f != fixed.end()) {
      const json v = parse_value(f->second);
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        throw UsageError("plan: --set " + std::string(dim) + "=" + f->second + ": expected a whole number >= 1");
    }
  if (const auto f = fixed.find("cp_method"); f != fixed.end() && f->second != "ring" && f->second != "allgather")
    throw UsageError("plan: --set cp_method=" + f->second + ": expected ring or allgather");
  const std::vector<std::string>& names = pipeline::schedule_names();
  if (const auto f = fixed.find("pp_schedule"); f != fixed.end() && std::find(names.begin(), names.end(), f->second) == names.end())
    throw UsageError("plan: --set pp_schedule=" + f->second + ": expected gpipe, 1f1b, interleaved-1f1b or zb-1p");
}

}  // namespace

int plan_command(const PlanArgs& a) {
  if (a.into_report && a.check.empty()) throw UsageError("plan: --into-report needs --check DIR (the results folder whose report takes the comparison)");
  if (!a.check.empty()) {
    const json report = reports::read_report(a.check);
    const json hardware = read_hardware(a.hardware);
    const json check = plan::check_report(report, hardware);
    if (a.format == "json") std::cout << check.dump(2) << "\n";
    else std::cout << plan::render_check(check);
    if (a.into_report) {
      // The run's own report carries the comparison: each cell its row, the report the summary.
      std::string folder = fs::is_directory(a.check) ? a.check : fs::path(a.check).parent_path().string();
      if (folder.empty()) folder = ".";
      const FolderLock lock(folder);
      json r = report;
      r["plan_check"] = {{"hardware", a.hardware.empty() ? json() : hardware["source"]}, {"summary", check.value("summary", json())},
                         {"frontier", check.value("frontier", json::array())}};
      for (auto& cell : r["cells"])
        for (const auto& row : check.value("cells", json::array()))
          if (row.value("cell", "") == cell.value("name", "")) {
            json p = row;
            p.erase("cell");
            cell["plan"] = p;
          }
      reports::write_json_atomic((fs::path(folder) / "report.json").string(), r);
      reports::write_renderings(r, folder);
      if (a.format != "json") std::cout << "\nthe comparison is in " << folder << "/report.json, report.md and report.html\n";
    }
    return 0;
  }
  // The model: a preset (or a family) with dimension keys, as the suites take them.
  static const std::set<std::string> axes = {"precision", "parallel", "checkpoint", "attention", "batch_size", "reduce_dtype",
                                              "reshard_after_forward", "cross_entropy", "tp", "sequence_parallel", "pp", "pp_schedule",
                                              "pp_virtual", "cp", "cp_method", "cp_balance"};
  json cfg = {{"model", a.model}};
  plan::PlanRequest r;
  for (const auto& [k, v] : a.sets) {
    if (axes.count(k)) {
      r.fixed[k] = v;
      continue;
    }
    const auto& dims = model_dimension_keys();
    if (k != "model" && std::find(dims.begin(), dims.end(), k) == dims.end()) {
      std::string allowed;
      for (const auto& x : axes) allowed += x + ", ";
      for (const auto& x : dims) allowed += x + ", ";
      throw UsageError("plan: --set " + k + ": not a planning axis or model dimension (allowed: " + allowed + "model)");
    }
    cfg[k] = parse_value(v);
  }
  if (a.seq > 0) cfg["seq_len"] = a.seq;
  // Validate the fixed axes with the run configuration's own checks.
  json probe = cfg;
  for (const auto& [k, v] : r.fixed) probe[k] = parse_value(v);
  // pp, cp and their settings are the search's own to check: a run configuration refuses pp beside
  // other dimensions, which this build plans but does not train yet.
  check_layout_axes(r.fixed);
  for (const char* k : {"pp", "pp_schedule", "pp_virtual", "cp", "cp_method", "cp_balance"}) probe.erase(k);
  const int64_t tp = probe.contains("tp") && probe["tp"].is_number_integer() ? std::max<int64_t>(1, probe["tp"].get<int64_t>()) : 1;
  if (r.fixed.count("parallel") && r.fixed["parallel"] != "single") probe["world_size"] = 2 * tp;
  else if (tp > 1) probe["world_size"] = tp;
  if (r.fixed.count("sequence_parallel") && tp == 1) probe.erase("sequence_parallel");  // searched with tp
  const RunConfig c = RunConfig::from_json(probe);
  r.model = resolve_model(c);
  if (!a.hardware.empty()) {
    const json hw = read_hardware(a.hardware);
    r.device = plan::measured_profile(hw, hw["source"]);
  } else {
    r.device = plan::datasheet_profile(a.device);
  }
  if (a.gpus_per_node < 1 || a.nodes < 1) throw UsageError("plan: --gpus-per-node and --nodes must be at least 1");
  r.cluster = plan::Cluster{a.gpus_per_node, a.nodes};
  r.headroom = parse_headroom(a.headroom);
  if (!a.global_batch.empty()) r.global_tokens = parse_tokens(a.global_batch);
  const json plan = plan::make_plan(r);
  if (!a.out.empty()) {
    fs::create_directories(a.out);
    write_file(fs::path(a.out) / "plan.json", plan.dump(2) + "\n");
    write_file(fs::path(a.out) / "plan.md", reports::render_plan_markdown(plan));
    write_file(fs::path(a.out) / "plan.html", reports::render_plan_html(plan, reports::kChartJsPath));
  }
  if (a.format == "json") std::cout << plan.dump(2) << "\n";
  else if (a.format == "md") std::cout << reports::render_plan_markdown(plan);
  else std::cout << reports::render_plan_text(plan);
  if (!a.out.empty()) std::fprintf(stderr, "plan: %s/plan.json, plan.md, plan.html\n", a.out.c_str());
  return 0;
}

}  // namespace trainscope::runners
