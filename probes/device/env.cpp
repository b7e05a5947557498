#include "probes/device/env.hpp"

#include <sys/utsname.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/torch.h>

#include "core/build_info.hpp"
#include "probes/device/gpu.hpp"

namespace trainscope::probes {
namespace {

std::string read_first(const std::string& path, const std::string& prefix) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  return "";
}

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t:\"="), e = s.find_last_not_of(" \t\"");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

json cpu_info() {
  const std::string model = trim(read_first("/proc/cpuinfo", "model name"));
  std::istringstream flags(trim(read_first("/proc/cpuinfo", "flags")));
  std::set<std::string> have;
  for (std::string f; flags >> f;) have.insert(f);
  json relevant = json::object();
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
                        "amx_bf16", "amx_int8"})
    relevant[f] = have.count(f) > 0;
  return json{{"model", model.empty() ? json(nullptr) : json(model)},
              {"logical_cores", std::thread::hardware_concurrency()},
              {"flags", relevant}};
}

json memory_bytes() {
  const std::string kb = trim(read_first("/proc/meminfo", "MemTotal"));
  return kb.empty() ? json(nullptr) : json(std::stoll(kb) * 1024);
}

json os_info() {
  utsname u{};
  uname(&u);
  const std::string pretty = trim(read_first("/etc/os-release", "PRETTY_NAME"));
  return json{{"name", pretty.empty() ? json(nullptr) : json(pretty)},
              {"kernel", std::string(u.sysname) + " " + u.release},
              {"arch", u.machine}};
}

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

// The vector ISA ATen's CPU kernels dispatch to (AVX512, AVX2, DEFAULT; ATEN_CPU_CAPABILITY lowers it).
std::string cpu_capability() {
  const std::string config = at::show_config();
  const std::string key = "CPU capability usage: ";
  const auto at = config.find(key);
  if (at == std::string::npos) return "unknown";
  return config.substr(at + key.size(), config.find('\n', at) - at - key.size());
}

}  // namespace

BlasInfo blas_in_use() {
  BlasInfo b{"unknown", "", false};
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const bool blas = path.find("libblas") != std::string::npos || path.find("openblas") != std::string::npos ||
                      path.find("libmkl") != std::string::npos || path.find("blis") != std::string::npos;
    if (!blas) continue;
    char real[PATH_MAX];
    const std::string resolved = realpath(path.c_str(), real) ? real : path;
    b.path = resolved;
    if (resolved.find("mkl") != std::string::npos) b.name = "MKL";
    else if (resolved.find("openblas-openmp") != std::string::npos) b.name = "OpenBLAS (openmp)";
    else if (resolved.find("openblas-pthread") != std::string::npos) b.name = "OpenBLAS (pthread)";
    else if (resolved.find("openblas") != std::string::npos) b.name = "OpenBLAS";
    else if (resolved.find("blis") != std::string::npos) b.name = "BLIS";
    else if (resolved.find("/blas/libblas") != std::string::npos) {
      b.name = "reference BLAS (netlib)";
      b.reference = true;
    }
    if (b.name != "unknown") break;
  }
  if (b.name == "unknown") {
    // The PyPI wheels link MKL statically into libtorch_cpu: nothing to see in the maps, the build
    // configuration says which.
    const std::string config = at::show_config();
    const auto at = config.find("BLAS_INFO=");
    if (at != std::string::npos) {
      const std::string info = config.substr(at + 10, config.find_first_of(", \n", at + 10) - at - 10);
      if (info == "mkl") b.name = "MKL (linked into LibTorch)";
      else if (info == "open") b.name = "OpenBLAS (linked into LibTorch)";
      else if (!info.empty()) b.name = info + " (linked into LibTorch)";
    }
  }
  return b;
}

int configure_threads(int64_t threads) {
  const int n = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, n));
  return at::get_num_threads();
}

json collect_env() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const BlasInfo blas = blas_in_use();
  json cuda = gpu_inventory();
  json torch_info{{"version", TORCH_VERSION},
                  {"cuda_available", torch::cuda::is_available()},
                  {"cuda_device_count", torch::cuda::device_count()},
                  {"intra_op_threads", at::get_num_threads()},
                  {"cpu_capability", cpu_capability()},
                  {"build_config", at::show_config()}};
  json j;
  j["host"] = host;
  j["cpu"] = cpu_info();
  j["memory_bytes"] = memory_bytes();
  j["os"] = os_info();
  j["compiler"] = compiler();
  j["torch"] = torch_info;
  j["blas"] = {{"name", blas.name}, {"path", blas.path.empty() ? json(nullptr) : json(blas.path)},
               {"reference", blas.reference}};
  j["gpus"] = cuda["devices"];
  j["cuda"] = cuda;
  j["trainscope"] = {{"version", version()}, {"commit", commit()}};
  json warnings = json::array();
  if (blas.reference)
    warnings.push_back("torch is calling the reference BLAS (" + blas.path +
                       "): fp32 matmuls run ~20x slower than OpenBLAS; install libopenblas0-openmp");
  if (!j["cpu"]["flags"]["avx512_bf16"].get<bool>() && !j["cpu"]["flags"]["amx_bf16"].get<bool>())
    warnings.push_back("this CPU has no bf16 instructions (avx512_bf16/amx_bf16): bf16 runs emulated and slow");
  j["warnings"] = warnings;
  return j;
}

}  // namespace trainscope::probes
