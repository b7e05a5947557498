#include "suites/parallel/comm.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/compat.hpp"
#include "core/errors.hpp"

#if defined(TRAINSCOPE_TORCH_CUDA) && defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define TRAINSCOPE_HAVE_NCCL 1
#elif defined(TRAINSCOPE_TORCH_CUDA)
#warning "CUDA LibTorch without USE_C10D_NCCL on the compile line: multi-rank GPU cells will say this build has no NCCL"
#endif

namespace trainscope::suites {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Gloo's transport: the interface GLOO_SOCKET_IFNAME names (as PyTorch does), loopback for a local
// group, else the address the host name resolves to. When the ranks span hosts and that address is
// loopback (a host name mapped to 127.0.1.1, as Debian's installer does), the peers on other hosts
// would time out connecting to it after the whole collective timeout: said at once instead.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& host, bool spans_hosts, int rank) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (host == "127.0.0.1" || host == "localhost") return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  if (spans_hosts) {
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    addrinfo hints{}, *found = nullptr;
    hints.ai_family = AF_INET;
    std::string address = "nothing";
    if (getaddrinfo(name, nullptr, &hints, &found) == 0 && found) {
      char text[INET_ADDRSTRLEN] = {0};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text, sizeof text);
      address = text;
      freeaddrinfo(found);
    }
    if (address == "nothing" || address.rfind("127.", 0) == 0)
      throw std::runtime_error("rank " + std::to_string(rank) + ": Gloo would offer the ranks on other hosts " + address +
                               " (what this host's name '" + name + "' resolves to), which they cannot reach: set " +
                               "GLOO_SOCKET_IFNAME to the interface that reaches them (eth0, ib0, ...)");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

Communicator::Communicator(const Rendezvous& rv, const std::string& backend, const torch::Device& device,
                           double timeout_s)
    : rv_(rv), timeout_s_(timeout_s), rank_(rv.rank), world_(rv.world_size), backend_(backend), device_(device) {
  // Gloo's native flat all-gather and reduce-scatter measured 1.3-3x slower than the emulation from
  // 4 MiB up (2 ranks, LibTorch 2.11; smaller sizes within the noise): emulated on Gloo, native on NCCL.
  native_flat_ = backend_ == "nccl";
  // Ranks on other hosts: every collective of the world crosses the link between nodes.
  if (rv.spans_hosts) level_ = "inter-node";
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(rv.port);
  opts.isServer = false;  // the launcher serves the store; ranks are clients
  opts.waitWorkers = false;
  opts.timeout = timeout;
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(rv.host, opts);
    store_ = c10::make_intrusive<c10d::PrefixStore>(rv.prefix, tcp);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("rank " + std::to_string(rank_) + " cannot reach the rendezvous store at " + rv.host +
                             ":" + std::to_string(rv.port) + ": " + what.substr(0, what.find('\n')));
  }
  if (backend_ == "nccl") {
#ifdef TRAINSCOPE_HAVE_NCCL
    auto o = c10d::ProcessGroupNCCL::Options::create();
    o->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank_, world_, o);
    // CUDA events around every collective on NCCL's stream: its device duration (Work::getDuration).
    nccl->enableCollectivesTiming();
    device_clock_ = [](const c10d::Work& w) { return static_cast<double>(w.getDuration()) / 1e3; };
    pg_ = compat::as_process_group<c10d::ProcessGroup>(nccl, store_, rank_, world_, true);
#else
    throw UsageError("this build has no NCCL (a CUDA LibTorch built with NCCL is needed)");
#endif
  } else {
    auto o = c10d::ProcessGroupGloo::Options::create(timeout);
    o->devices.push_back(gloo_device(rv.host, rv.spans_hosts, rv.rank));
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, world_, o);
    pg_ = compat::as_process_group<c10d::ProcessGroup>(gloo, store_, rank_, world_, false);
    // For the tests of the device-clock path on a machine without one: every Work "ran" this long.
    if (const char* fake = std::getenv("TRAINSCOPE_FAKE_DEVICE_CLOCK_S"); fake && *fake) {
      char* end = nullptr;
      const double s = std::strtod(fake, &end);
      if (end == fake || *end != '\0' || !(s >= 0))
        throw UsageError(std::string("TRAINSCOPE_FAKE_DEVICE_CLOCK_S must be seconds, not '") + fake + "'");
      device_clock_ = [s](const c10d::Work&) { return s; };
    }
  }
}

Communicator::~Communicator() = default;

