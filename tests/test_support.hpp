#pragma once
// Helpers shared by the unit tests.
#include <functional>
#include <string>

#include "core/errors.hpp"

namespace trainscope::test {

// The message of the UsageError that f throws ("" if it throws none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace trainscope::test
