// Built when CMake finds the CUDA toolkit. Links the CUDA runtime (the shared one a CUDA LibTorch has
// loaded, else the static one) and header-only NVTX only: never the driver stub, so the program loads
// on machines without a driver. cuDNN, NCCL and CUPTI are
// opened with dlopen for their versions, so their absence costs nothing but a null.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nvtx3/nvToolsExt.h>

#include "probes/device/gpu.hpp"

#include <string>

#include "core/build_info.hpp"

namespace trainscope::probes {
namespace {

// Calls `int name(args...)`-style version getters from a library found at run time.
// Looks on the loader's path first, then in the toolkit's library folder found at configure time.
template <typename Fn>
Fn find_symbol(std::initializer_list<const char*> libraries, const char* symbol) {
  const std::string toolkit = cuda_library_dir();
  for (const char* lib : libraries) {
    for (const std::string& path : {std::string(lib), toolkit.empty() ? std::string() : toolkit + "/" + lib}) {
      if (path.empty()) continue;
      if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL))
        if (void* f = dlsym(h, symbol)) return reinterpret_cast<Fn>(f);
    }
  }
  return nullptr;
}

json cudnn_version() {
  using Fn = size_t (*)();
  auto f = find_symbol<Fn>({"libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"}, "cudnnGetVersion");
  return f ? json(f()) : json(nullptr);
}

json nccl_version() {
  using Fn = int (*)(int*);
  auto f = find_symbol<Fn>({"libnccl.so.2", "libnccl.so"}, "ncclGetVersion");
  int v = 0;
  return f && f(&v) == 0 ? json(v) : json(nullptr);
}

json cupti_version() {
  using Fn = int (*)(uint32_t*);
  auto f = find_symbol<Fn>({"libcupti.so", "libcupti.so.13", "libcupti.so.12"}, "cuptiGetVersion");
  uint32_t v = 0;
  return f && f(&v) == 0 ? json(v) : json(nullptr);
}

// NVML, opened at run time (it comes with the driver, not the toolkit): the driver, and per GPU the
// clocks, the power limit and the temperature, which say whether a slow device is being held back.
// The few declarations needed, from NVML's stable C ABI (nvml.h is not part of the toolkit here).
json nvml_state() {
  using Handle = void*;
  using Init = int (*)();
  using Count = int (*)(unsigned*);
  using ByIndex = int (*)(unsigned, Handle*);
  using Clock = int (*)(Handle, int, unsigned*);   // nvmlClockType_t: 0 graphics, 1 SM, 2 memory
  using Uint = int (*)(Handle, unsigned*);
  using Temp = int (*)(Handle, int, unsigned*);    // nvmlTemperatureSensors_t: 0 GPU
  using Driver = int (*)(char*, unsigned);
  void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return json{{"status", "unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver)"}};
  auto sym = [h](const char* n) { return dlsym(h, n); };
  auto init = reinterpret_cast<Init>(sym("nvmlInit_v2"));
  if (!init || init() != 0) return json{{"status", "unavailable: nvmlInit failed"}};
  json j{{"status", "ok"}};
  char driver[96] = {0};
  if (auto f = reinterpret_cast<Driver>(sym("nvmlSystemGetDriverVersion")); f && f(driver, sizeof driver) == 0) j["driver"] = driver;
  unsigned count = 0;
  auto count_fn = reinterpret_cast<Count>(sym("nvmlDeviceGetCount_v2"));
  auto by_index = reinterpret_cast<ByIndex>(sym("nvmlDeviceGetHandleByIndex_v2"));
  auto clock = reinterpret_cast<Clock>(sym("nvmlDeviceGetClockInfo"));
  auto max_clock = reinterpret_cast<Clock>(sym("nvmlDeviceGetMaxClockInfo"));
  auto power_limit = reinterpret_cast<Uint>(sym("nvmlDeviceGetPowerManagementLimit"));
  auto power = reinterpret_cast<Uint>(sym("nvmlDeviceGetPowerUsage"));
  auto temp = reinterpret_cast<Temp>(sym("nvmlDeviceGetTemperature"));
  json gpus = json::array();
  if (count_fn && by_index && count_fn(&count) == 0) {
    for (unsigned i = 0; i < count; ++i) {
      Handle d = nullptr;
      if (by_index(i, &d) != 0) continue;
      auto read = [&](auto fn, auto... args) -> json {
        unsigned v = 0;
        return fn && fn(d, args..., &v) == 0 ? json(v) : json(nullptr);
      };
      gpus.push_back({{"index", i}, {"sm_clock_mhz", read(clock, 1)}, {"max_sm_clock_mhz", read(max_clock, 1)},
                      {"memory_clock_mhz", read(clock, 2)}, {"power_limit_mw", read(power_limit)},
                      {"power_mw", read(power)}, {"temperature_c", read(temp, 0)}});
    }
  }
  j["gpus"] = gpus;
  return j;
}

class NvtxProbe : public Probe {
 public:
  std::string name() const override { return "nvtx"; }
  void step_begin(const StepInfo& s) override {
    label_ = "step " + std::to_string(s.step);
    nvtxRangePushA(label_.c_str());
    nvtxRangePushA("forward");
  }
  void forward_end(const StepInfo&) override {
    nvtxRangePop();
    nvtxRangePushA("backward");
  }
  void backward_end(const StepInfo&) override {
    nvtxRangePop();
    nvtxRangePushA("optimizer");
  }
  void optimizer_end(const StepInfo&) override { nvtxRangePop(); }
  void step_end(const StepInfo&) override { nvtxRangePop(); }
  json section() const override { return json{{"ranges", {"step N", "forward", "backward", "optimizer"}}}; }

 private:
  std::string label_;
};

}  // namespace

json gpu_inventory() {
  json j{{"toolkit", true}, {"built_with_cuda", CUDART_VERSION}, {"torch_cuda_pieces", torch_cuda_pieces()}};
  int runtime = 0, driver = 0, count = 0;
  j["runtime_version"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? json(runtime) : json(nullptr);
  j["driver_version"] = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0 ? json(driver) : json(nullptr);
  const cudaError_t err = cudaGetDeviceCount(&count);
  json devices = json::array();
  if (err != cudaSuccess) {
    j["status"] = std::string("no device: ") + cudaGetErrorString(err) + " (cudaGetDeviceCount error " +
                  std::to_string(static_cast<int>(err)) + ")";
    count = 0;
  } else {
    j["status"] = count > 0 ? "ok" : "no device";
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      devices.push_back({{"index", i},
                         {"name", p.name},
                         {"compute_capability", std::to_string(p.major) + "." + std::to_string(p.minor)},
                         {"memory_bytes", p.totalGlobalMem},
                         {"multiprocessors", p.multiProcessorCount},
                         {"bf16", p.major >= 8},
                         {"tf32", p.major >= 8}});
    }
  }
  j["device_count"] = count;
  j["devices"] = devices;
  j["cudnn_version"] = cudnn_version();
  j["nccl_version"] = nccl_version();
  j["cupti_version"] = cupti_version();
  j["nvml"] = nvml_state();
  return j;
}

std::shared_ptr<Probe> make_nvtx_probe() { return std::make_shared<NvtxProbe>(); }

}  // namespace trainscope::probes
