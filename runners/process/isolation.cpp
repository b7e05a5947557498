#include "runners/process/isolation.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <thread>

#include "core/errors.hpp"
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

namespace {

// A forked child's own work, ended as the binary's main would end it (its error line, 2 for bad input)
// but with _exit: the parent's atexit handlers and static objects are not this child's to run.
[[noreturn]] void run_in_child(const InProcess& work) {
  int code = 1;
  try {
    code = work();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "trainscope: error: %s\n", e.what());
    code = 2;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "trainscope: error: %s\n", what.substr(0, what.find('\n')).c_str());
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(code);
}

// Whether this process has no thread but the caller's: a lock another thread holds at a fork would stay
// held in the child for good, so only then does a child run InProcess work (else it is started afresh).
bool single_threaded() {
  DIR* tasks = opendir("/proc/self/task");
  if (!tasks) return false;
  int n = 0;
  while (const dirent* e = readdir(tasks))
    if (e->d_name[0] != '.') ++n;
  closedir(tasks);
  return n == 1;
}

pid_t spawn(const std::vector<std::string>& argv, const std::string& log_path, const InProcess& in_process) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (log < 0) throw std::runtime_error("cannot open " + log_path);
  const pid_t parent = getpid();
  const bool in_this_image = in_process && single_threaded();
  std::fflush(nullptr);  // else a forked child would write what the parent had buffered a second time
  const pid_t pid = fork();
  if (pid < 0) {
    ::close(log);
    throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  }
  if (pid == 0) {
    setpgid(0, 0);  // own process group: a timeout kills the cell and anything it started
    // A cell dies with the process that started it (a launcher's worker killed, a node lost): left
    // alone in its own group it would sit in a collective until its timeout.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(137);  // the parent was gone before the line above
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    ::close(log);
    if (in_this_image) run_in_child(in_process);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);  // also here, so the group exists before any kill below
  ::close(log);
  return pid;
}

void kill_and_reap(pid_t pid, int& status) {
  kill(-pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace

GroupOutcome run_children(const std::vector<std::vector<std::string>>& argvs, const std::vector<std::string>& logs,
                          double timeout_s, double grace_s, const std::vector<InProcess>& in_process) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  GroupOutcome out;
  out.children.resize(argvs.size());
  std::vector<pid_t> pids;
  std::vector<bool> done(argvs.size(), false);
  try {
    for (size_t i = 0; i < argvs.size(); ++i)
      pids.push_back(spawn(argvs[i], logs[i], in_process.empty() ? InProcess{} : in_process.at(i)));
  } catch (...) {
    int st = 0;
    for (pid_t p : pids) kill_and_reap(p, st);
    throw;
  }
  size_t running = pids.size();
  double stop_at = 0;
  while (running > 0) {
    bool progressed = false;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t r = waitpid(pids[i], &status, WNOHANG);
      if (r != pids[i] && !(r < 0 && errno != EINTR)) continue;
      done[i] = true;
      --running;
      progressed = true;
      kill(-pids[i], SIGKILL);  // anything the child left running in its group goes with it
      ChildOutcome& o = out.children[i];
      o.wall_s = elapsed();
      if (WIFSIGNALED(status)) {
        o.kind = ChildOutcome::Kind::Signaled;
        o.signal = WTERMSIG(status);
      } else {
        o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      const bool failed = o.kind != ChildOutcome::Kind::Exited || o.exit_code != 0;
      if (failed && out.first_failure < 0) {
        out.first_failure = static_cast<int>(i);
        stop_at = elapsed() + grace_s;
      }
    }
    // The others would only wait in a collective for the failed one: after a short grace (in which
    // they usually fail on their own, saying why), stop them.
    if (out.first_failure >= 0 && running > 0 && elapsed() >= stop_at) {
      for (size_t k = 0; k < pids.size(); ++k) {
        if (done[k]) continue;
        int st = 0;
        kill_and_reap(pids[k], st);
        done[k] = true;
        --running;
        out.children[k].kind = ChildOutcome::Kind::Stopped;
        out.children[k].wall_s = elapsed();
      }
    }
    if (running == 0) break;
    const bool late = elapsed() > timeout_s;
    if (late || interrupted()) {
      for (size_t k = 0; k < pids.size(); ++k) {
        if (done[k]) continue;
        int st = 0;
        kill_and_reap(pids[k], st);
        done[k] = true;
        out.children[k].kind = late ? ChildOutcome::Kind::TimedOut : ChildOutcome::Kind::Interrupted;
        out.children[k].wall_s = elapsed();
      }
      break;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  out.wall_s = elapsed();
  return out;
}

ChildOutcome run_child(const std::vector<std::string>& argv, const std::string& log_path, double timeout_s,
                       const InProcess& in_process) {
  return run_children({argv}, {log_path}, timeout_s, 1.0, {in_process}).children.at(0);
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
    case ChildOutcome::Kind::Stopped:
      return "stopped after another rank failed";
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
