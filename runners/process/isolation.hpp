#pragma once
// Process isolation: each cell runs in a child process (its own process group) under a timeout, so a
// crash, an abort or a hang ends that cell only.
#include <functional>
#include <string>
#include <vector>

namespace trainscope::runners {

struct ChildOutcome {
  // Stopped: killed by us because another process of the same group of ranks failed first.
  enum class Kind { Exited, Signaled, TimedOut, Interrupted, Stopped } kind = Kind::Exited;
  int exit_code = 0;
  int signal = 0;
  double wall_s = 0;
};

// What a child of this process may run without exec: the same work as its argv, as a function of this
// process (a cell of our own binary). The child is then a fork that calls it and exits with what it
// returns: it skips loading LibTorch again (0.3-0.4 s a process on CPU). Only where that is safe:
// cells_may_fork (suite_run.cpp) says when, and only while this process has a single thread.
using InProcess = std::function<int()>;

// Runs argv[0] with the arguments, stdout and stderr appended to `log_path`, and waits at most
// `timeout_s`; past it (or when the parent is interrupted) the child's whole process group is killed.
ChildOutcome run_child(const std::vector<std::string>& argv, const std::string& log_path, double timeout_s,
                       const InProcess& in_process = {});

// Several children at once (the ranks of one cell). The first to fail (signal or non-zero exit) is
// recorded; the others get grace_s to end on their own, then are killed (they would only wait for it
// in a collective). Past the timeout all are killed. Every process group is gone when this returns.
struct GroupOutcome {
  std::vector<ChildOutcome> children;
  int first_failure = -1;
  double wall_s = 0;
};
// in_process: empty, or one per child (an empty one is exec'd).
GroupOutcome run_children(const std::vector<std::vector<std::string>>& argvs, const std::vector<std::string>& logs,
                          double timeout_s, double grace_s = 1.0, const std::vector<InProcess>& in_process = {});

// The path of the running executable (children started afresh re-execute it).
std::string self_exe();
// The last non-empty line of a text file ("" if none): the error a dying child printed.
std::string last_line(const std::string& path);
// A one-line description: "exit code 3", "killed by signal 11 (SIGSEGV)", "timed out after 5 s".
std::string describe(const ChildOutcome& o, double timeout_s);

// Ctrl-C / SIGTERM in the parent: set a flag that run_child and the suite loop check.
void install_interrupt_handler();
bool interrupted();

}  // namespace trainscope::runners
