#include "probes/trace/trace.hpp"

#include <fstream>

#include "probes/distributed/comm.hpp"
#include "probes/step/memory.hpp"

namespace trainscope::probes {

double TraceProbe::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void TraceProbe::span(const std::string& name, int tid, double begin_us, double end_us, json args) {
  events_.push_back({{"name", name}, {"ph", "X"}, {"pid", rank_}, {"tid", tid}, {"ts", begin_us},
                     {"dur", std::max(0.0, end_us - begin_us)}, {"args", std::move(args)}});
}

void TraceProbe::step_begin(const StepInfo&) { step_begin_us_ = phase_begin_us_ = now_us(); }

void TraceProbe::forward_end(const StepInfo&) {
  const double t = now_us();
  span("forward", 1, phase_begin_us_, t);
  phase_begin_us_ = t;
}

void TraceProbe::backward_end(const StepInfo&) {
  const double t = now_us();
  span("backward", 1, phase_begin_us_, t);
  phase_begin_us_ = t;
}

void TraceProbe::optimizer_end(const StepInfo&) {
  const double t = now_us();
  span("optimizer", 1, phase_begin_us_, t);
  phase_begin_us_ = t;
}

void TraceProbe::step_end(const StepInfo& s) {
  const double t = now_us();
  // HTA and the PyTorch profiler name step spans ProfilerStep#N.
  span("ProfilerStep#" + std::to_string(s.step), 1, step_begin_us_, t,
       {{"step", s.step}, {"measured", s.measured}, {"skipped", s.skipped}});
  events_.push_back({{"name", "live tensor bytes"}, {"ph", "C"}, {"pid", rank_}, {"ts", t},
                     {"args", {{"bytes", AccountingAllocator::current()}}}});
  if (s.loss_scale > 0)
    events_.push_back({{"name", "loss scale"}, {"ph", "C"}, {"pid", rank_}, {"ts", t}, {"args", {{"scale", s.loss_scale}}}});
}

void TraceProbe::collective(const CollectiveInfo& c) {
  // Reported at completion (or later, with its completion time): it began `seconds` before that.
  const double end = c.end_s > 0 ? c.end_s * 1e6 : now_us(), begin = end - c.seconds * 1e6;
  const double algbw = c.seconds > 0 ? static_cast<double>(c.bytes) / c.seconds / 1e9 : 0.0;
  span(c.op, 2, begin, end,
       {{"bytes", c.bytes}, {"group_size", c.group_size}, {"algbw_gbps", algbw},
        {"busbw_gbps", algbw * bus_factor(c.op, c.group_size)}, {"exposed_us", c.exposed_s * 1e6}, {"step", c.step}});
}

void TraceProbe::run_end(const RunEnd&) {
  json events = json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"sort_index", rank_}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 1}, {"args", {{"name", "steps and phases"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 2}, {"args", {{"name", "communication"}}}});
  for (auto& e : events_) events.push_back(std::move(e));
  events_.clear();
  std::ofstream(path_) << json{{"traceEvents", events}, {"displayTimeUnit", "ms"},
                               {"distributedInfo", {{"rank", rank_}}}}.dump()
                       << "\n";
}

void merge_traces(const std::vector<std::string>& rank_files, const std::string& out) {
  json events = json::array();
  for (const auto& f : rank_files) {
    std::ifstream in(f);
    if (!in) continue;
    const json t = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!t.is_object() || !t.contains("traceEvents")) continue;
    for (const auto& e : t["traceEvents"]) events.push_back(e);
  }
  const std::string tmp = out + ".tmp";
  std::ofstream(tmp) << json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  std::rename(tmp.c_str(), out.c_str());
}

}  // namespace trainscope::probes
