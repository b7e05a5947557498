#include "plan/check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "core/errors.hpp"
#include "plan/device.hpp"
#include "plan/step.hpp"
#include "plan/time.hpp"

namespace trainscope::plan {

namespace {

double rel_error(double predicted, double measured) { return measured != 0 ? (predicted - measured) / measured : 0.0; }

json distribution(std::vector<double> e) {
  if (e.empty()) return nullptr;
  std::vector<double> a;
  for (double v : e) a.push_back(std::fabs(v));
  std::sort(a.begin(), a.end());
  const double median = a.size() % 2 ? a[a.size() / 2] : 0.5 * (a[a.size() / 2 - 1] + a[a.size() / 2]);
  return {{"count", a.size()}, {"median_abs", median}, {"worst_abs", a.back()}};
}

}  // namespace

json check_report(const json& report, const json& hardware) {
  json cells = json::array();
  std::vector<double> peak_err, state_err, step_err, comm_err;
  std::optional<DeviceProfile> device;
  if (!hardware.is_null()) device = measured_profile(hardware, hardware.value("source", std::string("hardware report")));
  for (const auto& cell : report.value("cells", json::array())) {
    json row = {{"cell", cell.value("name", "")}};
    const json& cfg = cell.value("config", json::object());
    if (cell.value("status", "") != "ok" || cfg.value("kind", "train") != "train") continue;
    if (cfg.value("method", "supervised") != "supervised") {
      row["skipped"] = "self-supervised cells are not planned (their objectives add views and heads)";
      cells.push_back(row);
      continue;
    }
    RunConfig c;
    try {
      c = RunConfig::from_json(cfg);
    } catch (const std::exception& e) {
      row["skipped"] = e.what();
      cells.push_back(row);
      continue;
    }
    const bool cuda = cfg.value("device", "cpu").rfind("cuda", 0) == 0;
    MemoryPrediction p;
    StepSetup setup;
    try {
      setup = step_setup(c, cuda);
      p = predict_memory(setup);
    } catch (const UsageError& e) {
      row["skipped"] = e.what();
      cells.push_back(row);
      continue;
    }
    const json& mem = cell["metrics"].value("memory", json::object());
    row["predicted"] = p.to_json();
    json measured;
    if (mem.contains("step_peak_bytes") && mem["step_peak_bytes"].is_number()) measured["peak_bytes"] = mem["step_peak_bytes"];
    else if (mem.contains("phase_peak_bytes")) {
      const auto& ph = mem["phase_peak_bytes"];
      measured["peak_bytes"] = std::max({ph.value("forward", int64_t{0}), ph.value("backward", int64_t{0}), ph.value("optimizer", int64_t{0})});
    }
    measured["phase_peak_bytes"] = mem.value("step_phase_peak_bytes", mem.value("phase_peak_bytes", json()));
    measured["model_state_total_bytes"] = mem.value("model_state_total_bytes", json());
    row["measured"] = measured;
    if (measured["peak_bytes"].is_number()) {
      const double e = rel_error(static_cast<double>(p.peak), measured["peak_bytes"].get<double>());
      row["peak_error"] = e;
      peak_err.push_back(e);
    }
    if (measured["model_state_total_bytes"].is_number()) {
      const double e = rel_error(static_cast<double>(p.state.total()), measured["model_state_total_bytes"].get<double>());
      row["model_state_error"] = e;
      state_err.push_back(e);
    }
    if (device) {
      // Ranks on one CPU share its cores: each gets cores / ranks of the measured rate.
      const double share = device->gpu || device->cores <= 0 ? 1.0 : std::min(1.0, static_cast<double>(device->cores) / static_cast<double>(c.world_size));
      const TimePrediction tp = predict_time(setup, p, *device, Cluster{c.world_size, 1}, 1, share);
      row["predicted"]["time"] = tp.to_json();
      const json& timing = cell["metrics"].value("timing", json::object());
      const double step = timing.value("step_time_s", json::object()).value("p50", 0.0);
      row["measured"]["step_time_s"] = step;
      // Steps under 10 ms are dominated by what no model of the work predicts (scheduling, timers).
      if (step >= 0.010) {
        row["step_error"] = rel_error(tp.step_s, step);
        step_err.push_back(row["step_error"]);
      }
      const json& comm = cell["metrics"].value("comm", json::object());
      if (comm.contains("comm_time_s") && comm["comm_time_s"].is_number() && c.world_size > 1) {
        row["measured"]["comm_time_s"] = comm["comm_time_s"];
        row["comm_error"] = rel_error(tp.comm_s, comm["comm_time_s"].get<double>());
        comm_err.push_back(row["comm_error"]);
      }
    }
    cells.push_back(row);
  }
  return {{"cells", cells},
          {"summary", {{"peak", distribution(peak_err)}, {"model_state", distribution(state_err)},
                       {"step_time", distribution(step_err)}, {"comm_time", distribution(comm_err)}}}};
}

std::string render_check(const json& check) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-44s %12s %12s %8s %8s %9s %9s %8s %8s\n", "cell", "peak pred", "peak meas", "err", "state",
                "step pred", "step meas", "err", "comm err");
  out += line;
  for (const auto& r : check["cells"]) {
    if (r.contains("skipped")) {
      out += r["cell"].get<std::string>() + ": not planned: " + r["skipped"].get<std::string>() + "\n";
      continue;
    }
    const json& tp = r["predicted"].value("time", json::object());
    std::snprintf(line, sizeof line, "%-44s %12lld %12lld %+7.2f%% %+7.3f%% %8.2fms %8.2fms %+7.1f%% %+7.1f%%\n",
                  r["cell"].get<std::string>().c_str(), static_cast<long long>(r["predicted"]["peak_bytes"].get<int64_t>()),
                  static_cast<long long>(r["measured"].value("peak_bytes", int64_t{0})), 100 * r.value("peak_error", 0.0),
                  100 * r.value("model_state_error", 0.0), 1e3 * tp.value("step_s", 0.0),
                  1e3 * r["measured"].value("step_time_s", 0.0), 100 * r.value("step_error", 0.0), 100 * r.value("comm_error", 0.0));
    out += line;
  }
  return out;
}

}  // namespace trainscope::plan
