#include "core/stats.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace trainscope {

static double percentile(const std::vector<double>& sorted, double q) {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Summary summarize(std::vector<double> values) {
  Summary s;
  s.count = static_cast<int64_t>(values.size());
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.p50 = percentile(values, 0.50);
  s.p90 = percentile(values, 0.90);
  s.p99 = percentile(values, 0.99);
  s.min = values.front();
  s.max = values.back();
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  if (values.size() > 1) {
    double sq = 0;
    for (double v : values) sq += (v - s.mean) * (v - s.mean);
    s.stdev = std::sqrt(sq / static_cast<double>(values.size() - 1));
  }
  return s;
}

json to_json(const Summary& s) {
  return json{{"p50", s.p50}, {"p90", s.p90},   {"p99", s.p99}, {"mean", s.mean},
              {"stdev", s.stdev}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

}  // namespace trainscope
