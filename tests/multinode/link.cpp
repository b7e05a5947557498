// The emulated cluster's network when the link between nodes needs a delay (this kernel has no netem):
// a user-space switch. It creates a TUN device named eth0 in each node's network namespace and
// forwards IPv4 packets between them by destination address (10.231.0.<i+1> is node i), each one
// serialised at RATE on the sender's port and again on the receiver's (two senders to one node share
// its port, as on a switch), then held DELAY before it is delivered. Runs until killed.
//
//   trainscope_link RATE_BITS_PER_S DELAY_US NETNS_PATH...    (one path per node, in node order)
//
// Prints "ready" once every eth0 exists (cluster.sh then gives them addresses).
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "trainscope_link: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

// eth0 as a TUN device (IP packets, no extra header) inside the namespace at `netns`.
int tun_in(const char* netns, int home) {
  const int ns = open(netns, O_RDONLY | O_CLOEXEC);
  if (ns < 0 || setns(ns, CLONE_NEWNET) != 0) die(std::string("cannot enter ") + netns);
  close(ns);
  const int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) die("cannot open /dev/net/tun");
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  std::strncpy(ifr.ifr_name, "eth0", IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) die(std::string("cannot create eth0 in ") + netns);
  if (setns(home, CLONE_NEWNET) != 0) die("cannot return to the original namespace");
  return fd;
}

struct Packet {
  Clock::time_point due;
  std::vector<unsigned char> bytes;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: trainscope_link RATE_BITS_PER_S DELAY_US NETNS_PATH NETNS_PATH...\n");
    return 2;
  }
  const double rate = std::strtod(argv[1], nullptr), delay_us = std::strtod(argv[2], nullptr);
  if (!(rate > 0) || !(delay_us >= 0)) {
    std::fprintf(stderr, "trainscope_link: RATE must be > 0 bit/s and DELAY >= 0 us\n");
    return 2;
  }
  prctl(PR_SET_TIMERSLACK, 1);  // wake-ups on time, not 50 us late
  const int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home < 0) die("cannot open this namespace");
  const size_t nodes = static_cast<size_t>(argc - 3);
  std::vector<int> tun;
  for (size_t i = 0; i < nodes; ++i) tun.push_back(tun_in(argv[3 + i], home));
  std::printf("ready\n");
  std::fflush(stdout);

  const auto delay = std::chrono::nanoseconds(static_cast<int64_t>(delay_us * 1e3));
  auto wire = [rate](size_t bytes) { return std::chrono::nanoseconds(static_cast<int64_t>(bytes * 8 / rate * 1e9)); };
  std::vector<Clock::time_point> out_free(nodes, Clock::now()), in_free(nodes, Clock::now());
  std::vector<std::deque<Packet>> queue(nodes);  // per receiving node, in delivery order
  std::vector<pollfd> fds(nodes);
  std::vector<unsigned char> buf(65536);
  for (;;) {
    // Deliver what is due; sleep until the next packet is, or a node sends one.
    auto now = Clock::now();
    Clock::time_point next = Clock::time_point::max();
    for (size_t d = 0; d < nodes; ++d) {
      while (!queue[d].empty() && queue[d].front().due <= now) {
        const auto& p = queue[d].front().bytes;
        if (write(tun[d], p.data(), p.size()) < 0 && errno != EAGAIN && errno != EIO) die("write to a node");
        queue[d].pop_front();
      }
      if (!queue[d].empty()) next = std::min(next, queue[d].front().due);
    }
    for (size_t i = 0; i < nodes; ++i) fds[i] = {tun[i], POLLIN, 0};
    timespec wait{};
    timespec* timeout = nullptr;
    if (next != Clock::time_point::max()) {
      const auto ns = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(next - Clock::now()).count());
      wait.tv_sec = ns / 1000000000;
      wait.tv_nsec = ns % 1000000000;
      timeout = &wait;
    }
    if (ppoll(fds.data(), fds.size(), timeout, nullptr) < 0 && errno != EINTR) die("poll");
    for (size_t s = 0; s < nodes; ++s) {
      if (!(fds[s].revents & POLLIN)) continue;
      for (;;) {
        const ssize_t n = read(tun[s], buf.data(), buf.size());
        if (n < 0) {
          if (errno == EAGAIN) break;
          die("read from a node");
        }
        // IPv4 only (version 4, 20-byte header at least); the destination's last byte names the node.
        if (n < 20 || (buf[0] >> 4) != 4 || buf[16] != 10 || buf[17] != 231 || buf[18] != 0) continue;
        const size_t d = static_cast<size_t>(buf[19]) - 1;
        if (d >= nodes || d == s) continue;
        now = Clock::now();
        out_free[s] = std::max(now, out_free[s]) + wire(static_cast<size_t>(n));
        in_free[d] = std::max(out_free[s], in_free[d]) + wire(static_cast<size_t>(n));
        queue[d].push_back({in_free[d] + delay, std::vector<unsigned char>(buf.begin(), buf.begin() + n)});
      }
    }
  }
}
