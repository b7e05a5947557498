// Collective bandwidth over the project's own communicator, in nccl-tests' table shape:
//   trainscope_collectives [--nproc 2] [--min-bytes 1KiB] [--max-bytes 64MiB] [--backend gloo]
//                          [--implementation default|native|emulated|both]
// All-reduce, all-gather and reduce-scatter from min to max bytes (x4 per row); time is the slowest
// rank's mean over the iterations on the host clock (a device sync after each), clock(us) the mean
// duration the communicator reports (on NCCL: CUDA events on NCCL's stream, so time - clock is the
// launch and sync overhead); algbw = size / time, busbw = algbw x nccl-tests' factor
// (probes/distributed/comm.hpp). Sizes follow nccl-tests: the per-rank buffer for all-reduce, the full buffer for
// all-gather and reduce-scatter. On Gloo, all-gather and reduce-scatter run natively or emulated
// (suites/parallel/comm.hpp); `both` measures the two, row by row, which is how the default was chosen.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include <CLI/CLI.hpp>

#include "core/units.hpp"
#include "probes/distributed/comm.hpp"
#include "runners/process/launch.hpp"
#include "suites/parallel/comm.hpp"

using namespace trainscope;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Options {
  std::string backend = "gloo", implementation = "default";
  int64_t min_bytes = 0, max_bytes = 0;
};

int rank_main(int rank, int world, int port, const Options& opt) {
  const std::string& backend = opt.backend;
  at::set_num_threads(1);
  // Rank 0 serves the rendezvous store, as `trainscope run` does.
  runners::Launch launch;
  launch.master_port = port;
  launch.world_size = world;
  runners::RendezvousStore store(launch);
  if (rank == 0) store.port();
  // NCCL: one GPU per rank; Gloo: host memory.
  const torch::Device device = backend == "nccl" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank))
                                                 : torch::Device(torch::kCPU);
  suites::Communicator comm(suites::Rendezvous{"127.0.0.1", port, "bench/", rank, world}, backend, device, 120);
  const bool default_native = comm.native_flat_collectives();
  if (rank == 0) {
    std::printf("# trainscope collectives: %d ranks, %s\n# default: %s\n#\n", world, backend.c_str(),
                comm.implementation().c_str());
    std::printf("# %12s %12s %6s %15s %9s %12s %12s %12s %12s\n", "size(B)", "count", "type", "op", "impl", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)", "clock(us)");
  }
  std::vector<std::pair<std::string, bool>> runs;  // (op, native flat collectives)
  for (const std::string op : {"all-reduce", "all-gather", "reduce-scatter"}) {
    if (op == "all-reduce" || opt.implementation == "default") runs.emplace_back(op, default_native);
    if (op != "all-reduce" && (opt.implementation == "native" || opt.implementation == "both")) runs.emplace_back(op, true);
    if (op != "all-reduce" && (opt.implementation == "emulated" || opt.implementation == "both")) runs.emplace_back(op, false);
  }
  for (const auto& [op, native] : runs) {
    comm.set_native_flat_collectives(native);
    const char* impl = op == "all-reduce" || comm.native_flat_collectives() ? "native" : "emulated";
    for (int64_t bytes = opt.min_bytes; bytes <= opt.max_bytes; bytes *= 4) {
      const int64_t count = bytes / 4;  // fp32 elements of the buffer the size names
      const int64_t shard = count / world;
      torch::Tensor full = torch::ones({count}, torch::TensorOptions().device(device));
      torch::Tensor part = torch::ones({std::max<int64_t>(shard, 1)}, torch::TensorOptions().device(device));
      auto once = [&] {
        if (op == "all-reduce") {
          comm.all_reduce(full, false);
        } else if (op == "all-gather") {
          torch::Tensor f = full.narrow(0, 0, shard * world);
          comm.all_gather(f, part.narrow(0, 0, shard));
        } else {
          torch::Tensor f = full.narrow(0, 0, shard * world);
          torch::Tensor s = part.narrow(0, 0, shard);
          comm.reduce_scatter(s, f, false);
        }
      };
      if (shard == 0) continue;
      // About 0.2 GB moved per row, at least 3 and at most 50 iterations, after 2 warm-ups.
      const int iters = static_cast<int>(std::clamp<int64_t>(200000000 / bytes, 3, 50));
      once();
      once();
      comm.barrier();
      double clocked = 0;  // the communicator's durations: CUDA events on NCCL's stream, else the host's
      comm.set_observer([&clocked](const CollectiveInfo& c) { clocked += c.seconds; });
      const double t0 = now_s();
      for (int i = 0; i < iters; ++i) once();
      comm.set_observer(nullptr);
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
      torch::Tensor t = torch::full({1}, (now_s() - t0) / iters, torch::TensorOptions().dtype(torch::kDouble).device(device));
      comm.all_reduce_max(t);  // the slowest rank's time
      const double secs = t.item<double>();
      torch::Tensor c = torch::full({1}, clocked / iters, torch::TensorOptions().dtype(torch::kDouble).device(device));
      comm.all_reduce_max(c);
      const double clock_secs = c.item<double>();
      const double algbw = static_cast<double>(bytes) / secs / 1e9;
      if (rank == 0)
        std::printf("  %12lld %12lld %6s %15s %9s %12.1f %12.3f %12.3f %12.1f\n", static_cast<long long>(bytes),
                    static_cast<long long>(count), "float", op.c_str(), impl, secs * 1e6, algbw,
                    algbw * probes::bus_factor(op, world), clock_secs * 1e6);
    }
  }
  comm.barrier();
  return 0;
}

int guarded_rank_main(int rank, int world, int port, const Options& opt) {
  try {
    return rank_main(rank, world, port, opt);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "trainscope_collectives: rank %d: error: %s\n", rank, what.substr(0, what.find('\n')).c_str());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"collective bandwidth (nccl-tests' table) over trainscope's communicator"};
  int nproc = 2;
  std::string min_text = "1KiB", max_text = "64MiB";
  Options opt;
  // One rank is allowed: on one GPU it shows that an NCCL communicator forms and what a launch costs.
  app.add_option("--nproc", nproc, "ranks (local processes)")->check(CLI::Range(1, 64));
  app.add_option("--min-bytes", min_text, "smallest size");
  app.add_option("--max-bytes", max_text, "largest size");
  app.add_option("--backend", opt.backend, "gloo (CPU) or nccl (a CUDA build with GPUs)")->check(CLI::IsMember({"gloo", "nccl"}));
  app.add_option("--implementation", opt.implementation, "Gloo's all-gather and reduce-scatter: default, native, emulated or both")
      ->check(CLI::IsMember({"default", "native", "emulated", "both"}));
  CLI11_PARSE(app, argc, argv);
  double lo = 0, hi = 0;
  if (!parse_bytes(min_text, lo) || !parse_bytes(max_text, hi) || lo < 4 || hi < lo) {
    std::fprintf(stderr, "trainscope_collectives: error: bad --min-bytes/--max-bytes\n");
    return 2;
  }
  opt.min_bytes = static_cast<int64_t>(lo);
  opt.max_bytes = static_cast<int64_t>(hi);
  const int port = runners::free_local_port();
  // Fork every rank before torch starts any thread.
  std::vector<pid_t> children;
  for (int r = 1; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(guarded_rank_main(r, nproc, port, opt));
    children.push_back(pid);
  }
  int rc = guarded_rank_main(0, nproc, port, opt);
  for (pid_t pid : children) {
    int status = 0;
    if (rc != 0) kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}
