#include "runners/process/launch.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "runners/process/isolation.hpp"

#include "core/errors.hpp"

extern char** environ;

namespace trainscope::runners {
namespace {

int to_int(const std::map<std::string, std::string>& env, const std::string& key) {
  const auto it = env.find(key);
  if (it == env.end()) throw UsageError(key + " is not set");
  try {
    size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  throw UsageError(key + "='" + it->second + "' is not an integer");
}

std::string value_or(const std::map<std::string, std::string>& env, const std::string& key, const std::string& dflt) {
  const auto it = env.find(key);
  return it == env.end() || it->second.empty() ? dflt : it->second;
}

// A listening socket on port (0: any free port) for the store's server, on 127.0.0.1 for ranks that
// meet on this machine: the store has no authentication, so a local run must not listen beyond it.
int store_listener(int port, bool loopback) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("cannot open a socket");
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(loopback ? INADDR_LOOPBACK : INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, SOMAXCONN) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    throw std::runtime_error(std::string("cannot listen on ") + (loopback ? "127.0.0.1:" : "port ") + std::to_string(port) +
                             ": " + why);
  }
  return fd;
}

// The store's server in a process of its own, serving on fd until this one ends it (or dies). c10d
// serves from a thread, and this process forks its cells (InProcess, isolation.hpp): a lock that thread
// held at a fork would stay held in the child for good (a rank that hung in its rendezvous, once in a
// whole ctest run). Forked while this process has no other thread; it never forks itself.
// Returns once the server serves (its pid), or throws what stopped it: a client would otherwise retry
// its connection for the whole store timeout.
int serve_in_child(int fd, const std::string& addr, c10d::TCPStoreOptions o) {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe failed: ") + std::strerror(errno));
  const pid_t parent = getpid();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(ready[0]);
    close(ready[1]);
    throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  }
  if (pid > 0) {
    close(ready[1]);
    std::string said;
    char buf[256];
    for (ssize_t n; (n = read(ready[0], buf, sizeof buf)) != 0;)
      if (n > 0) said.append(buf, static_cast<size_t>(n));
      else if (errno != EINTR) break;
    close(ready[0]);
    if (said == "ok") return pid;
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    throw std::runtime_error(said.empty() ? "its server process ended" : said);
  }
  close(ready[0]);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(0);
  signal(SIGINT, SIG_IGN);  // the run handles Ctrl-C and may still need its store; it ends this one
  signal(SIGTERM, SIG_IGN);
  try {
    o.isServer = true;
    o.masterListenFd = fd;
    c10d::TCPStore server(addr, o);
    (void)!write(ready[1], "ok", 2);
    close(ready[1]);
    for (;;) pause();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string line = what.substr(0, what.find('\n'));
    (void)!write(ready[1], line.data(), line.size());
  }
  _exit(1);
}

int bound_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) throw std::runtime_error("getsockname failed");
  return ntohs(a.sin_port);
}

}  // namespace

std::string host_name() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr a{};
  return inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

std::string Launch::describe() const {
  return source + ": rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local rank " +
         std::to_string(local_rank) + "), rendezvous " + master_addr + ":" + std::to_string(master_port);
}

std::map<std::string, std::string> process_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

int free_local_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("cannot open a socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  if (!ok) throw std::runtime_error("cannot find a free local port");
  return ntohs(a.sin_port);
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry, with its first bracketed number: "node[01-04,07]" -> "node01".
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const std::string inside = first.substr(open + 1, first.find(']') - open - 1);
  const size_t cut = inside.find_first_of(",-");
  return first.substr(0, open) + inside.substr(0, cut);
}

