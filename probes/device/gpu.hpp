#pragma once
// CUDA pieces that need only the toolkit (not a CUDA LibTorch): the GPU inventory with CUDA, cuDNN,
// NCCL and CUPTI versions, and NVTX ranges around the training phases. Built in probes/device/gpu_cuda.cpp
// when CMake finds the toolkit, else probes/device/gpu_none.cpp; whether a device exists is decided at run
// time, so a build with the toolkit on a machine without a driver reports "no device" and goes on.
#include <memory>

#include "core/hooks.hpp"

namespace trainscope::probes {

// {"toolkit": bool, "torch_cuda_pieces": bool, "status", "runtime_version", "driver_version",
//  "device_count", "devices": [...], "cudnn_version", "nccl_version", "cupti_version"}; fields that
// cannot be read are null.
json gpu_inventory();

// Whether the code paths that need a CUDA LibTorch (CUDA event timer, caching-allocator statistics,
// NCCL process groups) are compiled into this binary.
constexpr bool torch_cuda_pieces() {
#ifdef TRAINSCOPE_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

// NVTX ranges "step N", "forward", "backward", "optimizer" for Nsight Systems; null without the toolkit.
std::shared_ptr<Probe> make_nvtx_probe();

// The GPU timeline (metrics.timeline): CUPTI kernel and memcpy records of the measured steps, their
// compute / communication overlap, exposed communication, idle time and top kernels. Its section
// says {"available": false, "reason"} wherever CUPTI cannot run (no toolkit, no device, CPU cells).
std::shared_ptr<Probe> make_timeline_probe();

}  // namespace trainscope::probes
