#pragma once
// Helpers shared by the unit tests.
#include <stdlib.h>

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

// A fresh folder for a test's files (mkdtemp: std::filesystem::remove_all resolves to a copy inside
// libtorch.so that crashes).
inline std::string scratch(const std::string& name) {
  std::string templ = "/tmp/trainscope-test-" + name + "-XXXXXX";
  const char* dir = mkdtemp(templ.data());
  return dir ? std::string(dir) : std::string("/tmp");
}

// The [base] of the suites whose runs are compared with one process to the last bit or a derived
// tolerance (pipeline, context parallelism): fp64, plain SGD, 2 measured steps after 1 warm-up, the
// parameters saved, no probes that would touch the arithmetic.
inline const std::string kExactBase = R"(precision = "64-true"
warmup_steps = 1
steps = 2
eval = false
overflow_every = 0
save_parameters = true
optimizer = "sgd"
lr = 0.05
)";

}  // namespace trainscope::test

// Expects `expr` to throw a UsageError whose one-line message contains `part`.
#define EXPECT_THAT_ERROR(expr, part)                                                      \
  do {                                                                                     \
    const std::string message_ = ::trainscope::test::error_of([&] { (void)(expr); });      \
    EXPECT_NE(message_.find(part), std::string::npos) << "message: '" << message_ << "'"; \
    EXPECT_EQ(message_.find('\n'), std::string::npos) << message_;                        \
  } while (0)
