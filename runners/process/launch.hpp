#pragma once
// Rank launch and rendezvous.
//
// Local: `trainscope run --nproc N` starts a cell's world_size ranks as child processes of this one
// (world_size <= N). External: under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
// SLURM_JOB_NODELIST) or Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK), every launched
// `trainscope run` is one rank and runs the cells whose world_size equals the launch's.
//
// Either way the ranks meet through a c10d TCPStore that the rank-0 `trainscope run` serves (or
// torchrun's agent, when it says so), with a key prefix per cell; each cell's ranks form a process
// group under it. Rank 0's cell process merges the ranks' results; rank 0's `run` writes the report.
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace c10d {
class Store;
}

namespace trainscope::runners {

struct Launch {
  std::string source = "local";  // local | torchrun | slurm | mpirun
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;        // 0: any free port (local)
  bool serve_store = true;    // false under torchrun's agent store
  bool external() const { return source != "local"; }
  std::string describe() const;
};

// The launch this process is part of, from the environment (nullopt when none, or a world of one).
// Throws UsageError on inconsistent variables (RANK without WORLD_SIZE, a rank outside the world).
std::optional<Launch> detect_launch(const std::map<std::string, std::string>& env);
std::map<std::string, std::string> process_env();
// A loopback TCP port that was free a moment ago (for a rendezvous that others must know beforehand).
int free_local_port();
// This machine's host name (gethostname): what tells one node's ranks from another's.
std::string host_name();
// 127.0.0.0/8 or "localhost": where a store server listens on loopback only.
bool is_loopback(const std::string& host);
// "node[01-04,07],gpu2" -> "node01"; "a,b" -> "a".
std::string first_slurm_host(const std::string& nodelist);

// The rendezvous store as this `run` process sees it: the server on rank 0 (started on first use),
// a client elsewhere.
class RendezvousStore {
 public:
  explicit RendezvousStore(const Launch& launch, double timeout_s = 300);
  ~RendezvousStore();
  std::string host() const { return launch_.master_addr; }
  int port();
  void set(const std::string& key, const std::string& value);
  // Waits up to timeout_s for the key; throws naming it when it does not come.
  std::string get(const std::string& key, double timeout_s);
  // Adds delta to the counter at key (0 when new) and returns its new value.
  int64_t add(const std::string& key, int64_t delta);

 private:
  void open();
  Launch launch_;
  double timeout_s_;
  std::shared_ptr<void> holder_;  // keeps the TCPStore alive (its type stays out of this header)
  c10d::Store* store_ = nullptr;
  int server_pid_ = -1;  // the process that serves the store, where this one does (rank 0)
};

}  // namespace trainscope::runners
