#pragma once
// Memory probe. CPU: an accounting allocator installed as torch's CPU allocator counts the bytes live
// in tensor storage exactly (peak overall and per phase). CUDA (torch CUDA builds): the caching
// allocator's peak allocated and reserved bytes, alloc retries and OOMs.
#include <atomic>
#include <cstdint>

#include "core/hooks.hpp"

namespace trainscope::probes {

// Live and peak bytes of every CPU tensor allocated since install. Thread-safe, lock-free.
class AccountingAllocator {
 public:
  // Installs the allocator for the whole process (idempotent). Tensors allocated before keep their
  // own deleters and are not counted.
  static void install();
  // Puts torch's default CPU allocator back (benchmarks compare with and without accounting).
  static void uninstall();
  static bool installed();
  static int64_t current();
  static int64_t peak();
  static int64_t phase_peak();
  // Bytes freed on another thread than the one that allocated them (a communication backend's thread
  // dropping the last reference): when that happens is up to the scheduler, and so are the peaks, by
  // up to this much.
  static int64_t freed_elsewhere();
  static void reset_peak();        // peak := current
  static void reset_phase_peak();  // phase peak := current
  // A budget (0: none): an allocation that would take the live bytes past it throws
  // c10::OutOfMemoryError naming the phase and the bytes asked for.
  static void set_budget(int64_t bytes);
  static int64_t budget();
  // What the run is doing now ("setup", "forward", "backward", "optimizer"), for OOM messages.
  static void set_phase(const char* phase);
  static const char* phase();
  // Called by the allocator itself.
  static void on_alloc(int64_t bytes);
  static void on_free(int64_t bytes);
};

class MemoryProbe : public Probe {
 public:
  // `budget` bytes (0: none) hold from run_begin to run_end: the training steps, not set-up and
  // evaluation, and not the timing probe's GEMM-peak measurement that runs before.
  explicit MemoryProbe(int64_t budget = 0) : budget_(budget) {}
  std::string name() const override { return "memory"; }
  void run_begin(const RunInfo& info) override;
  void step_begin(const StepInfo& s) override;
  void forward_end(const StepInfo& s) override;
  void backward_end(const StepInfo& s) override;
  void optimizer_end(const StepInfo& s) override;
  void run_end(const RunEnd& e) override;
  json section() const override;

 private:
  void phase_begin();
  int64_t phase_end();
  int64_t live_now() const;
  bool cuda_ = false;
  int device_index_ = 0;
  int64_t step_start_ = 0, activation_ = 0;
  int64_t baseline_ = 0, forward_ = 0, backward_ = 0, optimizer_ = 0, peak_ = 0;
  // This step's phase peaks, and their maxima over the steps no sampling probe ran in.
  int64_t step_phase_[3] = {0, 0, 0}, plain_phase_[3] = {0, 0, 0};
  bool plain_seen_ = false;
  int64_t reserved_peak_ = 0, alloc_retries_ = 0, ooms_ = 0;
  int64_t freed_elsewhere_ = 0;  // at run_begin, then over the run
  ModelStateBytes model_state_;
  bool have_end_ = false;
  int64_t budget_ = 0;
};

}  // namespace trainscope::probes
