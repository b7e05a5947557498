#pragma once
// The ranks' communicator: a c10d process group (Gloo on CPU, NCCL on CUDA) behind the few collectives
// the parallel strategies need, each timed and reported to the hooks (the communication probe).
//
// All-gather and reduce-scatter are flat (one buffer of world x shard elements). NCCL runs them
// natively. Gloo has both in LibTorch 2.x (`_allgather_base`, `_reduce_scatter_base`), and each can
// also be emulated with the collectives Gloo has always had (one broadcast per rank; all-reduce +
// slice); which one runs is a setting, defaulted to the faster on this machine's measurement
// (trainscope_collectives --implementation both), and implementation() names it in the report.
//
// Durations: on Gloo the host clock (Gloo's collectives run on its threads and finish before the
// future does). On NCCL the host only sees launches, so each collective's duration comes from c10d's
// own CUDA events, recorded on NCCL's stream before and after the kernel (TORCH_NCCL_ENABLE_TIMING's
// mechanism, `Work::getDuration`), as nccl-tests times on the stream it runs on.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include "core/hooks.hpp"

namespace trainscope::suites {

// Where the ranks meet: a TCPStore served by the launcher, with a key prefix per cell.
struct Rendezvous {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string prefix;
  int rank = 0, world_size = 1;
  bool spans_hosts = false;  // the launcher put ranks on other hosts (its local world < the world)
};

class Communicator;

// After a CPU (Gloo) work's wait: returns once the caller holds the work's last reference, so that the
// tensors it keeps are freed on the caller's thread (comm.cpp says why); at most 200 ms.
void release_on_this_thread(const c10::intrusive_ptr<c10d::Work>& w);

// A collective in flight (zero3's prefetch). wait() blocks until it is done and reports it: its time
// from launch to completion, and the part the caller spent blocked as the exposed part.
class PendingCollective {
 public:
  void wait();

 private:
  friend class Communicator;
  Communicator* comm_ = nullptr;
  std::string op_;
  int64_t bytes_ = 0, step_ = -1;
  double launched_ = 0, launch_s_ = 0;  // when, and how long the caller spent launching it
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::shared_ptr<std::atomic<double>> finished_ = std::make_shared<std::atomic<double>>(0.0);
  bool waited_ = false;
};

class Communicator {
 public:
  // Joins the group; throws (naming the store) when the peers do not all arrive within timeout_s.
  Communicator(const Rendezvous& rv, const std::string& backend, const torch::Device& device, double timeout_s);
  ~Communicator();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const std::string& backend() const { return backend_; }
  std::string implementation() const;
  // Native (`_allgather_base` / `_reduce_scatter_base`) or emulated flat collectives on Gloo.
  void set_native_flat_collectives(bool native) { native_flat_ = native || backend_ == "nccl"; }
  bool native_flat_collectives() const { return native_flat_; }
  // The mesh dimension this communicator serves (tp, dp_shard, ...): its collectives are reported under it.
  void set_dimension(std::string dim) { dimension_ = std::move(dim); }
  c10::intrusive_ptr<c10d::ProcessGroup> process_group() const { return pg_; }

  // Every collective is reported here with its duration (the communication probe listens).
  void set_observer(std::function<void(const CollectiveInfo&)> f) { observer_ = std::move(f); }
  void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return parent_ ? parent_->step() : step_; }
  void report(CollectiveInfo c) const {
    if (c.level.empty()) c.level = level_;
    if (c.dimension.empty()) c.dimension = dimension_;
    if (parent_) parent_->report(std::move(c));
    else if (observer_) observer_(c);
  }

  // Whether durations come from a device clock (NCCL's CUDA events) rather than the host's.
  bool device_timed() const { return static_cast<bool>(device_clock_); }
  // Replaces the device clock: seconds one completed Work ran for (tests drive the deferred path with
  // it on Gloo; an empty function goes back to the host clock).
  void set_device_clock(std::function<double(const c10d::Work&)> clock) { device_clock_ = std::move(clock); }
  // Asynchronous collectives (the gradient buckets): reports c at once on the host clock; with a
  // device clock, holds it until flush(), when its works have run, and reports their device time
  // (their sum: one stream runs them one after the other) with the exposed part capped at it.
  void report_after(CollectiveInfo c, std::vector<c10::intrusive_ptr<c10d::Work>> works);
  // Reports what report_after holds, first waiting for the device when some of it is still running.
  void flush();

  // In place; average divides by the world size after summing. record=false keeps the run's own
  // bookkeeping (the loss it logs) out of the training's communication.
  void all_reduce(torch::Tensor& t, bool average, bool record = true);
  void all_reduce_max(torch::Tensor& t);
  // full (world x shard elements, flat) <- every rank's shard, in rank order.
  void all_gather(torch::Tensor& full, const torch::Tensor& shard);
  // The same, returning at once; `full` is complete after wait().
  std::shared_ptr<PendingCollective> all_gather_async(torch::Tensor& full, const torch::Tensor& shard);
  // shard <- this rank's slice of the sum (or mean) over ranks of full (scratch: Gloo reduces in it).
  void reduce_scatter(torch::Tensor& shard, const torch::Tensor& full, bool average);
  void broadcast(std::vector<torch::Tensor> tensors, int root);
  // Point-to-point between pipeline stages (group ranks), posted at once and completed by the Work's
  // wait(), which gives up after the group's timeout (a peer that died or hangs is an error, not a
  // hang). Gloo matches a receive by source and tag; the tags keep concurrent transfers apart.
  c10::intrusive_ptr<c10d::Work> send(const torch::Tensor& t, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const torch::Tensor& t, int src, int tag);
  void barrier();

  // A communicator over some of the world's ranks (`ranks`, world ranks in order; this one among them)
  // on the same store under a prefix of its own: every rank in `ranks` calls it with the same list and
  // tag (the collectives cell's per-node and cross-node groups). With a `level`, its collectives go to
  // this communicator's observer marked with it, at this one's step (hsdp's groups, seen by the probe).
  std::unique_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& tag,
                                      const std::string& level = "") const;

  // The world's ranks grouped by host (each host's ranks in order, hosts in order of their first
  // rank), from every rank's host name through the store; a collective every rank must call.
  std::vector<std::vector<int>> ranks_by_host();

  // Small key-value exchange through the store (results, fingerprints); get waits up to the timeout.
  void store_set(const std::string& key, const std::string& value);
  std::string store_get(const std::string& key);

 private:
  friend class PendingCollective;
  void wait(const c10::intrusive_ptr<c10d::Work>& w);
  double device_seconds(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const;
  void timed(const std::string& op, int64_t bytes, const std::function<void()>& body, bool record = true);

  Rendezvous rv_;
  const Communicator* parent_ = nullptr;  // a split group reporting through its parent
  std::string level_;
  std::string dimension_;
  double timeout_s_ = 0;
  int rank_ = 0, world_ = 1;
  std::string backend_;
  torch::Device device_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::function<void(const CollectiveInfo&)> observer_;
  int64_t step_ = -1;
  bool native_flat_ = true;
  std::function<double(const c10d::Work&)> device_clock_;
  bool collecting_ = false;                             // inside timed(): wait() keeps the works
  std::vector<c10::intrusive_ptr<c10d::Work>> waited_;  // the works of the blocking collective in progress
  std::vector<std::pair<CollectiveInfo, std::vector<c10::intrusive_ptr<c10d::Work>>>> held_;
};

}  // namespace trainscope::suites