std::string Communicator::implementation() const {
  const std::string clock = !device_timed()    ? "; timed by the host clock"
                            : backend_ == "nccl" ? "; timed by CUDA events on NCCL's stream"
                                                 : "; timed by a fixed device clock (TRAINSCOPE_FAKE_DEVICE_CLOCK_S)";
  if (native_flat_)
    return backend_ + ": native all-reduce, broadcast, all-gather (_allgather_base), reduce-scatter (_reduce_scatter_base)" +
           clock;
  return backend_ + ": native all-reduce and broadcast; all-gather as one broadcast per rank; reduce-scatter as "
                    "all-reduce + slice" + clock;
}

void Communicator::wait(const c10::intrusive_ptr<c10d::Work>& w) {
  w->wait();
  // NCCL's wait only orders the streams; the host clock needs the device to finish.
  if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  if (backend_ == "gloo") release_on_this_thread(w);
  if (collecting_ && device_clock_) waited_.push_back(w);
}

// Gloo's worker thread marks a work complete and only then lets go of it; were it the last holder, the
// work's tensors (a reduce-scatter's whole input, which the caller drops at once) would be freed on that
// thread whenever it gets to it, and the step's measured peak would depend on that race. Waiting the few
// microseconds until the caller's reference is the last one frees them here, at the caller's next line.
// Bounded: a backend that keeps its reference longer costs the measurement's exactness, never the run.
void release_on_this_thread(const c10::intrusive_ptr<c10d::Work>& w) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (w.use_count() > 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
}

// Negative when the device clock cannot tell (its events missing): the caller keeps the host's figure.
double Communicator::device_seconds(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const {
  double s = 0;
  try {
    for (const auto& w : works) s += device_clock_(*w);
  } catch (const std::exception& e) {
    static bool said = false;
    if (!said) {
      said = true;
      const std::string what = e.what();
      std::cerr << "trainscope: collective durations fall back to the host clock: " << what.substr(0, what.find('\n'))
                << "\n";
    }
    return -1;
  }
  return s;
}

void Communicator::timed(const std::string& op, int64_t bytes, const std::function<void()>& body, bool record) {
  waited_.clear();
  collecting_ = true;
  const double t0 = now_s();
  try {
    body();
  } catch (...) {
    collecting_ = false;
    throw;
  }
  const double dt = now_s() - t0;
  collecting_ = false;
  // Blocking: the caller waited for all of it, so all of it is exposed, whichever clock measured it.
  const double device = device_clock_ && !waited_.empty() ? device_seconds(waited_) : -1;
  waited_.clear();
  const double seconds = device >= 0 ? device : dt;
  if (record) report(CollectiveInfo{op, bytes, world_, seconds, seconds, step(), 0.0, "", ""});
}

void Communicator::report_after(CollectiveInfo c, std::vector<c10::intrusive_ptr<c10d::Work>> works) {
  if (!device_clock_ || works.empty()) {
    report(c);
    return;
  }
  if (c.end_s <= 0) c.end_s = now_s();
  held_.emplace_back(std::move(c), std::move(works));
}

void Communicator::flush() {
  if (held_.empty()) return;
  bool running = false;
  for (const auto& [c, works] : held_)
    for (const auto& w : works) running = running || !w->isCompleted();
  if (running && device_.is_cuda()) torch::cuda::synchronize(device_.index());
  for (auto& [c, works] : held_) {
    if (running && !device_.is_cuda())
      for (const auto& w : works) w->wait();
    const double device = device_seconds(works);
    if (device >= 0) {
      c.seconds = device;
      c.exposed_s = std::min(c.exposed_s, device);
    }
    report(c);
  }
  held_.clear();
}

void Communicator::all_reduce(torch::Tensor& t, bool average, bool record) {
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  timed("all-reduce", bytes, [&] {
    std::vector<torch::Tensor> v{t};
    wait(pg_->allreduce(v));
    if (average) t.div_(world_);
  }, record);
}

void Communicator::all_reduce_max(torch::Tensor& t) {
  timed("all-reduce", t.numel() * static_cast<int64_t>(t.element_size()), [&] {
    std::vector<torch::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    wait(pg_->allreduce(v, o));
  });
}

void Communicator::all_gather(torch::Tensor& full, const torch::Tensor& shard) {
  // Launched and waited for at once: all of it is exposed.
  all_gather_async(full, shard)->wait();
}

std::shared_ptr<PendingCollective> Communicator::all_gather_async(torch::Tensor& full, const torch::Tensor& shard) {
  const int64_t n = shard.numel();
  TORCH_CHECK(full.numel() == n * world_, "all_gather: full buffer must hold world_size shards");
  auto p = std::make_shared<PendingCollective>();
  p->comm_ = this;
  p->op_ = "all-gather";
  p->bytes_ = full.numel() * static_cast<int64_t>(full.element_size());
  p->step_ = step();
  p->launched_ = now_s();
  if (native_flat_) {
    torch::Tensor in = shard;
    p->works_.push_back(compat::all_gather_single(*pg_, full, in));
  } else {
    full.narrow(0, rank_ * n, n).copy_(shard);
    for (int r = 0; r < world_; ++r) {
      std::vector<torch::Tensor> v{full.narrow(0, r * n, n)};
      c10d::BroadcastOptions o;
      o.rootRank = r;
      p->works_.push_back(pg_->broadcast(v, o));
    }
  }
  // Completion time: the last of its works to finish (callbacks run on the backend's threads).
  for (const auto& w : p->works_) {
    auto finished = p->finished_;
    w->getFuture()->addCallback([finished](c10::ivalue::Future&) {
      const double t = now_s();
      double prev = finished->load();
      while (t > prev && !finished->compare_exchange_weak(prev, t)) {
      }
    });
  }
  p->launch_s_ = now_s() - p->launched_;
  return p;
}

void PendingCollective::wait() {
  if (waited_) return;
  waited_ = true;
  const double t0 = now_s();
  for (const auto& w : works_) comm_->wait(w);
  const double t1 = now_s();
  // Launch to completion: the last work's callback, or t1 (when the host saw it) if none ran.
  const double done = finished_->load();
  double exposed = launch_s_ + (t1 - t0);  // launching and waiting held the caller up
  double seconds = std::max((done > launched_ ? std::min(done, t1) : t1) - launched_, exposed);
  if (comm_->device_clock_) {
    // The device's time for the gather; the host's wait also covered the compute queued before it.
    if (const double device = comm_->device_seconds(works_); device >= 0) {
      seconds = device;
      exposed = std::min(exposed, device);
    }
  }
  comm_->report(CollectiveInfo{op_, bytes_, comm_->world_size(), seconds, exposed, step_, launched_ + seconds, "", ""});
}

void Communicator::reduce_scatter(torch::Tensor& shard, const torch::Tensor& full, bool average) {
  const int64_t n = shard.numel();
  TORCH_CHECK(full.numel() == n * world_, "reduce_scatter: full buffer must hold world_size shards");
  timed("reduce-scatter", full.numel() * static_cast<int64_t>(full.element_size()), [&] {
    if (native_flat_) {
      torch::Tensor in = full;
      wait(compat::reduce_scatter_single(*pg_, shard, in, c10d::ReduceScatterOptions{}));
    } else {
      // In place: `full` is scratch for the callers.
      torch::Tensor sum = full;
      std::vector<torch::Tensor> v{sum};
      wait(pg_->allreduce(v));
      shard.copy_(sum.narrow(0, rank_ * n, n));
    }
    if (average) shard.div_(world_);
  });
}

void Communicator::broadcast(std::vector<torch::Tensor> tensors, int root) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  timed("broadcast", bytes, [&] {
    for (auto& t : tensors) {
      std::vector<torch::Tensor> v{t};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      wait(pg_->broadcast(v, o));
    }
  });
}

