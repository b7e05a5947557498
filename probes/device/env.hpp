#pragma once
// Environment probe: the hardware and software inventory every report carries.
#include <string>

#include "core/config.hpp"

namespace trainscope::probes {

struct BlasInfo {
  std::string name;    // "OpenBLAS (openmp)", "reference BLAS (netlib)", "MKL", "unknown"
  std::string path;    // the library file actually mapped into this process
  bool reference = false;  // netlib's reference BLAS: fp32 GEMM ~6 GFLOP/s here
};

// Which BLAS torch is calling, read from this process's memory map (after torch is loaded).
BlasInfo blas_in_use();

// The inventory as docs/reports.md's "env" section: host, cpu, memory_bytes, os, compiler, torch, blas,
// cuda, gpus, plus trainscope's version and commit, and warnings (reference BLAS, no bf16 units).
json collect_env();

// Sets torch's intra-op threads: `threads` > 0, else one per core; returns the number in use.
int configure_threads(int64_t threads);

}  // namespace trainscope::probes
