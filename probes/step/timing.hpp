#pragma once
// Timing probe: step time and its forward/backward/optimizer split, throughput, FLOP/s and MFU.
//
// CPU: host steady clock. CUDA (torch CUDA builds): CUDA events on the current stream, resolved once
// at run end so the loop never waits on them. Warm-up steps are not measured.
#include <array>
#include <map>
#include <memory>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

// Best-of-n GEMM throughput (FLOP/s) for `dtype` ("fp32", "tf32", "bf16", "fp16", "fp8", "fp64") on
// `device`: the MFU denominator. Square matrices sized for the device (1024 on CPU, 8192 on GPU).
double measure_gemm_peak(const std::string& device, const std::string& dtype, int repeats = 5);

// The five time points of a step: begin, forward end, backward end, optimizer end, step end.
class StepClock {
 public:
  virtual ~StepClock() = default;
  virtual void mark(int point) = 0;
  virtual void finish_step() = 0;
  // Per finished step, in seconds: forward, backward, optimizer, whole step.
  virtual std::vector<std::array<double, 4>> resolve() = 0;
  virtual std::string kind() const = 0;
};
std::unique_ptr<StepClock> make_step_clock(const std::string& device);

class TimingProbe : public Probe {
 public:
  explicit TimingProbe(bool measure_peak = true) : measure_peak_(measure_peak) {}
  std::string name() const override { return "timing"; }
  void run_begin(const RunInfo& info) override;
  void step_begin(const StepInfo& s) override { mark(s, 0); }
  void forward_end(const StepInfo& s) override {
    mark(s, 1);
    if (s.measured && s.pipeline.span_s > 0) pipeline_.push_back(s.pipeline);
  }
  void backward_end(const StepInfo& s) override { mark(s, 2); }
  void optimizer_end(const StepInfo& s) override { mark(s, 3); }
  void step_end(const StepInfo& s) override;
  void run_end(const RunEnd&) override;
  json section() const override;

 private:
  void mark(const StepInfo& s, int point) {
    if (s.measured) clock_->mark(point);
  }
  RunInfo info_;
  bool measure_peak_;
  std::map<std::string, double> gemm_peaks_;  // dtype -> measured FLOP/s (the ones MFU's convention needs)
  std::string peak_source_;
  std::unique_ptr<StepClock> clock_;
  std::vector<std::array<double, 4>> steps_;
  std::vector<double> step_ends_;  // host seconds at each measured step's end: throughput over the run
  int64_t samples_per_step_ = 0;
  std::vector<StepInfo::Pipeline> pipeline_;  // per measured step, when a pipeline schedule ran it
  json pipeline_section() const;
  std::vector<StepInfo::Context> context_;  // per measured step, under context parallelism
  json context_section() const;
};

// Throughput per window of `window_s` seconds of the measured steps (step ends binned by host time):
// [{"start_s", "samples_per_s", "steps"}], full windows only, plus the drop from the first to the last
// window (throttling shows as a drop). Null drop with fewer than two full windows.
json throughput_windows(const std::vector<double>& step_ends, int64_t samples_per_step, double window_s);

}  // namespace trainscope::probes
