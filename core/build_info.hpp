#pragma once
// What this binary is: version, source commit, and the suite files compiled into it.
#include <string>
#include <utility>
#include <vector>

namespace trainscope {

const char* version();
const char* commit();
// The CUDA toolkit's library folder found at configure time ("" without the toolkit).
const char* cuda_library_dir();
// `trainscope parity`'s defaults: the PyTorch-side references (tests/parity in the source tree), the
// Python of the wheel's virtual environment, and libtrainscope_accounting.so.
const char* parity_reference_dir();
const char* parity_python();
const char* accounting_library();
// (name, TOML text) of every file in suites/catalog/, in name order.
const std::vector<std::pair<std::string, std::string>>& builtin_suites();

}  // namespace trainscope