c10::intrusive_ptr<c10d::Work> Communicator::send(const torch::Tensor& t, int dst, int tag) {
  std::vector<torch::Tensor> v{t};
  return pg_->send(v, dst, tag);
}

c10::intrusive_ptr<c10d::Work> Communicator::recv(const torch::Tensor& t, int src, int tag) {
  std::vector<torch::Tensor> v{t};
  return pg_->recv(v, src, tag);
}

void Communicator::barrier() { pg_->barrier()->wait(); }

std::vector<std::vector<int>> Communicator::ranks_by_host() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  store_set("hosts/" + std::to_string(rank_), name);
  std::vector<std::string> names;
  std::vector<std::vector<int>> nodes;
  for (int r = 0; r < world_; ++r) {
    const std::string host = store_get("hosts/" + std::to_string(r));
    const auto at = std::find(names.begin(), names.end(), host);
    if (at == names.end()) {
      names.push_back(host);
      nodes.push_back({r});
    } else {
      nodes[at - names.begin()].push_back(r);
    }
  }
  return nodes;
}

std::unique_ptr<Communicator> Communicator::split(const std::vector<int>& ranks, const std::string& tag,
                                                 const std::string& level) const {
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) throw std::logic_error("split: rank " + std::to_string(rank_) + " is not in group " + tag);
  Rendezvous r = rv_;
  r.prefix = rv_.prefix + "group/" + tag + "/";
  r.rank = static_cast<int>(me - ranks.begin());
  r.world_size = static_cast<int>(ranks.size());
  auto sub = std::make_unique<Communicator>(r, backend_, device_, timeout_s_);
  sub->set_native_flat_collectives(native_flat_);
  if (!level.empty()) {
    sub->parent_ = this;
    sub->level_ = level;
  }
  return sub;
}

void Communicator::store_set(const std::string& key, const std::string& value) {
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Communicator::store_get(const std::string& key) {
  const std::vector<uint8_t> v = store_->get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace trainscope::suites
