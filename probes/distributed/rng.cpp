#include "probes/distributed/rng.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

namespace trainscope::probes {
namespace {

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string join_ranks(const std::vector<int64_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

void RngProbe::run_begin(const RunInfo& info) {
  if (info.config) last_step_ = info.config->warmup_steps + info.config->steps - 1;
}

json RngProbe::section() const {
  json rows = json::array();
  for (const auto& f : records_) rows.push_back({f.stream, f.cls, f.step, hex(f.value)});
  json spread = json::array();
  for (const auto& [step, d] : spread_) spread.push_back({step, d});
  return json{{"every", every_}, {"fingerprints", rows}, {"parameter_spread", spread}};
}

json compare_rng(const std::vector<json>& rank_sections) {
  // stream -> class, and stream -> step -> value per rank
  std::map<std::string, std::string> cls;
  std::vector<std::string> order;
  std::map<std::string, std::map<int64_t, std::map<int64_t, std::string>>> seen;
  for (size_t r = 0; r < rank_sections.size(); ++r) {
    const json& s = rank_sections[r];
    if (!s.is_object() || !s.contains("fingerprints")) continue;
    for (const auto& row : s["fingerprints"]) {
      const std::string stream = row.at(0);
      if (!cls.count(stream)) order.push_back(stream);
      cls[stream] = row.at(1);
      seen[stream][row.at(2).get<int64_t>()][static_cast<int64_t>(r)] = row.at(3);
    }
  }
  json streams = json::array();
  int64_t violations = 0;
  for (const auto& name : order) {
    const bool must_match = cls[name] == "must-match";
    json entry{{"name", name}, {"class", cls[name]}, {"verdict", "ok"}, {"first_violation_step", nullptr},
               {"ranks", json::array()}, {"steps_compared", 0}};
    int64_t compared = 0;
    for (const auto& [step, by_rank] : seen[name]) {
      if (by_rank.size() < 2) continue;
      ++compared;
      std::map<std::string, std::vector<int64_t>> groups;  // value -> ranks holding it
      for (const auto& [rank, value] : by_rank) groups[value].push_back(rank);
      std::vector<int64_t> bad;
      std::string detail;
      if (must_match && groups.size() > 1) {
        // The ranks outside the largest agreeing group (all of them when no group is larger).
        size_t largest = 0;
        for (const auto& [v, rs] : groups) largest = std::max(largest, rs.size());
        const bool tie = std::count_if(groups.begin(), groups.end(),
                                       [&](const auto& g) { return g.second.size() == largest; }) > 1;
        for (const auto& [v, rs] : groups)
          if (tie || rs.size() < largest) bad.insert(bad.end(), rs.begin(), rs.end());
        detail = "must match on every rank but differs at step " + std::to_string(step);
      } else if (!must_match) {
        for (const auto& [v, rs] : groups)
          if (rs.size() > 1) bad.insert(bad.end(), rs.begin(), rs.end());
        if (!bad.empty()) detail = "identical on ranks " + join_ranks(bad) + " at step " + std::to_string(step) +
                                   ": no diversity across ranks";
      }
      if (!bad.empty() && entry["verdict"] == "ok") {
        std::sort(bad.begin(), bad.end());
        entry["verdict"] = "violated";
        entry["first_violation_step"] = step;
        entry["ranks"] = bad;
        entry["detail"] = detail;
        ++violations;
      }
    }
    entry["steps_compared"] = compared;
    if (compared == 0) entry["verdict"] = "not compared";
    streams.push_back(entry);
  }
  json out{{"streams", streams}, {"violations", violations}, {"parameter_spread", nullptr}};
  for (const auto& s : rank_sections) {
    if (!s.is_object() || !s.contains("parameter_spread") || s["parameter_spread"].empty()) continue;
    double worst = 0;
    json first = nullptr;
    for (const auto& row : s["parameter_spread"]) {
      const double d = row.at(1);
      worst = std::max(worst, d);
      if (d > 0 && first.is_null()) first = row.at(0);
    }
    out["parameter_spread"] = {{"max", worst}, {"final", s["parameter_spread"].back().at(1)},
                               {"first_nonzero_step", first}, {"by_step", s["parameter_spread"]}};
    break;
  }
  return out;
}

}  // namespace trainscope::probes
