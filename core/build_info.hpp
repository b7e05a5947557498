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
// (name, TOML text) of every file in suites/catalog/, in name order.
const std::vector<std::pair<std::string, std::string>>& builtin_suites();

}  // namespace trainscope
