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

// The errors of every cell, by what was predicted, for the summary's distributions.
struct Errors {
  std::vector<double> peak, state, step, comm, frontier;
};

// The replay of a configuration, with the measured GEMM scratch of this CPU when there is a profile.
StepSetup setup_for(const RunConfig& c, bool cuda, const std::optional<DeviceProfile>& device) {
  StepSetup s = step_setup(c, cuda);
  if (device && !cuda)
    for (const auto& [dtype, elem] : std::vector<std::pair<std::string, int>>{{"bf16", 2}, {"fp32", 4}})
      if (auto w = device->gemm_workspace.find(dtype); w != device->gemm_workspace.end()) s.replay.gemm_workspace[elem] = w->second;
  if (device && cuda) s.replay.persistent_workspace = device->gpu_gemm_workspace;
  if (device && !cuda) {
    s.replay.conv_workspace = device->conv_workspace;
    s.replay.batch_norm_backward_ratio = device->batch_norm_backward_ratio;
  }
  return s;
}

// The layout the run settled (hsdp's shard group is a node's ranks); older reports: the cell's first
// node says how many ranks a node held.
void settle_layout(StepSetup& setup, const json& cell) {
  if (cell.contains("layout") && cell["layout"].is_object()) {
    setup.layout.dp_replicate = cell["layout"].value("dp_replicate", setup.layout.dp_replicate);
    setup.layout.dp_shard = cell["layout"].value("dp_shard", setup.layout.dp_shard);
  } else if (setup.strategy() == "hsdp" && cell.contains("nodes") && !cell["nodes"].empty()) {
    const int64_t node = static_cast<int64_t>(cell["nodes"][0].value("ranks", json::array()).size());
    if (node > 0 && setup.world() % node == 0) setup.layout.dp_replicate = setup.world() / node, setup.layout.dp_shard = node;
  }
}

// The cell's measured memory: the step's peak (or the largest phase's), phases and model state.
json measured_memory(const json& mem) {
  json measured;
  if (mem.contains("step_peak_bytes") && mem["step_peak_bytes"].is_number()) measured["peak_bytes"] = mem["step_peak_bytes"];
  else if (mem.contains("phase_peak_bytes")) {
    const auto& ph = mem["phase_peak_bytes"];
    measured["peak_bytes"] = std::max({ph.value("forward", int64_t{0}), ph.value("backward", int64_t{0}), ph.value("optimizer", int64_t{0})});
  }
  measured["phase_peak_bytes"] = mem.value("step_phase_peak_bytes", mem.value("phase_peak_bytes", json()));
  measured["model_state_total_bytes"] = mem.value("model_state_total_bytes", json());
  return measured;
}

// The peak and model-state errors of a cell. A pipeline's metrics are rank 0's (the first stage); the
// last stage's model state, which holds the final norm and the head instead of the embedding, is checked
// from its rank's row (pp outermost: the last stage of the first data-parallel pipeline is rank (pp - 1)
// x world / pp).
void memory_errors(json& row, const json& cell, const StepSetup& setup, const MemoryPrediction& p, Errors& errors) {
  const json& measured = row["measured"];
  if (measured["peak_bytes"].is_number()) {
    const double e = rel_error(static_cast<double>(p.peak), measured["peak_bytes"].get<double>());
    row["peak_error"] = e;
    errors.peak.push_back(e);
  }
  if (measured["model_state_total_bytes"].is_number()) {
    const double e = rel_error(static_cast<double>(p.state.total()), measured["model_state_total_bytes"].get<double>());
    row["model_state_error"] = e;
    errors.state.push_back(e);
  }
  const int64_t pp = setup.schedule.ranks, world = setup.world();
  if (pp > 1 && cell.contains("ranks") && cell["ranks"].size() == static_cast<size_t>(world)) {
    const json& last = cell["ranks"][static_cast<size_t>((pp - 1) * (world / pp))];
    if (last.value("model_state_bytes", json()).is_number()) {
      StepSetup s = setup;
      s.set_pp_rank(pp - 1);
      const double e = rel_error(static_cast<double>(predict_memory(s).state.total()), last["model_state_bytes"].get<double>());
      row["last_stage_model_state_error"] = e;
      errors.state.push_back(e);
    }
  }
}

