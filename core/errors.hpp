#pragma once
// Error kinds the CLI maps to exit codes: a UsageError (bad argument, suite file or report) exits 2
// with its one-line message; anything else that escapes a cell makes that cell `failed`.
#include <stdexcept>
#include <string>

namespace trainscope {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The input data a run needs is not on this machine (names the package that provides it).
struct MissingData : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace trainscope
