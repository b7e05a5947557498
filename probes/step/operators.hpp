#pragma once
// Operator-time probe (config `operator_times`): how long each kind of operator takes inside the
// training step, on this device, as the step runs it. The planner's calibration on a CPU (docs/plan.md,
// "Step time"): the hardware suite's rates are measured on operators run alone, which on a CPU run
// 1.3-2.5x faster than the same operators between the step's others (their operands out of cache, the
// intra-op threads woken for each). The hardware suite trains small calibration models with this
// probe on, shapes of their own; the planner divides what each kind took by what it predicted.
//
// Every operator's self time (its span minus the operators it called) goes to its kind: gemm, conv,
// attention, activation, softmax, norm, random, memory (every other kernel), or dispatch (views,
// allocation, composite operators' own code, autograd nodes' own work); what a convolution or a
// fused attention calls is theirs. RecordFunction callbacks cost
// about a microsecond per operator, so they run on every other measured step only; the phases' wall
// times come from the steps in between.
#include <array>
#include <string>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

// The kinds, in report order.
const std::vector<std::string>& operator_kinds();
// The kind of an ATen operator by its RecordFunction name ("aten::addmm" -> "gemm").
std::string operator_kind(const std::string& name);

class OperatorTimeProbe : public Probe {
 public:
  OperatorTimeProbe();
  ~OperatorTimeProbe() override;
  std::string name() const override { return "operators"; }
  void step_begin(const StepInfo& s) override;
  void forward_end(const StepInfo& s) override;
  void backward_end(const StepInfo& s) override;
  void optimizer_end(const StepInfo& s) override;
  void step_end(const StepInfo& s) override;
  json section() const override;

 private:
  void phase(const StepInfo& s, int next);
  uint64_t handle_ = 0;
  bool profiled_ = false;               // this step runs the callbacks
  int64_t profiled_steps_ = 0;
  double mark_ = 0;                     // the current phase's start (s)
  std::vector<std::array<double, 3>> walls_;  // unprofiled measured steps: forward, backward, optimizer
  std::array<double, 3> current_{};
  std::array<double, 3> profiled_walls_{};  // the profiled steps' phase walls, summed: what their self times fit in
};

}  // namespace trainscope::probes
