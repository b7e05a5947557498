#pragma once
// The parallel layout of a run: a mesh of named dimensions, as torchtitan's ParallelDims and PyTorch's
// DeviceMesh name them, outermost first:
//   pp            pipeline stages
//   dp_replicate  copies of the model state (DDP; HSDP's replicas)
//   dp_shard      ranks one copy is sharded over, at a sharding level: zero1 (optimizer state), zero2
//                 (and gradients) or zero3 (and parameters: FSDP)
//   cp            context (sequence) shards
//   tp            tensor-parallel shards of each layer (innermost: the ranks of a node)
// The degrees multiply to the world size. `parallel = zero3` and the other strategy names stay as the
// shorthand they are: the data-parallel dimensions over the ranks the others leave. Torch-free: the
// suites build the communicators (suites/parallel/mesh.hpp), the planner enumerates layouts.
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/model_shape.hpp"
#include "core/pipeline.hpp"

namespace trainscope {

struct ParallelLayout {
  int64_t pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  std::string sharding = "none";  // what dp_shard shards: none (dp_shard 1), zero1, zero2, zero3
  bool shard_by_host = false;     // hsdp without hsdp_shard_size: dp_shard is one node's ranks, known at launch

  int64_t world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int64_t dp() const { return dp_replicate * dp_shard; }
  int64_t degree(const std::string& dim) const;
  // The dimensions in mesh order, outermost first.
  static const std::vector<std::string>& dimensions();
  // "dp_shard2-tp2" (dimensions of degree > 1, in mesh order; "-zero1"/"-zero2" when dp_shard shards
  // less than everything); "single" for one rank; "hsdp" while the node size is unknown.
  std::string name() const;
  // The data-parallel strategy over dp_replicate x dp_shard: single, ddp, zero1, zero2, zero3 or hsdp.
  std::string strategy() const;
  json to_json() const;  // {dp_replicate, dp_shard, tp, pp, cp, name}
  bool operator==(const ParallelLayout& o) const;
};

// Parses a layout name ("dp_shard4-tp2", "dp_replicate2-dp_shard2", "dp_shard2-zero1", "single");
// UsageError naming the grammar on anything else.
ParallelLayout parse_layout(const std::string& text);

// The degrees a configuration gives (its degree keys and `layout`), without the shorthand or any check
// against the world size; UsageError when the two disagree.
ParallelLayout given_layout(const RunConfig& c);

// The layout a configuration asks for: the degree keys, the `layout` key, and the `parallel` shorthand
// over the ranks tp x pp x cp leave of world_size. UsageError (one line) when they disagree or their
// product is not the world size. Nothing given at all (parallel = single, no degrees): one rank's
// layout, whatever world_size says (a cell that is no training, or one the runner skips).
ParallelLayout resolve_layout(const RunConfig& c);

// Whether the model can take the layout: UsageError, one line, when a degree does not divide what it
// splits (tp and the heads, the FFN, the vocabulary; cp and the sequence; pp and the layers).
void check_layout_fits(const ParallelLayout& l, const ModelShape& m);

// The layout the data-parallel strategy runs: cp's ranks hold the same model state and average their
// gradients with the data-parallel ranks' (torchtitan's dp_shard_cp), folded into dp_shard when it shards
// (or, cp alone, when the layout has a sharding level: "cp8-zero3", FSDP over the cp ranks), else into
// dp_replicate; cp 1 in the result. The layout itself without cp.
ParallelLayout fold_context(const ParallelLayout& l);

// The causal query-key pairs each of `cp` ranks' attention computes for a sequence of S (a multiple of
// 2 x cp): with `balance` rank r's tokens are chunks r and 2cp-1-r of 2cp (head-tail), else the r-th
// contiguous cp-th; a chunk of h tokens from position p0 has h p0 + h (h + 1) / 2 pairs. The imbalance the
// report shows and the busiest rank's attention the planner costs (suites/parallel/context_parallel.hpp).
std::vector<double> context_parallel_pairs(int64_t S, int64_t cp, bool balance);

// Whether this build runs micro-batches (a pipeline, or accumulation) beside the layout's other
// dimensions: alone, with tp, with dp_shard at zero3 (FSDP inside each stage), or both.
bool pipelines_with(const ParallelLayout& l);

// Why this build cannot run the layout yet ("" when it can): a dimension it does not implement, or a
// combination it does not (zero1/zero2 with replicas).
std::string layout_unsupported(const ParallelLayout& l);

// The pipeline a configuration runs: its schedule over the layout's pp ranks, with the micro-batches and
// stages per rank resolved (0: the schedule's defaults; without pp, one stage and pp_microbatches
// micro-batches whose gradients accumulate) and, with pp, the layers of each stage (pp_split, else
// stage_layers' cuts). UsageError, one line, when the schedule cannot take them, the micro-batches do not
// divide the batch, there are more stages than layers or pp_split is malformed.
pipeline::Schedule resolve_pipeline(const RunConfig& c, const ParallelLayout& l, const ModelShape& m);

}  // namespace trainscope