// The step and communication times of a cell, predicted on the cluster it ran on: its ranks grouped by
// host (one node for local ranks); ranks on one CPU share its cores, each getting cores / ranks of the
// measured rate.
void time_errors(json& row, const json& cell, const RunConfig& c, const StepSetup& setup, const MemoryPrediction& p,
                 const DeviceProfile& device, Errors& errors) {
  Cluster cluster{c.world_size, 1};
  const json nodes = cell.value("nodes", json::array());
  if (nodes.size() > 1 && c.world_size % static_cast<int64_t>(nodes.size()) == 0)
    cluster = Cluster{c.world_size / static_cast<int64_t>(nodes.size()), static_cast<int64_t>(nodes.size())};
  const double share = device.gpu || device.cores <= 0
                           ? 1.0
                           : std::min(1.0, static_cast<double>(device.cores) / static_cast<double>(cluster.gpus_per_node));
  const TimePrediction tp = predict_time(setup, p, device, cluster, 1, share);
  if (cluster.nodes > 1) row["nodes"] = cluster.nodes;
  row["predicted"]["time"] = tp.to_json();
  const json& timing = cell["metrics"].value("timing", json::object());
  const double step = timing.value("step_time_s", json::object()).value("p50", 0.0);
  row["measured"]["step_time_s"] = step;
  // Steps under 10 ms are dominated by what no model of the work predicts (scheduling, timers).
  if (step >= 0.010) {
    row["step_error"] = rel_error(tp.step_s, step);
    errors.step.push_back(row["step_error"]);
  }
  const json& comm = cell["metrics"].value("comm", json::object());
  if (comm.contains("comm_time_s") && comm["comm_time_s"].is_number() && c.world_size > 1) {
    row["measured"]["comm_time_s"] = comm["comm_time_s"];
    row["comm_error"] = rel_error(tp.comm_s, comm["comm_time_s"].get<double>());
    errors.comm.push_back(row["comm_error"]);
  }
}

// One cell's row: predicted beside measured, or why it was skipped; null for a cell that did not train.
json check_cell(const json& cell, const std::optional<DeviceProfile>& device, Errors& errors) {
  json row = {{"cell", cell.value("name", "")}};
  const json& cfg = cell.value("config", json::object());
  if (cell.value("status", "") != "ok" || cfg.value("kind", "train") != "train") return nullptr;
  if (cfg.value("method", "supervised") != "supervised") {
    row["skipped"] = "self-supervised cells are not planned (their objectives add views and heads)";
    return row;
  }
  RunConfig c;
  MemoryPrediction p;
  StepSetup setup;
  const bool cuda = cfg.value("device", "cpu").rfind("cuda", 0) == 0;
  try {
    c = RunConfig::from_json(cfg);  // a configuration this build reads differently: skipped
  } catch (const std::exception& e) {
    row["skipped"] = e.what();
    return row;
  }
  try {
    setup = setup_for(c, cuda, device);
    settle_layout(setup, cell);
    p = predict_memory(setup);
  } catch (const UsageError& e) {  // a layout the planner cannot replay
    row["skipped"] = e.what();
    return row;
  }
  row["predicted"] = p.to_json();
  row["measured"] = measured_memory(cell["metrics"].value("memory", json::object()));
  memory_errors(row, cell, setup, p, errors);
  if (device) time_errors(row, cell, c, setup, p, *device, errors);
  return row;
}

// The memory frontier: the largest batch under the run's budget, predicted by replaying batch sizes
// (memory grows with the batch) beside the one the run found by bisection.
json check_frontier(const json& report, const std::optional<DeviceProfile>& device, Errors& errors) {
  json frontier = json::array();
  for (const auto& f : report.value("frontier", json::array())) {
    if (!f.contains("largest_batch") || !f["largest_batch"].is_number()) continue;
    json base;
    for (const auto& cell : report["cells"]) {
      const json& cfg = cell.value("config", json::object());
      if (cfg.value("model", "") == f.value("model", "") && cfg.value("precision", "") == f.value("precision", "") &&
          cfg.value("checkpoint", "") == f.value("checkpoint", "") && cfg.value("world_size", 1) == f.value("world_size", 1)) {
        base = cfg;
        break;
      }
    }
    if (base.is_null()) continue;
    base["memory_budget"] = f.value("budget", "none");
    RunConfig c = RunConfig::from_json(base);
    const int64_t budget = memory_budget_bytes(c);
    if (budget <= 0) continue;
    const bool cuda = base.value("device", "cpu").rfind("cuda", 0) == 0;
    auto fits = [&](int64_t b) {
      c.batch_size = b;
      return predict_memory(setup_for(c, cuda, device)).peak <= budget;
    };
    int64_t lo = 0, hi = 1;
    while (hi <= (int64_t{1} << 20) && fits(hi)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
    const double e = rel_error(static_cast<double>(lo), f["largest_batch"].get<double>());
    errors.frontier.push_back(e);
    frontier.push_back({{"model", f["model"]}, {"precision", f["precision"]}, {"checkpoint", f["checkpoint"]},
                        {"budget", f["budget"]}, {"predicted_largest_batch", lo}, {"measured_largest_batch", f["largest_batch"]},
                        {"error", e}});
  }
  return frontier;
}

}  // namespace

