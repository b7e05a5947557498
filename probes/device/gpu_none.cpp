// Built when CMake found no CUDA toolkit: no inventory beyond saying so, no NVTX.
#include "probes/device/gpu.hpp"

namespace trainscope::probes {

json gpu_inventory() {
  return json{{"toolkit", false}, {"torch_cuda_pieces", torch_cuda_pieces()},
              {"status", "no device: built without the CUDA toolkit"}, {"device_count", 0}, {"devices", json::array()}};
}

std::shared_ptr<Probe> make_nvtx_probe() { return nullptr; }

namespace {
class NoTimeline : public Probe {
 public:
  std::string name() const override { return "timeline"; }
  json section() const override { return json{{"available", false}, {"reason", "built without the CUDA toolkit (no CUPTI)"}}; }
};
}  // namespace

std::shared_ptr<Probe> make_timeline_probe() { return std::make_shared<NoTimeline>(); }

}  // namespace trainscope::probes
