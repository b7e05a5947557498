#pragma once
// What the planner knows of a device: from a measured hardware report (`trainscope run --suite
// hardware` on that machine) or, without one, from the datasheet with stated default efficiencies.
// Every number carries where it came from.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "plan/curve.hpp"

namespace trainscope::plan {

struct DeviceProfile {
  std::string name;       // "H100-SXM", or the measured device's name
  std::string source;     // "datasheet" or the hardware report's path
  bool gpu = true;
  int64_t memory_bytes = 0;
  std::map<std::string, double> peak_flops;  // dtype -> the peak MFU is reported against (FLOP/s)
  std::map<std::string, double> gemm_rate;   // dtype -> the rate large GEMMs achieve (FLOP/s)
  std::map<std::string, Curve> gemm_curve;   // dtype -> achieved FLOP/s by FLOPs per GEMM (measured)
  std::map<std::string, Curve> batched_curve;
  std::map<std::string, Curve> gemm_workspace;  // dtype -> bytes a GEMM allocates beyond its product, by k (CPU)
  // dtype -> fused causal attention (SDPA on a GPU): forward and backward FLOP/s by forward FLOPs per
  // call (measured; none: attention costs as two batched GEMMs and its exponentials)
  std::map<std::string, std::pair<Curve, Curve>> attention;
  int64_t gpu_gemm_workspace = 0;  // bytes cuBLAS's workspaces keep on a GPU (measured)
  ConvScratch conv_workspace;  // CPU convolutions' scratch per measured shape (none: nothing added)
  double batch_norm_backward_ratio = 0;  // CPU: a batch norm's backward temporary over its input's bytes (measured)
  // dtype ("fp32", "bf16") -> kind ("activation", "softmax", "norm", "random") -> forward and backward
  // elements per second by elements (measured); none: the memory roofline.
  std::map<std::string, std::map<std::string, std::pair<Curve, Curve>>> elementwise;
  Curve bandwidth;                           // bytes/s by bytes moved per operator
  double op_overhead_s = 0, backward_node_s = 0;
  std::map<std::string, Curve> busbw;  // collective op -> bus bandwidth (bytes/s) by bytes, within a node
  // The same per world size the hardware suite swept (its `collectives` cells): a collective over n
  // ranks takes the sweep nearest n (on a CPU, ranks share the cores: 4 ranks' small collectives are
  // not 2 ranks' scaled by the ring factor).
  std::map<int64_t, std::map<std::string, Curve>> busbw_by_world;
  double latency_s = 0;                // per collective, within a node
  double inter_busbw = 0, inter_latency_s = 0;  // across nodes (per GPU)
  int64_t cores = 0;                   // CPU: the cores the measurements used
  // The hardware suite's calibration cells (plan/calibrate.hpp), per GEMM dtype: what each operator
  // kind took inside their steps over what this profile predicts for it, the per-operator and
  // per-backward-node cost the steps left outside the kernels, and the optimizer's ratio.
  struct InStep {
    std::map<std::string, std::pair<double, double>> factor;  // kind -> forward, backward
    double kernels_forward = 1, kernels_backward = 1;         // every kind pooled: a kind none of them ran
    double op_s = 0, node_s = 0;
    double optimizer = 1;
    std::vector<std::string> cells;
  };
  std::map<std::string, InStep> in_step;
  json sources = json::object();       // quantity -> where it came from

  bool has(const std::string& dtype) const { return gemm_rate.count(dtype) > 0; }
  // Seconds of one GEMM (batch x m x n x k) in `dtype`.
  double gemm_seconds(const std::string& dtype, double m, double n, double k, double batch) const;
  double memory_seconds(double bytes) const;
  // Seconds of a compute-bound elementwise kernel (kind: activation, softmax, norm, random) over
  // `elements` of `elem` bytes, forward or backward: at the measured rate, else the memory roofline.
  // `on_chip`: inside a fused kernel, so without a measured rate it costs nothing beyond its GEMMs.
  double elementwise_seconds(const std::string& kind, double elements, int elem, bool backward, bool on_chip = false) const;
  // Forward and backward seconds of fused causal attention over `heads` (batch x heads) of S x S x Dh,
  // at the measured rate; nullopt-like {0, 0} when this dtype has no measurement.
  std::pair<double, double> attention_seconds(const std::string& dtype, double heads, double seq, double head_dim) const;
  // nccl-tests: time = latency + bytes x factor / busbw, factor 2(n-1)/n for all-reduce, (n-1)/n for
  // all-gather and reduce-scatter; `inter`: the ranks span nodes.
  double collective_seconds(const std::string& op, double bytes, int64_t ranks, bool inter) const;
  json to_json() const;
};

// The devices the datasheet table knows, by the names `plan --device` takes.
std::vector<std::string> datasheet_devices();
// UsageError naming the known devices when `name` is none of them.
DeviceProfile datasheet_profile(const std::string& name);
// From a results folder (or report.json) of the hardware suite; UsageError when it has no
// measurements the planner can use.
DeviceProfile measured_profile(const json& hardware_report, const std::string& source);

}  // namespace trainscope::plan
