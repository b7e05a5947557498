#pragma once
// One cell, inside its own process: train with the probes on and write the cell's JSON.
#include <string>

#include "core/config.hpp"

namespace trainscope::runners {

// Reads the spec {"name", "config", "device"} and writes the cell result atomically to result_path.
// Returns 0 when the cell ran (whatever its status), 1 when it failed with an exception (the result
// still says why).
int cell_main(const std::string& spec_path, const std::string& result_path);

// The result of a cell that never ran (skipped) or whose process died (failed, timeout).
json cell_without_metrics(const std::string& name, const json& config, const std::string& device,
                          const std::string& status, const std::string& reason);

}  // namespace trainscope::runners