json check_report(const json& report, const json& hardware) {
  std::optional<DeviceProfile> device;
  if (!hardware.is_null()) device = measured_profile(hardware, hardware.value("source", std::string("hardware report")));
  Errors errors;
  json cells = json::array();
  for (const auto& cell : report.value("cells", json::array()))
    if (json row = check_cell(cell, device, errors); !row.is_null()) cells.push_back(row);
  const json frontier = check_frontier(report, device, errors);
  return {{"cells", cells},
          {"frontier", frontier},
          {"summary", {{"peak", distribution(errors.peak)}, {"model_state", distribution(errors.state)},
                       {"step_time", distribution(errors.step)}, {"comm_time", distribution(errors.comm)},
                       {"frontier", distribution(errors.frontier)}}}};
}

std::string render_check(const json& check) {
  std::string out;
  char line[512];
  auto summary = [&](const char* what, const json& d) {
    if (!d.is_object()) return;
    std::snprintf(line, sizeof line, "%s: %lld cells, median |error| %.2f%%, worst %.2f%%\n", what,
                  static_cast<long long>(d["count"].get<int64_t>()), 100 * d["median_abs"].get<double>(),
                  100 * d["worst_abs"].get<double>());
    out += line;
  };
  std::snprintf(line, sizeof line, "%-44s %12s %12s %8s %8s %10s %10s %8s %8s  %s\n", "cell", "peak pred", "peak meas", "err", "state",
                "step pred", "step meas", "err", "comm err", "bound");
  out += line;
  for (const auto& r : check["cells"]) {
    if (r.contains("skipped")) {
      out += r["cell"].get<std::string>() + ": not planned: " + r["skipped"].get<std::string>() + "\n";
      continue;
    }
    const json& tp = r["predicted"].value("time", json::object());
    // An error the check did not compute (a step under 10 ms, a cell without collectives) prints "-".
    auto pct = [&r](const char* key, int decimals) {
      char buf[32];
      if (!r.contains(key)) return std::string("-");
      std::snprintf(buf, sizeof buf, "%+.*f%%", decimals, 100 * r[key].get<double>());
      return std::string(buf);
    };
    std::snprintf(line, sizeof line, "%-44s %12lld %12lld %8s %8s %8.2fms %8.2fms %8s %8s  %s\n", r["cell"].get<std::string>().c_str(),
                  static_cast<long long>(r["predicted"]["peak_bytes"].get<int64_t>()),
                  static_cast<long long>(r["measured"].value("peak_bytes", int64_t{0})), pct("peak_error", 2).c_str(),
                  pct("model_state_error", 3).c_str(), 1e3 * tp.value("step_s", 0.0), 1e3 * r["measured"].value("step_time_s", 0.0),
                  pct("step_error", 1).c_str(), pct("comm_error", 1).c_str(), tp.value("bound", std::string()).c_str());
    out += line;
  }
  for (const auto& f : check.value("frontier", json::array())) {
    std::snprintf(line, sizeof line, "frontier %s/%s/%s under %s: largest batch predicted %lld, measured %lld (%+.1f%%)\n",
                  f["model"].get<std::string>().c_str(), f["precision"].get<std::string>().c_str(),
                  f["checkpoint"].get<std::string>().c_str(), f["budget"].get<std::string>().c_str(),
                  static_cast<long long>(f["predicted_largest_batch"].get<int64_t>()),
                  static_cast<long long>(f["measured_largest_batch"].get<int64_t>()), 100 * f["error"].get<double>());
    out += line;
  }
  const json& s = check["summary"];
  out += "\n";
  summary("peak memory", s["peak"]);
  summary("model state", s["model_state"]);
  summary("step time (steps >= 10 ms)", s["step_time"]);
  summary("communication per step", s["comm_time"]);
  summary("frontier's largest batch", s["frontier"]);
  return out;
}

}  // namespace trainscope::plan
