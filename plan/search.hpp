#pragma once
// The search behind `trainscope plan`: every candidate configuration of a model on a cluster
// (precision x layout (data-parallel strategy x tensor parallelism) x checkpoint policy x attention x
// micro-batch, gradient accumulation to the global batch), each replayed for its memory per rank and
// timed on the device profile; the ones that fit ranked by throughput, the others with the reason
// they do not fit, and a recommendation.
#include <map>
#include <string>

#include "core/config.hpp"
#include "core/model_shape.hpp"
#include "plan/device.hpp"
#include "plan/time.hpp"

namespace trainscope::plan {

struct PlanRequest {
  ModelShape model;                 // resolved (seq_len included)
  Cluster cluster;
  DeviceProfile device;
  int64_t global_tokens = 0;        // tokens per optimizer step; 0: 2^20 rounded to whole sequences per rank
  double headroom = 0.10;           // fraction of device memory kept free
  std::map<std::string, std::string> fixed;  // axis -> value: precision, parallel, tp, checkpoint, attention,
                                             // batch_size; settings not searched: reduce_dtype,
                                             // reshard_after_forward, cross_entropy, sequence_parallel (on with tp)
};

// The CUDA caching allocator's peak reserved over its peak allocated, for the candidates' reserved
// bytes: the median over the distinct H200 cells of at least 1 GB in tests/data/h200 (1.02 to 1.16;
// a test recomputes it). Published runs print reserved memory (torchtitan's memory line); whether a
// configuration fits is judged on allocated bytes.
inline constexpr double kReservedOverAllocated = 1.05;

// The plan as JSON ("schema": "trainscope.plan/1", reports/schema/plan.schema.json).
json make_plan(const PlanRequest& r);

// A single cell's prediction (the same replay and time model) for a configuration, on `device`:
// what `trainscope run` reports can carry beside its measurement.
json predict_config(const RunConfig& c, const DeviceProfile& device, bool cuda);

}  // namespace trainscope::plan
