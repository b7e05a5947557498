#pragma once
// The communicators of a parallel layout's dimensions (core/layout.hpp), as PyTorch's DeviceMesh makes
// them: a rank's coordinates in mesh order (pp, dp_replicate, dp_shard, cp, tp; tp innermost, so a
// node's consecutive ranks share its tensor-parallel group) and, per dimension of degree > 1, the
// group of ranks that differ from it in that dimension only. Every rank creates its groups once, at
// set-up, in that fixed order. A group that spans every rank is the world's communicator itself, so
// that zero3 over all ranks runs the very collectives it ran before layouts existed.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/layout.hpp"
#include "suites/parallel/comm.hpp"

namespace trainscope::suites {

class Mesh {
 public:
  // world: this rank's communicator over every rank (null: one process). hsdp by node (dp_shard = one
  // node's ranks) is settled here from the ranks' host names; UsageError when the nodes differ in size
  // or their ranks are not consecutive.
  Mesh(Communicator* world, ParallelLayout layout);
  const ParallelLayout& layout() const { return layout_; }
  Communicator* world() const { return world_; }
  // This rank's group in `dim` (nullptr when its degree is 1).
  Communicator* group(const std::string& dim) const;
  int64_t coordinate(const std::string& dim) const;
  // The world ranks of this rank's group in `dim`, in order of their coordinate.
  std::vector<int> members(const std::string& dim) const;
  // The data-parallel group: the ranks that differ from this one in dp_replicate, dp_shard and cp only
  // (one copy of each model shard per rank of it; nullptr when there is one). The world when tp and pp are 1.
  Communicator* data_parallel() const { return data_parallel_; }
  // The layout the data-parallel strategy runs (core/layout.hpp: fold_context) and its groups
  // ("dp_shard", "dp_replicate", each with cp's ranks where cp folds into it).
  const ParallelLayout& strategy_layout() const { return strategy_layout_; }
  Communicator* strategy_group(const std::string& dim) const;

 private:
  int64_t stride(const std::string& dim) const;
  void settle_hosts();  // host_of_, once, when a group is smaller than the world
  // A group of its own over the ranks that differ from this one in `dims` only (null when that is this
  // one alone), created under `name`.
  Communicator* group_over(const std::vector<std::string>& dims, const std::string& name);
  Communicator* world_;
  ParallelLayout layout_;
  int rank_ = 0;
  std::vector<int> host_of_;
  std::map<std::string, std::unique_ptr<Communicator>> owned_;
  std::map<std::string, Communicator*> groups_;
  Communicator* data_parallel_ = nullptr;
  ParallelLayout strategy_layout_;
  std::map<std::string, Communicator*> strategy_groups_;
};

}  // namespace trainscope::suites
