#include "plan/calibrate.hpp"

#include "plan/step.hpp"
#include "plan/time.hpp"

namespace trainscope::plan {

namespace {

struct Sums {
  std::map<std::string, std::pair<double, double>> measured, predicted;  // kind -> forward, backward
  double outside_forward = 0, outside_backward = 0, operators = 0;
  double optimizer_measured = 0, optimizer_predicted = 0;
  std::vector<std::string> cells;
};

}  // namespace

void calibrate_in_step(DeviceProfile& d, const json& report) {
  if (d.gpu) return;
  const DeviceProfile raw = d;  // predictions at the measured rates, before any calibration
  std::map<std::string, Sums> by_dtype;
  for (const auto& cell : report.value("cells", json::array())) {
    if (cell.value("status", "") != "ok" || !cell.value("metrics", json()).is_object()) continue;
    // A section this build did not write (or a damaged one) calibrates nothing.
    const json ops = cell["metrics"].value("operators", json());
    const json walls = ops.is_object() ? ops.value("phase_wall_s", json()) : json();
    const json self = ops.is_object() ? ops.value("self_s", json()) : json();
    auto number = [](const json& o, const std::string& k) { return o.is_object() && o.contains(k) && o[k].is_number(); };
    if (!number(walls, "forward") || !number(walls, "backward") || !number(walls, "optimizer") || !self.is_object() ||
        !self.value("forward", json()).is_object() || !self.value("backward", json()).is_object())
      continue;
    auto seconds = [&number](const json& o, const std::string& k) { return number(o, k) ? o[k].get<double>() : 0.0; };
    RunConfig c;
    StepSetup setup;
    MemoryPrediction m;
    try {  // a cell the replay does not cover calibrates nothing
      c = RunConfig::from_json(cell["config"]);
      if (c.world_size != 1 || c.method != "supervised") continue;
      setup = step_setup(c, false);
      m = predict_memory(setup);
    } catch (const std::exception&) {
      continue;
    }
    const TimePrediction t = predict_time(setup, m, raw, Cluster{1, 1});
    const std::string dtype = raw.has(setup.replay.num.gemm_dtype) ? setup.replay.num.gemm_dtype : "fp32";
    Sums& s = by_dtype[dtype];
    s.cells.push_back(cell.value("name", ""));
    double kernels_forward = 0, kernels_backward = 0;
    for (const auto& [kind, fb] : t.breakdown.items()) {
      if (kind == "per_operator") continue;
      const double mf = seconds(self["forward"], kind), mb = seconds(self["backward"], kind);
      s.measured[kind].first += mf;
      s.measured[kind].second += mb;
      s.predicted[kind].first += fb.value("forward_s", 0.0);
      s.predicted[kind].second += fb.value("backward_s", 0.0);
      kernels_forward += mf;
      kernels_backward += mb;
    }
    // Whatever the steps did outside the kinds the replay costs (dispatch, autograd's nodes, kernels
    // it has no kind for) is the per-operator cost.
    s.outside_forward += std::max(0.0, walls["forward"].get<double>() - kernels_forward);
    s.outside_backward += std::max(0.0, walls["backward"].get<double>() - kernels_backward);
    s.operators += t.breakdown["per_operator"].value("operators", 0.0);
    s.optimizer_measured += walls["optimizer"].get<double>();
    s.optimizer_predicted += t.optimizer_s;
  }
  for (const auto& [dtype, s] : by_dtype) {
    DeviceProfile::InStep cal;
    cal.cells = s.cells;
    double mf = 0, mb = 0, pf = 0, pb = 0;
    for (const auto& [kind, p] : s.predicted) {
      const auto& m = s.measured.at(kind);
      if (p.first > 0 && m.first > 0) cal.factor[kind].first = m.first / p.first;
      if (p.second > 0 && m.second > 0) cal.factor[kind].second = m.second / p.second;
      if (!cal.factor.count(kind)) continue;
      mf += m.first, mb += m.second, pf += p.first, pb += p.second;
    }
    // A kind calibrated in one direction only takes the pooled ratio in the other.
    cal.kernels_forward = pf > 0 ? mf / pf : 1.0;
    cal.kernels_backward = pb > 0 ? mb / pb : 1.0;
    for (auto& [kind, f] : cal.factor) {
      if (f.first <= 0) f.first = cal.kernels_forward;
      if (f.second <= 0) f.second = cal.kernels_backward;
    }
    cal.op_s = s.operators > 0 ? s.outside_forward / s.operators : d.op_overhead_s;
    cal.node_s = s.operators > 0 ? s.outside_backward / s.operators : d.backward_node_s;
    cal.optimizer = s.optimizer_predicted > 0 && s.optimizer_measured > 0 ? s.optimizer_measured / s.optimizer_predicted : 1.0;
    d.in_step[dtype] = cal;
  }
  if (!by_dtype.empty()) {
    std::string cells;
    for (const auto& [dtype, s] : by_dtype) cells += (cells.empty() ? "" : ", ") + dtype + ": " + std::to_string(s.cells.size());
    d.sources["in_step"] = "each operator kind's self time inside the steps of the hardware suite's calibration cells (" + cells +
                           " cells) over its prediction from the rates above";
  }
}

}  // namespace trainscope::plan
