#pragma once
// Stand-in for LibTorch's distributed-autograd context header, which Debian's libtorch-dev omits but
// c10d/reducer.hpp includes. The reducer only names these two types (a callback signature and a
// shared_ptr it never dereferences without distributed autograd), so declarations suffice. CMake puts
// this directory on the include path only when the real header is missing.
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
