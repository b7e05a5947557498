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

double final_loss_of(const std::vector<double>& step_losses, int64_t steps) {
  steps = std::min<int64_t>(steps, static_cast<int64_t>(step_losses.size()));
  const int64_t from = std::max<int64_t>(0, steps - 10);
  if (steps <= from) return std::nan("");
  double sum = 0;
  for (int64_t i = from; i < steps; ++i) sum += step_losses[static_cast<size_t>(i)];
  return sum / static_cast<double>(steps - from);
}

}  // namespace trainscope
