#include "runners/commands/frontier.hpp"

#include <algorithm>

namespace trainscope::runners {

FrontierResult frontier_search(const std::function<bool(int64_t)>& fits, int64_t start, int64_t limit) {
  FrontierResult r;
  auto attempt = [&](int64_t n) {
    const bool ok = fits(n);
    r.tries.emplace_back(n, ok);
    return ok;
  };
  int64_t lo = 0, hi = 0;  // lo fits (0 trivially), hi fails (0: unknown)
  for (int64_t n = std::max<int64_t>(1, std::min(start, limit)); n <= limit; n = std::min(limit, n * 2)) {
    if (!attempt(n)) {
      hi = n;
      break;
    }
    lo = n;
    if (n == limit) break;
  }
  if (hi == 0) {
    r.largest_fit = lo;
    return r;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (attempt(mid)) lo = mid;
    else hi = mid;
  }
  r.largest_fit = lo;
  r.first_fail = hi;
  return r;
}

}  // namespace trainscope::runners
