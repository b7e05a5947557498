#pragma once
#include <utility>
#include <vector>

namespace trainscope::plan {

// y(x) through measured points, linear in log-log between them, flat beyond the ends.
struct Curve {
  std::vector<std::pair<double, double>> points;  // sorted by x
  double at(double x) const;
  bool empty() const { return points.empty(); }
};

}  // namespace trainscope::plan
