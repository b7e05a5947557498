#include "runners/process/folder_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "core/errors.hpp"
#include "core/units.hpp"

namespace trainscope::runners {

namespace {

std::mutex held_mutex;
std::map<std::string, int> held;  // canonical folder -> locks this process holds on it

// This process's command line, for the holder's description.
std::string own_command() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>()), out;
  for (char c : raw) out += c == '\0' ? ' ' : c;
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

}  // namespace

FolderLock::FolderLock(const std::string& dir) {
  std::filesystem::create_directories(dir);
  key_ = std::filesystem::canonical(dir).string();
  std::lock_guard<std::mutex> guard(held_mutex);
  if (held[key_]++ > 0) return;  // this process holds it already
  const std::string path = key_ + "/.trainscope.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    held.erase(key_);
    throw UsageError(dir + ": cannot create " + path + ": " + std::strerror(errno));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    std::string holder;
    {
      std::ifstream f(path);
      std::getline(f, holder);
    }
    ::close(fd_);
    fd_ = -1;
    held.erase(key_);
    throw UsageError(dir + " is in use by another trainscope (" + (holder.empty() ? std::string("a process starting up") : holder) +
                     "): wait for it to finish, or write into another folder (--out)");
  }
  std::ostringstream who;
  who << "pid " << ::getpid() << ", since " << utc_now(false) << ": " << own_command() << "\n";
  const std::string text = who.str();
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    // The lock holds without the description; the next run's message is vaguer, nothing worse.
  }
}

FolderLock::~FolderLock() {
  std::lock_guard<std::mutex> guard(held_mutex);
  if (--held[key_] > 0) return;
  held.erase(key_);
  if (fd_ >= 0) ::close(fd_);  // releases the lock; the file stays (removing it would race a newcomer)
}

}  // namespace trainscope::runners
