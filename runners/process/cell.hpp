#pragma once
// One cell, inside its own process: train with the probes on and write the cell's JSON.
#include <string>

#include "core/config.hpp"

namespace trainscope::runners {

// The exit code of a rank that ran out of memory (its result says oom).
inline constexpr int kRankOom = 3;

// Which rank of the cell this process is, and where the ranks meet (world 1: a single process).
struct CellRank {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string store_host = "127.0.0.1";
  int store_port = 0;
  std::string prefix;
};

// Reads the spec {"name", "config", "device"} and writes the cell result atomically to result_path.
// With several ranks, rank 0 merges every rank's result into the cell (merge_ranks). Returns 0 when
// the cell ran (whatever its status), 1 when it failed with an exception (the result still says why).
int cell_main(const std::string& spec_path, const std::string& result_path, const CellRank& rank = {});

// Rank 0's cell with the others folded in: per-rank timing, memory and communication, the slowest
// rank, and the RNG probe's cross-rank verdicts (cells in rank order).
json merge_ranks(const std::vector<json>& cells);

// Where save_parameters writes a rank's parameters: "<result without .json>.params.pt".
std::string parameters_path(const std::string& result_path);
// Where parity_dump writes rank 0's record: "<result without .json>.parity.pt" (tests/parity reads it).
std::string parity_dump_path(const std::string& result_path);
// Where a rank's timeline goes (trace = true): the result's path with .trace.json.
std::string trace_path(const std::string& result_path);

// The result of a cell that never ran (skipped) or whose process died (failed, timeout).
json cell_without_metrics(const std::string& name, const json& config, const std::string& device,
                          const std::string& status, const std::string& reason);

}  // namespace trainscope::runners
