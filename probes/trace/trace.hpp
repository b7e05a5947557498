#pragma once
// Trace probe (`trace = true`, `trainscope run --trace`): a Chrome Trace Event / Perfetto timeline of
// one rank. Track 1 holds the steps with their phases nested inside (forward, backward, optimizer),
// track 2 the collectives (bytes and busbw as arguments), counters the live tensor bytes and the loss
// scale. Timestamps are the host's monotonic clock in microseconds, which every process on a machine
// shares, so the ranks of a cell line up when their files are merged (runners: one file per cell).
// On CUDA the host times are launch times, not kernel times (the CUPTI timeline is the GPU's).
#include <chrono>
#include <string>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

class TraceProbe : public Probe {
 public:
  TraceProbe(std::string path, int rank) : path_(std::move(path)), rank_(rank) {}
  std::string name() const override { return "trace"; }
  void step_begin(const StepInfo& s) override;
  void forward_end(const StepInfo& s) override;
  void backward_end(const StepInfo& s) override;
  void optimizer_end(const StepInfo& s) override;
  void step_end(const StepInfo& s) override;
  void collective(const CollectiveInfo& c) override;
  void run_end(const RunEnd&) override;  // writes the file
  json section() const override { return json{{"file", path_}, {"events", events_.size()}}; }

 private:
  double now_us() const;
  void span(const std::string& name, int tid, double begin_us, double end_us, json args = json::object());
  std::string path_;
  int rank_;
  double step_begin_us_ = 0, phase_begin_us_ = 0;
  std::vector<json> events_;
};

// Merges per-rank trace files into one trace (one process per rank), written atomically to `out`.
void merge_traces(const std::vector<std::string>& rank_files, const std::string& out);

}  // namespace trainscope::probes