std::optional<Launch> detect_launch(const std::map<std::string, std::string>& env) {
  Launch l;
  if (env.count("RANK") || env.count("WORLD_SIZE")) {
    l.source = "torchrun";
    l.rank = to_int(env, "RANK");
    l.world_size = to_int(env, "WORLD_SIZE");
    l.local_rank = env.count("LOCAL_RANK") ? to_int(env, "LOCAL_RANK") : 0;
    l.local_world_size = env.count("LOCAL_WORLD_SIZE") ? to_int(env, "LOCAL_WORLD_SIZE") : l.world_size;
    // torchrun's agent serves a store on MASTER_ADDR:MASTER_PORT and says so.
    l.serve_store = value_or(env, "TORCHELASTIC_USE_AGENT_STORE", "") != "True";
  } else if (env.count("SLURM_PROCID") && env.count("SLURM_NTASKS")) {
    l.source = "slurm";
    l.rank = to_int(env, "SLURM_PROCID");
    l.world_size = to_int(env, "SLURM_NTASKS");
    l.local_rank = env.count("SLURM_LOCALID") ? to_int(env, "SLURM_LOCALID") : 0;
    // The tasks on this node: all of them on one node, else --ntasks-per-node's, else the first entry of
    // the step's tasks per node ("2(x2)", "3,1": block distribution puts rank 0's node first).
    const std::string per_node = value_or(env, "SLURM_NTASKS_PER_NODE", value_or(env, "SLURM_STEP_TASKS_PER_NODE", ""));
    const std::string nodes_n = value_or(env, "SLURM_STEP_NUM_NODES", value_or(env, "SLURM_NNODES", ""));
    l.local_world_size = nodes_n == "1" ? l.world_size : per_node.empty() ? 1 : std::max(1, std::atoi(per_node.c_str()));
    const std::string nodes = value_or(env, "SLURM_STEP_NODELIST", value_or(env, "SLURM_JOB_NODELIST", ""));
    if (!nodes.empty()) l.master_addr = first_slurm_host(nodes);
  } else if (env.count("OMPI_COMM_WORLD_RANK")) {
    l.source = "mpirun";
    l.rank = to_int(env, "OMPI_COMM_WORLD_RANK");
    l.world_size = to_int(env, "OMPI_COMM_WORLD_SIZE");
    l.local_rank = env.count("OMPI_COMM_WORLD_LOCAL_RANK") ? to_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") : 0;
    l.local_world_size = env.count("OMPI_COMM_WORLD_LOCAL_SIZE") ? to_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") : 1;
  } else {
    return std::nullopt;
  }
  l.master_addr = value_or(env, "MASTER_ADDR", l.master_addr);
  l.master_port = env.count("MASTER_PORT") ? to_int(env, "MASTER_PORT") : 29500;
  if (l.world_size < 1 || l.rank < 0 || l.rank >= l.world_size)
    throw UsageError(l.source + " launch: rank " + std::to_string(l.rank) + " is outside a world of " +
                     std::to_string(l.world_size));
  if (l.master_port <= 0 || l.master_port > 65535)
    throw UsageError("MASTER_PORT=" + std::to_string(l.master_port) + " is not a TCP port");
  if (l.world_size == 1) return std::nullopt;  // a world of one is a plain local run
  return l;
}

RendezvousStore::RendezvousStore(const Launch& launch, double timeout_s) : launch_(launch), timeout_s_(timeout_s) {}
RendezvousStore::~RendezvousStore() {
  holder_.reset();
  if (server_pid_ > 0) {
    kill(server_pid_, SIGKILL);
    while (waitpid(server_pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

void RendezvousStore::open() {
  if (store_) return;
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(launch_.master_port);
  o.isServer = launch_.rank == 0 && launch_.serve_store;
  o.waitWorkers = false;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
  try {
    // Ranks that meet on this machine meet on loopback, and the server listens there only; a
    // multi-node launch's rank 0 listens on every interface, where MASTER_ADDR's peers will come. The
    // socket is this process's (a busy port is its error); the server is a child's, this a client.
    if (o.isServer) {
      const int fd = store_listener(launch_.master_port, is_loopback(launch_.master_addr));
      launch_.master_port = bound_port(fd);
      o.port = static_cast<std::uint16_t>(launch_.master_port);
      try {
        server_pid_ = serve_in_child(fd, launch_.master_addr, o);
      } catch (...) {
        close(fd);
        throw;
      }
      close(fd);
      o.isServer = false;
    }
    auto s = c10::make_intrusive<c10d::TCPStore>(launch_.master_addr, o);
    if (launch_.master_port == 0) launch_.master_port = s->getPort();
    store_ = s.get();
    holder_ = std::shared_ptr<void>(s.release(), [](void* p) {
      c10::intrusive_ptr<c10d::TCPStore>::reclaim(static_cast<c10d::TCPStore*>(p));
    });
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(std::string(o.isServer ? "cannot serve" : "cannot reach") + " the rendezvous store at " +
                             launch_.master_addr + ":" + std::to_string(launch_.master_port) + ": " +
                             what.substr(0, what.find('\n')));
  }
}

int RendezvousStore::port() {
  open();
  return launch_.master_port;
}

void RendezvousStore::set(const std::string& key, const std::string& value) {
  open();
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string RendezvousStore::get(const std::string& key, double timeout_s) {
  open();
  // In slices of at most a second, so that a SIGTERM (a launcher stopping its workers: torchrun gives
  // them 30 s before SIGKILL) ends the wait at once instead of after the whole timeout.
  const auto start = std::chrono::steady_clock::now();
  auto waited = [&start] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (;;) {
    const double slice = std::min(1.0, std::max(0.001, timeout_s - waited()));
    const auto tried = std::chrono::steady_clock::now();
    try {
      store_->wait({key}, std::chrono::milliseconds(static_cast<int64_t>(slice * 1000)));
      break;
    } catch (const std::exception& e) {
      const bool early = std::chrono::duration<double>(std::chrono::steady_clock::now() - tried).count() < slice / 2;
      if (early || waited() >= timeout_s) {  // the store is gone, or the time is up
        const std::string what = e.what();
        throw std::runtime_error("no '" + key + "' in the rendezvous store after " + std::to_string(static_cast<int>(waited())) +
                                 " s" + (early ? ": " + what.substr(0, what.find('\n')) : ""));
      }
      if (interrupted()) throw std::runtime_error("interrupted while waiting for '" + key + "' in the rendezvous store");
    }
  }
  const std::vector<uint8_t> v = store_->get(key);
  return std::string(v.begin(), v.end());
}

int64_t RendezvousStore::add(const std::string& key, int64_t delta) {
  open();
  return store_->add(key, delta);
}

}  // namespace trainscope::runners
