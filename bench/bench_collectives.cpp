// Collective bandwidth over the project's own communicator, in nccl-tests' table shape:
//   trainscope_collectives [--nproc 2] [--min-bytes 1KiB] [--max-bytes 64MiB] [--backend gloo]
// All-reduce, all-gather and reduce-scatter from min to max bytes (x4 per row); time is the slowest
// rank's mean over the iterations; algbw = size / time, busbw = algbw x nccl-tests' factor
// (probes/comm.hpp). Sizes follow nccl-tests: the per-rank buffer for all-reduce, the full buffer for
// all-gather and reduce-scatter. On Gloo the report's implementation line says what is emulated.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include <CLI/CLI.hpp>

#include "core/units.hpp"
#include "probes/comm.hpp"
#include "runners/launch.hpp"
#include "suites/comm.hpp"

using namespace trainscope;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int rank_main(int rank, int world, int port, const std::string& backend, int64_t min_bytes, int64_t max_bytes) {
  at::set_num_threads(1);
  // Rank 0 serves the rendezvous store, as `trainscope run` does.
  runners::Launch launch;
  launch.master_port = port;
  launch.world_size = world;
  runners::RendezvousStore store(launch);
  if (rank == 0) store.port();
  suites::Communicator comm(suites::Rendezvous{"127.0.0.1", port, "bench/", rank, world}, backend, torch::kCPU, 120);
  if (rank == 0) {
    std::printf("# trainscope collectives: %d ranks, %s\n# %s\n#\n", world, backend.c_str(), comm.implementation().c_str());
    std::printf("# %12s %12s %6s %15s %12s %12s %12s\n", "size(B)", "count", "type", "op", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)");
  }
  for (const std::string op : {"all-reduce", "all-gather", "reduce-scatter"}) {
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const int64_t count = bytes / 4;  // fp32 elements of the buffer the size names
      const int64_t shard = count / world;
      torch::Tensor full = torch::ones({count});
      torch::Tensor part = torch::ones({std::max<int64_t>(shard, 1)});
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
      const double t0 = now_s();
      for (int i = 0; i < iters; ++i) once();
      torch::Tensor t = torch::full({1}, (now_s() - t0) / iters, torch::kDouble);
      comm.all_reduce_max(t);  // the slowest rank's time
      const double secs = t.item<double>();
      const double algbw = static_cast<double>(bytes) / secs / 1e9;
      if (rank == 0)
        std::printf("  %12lld %12lld %6s %15s %12.1f %12.3f %12.3f\n", static_cast<long long>(bytes),
                    static_cast<long long>(count), "float", op.c_str(), secs * 1e6, algbw,
                    algbw * probes::bus_factor(op, world));
    }
  }
  comm.barrier();
  return 0;
}

int guarded_rank_main(int rank, int world, int port, const std::string& backend, int64_t lo, int64_t hi) {
  try {
    return rank_main(rank, world, port, backend, lo, hi);
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
  std::string min_text = "1KiB", max_text = "64MiB", backend = "gloo";
  app.add_option("--nproc", nproc, "ranks (local processes)")->check(CLI::Range(2, 64));
  app.add_option("--min-bytes", min_text, "smallest size");
  app.add_option("--max-bytes", max_text, "largest size");
  app.add_option("--backend", backend, "gloo (CPU) or nccl (a CUDA build with GPUs)")->check(CLI::IsMember({"gloo", "nccl"}));
  CLI11_PARSE(app, argc, argv);
  double lo = 0, hi = 0;
  if (!parse_bytes(min_text, lo) || !parse_bytes(max_text, hi) || lo < 4 || hi < lo) {
    std::fprintf(stderr, "trainscope_collectives: error: bad --min-bytes/--max-bytes\n");
    return 2;
  }
  const int port = runners::free_local_port();
  // Fork every rank before torch starts any thread.
  std::vector<pid_t> children;
  for (int r = 1; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(guarded_rank_main(r, nproc, port, backend, static_cast<int64_t>(lo), static_cast<int64_t>(hi)));
    children.push_back(pid);
  }
  int rc = guarded_rank_main(0, nproc, port, backend, static_cast<int64_t>(lo), static_cast<int64_t>(hi));
  for (pid_t pid : children) {
    int status = 0;
    if (rc != 0) kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}
