#pragma once
// The GPU timeline's arithmetic, free of CUDA so that every CI run tests it: kernel intervals are
// classified by name (Holistic Trace Analysis' rules), merged per kind, and the overlap of
// communication with computation is the time both are active over the merged communication time.
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"

namespace trainscope::probes {

struct Interval {
  int64_t start = 0, end = 0;  // ns, end exclusive
  int64_t length() const { return end > start ? end - start : 0; }
};

enum class KernelKind { Compute, Communication, Memory };

// HTA: communication is `^nccl`, `ncclKernel` (older NCCL) and the ROCm/Habana collectives; memory is
// Memcpy / Memset / dma; everything else is computation. The name after the prefix is never parsed:
// NCCL's names are hints, not contracts.
KernelKind classify_kernel(const std::string& name);

struct KernelRecord {
  std::string name;
  Interval span;
  uint32_t stream = 0;
  KernelKind kind = KernelKind::Compute;
};

// Sorted, disjoint union of the intervals (touching intervals join).
std::vector<Interval> merge_intervals(std::vector<Interval> intervals);
int64_t total_length(const std::vector<Interval>& merged);
// Length of the intersection of two merged (sorted, disjoint) lists.
int64_t intersection_length(const std::vector<Interval>& a, const std::vector<Interval>& b);
// The intervals clipped to [window.start, window.end).
std::vector<Interval> clip(const std::vector<Interval>& intervals, const Interval& window);

struct TimelineSummary {
  int64_t window_ns = 0;       // first kernel start to last kernel end (or the given window)
  int64_t compute_ns = 0;      // merged compute kernel time
  int64_t communication_ns = 0;
  int64_t memory_ns = 0;
  int64_t overlap_ns = 0;      // communication while computation runs
  int64_t exposed_ns = 0;      // communication with no computation beside it
  int64_t idle_ns = 0;         // the window with no kernel or copy at all: launch- or host-bound time
  int64_t kernels = 0;
  struct Top {
    std::string name;
    KernelKind kind;
    int64_t total_ns, count;
  };
  std::vector<Top> top;        // by total time, longest first
  double overlap_ratio() const { return communication_ns > 0 ? static_cast<double>(overlap_ns) / communication_ns : 0.0; }
};

// `window` empty (length 0): the records' own extent.
TimelineSummary summarize(const std::vector<KernelRecord>& records, Interval window = {}, size_t top = 10);

// The report's `metrics.timeline`, per step (totals divided by `steps`, the measured steps the window
// covers), in seconds.
json timeline_section(const TimelineSummary& s, int64_t steps, int64_t dropped_records);

const char* kernel_kind_name(KernelKind k);

}  // namespace trainscope::probes
