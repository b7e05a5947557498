#include "probes/distributed/comm.hpp"

#include <chrono>
#include <stdexcept>

namespace trainscope::probes {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

double bus_factor(const std::string& op, int64_t ranks) {
  const double n = static_cast<double>(ranks);
  if (op == "broadcast" || op == "send" || op == "recv") return 1.0;  // nccl-tests' sendrecv: busbw = algbw
  if (ranks <= 1) return 0.0;
  if (op == "all-reduce") return 2.0 * (n - 1) / n;
  if (op == "all-gather" || op == "reduce-scatter" || op == "all-to-all") return (n - 1) / n;
  throw std::invalid_argument("no bus-bandwidth factor for collective '" + op + "'");
}

void CommProbe::run_begin(const RunInfo& info) {
  info_ = info;
  warmup_ = info.config ? info.config->warmup_steps : 0;
}

void CommProbe::step_begin(const StepInfo& s) {
  if (s.measured) step_start_ = now_s();
}

void CommProbe::optimizer_end(const StepInfo& s) {
  if (!s.measured) return;
  step_wall_.push_back(now_s() - step_start_);
  comm_.try_emplace(s.step, 0.0);
  exposed_.try_emplace(s.step, 0.0);
}

void CommProbe::collective(const CollectiveInfo& c) {
  const Key key{c.dimension, c.level, c.op, c.bytes};
  if (c.step < warmup_) {
    if (c.step < 0) {
      auto& g = setup_[key];
      ++g.count;
      g.ranks = c.group_size;
      g.time_s += c.seconds;
    }
    return;
  }
  auto& g = groups_[key];
  ++g.count;
  g.ranks = c.group_size;
  if (!c.level.empty()) {
    level_comm_[c.level] += c.seconds;
    level_exposed_[c.level] += c.exposed_s;
  }
  if (!c.dimension.empty()) {
    dim_comm_[c.dimension] += c.seconds;
    dim_exposed_[c.dimension] += c.exposed_s;
    dim_bytes_[c.dimension] += static_cast<double>(c.bytes);
  }
  g.time_s += c.seconds;
  comm_[c.step] += c.seconds;
  exposed_[c.step] += c.exposed_s;
}

json CommProbe::section() const {
  auto rows = [&](const std::map<Key, Group>& groups) {
    json out = json::array();
    for (const auto& [key, g] : groups) {
      const auto& [dimension, level, op, bytes] = key;
      const double t = g.time_s / static_cast<double>(g.count);
      const double algbw = t > 0 ? static_cast<double>(bytes) / t / 1e9 : 0.0;
      json row{{"op", op},
               {"bytes", bytes},
               {"count", g.count},
               {"time_s", t},
               {"algbw_gbps", algbw},
               {"busbw_gbps", algbw * bus_factor(op, g.ranks)}};
      if (!level.empty()) {
        row["level"] = level;
        row["group_size"] = g.ranks;
      }
      if (!dimension.empty()) row["dimension"] = dimension;
      out.push_back(row);
    }
    return out;
  };
  double comm = 0, exposed = 0, wall = 0;
  for (const auto& [step, t] : comm_) comm += t;
  for (const auto& [step, t] : exposed_) exposed += t;
  for (double w : step_wall_) wall += w;
  const double steps = static_cast<double>(std::max<size_t>(comm_.size(), 1));
  json j{{"world_size", info_.world_size},
         {"implementation", info_.collectives},
         {"collectives", rows(groups_)},
         {"outside_steps", rows(setup_)},
         {"steps", comm_.size()},
         {"comm_time_s", comm / steps},
         {"exposed_comm_time_s", exposed / steps}};
  // Per level (hsdp's groups; a world that spans hosts is inter-node): time per measured step.
  if (!level_comm_.empty()) {
    json levels = json::object();
    for (const auto& [level, t] : level_comm_)
      levels[level] = {{"comm_time_s", t / steps}, {"exposed_comm_time_s", level_exposed_.at(level) / steps}};
    j["levels"] = levels;
  }
  // Per mesh dimension (tp's collectives apart from the data-parallel ones): time and bytes per measured step.
  if (!dim_comm_.empty()) {
    json dims = json::object();
    for (const auto& [dim, t] : dim_comm_)
      dims[dim] = {{"comm_time_s", t / steps}, {"exposed_comm_time_s", dim_exposed_.at(dim) / steps},
                   {"bytes", dim_bytes_.at(dim) / steps}};
    j["dimensions"] = dims;
  }
  // overlap = 1 - exposed / total; with no communication there is nothing to overlap.
  j["overlap"] = comm > 0 ? json(1.0 - exposed / comm) : json(nullptr);
  j["exposed_fraction_of_step"] = wall > 0 ? json(exposed / wall) : json(nullptr);
  return j;
}

}  // namespace trainscope::probes
