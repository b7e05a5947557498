#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace trainscope::plan {

// y(x) through measured points, linear in log-log between them, flat beyond the ends.
struct Curve {
  std::vector<std::pair<double, double>> points;  // sorted by x
  double at(double x) const;
  bool empty() const { return points.empty(); }
};

// CPU convolutions' scratch (oneDNN's reorders), measured per shape: bytes beyond the results over the
// output's bytes, forward and backward. A convolution takes the measured shape of its kernel and stride
// (any, if none was measured) nearest its channels in log space: the reorders follow oneDNN's channel
// blocking and the kernel's path, not the image size.
struct ConvScratch {
  struct Shape {
    double in_channels = 0, out_channels = 0;
    int64_t kernel = 3, stride = 1;
    double forward = 0, backward = 0;
  };
  std::vector<Shape> shapes;
  bool empty() const { return shapes.empty(); }
  const Shape* nearest(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride) const;
};

}  // namespace trainscope::plan
