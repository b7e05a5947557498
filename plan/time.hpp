#pragma once
// Step time from what the replay recorded (each operator's GEMM shape or bytes) and the device
// profile: compute per operator (GEMMs at the rate measured for their size and dtype, memory-bound
// operators at the bandwidth measured for their size, a fixed cost per operator and backward node),
// backward as twice the forward's GEMMs and memory traffic, recompute as the checkpointed forward
// again, the optimizer as its passes over its tensors; communication per collective (latency + bytes x
// the nccl-tests factor / bus bandwidth) with each strategy's overlap rule. Torch-free.
#include <string>

#include "core/config.hpp"
#include "plan/device.hpp"
#include "plan/step.hpp"

namespace trainscope::plan {

struct Cluster {
  int64_t gpus_per_node = 1, nodes = 1;
  int64_t ranks() const { return gpus_per_node * nodes; }
};

struct TimePrediction {
  double forward_s = 0, backward_s = 0, recompute_s = 0, optimizer_s = 0;
  double compute_s = 0;        // per optimizer step (all micro-batches)
  double host_s = 0, device_s = 0;  // the host's dispatch and the kernels: compute_s is their sum on a CPU, the larger on a GPU
  double comm_s = 0;           // every collective of the step, end to end
  double exposed_comm_s = 0;   // what the step waits for (the overlap rule's remainder)
  double inter_comm_s = 0;     // hsdp: the part of it across nodes (the gradient slices' all-reduce)
  double bubble_s = 0;         // pipeline parallelism: the busiest rank's idle time in its schedule
  json pipeline;               // the schedule, its bubble and point-to-point transfers (null: none)
  double step_s = 0;
  std::string bound;           // compute | host dispatch (a GPU waiting on the host) | intra-node | inter-node communication
  json collectives = json::array();  // per op: bytes per call, calls, seconds, exposed seconds
  std::string overlap_rule;
  json breakdown = json::object();  // compute seconds per operator kind, forward and backward
  std::string in_step;         // how the kernels' times were calibrated in-step ("": the profile's rates as measured)
  json to_json() const;
};

// `accumulation` micro-batches per optimizer step (gradients synchronised once, at the last).
// `cpu_share`: the fraction of the measured compute rate each rank gets (CPU ranks sharing cores).
TimePrediction predict_time(const StepSetup& s, const MemoryPrediction& m, const DeviceProfile& d, const Cluster& c,
                            int64_t accumulation = 1, double cpu_share = 1.0);

}  // namespace trainscope::plan
