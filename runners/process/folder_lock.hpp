#pragma once
#include <string>

namespace trainscope::runners {

// One writer per results folder: an advisory lock (flock) on DIR/.trainscope.lock, held for the life
// of this object. A second trainscope into the same folder gets a UsageError naming the process that
// holds it (exit 2); the kernel drops the lock when its holder dies, so a lock left by a killed run
// blocks nothing. Re-entrant within one process (`parity` runs its suite into its own folder).
class FolderLock {
 public:
  explicit FolderLock(const std::string& dir);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  int fd_ = -1;
  std::string key_;
};

}  // namespace trainscope::runners
