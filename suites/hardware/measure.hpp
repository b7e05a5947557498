#pragma once
// What the hardware suite and `trainscope peak` measure: the achievable GEMM FLOP/s per dtype over a
// sweep of shapes (stas00's mamf-finder method), the device memory bandwidth (a large copy) and the
// host-device copy bandwidth. Each result is JSON for the report, beside the datasheet when the
// device is known.
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope::suites {

class Communicator;

struct GemmShape {
  int64_t m, n, k;
};

// The dtypes a device can be asked for: cpu fp32, bf16, fp16; cuda also tf32 and fp8 (sm89+).
std::vector<std::string> peak_dtypes(const std::string& device);
// "" when `dtype` can run on `device`, else why not (fp8 needs sm89+, tf32 needs CUDA, ...).
std::string gemm_unsupported(const std::string& device, const std::string& dtype);
// The sweep: multiples of 256 near the shapes where published peaks were found; `thorough` is wider.
std::vector<GemmShape> peak_shapes(const std::string& device, bool thorough);

struct GemmTiming {
  GemmShape shape;
  double mean = 0, median = 0, max = 0;  // FLOP/s over the timed iterations (2·m·n·k each)
  int iterations = 0;
};

// mamf-finder: C = A·B with A [m,k] row-major and B a transposed [n,k] view, warm-up then timed
// iterations each timed on its own (CUDA events on a GPU, after an L2 flush), FLOPs 2·m·n·k.
GemmTiming time_gemm(const std::string& device, const std::string& dtype, const GemmShape& s, int warmup, int iterations);

// One dtype over the sweep: every shape, and the best by mean (the published statistic), median, max;
// beside the datasheet's dense peak where the device is known. {"dtype", "skipped": reason} when the
// dtype cannot run here.
json gemm_peak(const std::string& device, const std::string& dtype, bool thorough);

// Device memory bandwidth: copy_ of a large buffer (bytes read + written per second), best of
// several; against the datasheet's memory figure when known.
json memory_bandwidth(const std::string& device);
// Host to device and back through pinned memory; {"skipped"} without a GPU.
json copy_bandwidth(const std::string& device);

// nccl-tests' sweep on this cell's ranks: all-reduce, all-gather and reduce-scatter of fp32 buffers
// from 1 KiB up (x4) to 64 MiB on CPU, 1 GiB on GPU, `warmup` + `iterations` of each; the comm probe
// records them (iteration i is "step" i, so warm-up iterations are left out) and reports time, algbw
// and busbw per (op, size).
// Across hosts it also measures each level on its own groups (within a node, across nodes) and
// returns them ({"nodes", "ranks_per_node", "hosts", "rows": [{"level", "group_size", "op", "bytes",
// "time_s", "algbw_gbps", "busbw_gbps"}]}); null on one host.
json collectives_sweep(Communicator& comm, const std::string& device, int warmup, int iterations);

}  // namespace trainscope::suites
