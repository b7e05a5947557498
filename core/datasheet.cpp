#include "core/datasheet.hpp"

#include <torch/cuda.h>

#include <fstream>
#include <vector>

#ifdef TRAINSCOPE_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace trainscope {
namespace {

const std::vector<Datasheet>& table() {
  // Dense figures. NVIDIA's pages print the sparse ones for tf32/bf16/fp16/fp8 ("with sparsity"); these
  // are half of those. H100 SXM and H200 SXM share the compute and differ in memory.
  static const std::vector<Datasheet> t = {
      {"NVIDIA H100 80GB HBM3", "nvidia.com H100 SXM datasheet, dense",
       {{"fp32", 67.0}, {"tf32", 494.5}, {"bf16", 989.0}, {"fp16", 989.0}, {"fp8", 1979.0}}, 3350},
      {"NVIDIA H200", "nvidia.com H200 SXM datasheet, dense",
       {{"fp32", 67.0}, {"tf32", 494.5}, {"bf16", 989.0}, {"fp16", 989.0}, {"fp8", 1979.0}}, 4800},
      {"NVIDIA H100 PCIe", "nvidia.com H100 PCIe datasheet, dense",
       {{"fp32", 51.0}, {"tf32", 378.0}, {"bf16", 756.0}, {"fp16", 756.0}, {"fp8", 1513.0}}, 2000},
      {"NVIDIA A100-SXM4-80GB", "nvidia.com A100 datasheet, dense",
       {{"fp32", 19.5}, {"tf32", 156.0}, {"bf16", 312.0}, {"fp16", 312.0}}, 2039},
      {"NVIDIA A100-SXM4-40GB", "nvidia.com A100 datasheet, dense",
       {{"fp32", 19.5}, {"tf32", 156.0}, {"bf16", 312.0}, {"fp16", 312.0}}, 1555},
      {"NVIDIA B200", "nvidia.com HGX B200 datasheet, dense, per GPU",
       {{"tf32", 1100.0}, {"bf16", 2250.0}, {"fp16", 2250.0}, {"fp8", 4500.0}}, 8000},
      {"AMD Instinct MI300X", "amd.com MI300X datasheet, dense",
       {{"fp32", 163.4}, {"tf32", 653.7}, {"bf16", 1307.4}, {"fp16", 1307.4}, {"fp8", 2614.9}}, 5300},
  };
  return t;
}

}  // namespace

std::optional<Datasheet> datasheet_for(const std::string& name) {
  for (const auto& d : table())
    if (d.device == name) return d;
  return std::nullopt;
}

std::optional<double> datasheet_peak_flops(const std::string& name, const std::string& dtype) {
  const auto d = datasheet_for(name);
  if (!d || !d->peak_tflops.contains(dtype)) return std::nullopt;
  return d->peak_tflops[dtype].get<double>() * 1e12;
}

std::string device_name(const std::string& device) {
#ifdef TRAINSCOPE_TORCH_CUDA
  if (device.rfind("cuda", 0) == 0 && torch::cuda::is_available()) {
    const int index = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
    return at::cuda::getDeviceProperties(index)->name;
  }
#endif
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return device;
}

}  // namespace trainscope
