#include "probes/device/timeline.hpp"

#include <algorithm>
#include <map>
#include <regex>

namespace trainscope::probes {

KernelKind classify_kernel(const std::string& name) {
  // HTA also counts every `^hip` kernel as communication; here only the collective libraries do.
  static const std::regex comm("(^nccl)|(^rccl)|(^hccl)|(ncclKernel)");
  static const std::regex memory("(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)");
  if (std::regex_search(name, comm)) return KernelKind::Communication;
  if (std::regex_search(name, memory)) return KernelKind::Memory;
  return KernelKind::Compute;
}

const char* kernel_kind_name(KernelKind k) {
  switch (k) {
    case KernelKind::Communication: return "communication";
    case KernelKind::Memory: return "memory";
    default: return "compute";
  }
}

std::vector<Interval> merge_intervals(std::vector<Interval> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](const Interval& i) { return i.length() == 0; }), v.end());
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
  std::vector<Interval> out;
  for (const auto& i : v) {
    if (!out.empty() && i.start <= out.back().end) out.back().end = std::max(out.back().end, i.end);
    else out.push_back(i);
  }
  return out;
}

int64_t total_length(const std::vector<Interval>& merged) {
  int64_t t = 0;
  for (const auto& i : merged) t += i.length();
  return t;
}

int64_t intersection_length(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  // Two pointers over sorted disjoint lists: each overlap of a[i] and b[j] counts once.
  int64_t t = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    t += std::max<int64_t>(0, std::min(a[i].end, b[j].end) - std::max(a[i].start, b[j].start));
    (a[i].end < b[j].end ? i : j) += 1;
  }
  return t;
}

std::vector<Interval> clip(const std::vector<Interval>& v, const Interval& w) {
  std::vector<Interval> out;
  for (const auto& i : v) {
    const Interval c{std::max(i.start, w.start), std::min(i.end, w.end)};
    if (c.length() > 0) out.push_back(c);
  }
  return out;
}

TimelineSummary summarize(const std::vector<KernelRecord>& records, Interval window, size_t top) {
  TimelineSummary s;
  std::vector<Interval> compute, comm, memory, all;
  std::map<std::pair<std::string, KernelKind>, std::pair<int64_t, int64_t>> by_name;  // total, count
  for (const auto& r : records) {
    (r.kind == KernelKind::Communication ? comm : r.kind == KernelKind::Memory ? memory : compute).push_back(r.span);
    all.push_back(r.span);
    auto& [total, count] = by_name[{r.name, r.kind}];
    total += r.span.length();
    ++count;
  }
  if (window.length() == 0 && !all.empty()) {
    window.start = std::min_element(all.begin(), all.end(), [](auto& a, auto& b) { return a.start < b.start; })->start;
    window.end = std::max_element(all.begin(), all.end(), [](auto& a, auto& b) { return a.end < b.end; })->end;
  }
  const auto mc = merge_intervals(clip(compute, window)), mm = merge_intervals(clip(comm, window));
  s.window_ns = window.length();
  s.compute_ns = total_length(mc);
  s.communication_ns = total_length(mm);
  s.memory_ns = total_length(merge_intervals(clip(memory, window)));
  s.overlap_ns = intersection_length(mc, mm);
  s.exposed_ns = s.communication_ns - s.overlap_ns;
  s.idle_ns = s.window_ns - total_length(merge_intervals(clip(all, window)));
  s.kernels = static_cast<int64_t>(records.size());
  for (const auto& [key, v] : by_name) s.top.push_back({key.first, key.second, v.first, v.second});
  std::sort(s.top.begin(), s.top.end(), [](const auto& a, const auto& b) {
    return a.total_ns != b.total_ns ? a.total_ns > b.total_ns : a.name < b.name;
  });
  if (s.top.size() > top) s.top.resize(top);
  return s;
}

json timeline_section(const TimelineSummary& s, int64_t steps, int64_t dropped) {
  const double per = 1e-9 / static_cast<double>(std::max<int64_t>(steps, 1));
  json top = json::array();
  for (const auto& t : s.top)
    top.push_back({{"name", t.name}, {"kind", kernel_kind_name(t.kind)}, {"time_s", t.total_ns * per},
                   {"count_per_step", static_cast<double>(t.count) / std::max<int64_t>(steps, 1)}});
  return json{{"available", true},
              {"source", "cupti-activity"},
              {"steps", steps},
              {"kernels", s.kernels},
              {"dropped_records", dropped},
              {"window_s", s.window_ns * per},
              {"compute_s", s.compute_ns * per},
              {"communication_s", s.communication_ns * per},
              {"memory_s", s.memory_ns * per},
              {"overlap_s", s.overlap_ns * per},
              {"exposed_communication_s", s.exposed_ns * per},
              {"idle_s", s.idle_ns * per},
              {"overlap", s.communication_ns > 0 ? json(s.overlap_ratio()) : json(nullptr)},
              {"idle_fraction", s.window_ns > 0 ? json(static_cast<double>(s.idle_ns) / s.window_ns) : json(nullptr)},
              {"top_kernels", top}};
}

}  // namespace trainscope::probes
