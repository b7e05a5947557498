#pragma once
// Frontier search: the largest batch size that fits a memory budget, by doubling then bisection.
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace trainscope::runners {

struct FrontierResult {
  int64_t largest_fit = 0;  // 0: not even the smallest size fits
  int64_t first_fail = 0;   // the smallest size seen to fail (0: none failed up to the limit)
  std::vector<std::pair<int64_t, bool>> tries;  // in the order tried
};

// `fits` must be monotone (fits(n) implies fits(m) for m < n). Starts at `start`, doubles while it
// fits (up to `limit`), then bisects between the last fit and the first failure; below `start`
// when `start` itself fails.
FrontierResult frontier_search(const std::function<bool(int64_t)>& fits, int64_t start, int64_t limit);

}  // namespace trainscope::runners
