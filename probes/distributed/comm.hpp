#pragma once
// Communication probe: every collective the parallel layer ran, grouped by operation and size, with
// nccl-tests' algbw and busbw (docs/metrics.md), and per measured step the communication time, the part
// the step waited on (exposed) and the overlap fraction. hsdp's collectives run on sub-groups: their
// rows name the level (intra-node / inter-node) and take busbw's factor from the group's size.
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/hooks.hpp"

namespace trainscope::probes {

// nccl-tests' bus-bandwidth factor: busbw = algbw x factor. All-reduce 2(n-1)/n; reduce-scatter,
// all-gather and all-to-all (n-1)/n; broadcast 1. Throws on an unknown operation.
double bus_factor(const std::string& op, int64_t ranks);

class CommProbe : public Probe {
 public:
  std::string name() const override { return "comm"; }
  void run_begin(const RunInfo& info) override;
  void step_begin(const StepInfo& s) override;
  void optimizer_end(const StepInfo& s) override;
  void collective(const CollectiveInfo& c) override;
  json section() const override;

 private:
  struct Group {
    int64_t count = 0, ranks = 1;
    double time_s = 0;
  };
  using Key = std::tuple<std::string, std::string, std::string, int64_t>;  // (dimension, level, op, bytes)
  RunInfo info_;
  int64_t warmup_ = 0;
  std::map<Key, Group> groups_;  // measured steps
  std::map<Key, Group> setup_;   // outside steps: initial broadcast, final gather
  std::map<int64_t, double> comm_, exposed_;                  // per measured step
  std::map<std::string, double> level_comm_, level_exposed_;  // per level, measured steps
  std::map<std::string, double> dim_comm_, dim_exposed_, dim_bytes_;  // per mesh dimension, measured steps
  std::vector<double> step_wall_;
  double step_start_ = 0;
};

}  // namespace trainscope::probes
