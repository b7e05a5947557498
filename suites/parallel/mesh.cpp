#include "suites/parallel/mesh.hpp"

#include <algorithm>

#include "core/errors.hpp"

namespace trainscope::suites {

Mesh::Mesh(Communicator* world, ParallelLayout layout) : world_(world), layout_(std::move(layout)), rank_(world ? world->rank() : 0) {
  strategy_layout_ = fold_context(layout_);
  if (!world_) return;
  if (layout_.shard_by_host) {
    // hsdp without hsdp_shard_size: each node's ranks are one shard group.
    settle_hosts();
    const int64_t world_size = world_->world_size();
    int64_t node = 0;
    for (int h : host_of_) node += h == host_of_.front() ? 1 : 0;
    for (int r = 0; r < world_size; ++r)
      if (host_of_[r] != r / node)
        throw UsageError("hsdp shards over one node's ranks, but the nodes do not hold " + std::to_string(node) +
                         " consecutive ranks each: set hsdp_shard_size");
    const int64_t inner = layout_.tp * layout_.cp;
    if (node % inner != 0)
      throw UsageError("hsdp: a node's " + std::to_string(node) + " ranks are not a multiple of tp x cp = " + std::to_string(inner));
    const int64_t dp = layout_.dp_shard * layout_.dp_replicate;
    layout_.dp_shard = node / inner;
    layout_.dp_replicate = dp / layout_.dp_shard;
    layout_.shard_by_host = false;
  }
  if (layout_.world() != world_->world_size())
    throw UsageError("layout " + layout_.name() + " needs " + std::to_string(layout_.world()) + " ranks; this run has " +
                     std::to_string(world_->world_size()));
  for (const auto& dim : ParallelLayout::dimensions()) {
    if (layout_.degree(dim) <= 1) continue;
    const std::vector<int> ranks = members(dim);
    if (static_cast<int64_t>(ranks.size()) == world_->world_size()) {
      groups_[dim] = world_;
      world_->set_dimension(dim);
      continue;
    }
    settle_hosts();
    bool one_host = true;
    for (int r : ranks) one_host = one_host && host_of_[r] == host_of_[ranks.front()];
    owned_[dim] = world_->split(ranks, dim + "-" + std::to_string(ranks.front()), one_host ? "intra-node" : "inter-node");
    groups_[dim] = owned_[dim].get();
    owned_[dim]->set_dimension(dim);
  }
  // The strategy's groups (core/layout.hpp: fold_context), created last, in the same place of every
  // rank's set-up.
  strategy_layout_ = fold_context(layout_);
  if (layout_.cp > 1) {
    const std::string into = strategy_layout_.dp_shard != layout_.dp_shard ? "dp_shard" : "dp_replicate";
    strategy_groups_[into] = group_over({into, "cp"}, into + "_cp");
  }
  for (const char* dim : {"dp_replicate", "dp_shard"})
    if (!strategy_groups_.count(dim)) strategy_groups_[dim] = group(dim);
  if (strategy_layout_.dp() == 1) return;
  if (layout_.cp == 1 && layout_.dp() == world_->world_size()) data_parallel_ = world_;
  else if (strategy_layout_.dp_replicate == 1) data_parallel_ = strategy_groups_["dp_shard"];
  else if (strategy_layout_.dp_shard == 1) data_parallel_ = strategy_groups_["dp_replicate"];
  else data_parallel_ = group_over({"dp_replicate", "dp_shard", "cp"}, "dp");
}

Communicator* Mesh::group_over(const std::vector<std::string>& dims, const std::string& name) {
  // The ranks that differ from this one in `dims` only, in rank order (dims in mesh order, outer first).
  std::vector<int> ranks{rank_};
  for (const auto& dim : dims) {
    std::vector<int> next;
    for (int r : ranks)
      for (int m : members(dim)) next.push_back(r + (m - rank_));
    ranks = next;
  }
  std::sort(ranks.begin(), ranks.end());
  if (ranks.size() == 1) return nullptr;
  settle_hosts();
  bool one_host = true;
  for (int r : ranks) one_host = one_host && host_of_[r] == host_of_[ranks.front()];
  owned_[name] = world_->split(ranks, name + "-" + std::to_string(ranks.front()), one_host ? "intra-node" : "inter-node");
  owned_[name]->set_dimension(name);
  return owned_[name].get();
}

Communicator* Mesh::strategy_group(const std::string& dim) const {
  const auto it = strategy_groups_.find(dim);
  return it == strategy_groups_.end() ? nullptr : it->second;
}

void Mesh::settle_hosts() {
  if (!host_of_.empty()) return;
  const std::vector<std::vector<int>> hosts = world_->ranks_by_host();
  host_of_.assign(world_->world_size(), 0);
  for (size_t h = 0; h < hosts.size(); ++h)
    for (int r : hosts[h]) host_of_[r] = static_cast<int>(h);
}

int64_t Mesh::stride(const std::string& dim) const {
  int64_t s = 1;
  const auto& dims = ParallelLayout::dimensions();
  for (auto it = dims.rbegin(); it != dims.rend() && *it != dim; ++it) s *= layout_.degree(*it);
  return s;
}

int64_t Mesh::coordinate(const std::string& dim) const { return (rank_ / stride(dim)) % layout_.degree(dim); }

std::vector<int> Mesh::members(const std::string& dim) const {
  const int64_t s = stride(dim), base = rank_ - coordinate(dim) * s;
  std::vector<int> out;
  for (int64_t i = 0; i < layout_.degree(dim); ++i) out.push_back(static_cast<int>(base + i * s));
  return out;
}

Communicator* Mesh::group(const std::string& dim) const {
  const auto it = groups_.find(dim);
  return it == groups_.end() ? nullptr : it->second;
}

}  // namespace trainscope::suites
