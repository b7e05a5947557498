#include "runners/isolation.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "core/units.hpp"

namespace trainscope::runners {
namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_interrupt(int) { g_interrupted = 1; }

}  // namespace

void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool interrupted() { return g_interrupted != 0; }

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot resolve /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

ChildOutcome run_child(const std::vector<std::string>& argv, const std::string& log_path, double timeout_s) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (log < 0) throw std::runtime_error("cannot open " + log_path);

  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid < 0) {
    ::close(log);
    throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  }
  if (pid == 0) {
    setpgid(0, 0);  // own process group: a timeout kills the cell and anything it started
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    ::close(log);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so the group exists before any kill below
  ::close(log);

  ChildOutcome out;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) break;
    const bool late = elapsed() > timeout_s;
    if (late || interrupted()) {
      kill(-pid, SIGKILL);
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      out.kind = late ? ChildOutcome::Kind::TimedOut : ChildOutcome::Kind::Interrupted;
      out.wall_s = elapsed();
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Anything the cell left running in its group goes with it.
  kill(-pid, SIGKILL);
  out.wall_s = elapsed();
  if (WIFSIGNALED(status)) {
    out.kind = ChildOutcome::Kind::Signaled;
    out.signal = WTERMSIG(status);
  } else {
    out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return out;
}

std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

std::string describe(const ChildOutcome& o, double timeout_s) {
  switch (o.kind) {
    case ChildOutcome::Kind::TimedOut:
      return "timed out after " + format_seconds(timeout_s) + " (process group killed)";
    case ChildOutcome::Kind::Interrupted:
      return "interrupted by the user";
    case ChildOutcome::Kind::Signaled: {
      const char* name = sigabbrev_np(o.signal);
      return "killed by signal " + std::to_string(o.signal) + (name ? std::string(" (SIG") + name + ")" : "");
    }
    case ChildOutcome::Kind::Exited:
      return "exit code " + std::to_string(o.exit_code);
  }
  return "unknown";
}

}  // namespace trainscope::runners
